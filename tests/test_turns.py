"""Turns on the model (hetero/decode/turns.py): round-robin by units, and while someone decodes, prefill time is paid back
to the decoders so that they keep `decode_share` of the model's time. Jobs are real threads; the clock is a
counter the job holding the turn advances by its unit's length, so the order of units is exact."""

from __future__ import annotations

import threading

import pytest

from hetero.decode.turns import Turns


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def queued(turns: Turns) -> int:
    return turns.others(object())  # every job in the ring


def wait_until(condition) -> None:
    for _ in range(5000):
        if condition():
            return
        threading.Event().wait(0.001)
    raise AssertionError("timed out")


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
