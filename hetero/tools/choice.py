"""tool_choice: which tools the template sees and what text, forced after the prompt, makes the model call one.

`none` renders no tools (the model cannot see them). `required` and a named function are enforced by
appending the start of a call to the generation prompt, in the template's own call form:

    XML form (Qwen3.5 / 3.6):  <tool_call>\\n<function=NAME          (required: <tool_call>\\n<function=)
    JSON form (Qwen2.5 / 3):   <tool_call>\\n{"name": "NAME", "arguments":    (required: <tool_call>\\n{"name":)

so the model can only go on with that call; the server then decodes the rest under `call_grammar`, so the call
is complete and its arguments valid for the tool's schema by construction. The prefix stops before the `>\\n` or the space that follows, where
the model's own tokens break: a prefix ending inside what the tokenizer writes as one token leaves the model a
token sequence it never saw, and it wanders off (measured on the test tool model: `...<function=NAME>\\n` failed,
`...<function=NAME` gives the call). When the prompt leaves a think block open, the prefix closes it first (an
empty block, as the template writes with enable_thinking=False): a forced call skips reasoning. The caller feeds
the prefix to the ReplyParser before the model's text, as if the model had written it.
"""

from __future__ import annotations

import json
from typing import Any

from hetero.errors import HeteroError
from hetero.tools.reasoning import CLOSE, opens_reasoning


def normalize_choice(choice: Any, tools: list[dict] | None) -> str | None:
    """OpenAI ("auto" | "none" | "required" | {"type": "function", "function": {"name"}}) or Anthropic
    ({"type": "auto" | "any" | "tool" | "none", "name"}) tool_choice -> "auto", "none", "required" or a function
    name; None without tools. A value of any other shape, or one that needs tools the request lacks, is an error."""
    mode = _mode(choice)
    if not tools:
        if mode in ("auto", "none"):
            return None
        raise HeteroError(f"tool_choice {choice!r} asks for a tool call, but the request has no tools")
    if mode in ("auto", "none", "required"):
        return mode
    known = {t["function"]["name"] for t in tools}
    if mode not in known:
        raise HeteroError(f"tool_choice names {mode!r}, which is not among the tools ({', '.join(sorted(known))})")
    return mode


def _mode(choice: Any) -> str:
    """"auto", "none", "required", or the function name a tool_choice value asks for."""
    if choice is None:
        return "auto"
    if isinstance(choice, str) and choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind in ("auto", "none"):
            return kind
        if kind == "any":
            return "required"
        function = choice.get("function") if kind == "function" else None
        name = choice.get("name") if kind == "tool" else function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str) and name:
            return name
    raise HeteroError(f"tool_choice {choice!r} is not understood; use auto, none, required or a named function")


def call_form(template: str | None) -> str:
    """"xml" when the chat template writes calls as <function=...>, else "json"."""
    return "xml" if template and "<function=" in template else "json"


def forced_prefix(choice: str | None, prompt: str, template: str | None) -> str:
    """Text to append to the rendered prompt so the model must call a tool ("" for auto / none / no tools)."""
    if choice in (None, "auto", "none"):
        return ""
    named = choice != "required"
    if call_form(template) == "xml":
        call = "<tool_call>\n<function=" + (choice if named else "")
    else:
        call = '<tool_call>\n{"name":' + (" " + json.dumps(choice) + ', "arguments":' if named else "")
    return ("\n" + CLOSE + "\n\n" if opens_reasoning(prompt) else "") + call
