"""OpenAI and Anthropic chat requests -> the messages, tools and tool_choice that Qwen chat templates expect.

Qwen templates read an assistant turn's calls as `tool_calls: [{"type": "function", "function": {"name": ...,
"arguments": <dict>}}]` (they iterate the arguments' items), a tool's output as a `role: "tool"` message (matched
to its call by position), reasoning as `reasoning_content`, and tool definitions in OpenAI's function form (each
is written into the system prompt with `tojson`). Bad shapes raise HeteroError (the server answers 400).
"""

from __future__ import annotations

import json
from typing import Any

from hetero.errors import HeteroError


TEXT_PARTS = {"text", "input_text", "output_text"}  # chat, Responses input and Responses output text parts
IMAGE_PARTS = {"image_url", "image", "input_image"}  # OpenAI chat, Anthropic, Responses
IMAGE_PLACEHOLDER = "[an image was omitted here: this model reads text only]"


def _text(content: Any, where: str, images: list[str] | None = None) -> str:
    """A message's content as text: a string, None, or a list of text parts / blocks.

    Image parts become IMAGE_PLACEHOLDER, their place appended to `images`; with `images=None` (strict) an image
    is refused, as is any other kind of part."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            kind = kind if isinstance(kind, str) else repr(kind)
            if kind in IMAGE_PARTS and images is not None:
                parts.append(take_image(images, part, f"{where}[{j}]"))
                continue
            if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
                why = "this model reads text only" if kind in IMAGE_PARTS else "text only"
                raise HeteroError(f"{where}: content part of type {kind!r} is not supported ({why})")
            parts.append(part["text"])
        return "".join(parts)
    raise HeteroError(f"{where}: content must be a string or a list of text parts")


def take_image(images: list, part: dict, place: str) -> str:
    """The text that stands for an image part: what a collector that reads images (`images.take`, the server's
    `ImageInputs`) gives, else IMAGE_PLACEHOLDER, its place listed in `images`."""
    if hasattr(images, "take"):
        return images.take(part, place)
    images.append(place)
    return IMAGE_PLACEHOLDER


def text_of(content: Any, where: str, images: list[str] | None = None) -> str:
    """Content (a string, None or a list of parts) -> text; image parts become IMAGE_PLACEHOLDER and are listed in
    `images`, or refused when `images` is None."""
    return _text(content, where, images)


def _arguments(value: Any, where: str) -> dict:
    """OpenAI arguments (a JSON string) or an input object -> the dict the template iterates."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise HeteroError(f"{where}: arguments are not valid JSON") from None
    if not isinstance(value, dict):
        raise HeteroError(f"{where}: arguments must be a JSON object")
    return value


def _call(call_id: Any, name: Any, arguments: dict, where: str) -> dict:
    if not isinstance(name, str) or not name:
        raise HeteroError(f"{where}: a tool call needs a function name")
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(call_id, str):
        call["id"] = call_id
    return call


def openai_messages(messages: list[dict], images: list[str] | None = None) -> list[dict]:
    """OpenAI chat messages -> template messages (developer -> system, JSON-string arguments -> dicts); image parts
    as `_text` treats them (listed in `images`, or refused when it is None)."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = "system" if m.get("role") == "developer" else m.get("role")
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"{where}.content", images)}
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise HeteroError(f"{where}.tool_calls must be a list")
            msg["tool_calls"] = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict):
                    raise HeteroError(f"{where}.tool_calls[{j}] needs a function object")
                msg["tool_calls"].append(_call(c.get("id"), fn.get("name"), _arguments(fn.get("arguments"), where), where))
            if not msg["tool_calls"]:
                del msg["tool_calls"]
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if isinstance(reasoning, str):
                msg["reasoning_content"] = reasoning
        elif role == "tool" and isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def anthropic_messages(messages: list[dict], system: Any = None, images: list[str] | None = None) -> list[dict]:
    """Anthropic messages (+ top-level system) -> template messages.

    `system` may be a string or a list of text blocks (their `cache_control` is the client's caching hint: the
    prefix cache needs none); a `role: "system"` message stays where it stands. Image blocks, also inside a
    `tool_result`, become a placeholder listed in `images` (refused when `images` is None).

    A user turn's `tool_result` blocks become `role: "tool"` messages (before the turn's own text, as the API
    puts results first); an assistant turn's `thinking` blocks become reasoning_content and its `tool_use`
    blocks tool_calls with their input objects.
    """
    out: list[dict] = []
    if system:
        out.append({"role": "system", "content": _text(system, "system", images)})
    for i, m in enumerate(messages):
        where, role, content = f"messages[{i}]", m.get("role"), m.get("content")
        if isinstance(content, str) or content is None or role == "system":
            out.append({"role": role, "content": _text(content, where + ".content", images)})
            continue
        if not isinstance(content, list):
            raise HeteroError(f"{where}.content must be a string or a list of blocks")
        text, reasoning, calls = [], [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            kind = kind if isinstance(kind, str) else None
            here = f"{where}.content[{j}]"
            if kind == "text" or kind in IMAGE_PARTS:
                text.append(_text([block], here, images))
            elif kind == "thinking" and role == "assistant":
                reasoning.append(str(block.get("thinking", "")))
            elif kind == "redacted_thinking":
                continue  # encrypted by another provider: nothing this model can read
            elif kind == "tool_use" and role == "assistant":
                calls.append(_call(block.get("id"), block.get("name"), _arguments(block.get("input", {}), here), here))
            elif kind == "tool_result" and role == "user":
                result = _text(block.get("content"), here, images)
                out.append({"role": "tool", "content": ("Error: " + result) if block.get("is_error") else result,
                            "tool_call_id": block.get("tool_use_id")})
            else:
                raise HeteroError(f"{here}: block type {kind!r} is not supported in a {role} turn")
        if role == "user" and not text and any(o["role"] == "tool" for o in out[-1:]):
            continue  # a turn of tool results only
        msg: dict[str, Any] = {"role": role, "content": "".join(text)}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _function(name: Any, description: Any, parameters: Any, where: str) -> dict:
    if not isinstance(name, str) or not name:
        raise HeteroError(f"{where} needs a name")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise HeteroError(f"{where}: the parameters schema must be an object")
    fn: dict[str, Any] = {"name": name}
    if isinstance(description, str):
        fn["description"] = description
    fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def openai_tools(tools: list[dict] | None) -> list[dict] | None:
    """OpenAI `tools` -> the template's list (function tools in OpenAI's own form); None when empty."""
    out = []
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise HeteroError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        out.append(_function(fn.get("name"), fn.get("description"), fn.get("parameters"), f"tools[{i}].function"))
    return out or None


def anthropic_tools(tools: list[dict] | None) -> list[dict] | None:
    """Anthropic `tools` ({name, description, input_schema}) -> the template's list in OpenAI function form."""
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict):
            raise HeteroError(f"tools[{i}] must be an object")
        out.append(_function(t.get("name"), t.get("description"), t.get("input_schema"), f"tools[{i}]"))
    return out or None
