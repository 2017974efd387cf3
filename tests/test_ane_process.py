"""The ANE lane in its own worker process: the real protocol (shared-memory arenas, a spawned interpreter running
the reference executor), bit-identical to the in-thread lane; a worker that dies, hangs or returns garbage never
loses a request (the prompt is prefilled GPU-only, exactly, and the next split gets a fresh worker); the trace's
IPC cost per job; the memory governor's worker line.

The faults come from `tests/ane_faults.py`, loaders that stand in for Core ML's `CompiledMLModel.predict` dying,
hanging or returning NaN inside the worker; the worker process, its death (a real SIGKILL), the socket and the
shared memory are real."""

from __future__ import annotations

import os
import types
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types as miltypes

from hetero.checkpoint.loader import load_model
from hetero.coreml.backends.reference_executor import ReferenceExecutor
from hetero.coreml.graphs.ops import DEPLOYMENT_TARGET
from hetero.coreml.graphs.package import save_program
from hetero.decode.prefill import prefill
from hetero.pipeline import Trace, configure
from hetero.pipeline.ane_process import TRACK, AneProcess, stop_workers
from hetero.planner import loaded_budget
from hetero.validate import AneSplit
from test_coreml_graphs import save_checkpoint, tiny_model
from test_pipeline import PIPE

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    path = save_checkpoint(tiny_model(3, PIPE), tmp_path_factory.mktemp("ane-proc") / "ckpt", PIPE)
    model, path, config = load_model(path, dtype=mx.float32)
    return types.SimpleNamespace(model=model, config=config, path=path, name=str(path), identity="ane-proc@test")


@pytest.fixture
def fault_env(monkeypatch):
    """The worker can import tests/ane_faults.py; its fault comes at its 3rd job."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("HETERO_TEST_FAULT_AT", "3")
    yield monkeypatch
    stop_workers()  # a worker started with one fault setting must not serve the next test


def _prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, PIPE["vocab_size"], n).tolist()


def _arrays(cache) -> list[np.ndarray]:
    return [np.array(a) for c in cache for a in c.state]


def _scale_program(tmp_path: Path, shape: tuple) -> Path:
    @mb.program(input_specs=[mb.TensorSpec(shape=shape, dtype=miltypes.fp16)], opset_version=DEPLOYMENT_TARGET)
    def prog(x):
        return mb.mul(x=x, y=np.float16(3.0), name="y")

    return save_program(prog, tmp_path / f"scale{shape[-1]}.mlpackage")


def test_a_job_in_the_worker_equals_the_executor_in_this_process(tmp_path):
    """Same outputs bit for bit, as read-only views of the shared output arena; arenas grow for a larger job."""
    lane = AneProcess()
    try:
        assert lane.pid != os.getpid()
        for width in (64, 4096):  # the second job needs larger arenas both ways
            path = _scale_program(tmp_path, (1, 64, 1, width))
            x = np.random.default_rng(width).standard_normal((1, 64, 1, width)).astype(np.float32)
            ours = lane.load(path)({"x": x})
            ref = ReferenceExecutor(path)({"x": x})
            assert ours.keys() == ref.keys()
            np.testing.assert_array_equal(ours["y"], ref["y"])
            assert not ours["y"].flags.writeable and not ours["y"].flags.owndata  # a view, no copy out
        assert lane.stats.calls == 2 and lane.stats.compute_s > 0
        assert lane.resident_bytes() > 64 * 4096 * 4  # at least the arenas' pages it touched
    finally:
        lane.close()
    assert lane.proc.poll() is not None  # stopped


def _minor_faults(pid: int) -> int:
    """Minor page faults of a process so far (/proc/PID/stat field 10)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads page faults from /proc (Linux)")
def test_a_warm_worker_touches_no_fresh_pages_per_job(tmp_path, fault_env):
    """The worker keeps the memory a job frees (`keep_freed_memory`): a job whose temporaries grow and shrink as
    the reference executor's do faults in no fresh pages once warm. Without it a fresh process's malloc maps and
    returns them every job: 1,562 minor faults per job of this program (51 with it), 3,552 per call of
    bench/ttft.py's MLP program (71 ms against 58 ms)."""
    lane = AneProcess("ane_faults:temporaries")
    try:
        program = lane.load(tmp_path / "none.mlpackage")  # the loader ignores its path
        x = np.ones((512, 512), np.float32)
        program({"x": x})
        before = _minor_faults(lane.pid)
        for _ in range(10):
            program({"x": x})
        assert (_minor_faults(lane.pid) - before) / 10 < 200  # a few small buffers, not the job's temporaries
    finally:
        lane.close()


def test_process_lane_is_bit_identical_to_the_in_thread_lane(tiny_engine):
    """Fraction 0.5: every piece kind split, its merges with the GPU's rest included."""
    fraction, ids = 0.5, _prompt(200)
    results = {}
    for lane in ("process", "thread"):
        run = configure(tiny_engine, fraction, 64, lane=lane)
        cache = tiny_engine.model.make_cache()
        res = run.splitter(len(ids)).run(ids, cache, mtp=False, logits=True)
        results[lane] = res, np.array(res.logits), _arrays(cache)
    (proc, p_logits, p_cache), (thread, t_logits, t_cache) = results["process"], results["thread"]
    np.testing.assert_array_equal(p_logits, t_logits)
    for a, b in zip(p_cache, t_cache, strict=True):
        np.testing.assert_array_equal(a, b)
    assert proc.lane == "process" and proc.worker_s > 0 and proc.ipc_s > 0
    assert thread.lane == "thread" and thread.ipc_s == 0


@pytest.mark.parametrize("fault, says", [("dies", "exited"), ("hangs", "answered nothing"),
                                         ("garbage", "non-finite")])
