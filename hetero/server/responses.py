"""The OpenAI Responses API, request side: POST /v1/responses (Codex CLI speaks only this API).

`parse_responses(store)` reads a request into a Job. The `input` items (messages with `input_text` /
`output_text` parts, `function_call`, `function_call_output` and `reasoning` items) become chat messages in the form
the chat completions route builds (`developer` is a system message; `instructions` comes first), and from there
they take the same path: `openai_messages`, then the chat template through `toolcalls.render`, so the prompt of a
Responses request is exactly the prompt of the equivalent chat request. `previous_response_id` prepends a stored
response's input and output items (`ResponseStore`, bounded, in memory); the previous `instructions` are not
carried over, as OpenAI documents.

Mapped: function `tools` (other types, such as web_search, image_generation, custom or namespace tools, are left
out with a warning in the log), `tool_choice`, `parallel_tool_calls`, `reasoning.effort` (one of the template's
own `reasoning_effort` levels when it reads one; else none / minimal: the template's enable_thinking off, low and
up: on; absent: the checkpoint's default: `hetero.server.thinking`), `max_thinking_tokens` (a thinking budget),
`max_output_tokens`,
`temperature`, `top_p` (and the extensions `top_k`, `min_p`), `text.format` (json_object / json_schema constrain
the output as chat `response_format` does), `store`.
Accepted without effect: `include` (encrypted reasoning is an OpenAI-hosted feature: reasoning comes back as text),
`prompt_cache_key` (the prefix cache matches prompts by their tokens, not by a key), `client_metadata` and
`metadata` (nothing here reads them), `truncation` (a prompt over the window is refused, never cut), `service_tier`,
`user`, `safety_identifier`, `text.verbosity`; `store: false` only means the response is not kept.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hetero.server.openai import parse_response_format
from hetero.server.requests import Job, Parser, boolean
from hetero.server.refusals import RequestError, refusing
from hetero.server.thinking import effort_kwargs, thinking_budget
from hetero.server.toolcalls import checked_tools, render
from hetero.tools import openai_messages, openai_tools
from hetero.tools.messages import text_of

log = logging.getLogger("hetero.server")

STORE_SIZE = 512  # responses kept for previous_response_id (oldest dropped first)
ROLES = {"user", "assistant", "system", "developer"}
_warned: set[str] = set()  # tool and item types already reported as ignored (once per process: agents resend them)


class ResponseStore:
    """The conversations (input items, then output items) of the last `size` stored responses, by response id."""

    def __init__(self, size: int = STORE_SIZE):
        self.size = size
        self._items: OrderedDict[str, list[dict]] = OrderedDict()
        self._lock = threading.Lock()  # parsing runs on worker threads

    def put(self, rid: str, items: list[dict]) -> None:
        with self._lock:
            self._items[rid] = items
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, rid: str) -> list[dict] | None:
        with self._lock:
            return self._items.get(rid)


@dataclass
class ResponseContext:
    """What the output shaper needs from the request: the echo fields, the conversation so far, where to store."""

    conversation: list[dict]  # the request's items (after a previous response's), to store with the output
    store: ResponseStore | None  # None: `store: false`
    echo: dict = field(default_factory=dict)  # request fields the response object repeats
    count_tokens: Callable[[str], int] = len  # the tokenizer's count (reasoning tokens in the usage)


def parse_responses(store: ResponseStore) -> Callable[[Parser, dict], Job]:
    """The parse function of POST /v1/responses over `store`."""

    def parse(parser: Parser, body: dict) -> Job:
        parser.model(body)
        if body.get("background") is True:
            raise RequestError(400, "'background': true is not supported; leave it out and read the response (or "
                               "its stream) directly", "background")
        items = input_items(body.get("input"))
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str):
                raise RequestError(400, "'previous_response_id' must be a string", "previous_response_id")
            stored = store.get(previous)
            if stored is None:
                raise RequestError(404, f"previous response {previous!r} is not stored here (unknown id, sent with "
                                   f"store: false, or one of more than {store.size} older ones); send the whole "
                                   "conversation in 'input' instead", "previous_response_id",
                                   "previous_response_not_found")
            items = stored + items
        images = parser.image_places()
        msgs = chat_messages(items, images)
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise RequestError(400, "'instructions' must be a string", "instructions")
        if instructions:
            msgs.insert(0, {"role": "system", "content": instructions})
        with refusing("input", "the input cannot be read"):  # e.g. a function_call's arguments
            template_msgs = openai_messages(msgs)
        tools, shown = function_tools(body.get("tools"))
        parallel = bool(boolean(body, "parallel_tool_calls", True))
        ids, reply = render(parser, template_msgs, tools, tool_choice(body.get("tool_choice")),
                            reasoning_switch(parser, body.get("reasoning")), parallel, images=images)
        reply.images = images or []
        job = parser.job(body, ids, "max_output_tokens")
        job.reply = reply
        job.set(thinking_budget=thinking_budget(parser, body.get("max_thinking_tokens"), "max_thinking_tokens"))
        text_format(parser, body, job)
        keep = boolean(body, "store", True)
        sampling = job.options.sampling
        echo = {"instructions": instructions, "tools": shown, "tool_choice": body.get("tool_choice") or "auto",
                "parallel_tool_calls": parallel, "previous_response_id": previous,
                "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
                "reasoning": body.get("reasoning"), "temperature": sampling.temperature, "top_p": sampling.top_p,
                "store": keep, "text": body.get("text") or {"format": {"type": "text"}}}
        job.context = ResponseContext(items, store if keep else None, echo,
                                      lambda s: len(parser.engine.tokenizer.encode(s)) if s else 0)
        return job

    return parse


def input_items(value: Any) -> list[dict]:
    """`input`: a string (one user message) or a list of items (a message without `type` is a message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise RequestError(400, "'input' is required: a string or a list of input items", "input")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise RequestError(400, f"'input[{i}]' must be an object (a message or another input item)", f"input[{i}]")
    return [item if "type" in item else {**item, "type": "message"} for item in value]


def chat_messages(items: list[dict], images: list[str] | None) -> list[dict]:
    """Input items -> chat messages (content as text). Reasoning joins the next assistant message; function
    calls join the assistant message they follow (or open one); outputs are `role: "tool"` messages."""
    out: list[dict] = []
    reasoning: list[str] = []  # a reasoning item's text, waiting for its assistant message

    def assistant() -> dict:
        msg = {"role": "assistant", "content": ""}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        out.append(msg)
        return msg

    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type")
        with refusing(where, "the input item cannot be read", prefix=False):
            if kind == "message":
                role = item.get("role")
                if role not in ROLES:
                    raise RequestError(400, f"'{where}.role' must be one of {sorted(ROLES)}, got {role!r}",
                                       f"{where}.role")
                text = text_of(_parts(item.get("content")), f"{where}.content", images)
                if role == "assistant":
                    assistant()["content"] = text
                else:
                    out.append({"role": role, "content": text})
            elif kind == "function_call":
                if not isinstance(item.get("name"), str) or not item["name"]:
                    raise RequestError(400, f"'{where}.name' must name the function that was called", f"{where}.name")
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
                last = out[-1] if out and out[-1]["role"] == "assistant" and not reasoning else assistant()
                last.setdefault("tool_calls", []).append(call)
            elif kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                            "content": text_of(_parts(item.get("output")), f"{where}.output", images)})
            elif kind == "reasoning":
                reasoning.append(reasoning_text(item))
            else:
                _ignore("input item", kind)
    return out


