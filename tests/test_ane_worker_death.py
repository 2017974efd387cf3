"""The ANE lane's worker may die at any moment and the run goes on: while its programs load, mid-job, between jobs
and while the engine writes to it. Each time the prompt is prefilled GPU-only (exactly the GPU-only tokens), one
warning line says so, nothing else is printed (no traceback, no SIGPIPE death) and the next prompt gets a fresh
worker.

The deaths are real SIGKILLs of the real worker process: from outside (`os.kill` of its pid) or from inside, by the
loaders of `tests/ane_faults.py`, which stand in for Core ML's compile/load (`CompiledMLModel(...)`) or `predict`
killing the process (an ANE compile failure, a memory-pressure kill)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hetero.errors import AneLaneLost
from hetero.pipeline import configure
from hetero.pipeline.ane_process import AneProcess, stop_workers

TESTS = Path(__file__).resolve().parent
PROMPT = "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip()\n" * 12  # 2 chunks of 256


def _hetero_run(*args: str, loader: str | None = None, fault_at: int = 3) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
           "HETERO_TEST_FAULT_AT": str(fault_at)}
    env.pop("HETERO_ANE_LOADER", None)
    if loader:
        env["HETERO_ANE_LOADER"] = f"ane_faults:{loader}"
    return subprocess.run([sys.executable, "-m", "hetero.cli.main", "run", "--prompt", PROMPT, "--max-tokens", "10",
                           "--no-mtp", "--json", *args], capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def gpu_tokens() -> list[int]:
    out = _hetero_run()
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["tokens"]


@pytest.mark.parametrize("loader, says", [
    ("dies_loading", "while loading"),  # its 3rd program's compile/load kills it, inside `prepare`
    ("dies", "while a job of"),  # mid-job: its 3rd job's predict kills it
    ("dies_after", "exited"),  # just after answering its 3rd job: between jobs, or while the engine sends the next
])
def test_hetero_run_survives_the_worker_dying(gpu_tokens, loader, says):
    out = _hetero_run("--ane-fraction", "0.5", loader=loader)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # stdout is the JSON alone
    assert result["tokens"] == gpu_tokens
    assert result["ane"]["lane_failures"] == 1 and says in result["ane"]["last_failure"]
    warnings = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "prefilled GPU-only" in warnings[0] and says in warnings[0]
    assert "Traceback" not in out.stderr and "error" not in out.stderr


@pytest.fixture
def fault_env(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    yield monkeypatch
    stop_workers()


def _split_and_gpu(engine, run) -> tuple[list[int], list[int]]:
    split = engine.generate(PROMPT, max_tokens=10, mtp=False, split=run, use_prefix_cache=False)
    gpu = engine.generate(PROMPT, max_tokens=10, mtp=False, use_prefix_cache=False)
    return split.tokens, gpu.tokens


def test_a_worker_dying_while_loading_gives_the_next_prompt_a_fresh_one(fault_env, capsys):
    """`prepare` (before the clock) loses the worker at its 3rd program load: that prompt is prefilled GPU-only,
    with one warning and no second try; the next prompt's split loads into a new worker and runs."""
    import hetero

    engine = hetero.load()
    fault_env.setenv("HETERO_TEST_FAULT_AT", "3")
    run = configure(engine, 0.5, 256)
    run.ane_loader = "ane_faults:dies_loading"
    ids = engine.encode_prompt(PROMPT)
    run.prepare(ids)
    assert run.lane_failures == 1 and "while loading" in run.last_failure
    ours, gpu = _split_and_gpu(engine, run)
    assert ours == gpu and run.last is None and run.lane_failures == 1
    assert capsys.readouterr().err.count("warning:") == 1

    fault_env.setenv("HETERO_TEST_FAULT_AT", "0")  # the fresh worker never faults
    run.prepare(ids)
    ours, _ = _split_and_gpu(engine, run)
    assert run.last is not None and run.lane_failures == 1  # split this time
    assert run.splitter(len(ids) - 1).worker.alive


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc (Linux)")
def test_a_worker_killed_between_jobs_from_outside(fault_env, capsys):
    """The programs are loaded, then the worker is SIGKILLed from outside (as macOS's memory pressure would):
    the next prompt finds it gone before sending anything, goes GPU-only with one warning, and the one after gets
    a fresh worker."""
    import hetero

    engine = hetero.load()
    run = configure(engine, 0.5, 256)
    ids = engine.encode_prompt(PROMPT)
    run.prepare(ids)
    worker = run.splitter(len(ids) - 1).worker
    os.kill(worker.pid, signal.SIGKILL)
    _wait_dead(worker.pid)  # gone before the next prompt (killed during it, it is the mid-job case)
    ours, gpu = _split_and_gpu(engine, run)
    assert ours == gpu and run.lane_failures == 1 and "between jobs" in run.last_failure
    assert capsys.readouterr().err.count("warning:") == 1
    run.prepare(ids)
    _split_and_gpu(engine, run)
    assert run.last is not None and run.splitter(len(ids) - 1).worker.pid != worker.pid


def _wait_dead(pid: int) -> None:
    """Until `pid` has exited (a zombie: its sockets closed), without reaping it; gone altogether counts too (the
    split's background load of the next context bucket may meet the dead worker first and reap it)."""
    for _ in range(500):
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return
        except FileNotFoundError:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not die")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc (Linux)")
def test_a_send_to_a_dead_worker_is_a_lost_worker_not_a_broken_pipe():
    """The engine writes to a worker that died a moment ago: the broken pipe is `AneLaneLost` (the CLI took a bare
    BrokenPipeError for its stdout's reader going away and exited 141 with no output)."""
    lane = AneProcess()
    os.kill(lane.pid, signal.SIGKILL)
    _wait_dead(lane.pid)
    with pytest.raises(AneLaneLost, match="exited .* while a job"):
        lane._send(("run", 0, []), "a job of x")  # what `run` sends once `_check` has passed
    assert lane.proc.poll() is not None and not lane.alive
    x = np.zeros(4, np.float32)
    with pytest.raises(AneLaneLost):
        lane.run(("x", None), {"x": x})
