"""Turns on the model (hetero/decode/turns.py): round-robin by units, and while someone decodes, prefill time is paid back
to the decoders so that they keep `decode_share` of the model's time. Jobs are real threads; the clock is a
counter the job holding the turn advances by its unit's length, so the order of units is exact."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero.decode.turns import Turns


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def queued(turns: Turns) -> int:
    return turns.others(object())  # every job in the ring


def wait_until(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds  # (a loaded machine may not run a thread for seconds)
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        threading.Event().wait(0.001)


def run_jobs(turns: Turns, clock: Clock, jobs: dict[str, tuple[int, float, bool]]) -> list[str]:
    """Run each job (name -> (units, seconds per unit, prefilling)) on its own thread, queued in the dict's order;
    returns the names in the order their units ran."""
    trace: list[str] = []

    def job(name: str, units: int, seconds: float, prefilling: bool) -> None:
        turns.enter(name)
        wait_until(lambda: queued(turns) == len(jobs))  # the first job starts once all are queued
        for _ in range(units):
            clock.now += seconds  # the unit's work, done while holding the turn
            trace.append(name)
            turns.pass_turn(name, prefilling=prefilling)
        turns.leave(name)

    threads = []
    for i, (name, (units, seconds, prefilling)) in enumerate(jobs.items()):
        threads.append(threading.Thread(target=job, args=(name, units, seconds, prefilling)))
        threads[-1].start()
        wait_until(lambda: queued(turns) == i + 1)
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a job never got its turn back"
    return trace


def runs_between(trace: list[str], name: str) -> list[int]:
    """How many units of other jobs ran between consecutive units of `name`."""
    at = [i for i, n in enumerate(trace) if n == name]
    return [b - a - 1 for a, b in zip(at, at[1:])]


def test_decoders_are_paid_back_the_prefill_time():
    clock = Clock()
    turns = Turns(decode_share=0.8, clock=clock)
    # D decodes in 1/8 s rounds; P prefills in 1 s chunks: each chunk is owed 4 s = 32 rounds of D
    trace = run_jobs(turns, clock, {"D": (200, 0.125, False), "P": (4, 1.0, True)})
    assert runs_between(trace, "P") == [32, 32, 32]
    prefill_span = trace[trace.index("P"): len(trace) - trace[::-1].index("P")]
    assert prefill_span.count("D") / len(prefill_span) > 0.95  # by units; by time D had 0.8 of it


def test_share_zero_is_plain_round_robin():
    clock = Clock()
    trace = run_jobs(Turns(decode_share=0.0, clock=clock), clock, {"D": (10, 0.125, False), "P": (4, 1.0, True)})
    assert runs_between(trace, "P") == [1, 1, 1]


def test_prefills_alone_owe_nothing():
    """Two prompts prefilling and nobody decoding: chunk for chunk, whatever their lengths."""
    clock = Clock()
    trace = run_jobs(Turns(decode_share=0.8, clock=clock), clock, {"A": (4, 1.0, True), "B": (4, 0.25, True)})
    assert trace[:8] == ["A", "B"] * 4


def test_a_prefill_that_starts_decoding_owes_nothing_more():
    """A job's debt ends with its prompt: once it decodes, the jobs alternate round by round."""
    clock = Clock()
    turns = Turns(decode_share=0.8, clock=clock)
    trace: list[str] = []

    def decoder() -> None:
        turns.enter("D")
        wait_until(lambda: queued(turns) == 2)
        for _ in range(60):
            clock.now += 0.125
            trace.append("D")
            turns.pass_turn("D")
        turns.leave("D")

    def request() -> None:
        turns.enter("R")
        clock.now += 1.0
        trace.append("R-prefill")
        turns.pass_turn("R", prefilling=True)
        for _ in range(5):
            clock.now += 0.125
            trace.append("R")
            turns.pass_turn("R")
        turns.leave("R")

    d = threading.Thread(target=decoder)
    d.start()
    wait_until(lambda: queued(turns) == 1)
    r = threading.Thread(target=request)
    r.start()
    d.join(timeout=30)
    r.join(timeout=30)
    first = trace.index("R")
    assert trace[trace.index("R-prefill") + 1: first].count("D") == 32  # the chunk's debt
    assert runs_between(trace, "R") == [1, 1, 1, 1]  # then plain alternation


