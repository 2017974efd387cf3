"""Turns for generation jobs that each run on their own thread but share one model.

Only the job holding the turn runs model work. A job gives the turn away at its natural pauses (after every
prefill chunk, after every decode token or MTP round) and gets it back once every other job has had one such
unit of work: requests that arrive while another generates start at once, a long prefill and the decode of
others interleave chunk by chunk, and no request starves another.

Units differ in length: a prefill chunk of a long prompt takes seconds, a decode round milliseconds. Counted
in units, two decoding requests got a tenth of their speed while a 16K prompt prefilled. So time is counted
too: while other jobs are decoding, the seconds a job spends prefilling are owed to them, and it gets the turn
back only once they have used `decode_share / (1 - decode_share)` times as long (decode_share = 0.8: they keep
0.8 of the model's time; the prefill goes on at 0.2 of it, and at full speed as soon as nobody decodes).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable

from hetero.pipeline.lanes import DecodeQueue

DECODE_SHARE = 0.8  # of the model's time that decoding jobs keep while another job prefills


class Turns:
    """The ring of jobs in turn order; the first one holds the turn."""

    def __init__(self, decode_share: float = DECODE_SHARE, clock: Callable[[], float] = time.perf_counter) -> None:
        if not 0.0 <= decode_share < 1.0:
            raise ValueError(f"decode_share must be in [0, 1), got {decode_share}")
        self.decode_share = decode_share
        self._clock = clock
        self._ring: deque[Hashable] = deque()
        self._cv = threading.Condition()
        self._held_since = clock()  # when the front job got the turn
        self._prefilling: set[Hashable] = set()  # jobs whose last unit was a prefill chunk
        self._owed: dict[Hashable, float] = {}  # prefilling job -> decode seconds it still owes the others
        self.handovers = 0  # times the turn passed from one job to another

    def enter(self, job: Hashable) -> None:
        """Join at the back of the ring and wait for the turn."""
        with self._cv:
            if not self._ring:
                self._held_since = self._clock()
            self._ring.append(job)
            self._cv.wait_for(lambda: self._ring[0] == job)

    def leave(self, job: Hashable) -> None:
        """Leave the ring (holding the turn or not); the next job gets the turn."""
        with self._cv:
            if job in self._ring:
                if self._ring[0] == job:
                    self._held_since = self._clock()
                self._ring.remove(job)
            self._prefilling.discard(job)
            self._owed.pop(job, None)
            self._cv.notify_all()

    def others(self, job: Hashable) -> int:
        """How many other jobs are waiting for a turn."""
        with self._cv:
            return len(self._ring) - (job in self._ring)

    def pass_turn(self, job: Hashable, prefilling: bool = False) -> None:
        """Let every other job run one unit of work, then continue (returns at once when alone). `prefilling`: the
        unit just done was prefill work, whose time the decoding jobs are then owed (module docstring)."""
        with self._cv:
            if len(self._ring) < 2 or self._ring[0] != job:
                return
            now = self._clock()
            spent = now - self._held_since
            if prefilling:
                self._prefilling.add(job)
                if any(j not in self._prefilling for j in self._ring if j != job):
                    self._owed[job] = self._owed.get(job, 0.0) + spent * self.decode_share / (1 - self.decode_share)
            else:
                self._prefilling.discard(job)
                self._owed.pop(job, None)  # its own prompt is done: it owes nothing now
                for debtor in self._owed:  # a decode unit pays the prefilling jobs' debt (to the microsecond)
                    self._owed[debtor] = 0.0 if self._owed[debtor] - spent < 1e-6 else self._owed[debtor] - spent
            self._hand_on(now)
            self._cv.wait_for(lambda: self._ring[0] == job)

    def _hand_on(self, now: float) -> None:
        """Rotate to the next job that may run: a prefilling job that still owes decode time is skipped while a
        decoding job waits."""
        self._ring.rotate(-1)
        if any(j not in self._prefilling for j in self._ring):  # decoding jobs never owe: one of them is found
            while self._owed.get(self._ring[0], 0.0) > 0.0:
                self._ring.rotate(-1)
        self._held_since = now
        self.handovers += 1
        self._cv.notify_all()


class LentTurns(DecodeQueue):
    """What the split prefill's GPU lane does while the ANE computes its share: lend the turn to the other jobs
    (their decode rounds, or their own prefill chunks) instead of idling; nothing to do when the job is alone.
    The GPU time the split spent since it last lent the turn counts as prefill time (`Turns.pass_turn`)."""

    def __init__(self, turns: Turns, job: Hashable, every: int = 4):
        super().__init__(every=every)
        self.turns, self.job = turns, job

    @property
    def pending(self) -> bool:
        return self.turns.others(self.job) > 0

    def run_one(self) -> None:
        self.turns.pass_turn(self.job, prefilling=True)
        self.rounds += 1
        self.since = 0
