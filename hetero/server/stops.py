"""Exact stop strings over streamed text."""

from __future__ import annotations


class StopMatcher:
    """Cuts streamed text exactly where the first stop string begins; never emits any part of it.

    Text that could be the start of a stop string (a suffix of the text so far that is a prefix of a stop) is
    held back until the next piece decides, so stops that span token boundaries are still found.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped: str | None = None  # the stop string that matched

    def feed(self, piece: str) -> str:
        """Add generated text; returns what may be emitted now."""
        if self.stopped is not None:
            return ""
        self.held += piece
        hits = [(self.held.find(s), s) for s in self.stops if s in self.held]
        at = min(hits)[0] if hits else len(self.held)
        pending = self._pending(at)  # a stop that begins earlier may still complete: it would win
        if hits and pending is None:
            return self._cut(*min(hits))
        keep = at if pending is None else pending
        out, self.held = self.held[:keep], self.held[keep:]
        return out

    def flush(self) -> str:
        """The held-back text once generation has ended (up to the first stop string in it)."""
        if self.stopped is not None:
            return ""
        hits = [(self.held.find(s), s) for s in self.stops if s in self.held]
        if hits:
            return self._cut(*min(hits))
        out, self.held = self.held, ""
        return out

    def _pending(self, limit: int) -> int | None:
        """The first position before `limit` from which the held text is a proper prefix of a stop string."""
        for q in range(max(0, len(self.held) - max((len(s) for s in self.stops), default=0) + 1), limit):
            tail = self.held[q:]
            if any(len(tail) < len(s) and s.startswith(tail) for s in self.stops):
                return q
        return None

    def _cut(self, at: int, stop: str) -> str:
        self.stopped = stop
        out, self.held = self.held[:at], ""
        return out