def test_decode_share_must_leave_the_prefill_some_time():
    with pytest.raises(ValueError, match="decode_share"):
        Turns(decode_share=1.0)


def test_an_earlier_prompt_keeps_its_share_against_a_later_one():
    """Two prompts prefilling: the later one owes the earlier one its time as a decoder would be owed it, so the
    earlier keeps decode_share of the model (A's 1/4 s chunks: four of them per chunk of B's), and is never made to
    wait for the later one's work (OpenCode's title request, then its main request)."""
    clock = Clock()
    trace = run_jobs(Turns(decode_share=0.8, clock=clock), clock, {"A": (12, 0.25, True), "B": (4, 0.25, True)})
    assert trace[:2] == ["A", "B"]  # a job that has not run yet gets its first unit at once
    assert runs_between(trace, "B")[:2] == [4, 4]
    assert trace.index("A") == 0 and "".join(trace).rstrip("B").count("B") <= 3  # A ends first


def test_a_later_prompt_runs_at_full_speed_once_the_earlier_one_is_gone():
    clock = Clock()
    trace = run_jobs(Turns(decode_share=0.8, clock=clock), clock, {"A": (2, 0.25, True), "B": (6, 0.25, True)})
    assert trace == ["A", "B", "A", "B", "B", "B", "B", "B"]


def test_the_decode_loop_takes_a_jobs_place_and_gives_it_back():
    """`hand_over`: the job's place (and its turn) becomes the loop's, so the loop decodes next, not after a lap;
    `reserve`: the place comes back right behind the job holding the turn, so the job's last unit runs next, ahead
    of the jobs that waited."""
    turns = Turns()
    order: list[str] = []

    def unit(name: str) -> None:
        turns.enter(name)
        order.append(name)
        turns.leave(name)

    turns.enter("job")
    other = threading.Thread(target=unit, args=("other",))
    other.start()
    wait_until(lambda: queued(turns) == 2)
    turns.hand_over("job", "loop")
    assert turns.others("job") == 2 and turns.others("loop") == 1  # the job is out; the loop holds its place
    turns.enter("loop")  # at once: the place is the loop's, at the front
    order.append("loop")
    turns.reserve("job")  # a round ended the job's request: it is next in line, ahead of "other"
    job = threading.Thread(target=unit, args=("job",))
    job.start()
    turns.pass_turn("loop")  # returns once the job and "other" had their units
    order.append("loop again")
    turns.leave("loop")
    for t in (job, other):
        t.join(timeout=10)
    assert order == ["loop", "job", "other", "loop again"]


def test_a_lane_job_never_waits_on_the_ring():
    """Inside a lane's job (the wavefront's lanes, the split's lanes, a decode round) entering the ring or passing
    the turn raises at once: it would hold the lane while the jobs waiting for it wait on the ring (a circle)."""
    from hetero.decode.turns import lane_job

    turns = Turns()
    turns.enter("a")
    threading.Thread(target=lambda: (turns.enter("b"), turns.leave("b")), daemon=True).start()
    wait_until(lambda: queued(turns) == 2)
    with lane_job("test lane"):
        with pytest.raises(RuntimeError, match="inside a job of the test lane lane"):
            turns.pass_turn("a")
        with pytest.raises(RuntimeError, match="never waits on the turn ring"):
            turns.enter("c")
    turns.pass_turn("a")  # between jobs it passes as ever ("b" has its unit, and leaves)
    turns.leave("a")


@settings(max_examples=40, deadline=None)
@given(decode_share=st.sampled_from([0.0, 0.5, 0.8]),
       jobs=st.lists(st.tuples(st.integers(0, 6), st.sampled_from([0.05, 0.25, 1.0, 3.0]),
                               st.integers(0, 12), st.sampled_from([0.01, 0.125])), min_size=1, max_size=5))
