"""A model's reply, parsed: reasoning split off first, then tool calls out of the answer text."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero.tools.calls import ToolCallParser
from hetero.tools.events import CallEnd, Event, Reasoning, Text, ToolCall
from hetero.tools.reasoning import ReasoningSplitter, opens_reasoning


class ReplyParser:
    """feed(piece) -> events, finish() -> the rest, for one generated reply.

    `prompt` is the rendered prompt (it tells whether generation starts inside a think block). With
    `tools=None` and `parse_calls=False` the answer is plain text; with `reasoning=False` <think> is text too.
    Text a caller forces after the prompt (a tool_choice prefix) is fed first, as if the model wrote it; `only`
    (the function a tool_choice names) turns a call to any other function into text.
    """

    def __init__(self, prompt: str = "", tools: list[dict] | None = None, parse_calls: bool = True,
                 reasoning: bool = True, only: str | None = None) -> None:
        self._think = ReasoningSplitter(opens_reasoning(prompt)) if reasoning else None
        self._calls = ToolCallParser(tools, only) if parse_calls else None

    def feed(self, piece: str) -> list[Event]:
        return self._route(self._think.feed(piece) if self._think else [Text(piece)])

    def finish(self) -> list[Event]:
        out = self._route(self._think.finish()) if self._think else []
        return out + (self._calls.finish() if self._calls else [])

    def _route(self, events: list[Event]) -> list[Event]:
        if self._calls is None:
            return events
        out: list[Event] = []
        for event in events:
            out += self._calls.feed(event.text) if isinstance(event, Text) else [event]
        return out


@dataclass
class Reply:
    """A whole reply: answer text, reasoning text and the calls, in order."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: list[Event]) -> "Reply":
        for event in events:
            if isinstance(event, Text):
                self.content += event.text
            elif isinstance(event, Reasoning):
                self.reasoning += event.text
            elif isinstance(event, CallEnd):
                self.tool_calls.append(ToolCall(event.id, event.name, event.arguments))
        return self


def parse_reply(text: str, prompt: str = "", tools: list[dict] | None = None, parse_calls: bool = True,
                reasoning: bool = True) -> Reply:
    """Parse a complete reply (see ReplyParser)."""
    parser = ReplyParser(prompt, tools, parse_calls, reasoning)
    return Reply().add(parser.feed(text)).add(parser.finish())
