"""Round-robin turns for generation jobs that each run on their own thread but share one model.

Only the job holding the turn runs model work. A job gives the turn away at its natural pauses (after every
prefill chunk, after every decode token or MTP round) and gets it back once every other job has had one such
unit of work: requests that arrive while another generates start at once, a long prefill and the decode of
others interleave chunk by chunk, and no request starves another.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable

from hetero.pipeline.lanes import DecodeQueue


class Turns:
    """The ring of jobs in turn order; the first one holds the turn."""

    def __init__(self) -> None:
        self._ring: deque[Hashable] = deque()
        self._cv = threading.Condition()
        self.handovers = 0  # times the turn passed from one job to another

    def enter(self, job: Hashable) -> None:
        """Join at the back of the ring and wait for the turn."""
        with self._cv:
            self._ring.append(job)
            self._cv.wait_for(lambda: self._ring[0] == job)

    def leave(self, job: Hashable) -> None:
        """Leave the ring (holding the turn or not); the next job gets the turn."""
        with self._cv:
            if job in self._ring:
                self._ring.remove(job)
            self._cv.notify_all()

    def others(self, job: Hashable) -> int:
        """How many other jobs are waiting for a turn."""
        with self._cv:
            return len(self._ring) - (job in self._ring)

    def pass_turn(self, job: Hashable) -> None:
        """Let every other job run one unit of work, then continue (returns at once when alone)."""
        with self._cv:
            if len(self._ring) < 2 or self._ring[0] != job:
                return
            self._ring.rotate(-1)
            self.handovers += 1
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._ring[0] == job)


class LentTurns(DecodeQueue):
    """What the split prefill's GPU lane does while the ANE computes its share: lend the turn to the other jobs
    (their decode rounds, or their own prefill chunks) instead of idling; nothing to do when the job is alone."""

    def __init__(self, turns: Turns, job: Hashable, every: int = 4):
        super().__init__(every=every)
        self.turns, self.job = turns, job

    @property
    def pending(self) -> bool:
        return self.turns.others(self.job) > 0

    def run_one(self) -> None:
        self.turns.pass_turn(self.job)
        self.rounds += 1
        self.since = 0