def test_no_job_waits_for_one_that_came_after_it(decode_share, jobs):
    """Any jobs (prefill units, then decode units, of any lengths), queued in any order: every one ends, and by the
    time it does the jobs queued after it have run at most a bounded share of its own time (their whole work if
    smaller): `r * W + (n + 1) * u`, r = decode_share / (1 - decode_share) what a senior decoder may take of W (its
    own work), one unit u of theirs per unit n of its own otherwise. So its end is bounded by its own work plus the
    work queued ahead of it plus that share, never by the later jobs' whole work."""
    jobs = [(p, pu, d, du) for p, pu, d, du in jobs if p + d] or [(1, 0.25, 1, 0.01)]
    clock = Clock()
    turns = Turns(decode_share=decode_share, clock=clock)
    ended: dict[int, float] = {}
    go = threading.Event()  # set once every job is queued

    def job(i: int, prefill: int, pu: float, decode: int, du: float) -> None:
        turns.enter(i)
        go.wait()
        for k in range(prefill + decode):
            clock.now += pu if k < prefill else du
            turns.pass_turn(i, prefilling=k < prefill)
        ended[i] = clock.now
        turns.leave(i)

    threads = []
    for i, spec in enumerate(jobs):
        threads.append(threading.Thread(target=job, args=(i, *spec)))
        threads[-1].start()
        wait_until(lambda: queued(turns) == i + 1)
    go.set()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a job never got its turn back"
    r = decode_share / (1 - decode_share)
    work = [p * pu + d * du for p, pu, d, du in jobs]
    for i, (p, pu, d, du) in enumerate(jobs):
        later = sum(min(work[j], r * work[i] + (p + d + 1) * max(jobs[j][1], jobs[j][3]))
                    for j in range(i + 1, len(jobs)))
        assert ended[i] <= sum(work[: i + 1]) + later + 1e-9, (i, ended, work)


def test_a_pause_is_wanted_only_when_another_job_would_run():
    """`wanted`: a job that still owes its senior the time it took is passed over, so the senior does not stop its
    work (a wavefront's segment) just to get the turn straight back."""
    clock = Clock()
    turns = Turns(decode_share=0.8, clock=clock)
    turns.enter("A")
    assert not turns.wanted("A")  # alone
    b = threading.Thread(target=lambda: (turns.enter("B"), clock.__setattr__("now", clock.now + 1.0),
                                         turns.pass_turn("B", prefilling=True), turns.leave("B")))
    b.start()
    wait_until(lambda: queued(turns) == 2)
    assert turns.wanted("A")  # B has not run yet: it gets its first unit at once
    clock.now += 0.25
    turns.pass_turn("A", prefilling=True)  # B runs 1 s of prefill and now owes A 4 s
    assert not turns.wanted("A") and turns.others("A") == 1  # B waits, but would be passed over
    passes = 0
    while turns.others("A"):
        assert not turns.wanted("A")  # B still owes: a pause would only cost the pause
        clock.now += 0.25
        turns.pass_turn("A", prefilling=True)  # B is passed over until its debt is paid, then runs (and leaves)
        passes += 1
    assert passes == 16  # 4 s paid back in A's 1/4 s units
    turns.leave("A")
    b.join(timeout=10)
    assert not b.is_alive()


def test_a_newcomer_gets_one_unit_not_its_whole_prompt():
    """A prompt arriving while an earlier one prefills gets its first unit at once, and the earlier one, waiting,
    wants the turn back after it (it owes the newcomer nothing). Found by tests/test_stress.py: when a job that had
    not run yet counted as senior, the earlier prompt owed it its time, was passed over, and the newcomer's wavefront
    never paused: it prefilled all of its prompt first."""
    clock = Clock()
    turns = Turns(decode_share=0.8, clock=clock)
    seen: list[bool] = []
    turns.enter("early")

    def newcomer() -> None:
        turns.enter("new")
        clock.now += 0.5
        seen.append(turns.wanted("new"))  # where the newcomer's wavefront would end its first segment
        turns.pass_turn("new", prefilling=True)
        turns.leave("new")

    t = threading.Thread(target=newcomer)
    t.start()
    wait_until(lambda: queued(turns) == 2)
    clock.now += 0.33
    turns.pass_turn("early", prefilling=True)  # the newcomer runs one unit
    turns.leave("early")
    t.join(timeout=10)
    assert seen == [True]
