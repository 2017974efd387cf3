"""Compiled few-token steps (hetero/models/compiled.py): same numbers as the op-by-op graph, and a process that
ran them on worker threads exits cleanly."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np

import hetero
from hetero.decode.prefill import prefill
from hetero.models.compiled import PerThread

PROMPT = "def fibonacci(n):\n    if n < 2:\n"


def spy_steps(monkeypatch) -> list:
    """Every call of a compiled piece (`PerThread`, the real one wrapped), as the piece called."""
    calls, call = [], PerThread.__call__
    monkeypatch.setattr(PerThread, "__call__", lambda self, *args: calls.append(self) or call(self, *args))
    return calls


def compiled_pieces(model, recorded: bool = False) -> list:
    """The pieces one few-token step over a warm cache runs, in order: a GDN layer's whole-layer step (recorded in a
    verify pass), an attention layer's projections and its output + MLP."""
    pieces = []
    for layer in model.layers:
        if layer.is_linear:
            pieces.append(layer._gdn_recorded_step if recorded else layer._gdn_step)
        else:
            pieces += [layer._attention_in, layer._attention_out]
    return pieces


def _decode_logits(engine, steps: int, calls: list | None = None) -> tuple[list[int], np.ndarray]:
    """Greedy decode `steps` tokens one at a time after a prefill; returns (tokens, logits [steps, V]). `calls`
    (from `spy_steps`): emptied after the prefill, so it holds the decode steps' compiled pieces."""
    model = engine.model
    cache = model.make_cache()
    logits, _ = prefill(model, engine.tokenizer.encode(PROMPT), cache)
    if calls is not None:
        calls.clear()
    tokens, rows = [], []
    for _ in range(steps):
        tok = int(mx.argmax(logits[-1]).item())
        tokens.append(tok)
        out, _ = model(mx.array([[tok]]), cache)
        logits = out[0]
        rows.append(np.array(logits[-1]))
    return tokens, np.stack(rows)


def test_compiled_decode_steps_match_uncompiled(monkeypatch):
    engine = hetero.load()
    calls = spy_steps(monkeypatch)
    tokens, compiled = _decode_logits(engine, 12, calls)
    assert calls == compiled_pieces(engine.model) * 12  # every layer of every step took its compiled branch
    mx.disable_compile()
    try:
        plain_tokens, plain = _decode_logits(engine, 12)
    finally:
        mx.enable_compile()
    assert tokens == plain_tokens
    np.testing.assert_allclose(compiled, plain, rtol=1e-5, atol=1e-5)


def test_compiled_verify_records_the_same_states(monkeypatch):
    """A recorded (verify) pass through the compiled layers keeps the same per-token states as the op graph."""
    engine = hetero.load()
    model = engine.model
    ids = engine.tokenizer.encode(PROMPT)
    calls = spy_steps(monkeypatch)

    def recorded(compile_on: bool) -> list[np.ndarray]:
        (mx.enable_compile if compile_on else mx.disable_compile)()
        try:
            cache = model.make_cache()
            prefill(model, ids, cache)
            gdn = [c for c, layer in zip(cache, model.layers) if layer.is_linear]
            for c in gdn:
                c.start_recording()
            calls.clear()
            out, _ = model(mx.array([[5, 17, 42, 9]]), cache)
            if compile_on:  # the recorded pass took every layer's compiled branch
                assert calls == compiled_pieces(model, recorded=True)
            return [np.array(out)] + [np.array(s) for c in gdn for s in (*c.recorded_states, c.recorded_conv_in)]
        finally:
            mx.enable_compile()

    for a, b in zip(recorded(True), recorded(False), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


EXIT_SCRIPT = textwrap.dedent(
    """
    import hetero
    from concurrent.futures import ThreadPoolExecutor
    engine = hetero.load()
    pool = ThreadPoolExecutor(2)
    jobs = [pool.submit(engine.generate, "def f(x):\\n", max_tokens=8, mtp=mtp) for mtp in (True, False)]
    print([job.result().tokens for job in jobs])
    pool.shutdown(wait=True)
    """
)


def test_process_exits_cleanly_after_compiled_steps_on_worker_threads():
    """MLX 0.32 aborts at exit when a thread-local compile cache outlives its thread (compiled.py); with one
    compiled function shared by all threads this script aborted in 6 of 8 runs."""
    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
