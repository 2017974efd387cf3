"""Idle time in `hetero serve` measures a draft-depth verdict left inside the noise again (hetero/server/idle_tuning.py):
on a real Runner over the tiny model, with the contest's decoder scripted (the real `calibrate`, its timing injected)
and gated by events, so what the test sees happens in a fixed order: the spell starts only while no request runs,
a request arriving mid-spell stops it after the pair being timed and then runs, and the samples are saved."""

from __future__ import annotations

import functools
import threading

import pytest

import hetero
from hetero.decode.depth_calibration import calibrate, verdict_entry
from hetero.decode.options import DecodeOptions
from hetero.decode.depth_contest import Contest, Verdict
from hetero.host.settings import remeasure_reason, save_tuning, tuning
from hetero.server.idle_tuning import IdleTuning
from hetero.server.requests import Job
from hetero.server.runner import Runner
from tiny_checkpoint import write_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return hetero.load(write_tiny_model(tmp_path_factory.mktemp("idle") / "m"))


@pytest.fixture
def unsettled(engine, tmp_path, monkeypatch):
    """A saved verdict inside the noise for the engine, measured with this code: it needs measuring again."""
    monkeypatch.setenv("HETERO_HOME", str(tmp_path))
    contest = Contest((3,), ratios={3: [1.1, 0.9]}, rates={3: [110.0, 90.0]}, accepted={3: [2.5, 2.5]},
                      plain=[100.0, 100.0], rounds=0, seconds=1.0)
    save_tuning(engine.identity, verdict_entry(contest, Verdict(3, False, "inside the noise"), 64, "first use"))
    assert remeasure_reason(engine.identity) == "its last verdict was inside the noise"


class Gate:
    """A scripted decoder (MTP 1.3x plain, 2.5 tokens per pass) that blocks inside one chosen call until released."""

    def __init__(self, block_at: int | None):
        self.calls, self.block_at = 0, block_at
        self.inside, self.release = threading.Event(), threading.Event()

    def __call__(self, depth, prompt, tokens):
        self.calls += 1
        if self.calls == self.block_at:
            self.inside.set()
            assert self.release.wait(30)
        return (130.0, 2.5) if depth else (100.0, None)


def test_an_idle_server_measures_again_and_a_request_stops_the_spell(engine, unsettled):
    runner = Runner(engine, max_concurrent=1)
    gate = Gate(block_at=4)  # warm-up: calls 1-2; the first pair: calls 3-4
    first = functools.partial(calibrate, decode=gate, expected=lambda *_: 1.2)
    spells = []

    def measure(*a, **kw):  # the first spell measures; a later one (the verdict is still unsettled) only counts
        spells.append(kw["why"])
        return first(*a, **kw) if len(spells) == 1 else None

    idle = IdleTuning(engine, runner, idle_s=0.05, measure=measure)
    try:
        assert idle.start()
        assert gate.inside.wait(30)  # the spell is timing its first pair
        # (plain: the server's start-up has looked at the verdict already, `serve` calls `default_depth`)
        job = Job(engine.tokenizer.encode("def add(a, b):"), DecodeOptions(4, mtp=False))
        done = runner.submit(job, lambda piece: None, threading.Event())
        gate.release.set()
        outcome = done.result(timeout=60)  # the spell stopped after that pair, and the request ran
        assert outcome.stats["generated_tokens"] == 4
        entry = tuning(engine.identity)
        assert entry["verdict"]["pairs"] == 3  # the 2 saved pairs and the one timed before the request came
        assert entry["calibrated"].startswith("again: its last verdict was inside the noise; idle time")
    finally:
        runner.stop()
        runner.close()


def test_a_settled_verdict_needs_no_idle_measuring(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_HOME", str(tmp_path))
    from hetero.host.settings import pin_tuning

    pin_tuning(engine.identity, 3, "pinned")
    runner = Runner(engine)
    try:
        assert not IdleTuning(engine, runner, idle_s=0.01, measure=lambda *a, **k: pytest.fail("measured")).start()
    finally:
        runner.close()
