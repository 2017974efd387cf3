"""Idle time in `hetero serve` measures a draft-depth verdict again when it needs it (left inside the noise, or
measured with other code: `hetero.host.settings.remeasure_reason`).

A timer thread watches the runner; once no request has run or waited for `IDLE_S` seconds, it hands one measurement
to the runner's worker pool (so the server's close waits for it, as for any job). The measurement takes the model's
turn like a request and stops between pairs as soon as a request is running or waiting, so a request waits at most
for the pair being timed; what it measured is saved and added to at the next idle spell. Requests read the saved
verdict, so a settled one applies from the next request on."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from hetero.decode.depth_calibration import calibrate
from hetero.host.settings import DEFAULT_DRAFT_DEPTH, remeasure_reason

IDLE_S = 30.0  # seconds with no request running or waiting before the server measures
SPELL_S = 10.0  # the time cap of one idle spell's measurement

log = logging.getLogger("hetero.server")


class IdleTuning:
    """Measures `engine`'s draft-depth verdict again in `runner`'s idle time, while it needs it."""

    def __init__(self, engine, runner, idle_s: float = IDLE_S, spell_s: float = SPELL_S,
                 measure: Callable[..., object] = calibrate):
        self.engine, self.runner, self.idle_s, self.spell_s, self.measure = engine, runner, idle_s, spell_s, measure
        self.spells = 0  # measurements run
        self._thread = threading.Thread(target=self._watch, name="hetero-idle-tuning", daemon=True)

    def start(self) -> bool:
        """Start watching when the verdict needs measuring (a model with an MTP head); whether it started."""
        if not getattr(self.engine.model, "has_mtp", False) or remeasure_reason(self.engine.identity) is None:
            return False
        self._thread.start()
        return True

    def busy(self) -> bool:
        r = self.runner
        return r.running > 0 or r.waiting > 0 or r.stopping.is_set()

    def _watch(self) -> None:
        seen = self.runner.finished
        while not self.runner.stopping.wait(self.idle_s):
            if self.busy() or self.runner.finished != seen:  # a request ran in this spell: wait for a quiet one
                seen = self.runner.finished
                continue
            why = remeasure_reason(self.engine.identity)
            if why is None:
                return
            try:
                self.runner.pool.submit(self._spell, why).result()
            except RuntimeError:  # the pool is shut down: the server is stopping
                return
            seen = self.runner.finished

    def _spell(self, why: str) -> None:
        """One measurement, holding the model's turn as a request would; it stops between pairs for a request."""
        ticket = object()
        self.runner.turns.enter(ticket)
        try:
            if not self.busy():
                self.spells += 1
                self.measure(self.engine, DEFAULT_DRAFT_DEPTH, report=log.info, why=f"{why}; idle time",
                             cap_s=self.spell_s, stop=self.busy)
        except Exception:  # a failed measurement must not take the server down: the old verdict stands
            log.exception("measuring the draft depth in idle time failed")
        finally:
            self.runner.turns.leave(ticket)
