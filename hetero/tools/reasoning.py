"""Splitting <think>...</think> reasoning from the answer, incrementally.

Qwen3.5 / Qwen3.6 templates open the think block in the prompt (the generation prompt ends `<think>\\n`), so
generation starts inside reasoning; with `enable_thinking=False` they close it there (`<think>\\n\\n</think>\\n\\n`)
and generation starts in the answer. Earlier templates leave it to the model to write `<think>` first.
`opens_reasoning(prompt)` tells the cases apart from the rendered prompt. The newlines the template puts
inside the tags and after `</think>` are dropped; an output without a think block comes through unchanged; an
output that ends before `</think>` is all reasoning.
"""

from __future__ import annotations

from hetero.tools.calls import held_tail
from hetero.tools.events import Event, Reasoning, Text

OPEN, CLOSE = "<think>", "</think>"


def opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt leaves a think block open, so the output starts as reasoning."""
    return prompt.rstrip().endswith(OPEN)


class ReasoningSplitter:
    """feed(piece) -> Reasoning / Text events; finish() -> the rest."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self._state = "reasoning" if in_reasoning else "start"  # start: the output may still open <think>
        self._buf = ""
        self._strip = in_reasoning  # drop leading whitespace of the next reasoning / answer text (inside the tags)

    def feed(self, piece: str) -> list[Event]:
        self._buf += piece
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        return self._drain(final=True)

    def _take(self, n: int) -> str:
        text, self._buf = self._buf[:n], self._buf[n:]
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        return text

    def _drain(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(OPEN):
                    self._buf, self._state, self._strip = head[len(OPEN) :], "reasoning", True
                    continue
                if not final and OPEN.startswith(head):  # empty or a partial <think>: wait
                    return out
                self._state = "answer"
            if self._state == "reasoning":
                i = self._buf.find(CLOSE)
                if i >= 0:
                    text = self._take(i).rstrip()
                    self._buf, self._state, self._strip = self._buf[len(CLOSE) :], "answer", True
                else:
                    keep = 0 if final else held_tail(self._buf, CLOSE)
                    text = self._take(len(self._buf) - keep)
                    text = text.rstrip() if final else text
                if text:
                    out.append(Reasoning(text))
                if i >= 0:
                    continue
                return out
            text = self._take(len(self._buf))
            if text:
                out.append(Text(text))
            return out
