"""What the output parsers emit: plain text, reasoning, and a tool call's start, argument pieces and end.

A call's `CallArgs` pieces join to `json.dumps(arguments, ensure_ascii=False)` of its `CallEnd`, so a stream
can forward them as OpenAI `delta.tool_calls[i].function.arguments` or Anthropic `input_json_delta`.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Union


@dataclass(frozen=True)
class Text:
    """Answer text (message content)."""

    text: str


@dataclass(frozen=True)
class Reasoning:
    """Text the model wrote inside <think>...</think>."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A tool call begins: its position among this reply's calls, a fresh id, the function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    """A piece of the call's arguments as JSON text."""

    index: int
    delta: str


@dataclass(frozen=True)
class CallEnd:
    """The call is complete; `arguments` is the parsed (schema-typed) object."""

    index: int
    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


Event = Union[Text, Reasoning, CallStart, CallArgs, CallEnd]


@dataclass(frozen=True)
class ToolCall:
    """A complete call, as a non-streaming reply lists it."""

    id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        """The arguments as OpenAI sends them: a JSON string."""
        return json.dumps(self.arguments, ensure_ascii=False)


def new_call_id() -> str:
    """A fresh id in the form OpenAI uses (call_ + 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


def argument_pieces(arguments: dict[str, Any]) -> list[str]:
    """JSON text of `arguments` in one piece per top-level key (then the closing brace); the pieces join to
    json.dumps(arguments, ensure_ascii=False)."""
    if not arguments:
        return ["{}"]
    pieces = []
    for i, (key, value) in enumerate(arguments.items()):
        item = json.dumps({key: value}, ensure_ascii=False)[1:-1]  # '"key": value'
        pieces.append(("{" if i == 0 else ", ") + item)
    pieces.append("}")
    return pieces


def call_events(index: int, name: str, arguments: dict[str, Any], call_id: str | None = None) -> list[Event]:
    """The events of one complete call: start, argument pieces, end."""
    call_id = call_id or new_call_id()
    return [CallStart(index, call_id, name), *(CallArgs(index, p) for p in argument_pieces(arguments)),
            CallEnd(index, call_id, name, arguments)]