def _parts(content: Any) -> Any:
    """Responses content parts the text rule does not know as such: a `refusal` is text."""
    if isinstance(content, list):
        return [{"type": "output_text", "text": p["refusal"]} if isinstance(p, dict) and p.get("type") == "refusal"
                and isinstance(p.get("refusal"), str) else p for p in content]
    return content


def reasoning_text(item: dict) -> str:
    """A reasoning item's text: its `reasoning_text` content, else its summary (encrypted content is unreadable)."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if isinstance(parts, list):
            text = "".join(p["text"] for p in parts if isinstance(p, dict) and p.get("type") == kind
                           and isinstance(p.get("text"), str))
            if text:
                return text
    return ""


def _ignore(what: str, kind: Any) -> None:
    if f"{what}:{kind}" not in _warned:
        _warned.add(f"{what}:{kind}")
        log.warning("/v1/responses: %s of type %r is not served here (function tools and messages only); ignored",
                    what, kind)


def function_tools(tools: Any) -> tuple[list[dict] | None, list[dict]]:
    """Function `tools` ({type: function, name, description, parameters}) -> (the template's list, the tools as
    the response echoes them); tools of other types are left out with a warning."""
    if tools is None:
        return None, []
    if not isinstance(tools, list):
        raise RequestError(400, "'tools' must be a list", "tools")
    kept = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise RequestError(400, f"'tools[{i}]' must be an object", f"tools[{i}]")
        if t.get("type") == "function":
            kept.append(t)
        else:
            _ignore("tool", t.get("type"))
    chat = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
            for t in kept]
    echo = [{"type": "function", "name": t.get("name"), "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": t.get("strict")} for t in kept]
    return checked_tools(openai_tools, chat), echo


def tool_choice(choice: Any) -> Any:
    """Responses `tool_choice` -> the chat form (`{"type": "function", "name"}` -> `{"type": "function",
    "function": {"name"}}`); an `allowed_tools` choice keeps its mode (every function tool stays shown)."""
    if isinstance(choice, dict):
        if choice.get("type") == "function":
            return {"type": "function", "function": {"name": choice.get("name")}}
        if choice.get("type") == "allowed_tools":
            return choice.get("mode", "auto")
        raise RequestError(400, f"'tool_choice' {choice!r}: only auto, none, required or a function tool are served",
                           "tool_choice")
    return choice


def reasoning_switch(parser: Parser, reasoning: Any) -> dict:
    """`reasoning.effort` -> the template's `reasoning_effort` or enable_thinking (`hetero.server.thinking`; nothing
    when absent: the checkpoint's default)."""
    if reasoning is None:
        return {}
    if not isinstance(reasoning, dict):
        raise RequestError(400, "'reasoning' must be an object such as {\"effort\": \"medium\"}", "reasoning")
    effort = reasoning.get("effort")
    if effort is None:
        return {}
    return effort_kwargs(parser, effort, "reasoning.effort")


def text_format(parser: Parser, body: dict, job: Job) -> None:
    """`text.format`: text, json_object, or json_schema {name, schema, strict} -> chat `response_format`."""
    text = body.get("text")
    if text is None:
        return
    if not isinstance(text, dict):
        raise RequestError(400, "'text' must be an object such as {\"format\": {\"type\": \"text\"}}", "text")
    fmt = text.get("format")
    if fmt is None:
        return
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    try:
        parse_response_format(parser, {"response_format": fmt}, job)
    except RequestError as e:
        param = (e.param or "").replace("response_format.json_schema", "text.format").replace("response_format",
                                                                                             "text.format")
        raise RequestError(400, e.message.replace("'response_format", "'text.format").replace(".json_schema", ""),
                           param) from None
