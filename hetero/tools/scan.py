"""The result of scanning one tool call's text (what follows `<tool_call>`), shared by both call formats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CLOSE = "</tool_call>"


@dataclass(frozen=True)
class Scan:
    """`status` "ok": the call ends at `end` (past </tool_call>); "more": it may still complete, wait for text;
    "bad": it cannot be a call, `end` is where the scan gave up (the text before it goes out as plain text)."""

    status: str
    end: int = 0
    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    why: str = ""


MORE = Scan("more")


def bad(end: int, why: str) -> Scan:
    return Scan("bad", end=max(end, 1), why=why)


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def expect(text: str, pos: int, word: str) -> int | None | Scan:
    """Position after `word` at `pos`; MORE if the text stops inside it; None if something else is there."""
    rest = text[pos : pos + len(word)]
    if rest == word:
        return pos + len(word)
    return MORE if word.startswith(rest) else None