def test_a_lost_worker_loses_no_request(tiny_engine, fault_env, fault, says, capsys):
    """The worker dies, hangs or returns NaN at its 3rd job: the prompt comes back to be prefilled GPU-only (an
    empty cache), with one warning line and the failure counted; the next prompt's split runs in a new worker and
    matches the in-thread split exactly."""
    ids = _prompt(200)  # the export of the other tests (one context bucket)
    run = configure(tiny_engine, 0.5, 64)
    run.ane_loader, run.ane_timeout_s = f"ane_faults:{fault}", 3.0
    first = run.splitter(len(ids) - 1).worker
    cache, n, carry = run.prefill(ids)
    assert (n, carry) == (0, None) and cache[0].offset == 0  # nothing of the split is kept
    assert run.lane_failures == 1 and says in run.last_failure
    assert run.ane_block()["lane_failures"] == 1
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "prefilled GPU-only" in err and says in err
    assert first.proc.poll() is not None  # killed, not left running

    fault_env.setenv("HETERO_TEST_FAULT_AT", "0")  # the fresh worker never faults
    cache, n, carry = run.prefill(ids)
    second = run.splitter(len(ids) - 1).worker
    assert second.pid != first.pid and second.alive and n == len(ids) - 1
    ref = configure(tiny_engine, 0.5, 64, lane="thread")
    ref_cache = tiny_engine.model.make_cache()
    ref.splitter(len(ids) - 1).run(ids[:-1], ref_cache, mtp=tiny_engine.model.has_mtp, logits=False)
    for a, b in zip(_arrays(cache), _arrays(ref_cache), strict=True):
        np.testing.assert_array_equal(a, b)
    assert run.lane_failures == 1


def test_a_killed_worker_gives_exactly_the_gpu_only_generation(fault_env):
    """Through `Engine.generate` on the bundled model: the worker is SIGKILLed mid-prefill; the reply is the
    GPU-only run's, token for token, and reports no cached tokens."""
    import hetero

    engine = hetero.load()
    prompt = "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip()\n" * 12
    run = configure(engine, 0.5, 256)
    run.ane_loader = "ane_faults:dies"
    run.prepare(engine.encode_prompt(prompt))
    split = engine.generate(prompt, max_tokens=12, mtp=False, split=run, use_prefix_cache=False)
    gpu = engine.generate(prompt, max_tokens=12, mtp=False, use_prefix_cache=False)
    assert run.lane_failures == 1 and "exited" in run.last_failure
    assert split.tokens == gpu.tokens and split.stats["cached_tokens"] == 0


def test_the_trace_shows_each_worker_job_and_its_ipc_cost(tiny_engine):
    ids = _prompt(200)
    run = configure(tiny_engine, 0.5, 64)
    split = run.splitter(len(ids))
    before = split.worker.stats.calls
    trace = Trace()
    res = split.run(ids, tiny_engine.model.make_cache(), trace=trace)
    jobs = [e for e in trace.events if e["tid"] == TRACK]
    assert len(jobs) == split.worker.stats.calls - before > 0
    assert all(set(e["args"]) >= {"compute_ms", "ipc_ms", "copy_in_ms"} for e in jobs)
    assert all(e["args"]["compute_ms"] <= e["dur"] / 1e3 + 1e-3 for e in jobs)  # compute is inside the round trip
    names = trace.to_json()["traceEvents"]
    assert any(m["ph"] == "M" and m["tid"] == TRACK and "ANE worker" in m["args"]["name"] for m in names)
    ipc = sum(e["args"]["ipc_ms"] for e in jobs) / 1e3
    assert ipc == pytest.approx(res.ipc_s, rel=1e-2, abs=1e-4)


def test_the_governor_counts_the_worker(tiny_engine):
    """The worker's bytes are a budget line of their own, taken from the room the KV cache may use."""
    model = tiny_engine.model
    worker = 300 << 20
    free = loaded_budget(model, memory_gb=4.0, in_flight=4)
    held = loaded_budget(model, memory_gb=4.0, in_flight=4, ane_worker_bytes=worker + 12345)  # whole MiB count
    assert ("ANE lane: worker footprint, or its loaded Core ML functions if more", worker) in held.lines
    room = lambda b: sum(n for name, n in b.lines if name.startswith(("KV cache", "unused")))  # noqa: E731
    assert room(free) - room(held) == worker
    assert sum(n for _, n in held.lines) == held.wirable_bytes


def test_the_library_prefill_survives_a_lost_worker(fault_env):
    """`hetero.prefill` appending a turn through the split: the worker dies mid-prompt, the caller's cache goes
    back to the prefix it held and the turn is prefilled GPU-only, so the cache equals the GPU-only one exactly."""
    import hetero
    from hetero.caches.mlx_lm import cache_leaves

    engine = hetero.load()
    first, second = engine.encode_prompt(DOCTOR_TEXT * 3), engine.encode_prompt(DOCTOR_TEXT * 6)[:300]
    run = configure(engine, 0.5, 256)  # the export of the generation test above (one context bucket)
    run.ane_loader = "ane_faults:dies"
    engine.split_runs = {(AneSplit(0.5), 256, "lut"): run}  # the library's configured split (split, chunk, weights)
    ours = hetero.prefill(engine, second, ane_fraction=0.5, chunk=256, cache=hetero.prefill(engine, first, chunk=256))
    gpu = hetero.prefill(engine, second, chunk=256, cache=hetero.prefill(engine, first, chunk=256))
    assert run.lane_failures == 1
    for a, b in zip(cache_leaves(ours), cache_leaves(gpu), strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))


DOCTOR_TEXT = "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip()\n"
