"""Incremental tool-call parsing of a model's answer text: plain text passes through, calls become events.

A call starts at `<tool_call>`; the text after it decides the form (`<function=` XML, `{` JSON). Nothing of a
call is emitted before its `</tool_call>`: a call that turns out malformed, or that the output cuts off, goes
out as the text it was (with a warning in the log) instead of as a call the client already started to build.
Text that could still become `<tool_call>` is held back until the next piece decides it. Whitespace the
template puts around calls (before, between, after) is dropped.
"""

from __future__ import annotations

import logging

from hetero.tools.events import Event, Text, call_events
from hetero.tools.json_calls import scan_json_call
from hetero.tools.scan import Scan, bad, skip_space
from hetero.tools.schema import tool_parameters
from hetero.tools.xml_calls import scan_xml_call

log = logging.getLogger(__name__)

OPEN = "<tool_call>"


def held_tail(text: str, word: str) -> int:
    """Length of the end of `text` to hold back: a partial `word` and the whitespace before it."""
    keep = next((k for k in range(min(len(word) - 1, len(text)), 0, -1) if text.endswith(word[:k])), 0)
    j = len(text) - keep
    while j > 0 and text[j - 1].isspace():
        j -= 1
    return len(text) - j


class ToolCallParser:
    """feed(piece) -> events; finish() -> the rest. `tools` (OpenAI or Anthropic definitions) type XML values;
    with `only` (a tool_choice that names a function), a call to any other function is returned as text."""

    def __init__(self, tools: list[dict] | None = None, only: str | None = None) -> None:
        self._params = tool_parameters(tools)
        self._only = only
        self._buf = ""  # text mode: the held tail; call mode: what follows <tool_call>
        self._in_call = False
        self._after_call = False  # strip the whitespace that follows a call
        self._gap = ""  # whitespace before the open call: dropped if it is a call, kept if it turns out text
        self.count = 0  # calls emitted so far

    def feed(self, piece: str) -> list[Event]:
        self._buf += piece
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        """End of output: an unterminated call becomes text."""
        return self._drain(final=True)

    def _scan(self) -> Scan:
        start = skip_space(self._buf, 0)
        if self._buf.startswith("{", start):
            return scan_json_call(self._buf)
        return scan_xml_call(self._buf, self._params)

    def _text(self, out: list[Event], text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if text:
            out.append(Text(text))

    def _drain(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if not self._in_call:
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = 0 if final else held_tail(self._buf, OPEN)
                    self._text(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                before = self._buf[:i]
                self._text(out, before.rstrip())
                self._gap = before[len(before.rstrip()) :]
                self._buf, self._in_call = self._buf[i + len(OPEN) :], True
            scan = self._scan()
            if scan.status == "more" and not final:
                return out
            if scan.status == "ok" and self._only is not None and scan.name != self._only:
                scan = bad(scan.end, f"it calls {scan.name!r} where tool_choice names {self._only!r}")
            if scan.status == "ok":
                out += call_events(self.count, scan.name, scan.arguments)
                if self._params and scan.name not in self._params:
                    log.warning("the model called %r, which is not among the request's tools", scan.name)
                self.count += 1
                self._after_call = True
                self._buf = self._buf[scan.end :]
            else:
                end = len(self._buf) if scan.status == "more" else scan.end
                why = "the output ended inside it" if scan.status == "more" else scan.why
                log.warning("a malformed tool call (%s) is returned as text: %r", why, (OPEN + self._buf[:end])[:200])
                self._text(out, self._gap + OPEN + self._buf[:end])
                self._after_call = False
                self._buf = self._buf[end:]
            self._in_call = False
