"""A progress bar on stderr that appears only when the work takes more than a moment."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Call with (done, total); draws after `delay` seconds, redraws at most 10 times a second."""

    def __init__(self, label: str, delay: float = 0.5, stream: TextIO | None = None, width: int = 30):
        self.label = label
        self.delay = delay
        self.stream = stream or sys.stderr
        self.width = width
        self.start = time.perf_counter()
        self.last_draw = 0.0
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        elapsed = now - self.start
        finished = done >= total
        if elapsed < self.delay or (not finished and now - self.last_draw < 0.1):
            return
        self.last_draw = now
        filled = int(self.width * done / max(total, 1))
        rate = done / elapsed if elapsed > 0 else 0.0
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} ({rate:,.0f}/s)"
        )
        if finished:
            self.stream.write("\n")
        self.stream.flush()
        self.drawn = True
