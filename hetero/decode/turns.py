"""Turns for generation jobs that each run on their own thread but share one model.

Only the job holding the turn runs model work. A job gives the turn away at its natural pauses (after every
prefill chunk, after every decode token or MTP round) and gets it back once every other job has had one such
unit of work: requests that arrive while another generates start at once, a long prefill and the decode of
others interleave chunk by chunk, and no request starves another.

Units differ in length: a prefill chunk of a long prompt takes seconds, a decode round milliseconds. Counted
in units, two decoding requests got a tenth of their speed while a 16K prompt prefilled. So time is counted
too: a prefilling job owes the seconds it spends to the *senior* jobs waiting (those decoding, and those that
came before it and prefill too), and it gets the turn back only once they have used `decode_share / (1 -
decode_share)` times as long (decode_share = 0.8: they keep 0.8 of the model's time; the later prefill goes on at
0.2 of it, and at full speed as soon as nobody senior waits). So a request is slowed by the requests that arrived
after it by a bounded share of its own time, never made to wait for their work: a short prompt sent just before a
long one (OpenCode's title request, then its main request) keeps 0.8 of the model until its reply. A job that has
not run yet owes nothing: it gets its first unit at once (and counts as a prefill, junior to those before it).

The ring is the only place a job waits for another job, and it is waited on only between units of work: a thread
that runs a lane's job (the prefill wavefront's lanes, the split's GPU and ANE lanes, a batched decode round: see
`lane_job`) never enters the ring nor passes the turn. The job holding the turn waits only on its own lanes' jobs,
which never wait on the ring, so no wait ever closes a circle (docs/server.md, "One scheduler owns every lane").
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Protocol

DECODE_SHARE = 0.8  # of the model's time that senior jobs (decoding, or come first) keep while a later one prefills


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
        self._arrival = itertools.count()
        self._entered: dict[Hashable, int] = {}  # job -> its place in arrival order
        self._decoding: set[Hashable] = set()  # jobs whose last unit was a decode token or round
        self._owed: dict[Hashable, float] = {}  # prefilling job -> seconds it still owes its seniors
        self.handovers = 0  # times the turn passed from one job to another

    def enter(self, job: Hashable) -> None:
        """Join at the back of the ring, unless the job has a place already (`reserve`, `hand_over`), and wait for
        the turn."""
        refuse_inside_lane_job("Turns.enter")
        with self._cv:
            if job not in self._entered:
                self._join(job, len(self._ring))
            self._cv.wait_for(lambda: self._ring[0] == job)

    def reserve(self, job: Hashable) -> None:
        """Give `job` a place right behind the job holding the turn, without waiting (the decode loop handing a
        request back, for its last short unit: it gets the turn when the loop passes it); `enter` then waits."""
        with self._cv:
            if job not in self._entered:
                self._join(job, 1 if self._ring else 0)

    def leave(self, job: Hashable) -> None:
        """Leave the ring (holding the turn or not); the next job gets the turn."""
        with self._cv:
            if job in self._ring:
                if self._ring[0] == job:
                    self._held_since = self._clock()
                self._ring.remove(job)
            self._entered.pop(job, None)
            self._decoding.discard(job)
            self._owed.pop(job, None)
            self._cv.notify_all()

    def hand_over(self, job: Hashable, to: Hashable) -> None:
        """`job`'s place in the ring (and its turn, if it holds it) passes to `to`, which takes it with `enter`
        (the decode loop taking a request over: it decodes next, not after a lap; `reserve` gives it back); `job`
        leaves. When `to` has a place already, `job` just leaves."""
        with self._cv:
            if job in self._ring and to not in self._entered:
                if self._ring[0] == job:
                    self._held_since = self._clock()
                self._ring[self._ring.index(job)] = to
                self._entered[to] = next(self._arrival)
                self._entered.pop(job, None)
                self._decoding.discard(job)
                self._owed.pop(job, None)
                self._cv.notify_all()
                return
        self.leave(job)

    def others(self, job: Hashable) -> int:
        """How many other jobs are waiting for a turn."""
        with self._cv:
            return len(self._ring) - (job in self._ring)

    def wanted(self, job: Hashable) -> bool:
        """Whether passing the turn now would let another job run: one waits that does not owe time to a senior
        job waiting (a debtor is skipped: pausing for it would only cost the pause)."""
        with self._cv:
            return any(j != job and not self._skipped(j) for j in self._ring)

    def pass_turn(self, job: Hashable, prefilling: bool = False) -> None:
        """Let every other job run one unit of work, then continue (returns at once when alone). `prefilling`: the
        unit just done was prefill work, whose time the senior jobs waiting are then owed (module docstring)."""
        refuse_inside_lane_job("Turns.pass_turn")
        with self._cv:
            if len(self._ring) < 2 or self._ring[0] != job:
                return
            now = self._clock()
            spent = now - self._held_since
            if prefilling:
                self._decoding.discard(job)
                if any(self._senior(j, job) for j in self._ring if j != job):
                    self._owed[job] = self._owed.get(job, 0.0) + spent * self.decode_share / (1 - self.decode_share)
            else:
                self._decoding.add(job)
                self._owed.pop(job, None)  # its own prompt is done: it owes nothing now
            for debtor in self._owed:  # the unit pays its juniors' debt (to the microsecond)
                if self._senior(job, debtor):
                    left = self._owed[debtor] - spent
                    self._owed[debtor] = 0.0 if left < 1e-6 else left
            self._hand_on(now)
            self._cv.wait_for(lambda: self._ring[0] == job)

    def _join(self, job: Hashable, at: int) -> None:
        if not self._ring:
            self._held_since = self._clock()
        self._ring.insert(at, job)
        self._entered[job] = next(self._arrival)

    def _senior(self, a: Hashable, b: Hashable) -> bool:
        """Whether `a` keeps its share of the model against `b`: b prefills (or has not run yet), and a decodes or
        came first."""
        if b in self._decoding:
            return False
        return a in self._decoding or self._entered[a] < self._entered[b]

    def _skipped(self, j: Hashable) -> bool:
        """Whether `j` is passed over: it still owes time, and one of its seniors waits."""
        return self._owed.get(j, 0.0) > 0.0 and any(self._senior(s, j) for s in self._ring if s != j)

    def _hand_on(self, now: float) -> None:
        """Rotate to the next job that may run: a job that still owes time is skipped while one of its seniors
        waits (a job with no senior in the ring never is: one is always found)."""
        self._ring.rotate(-1)
        for _ in range(len(self._ring)):
            if self._skipped(self._ring[0]):
                self._ring.rotate(-1)
            else:
                break
        self._held_since = now
        self.handovers += 1
        self._cv.notify_all()


class Pause(Protocol):
    """Where long work may give the model away between its jobs (a `Turn`): `wanted()` says whether another job
    waits; `pause(prefilling)` lets it run and returns once this work may go on."""

    def wanted(self) -> bool: ...

    def __call__(self, prefilling: bool = False) -> None: ...


class Turn:
    """A job's seat in a `Turns` ring, as the work it runs sees it: the prefill's pause points between chunks and
    the decode loop between rounds call it (`hetero.decode.prefill.Progress`). `wanted()`: another job waits for the
    model; `turn(prefilling)`: let every other job run one unit, then go on (`Turns.pass_turn`)."""

    def __init__(self, turns: Turns, job: Hashable) -> None:
        self.turns, self.job = turns, job

    def wanted(self) -> bool:
        return self.turns.wanted(self.job)

    def __call__(self, prefilling: bool = False) -> None:
        self.turns.pass_turn(self.job, prefilling=prefilling)


_lane = threading.local()


@contextmanager
def lane_job(lane: str) -> Iterator[None]:
    """Mark the calling thread as running a job of `lane` for the block: inside it, entering the ring or passing the
    turn raises (`refuse_inside_lane_job`) instead of waiting, the one wait that could close a circle."""
    outer = getattr(_lane, "name", None)
    _lane.name = lane
    try:
        yield
    finally:
        _lane.name = outer


def refuse_inside_lane_job(what: str) -> None:
    """Raise where the calling thread runs a lane's job: that job would wait on the ring while holding its lane."""
    lane = getattr(_lane, "name", None)
    if lane is not None:
        raise RuntimeError(f"{what} inside a job of the {lane} lane: a lane's job never waits on the turn ring "
                           "(it would hold its lane while other jobs wait for it); pause between jobs instead")
