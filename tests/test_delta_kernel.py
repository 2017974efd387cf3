"""hetero's own gated delta step (hetero/host/kernels/delta_step.cpp), built for real like the few-row kernel: one token
of the delta rule against a float64 numpy oracle; the property batching and speculative decoding rest on (a row's
state does not depend on the rows beside it, so a verify pass leaves the states the decode steps would); the
recurrent form that takes it; and where it stays out (training, other dtypes, turned off)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from hetero.host import kernels
from hetero.models import attention
from hetero.models.gated_delta import _recurrent_step, recurrent_gated_delta

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(kernels.unsupported() is not None, reason=f"the kernels: {kernels.unsupported()}")


@pytest.fixture(scope="module")
def delta_step():
    k = kernels.delta_step()
    assert k is not None, kernels.why_not("HETERO_DELTA_KERNEL")
    return k


def inputs(rng, n: int, dk: int, dv: int) -> list[np.ndarray]:
    """q, k (l2-normalised, as the layer feeds them), v, g (log decay) in [-3, 0], beta in (0, 1), state."""
    q, k = (rng.standard_normal((n, dk), dtype=np.float32) for _ in range(2))
    q, k = (t / np.linalg.norm(t, axis=-1, keepdims=True) for t in (q, k))
    v = rng.standard_normal((n, dv), dtype=np.float32)
    g = -rng.uniform(0, 3, n).astype(np.float32)
    beta = rng.uniform(0, 1, n).astype(np.float32)
    state = rng.standard_normal((n, dk, dv), dtype=np.float32)
    return [q, k, v, g, beta, state]


def oracle(q, k, v, g, beta, state):
    """The rule in float64: S = exp(g) S; u = beta (v - S^T k); S = S + k u^T; o = S^T q."""
    q, k, v, g, beta, s = (t.astype(np.float64) for t in (q, k, v, g, beta, state))
    s = s * np.exp(g)[:, None, None]
    u = beta[:, None] * (v - np.einsum("nk,nkv->nv", k, s))
    s = s + k[:, :, None] * u[:, None, :]
    return np.einsum("nk,nkv->nv", q, s), s


@pytest.mark.parametrize("n, dk, dv", [(1, 1, 1), (3, 5, 11), (64, 64, 64), (32, 128, 128), (6, 48, 512)])
def test_the_step_equals_a_float64_oracle(delta_step, n, dk, dv):
    rng = np.random.default_rng(n * dk + dv)
    args = inputs(rng, n, dk, dv)
    out, state = delta_step(*map(mx.array, args))
    want_out, want_state = oracle(*args)
    assert out.shape == (n, dv) and state.shape == (n, dk, dv)
    # |S| entries are O(1) with O(dk) terms in each sum: fp32 rounding stays far below 1e-5 of it
    assert np.max(np.abs(np.array(state) - want_state)) < 1e-5 * dk
    assert np.max(np.abs(np.array(out) - want_out)) < 1e-5 * dk


def test_a_rows_state_does_not_depend_on_the_rows_beside_it(delta_step):
    """Each (row, head) of a batch equals the same one stepped alone, bit for bit, at every batch size (the state
    overwritten in place, as a decode step's is, or not)."""
    rng = np.random.default_rng(5)
    args = [mx.array(a) for a in inputs(rng, 8 * 16, 64, 64)]
    alone = [delta_step(*(a[i : i + 1] for a in args)) for i in range(0, 128, 16)]
    for rows in (2, 4, 8):
        out, state = delta_step(*(a[: rows * 16] for a in args))
        out2, state2 = delta_step(*(a[: rows * 16] for a in args[:5]), args[5][: rows * 16] * 1)  # held by nothing else
        assert np.array_equal(np.array(state2), np.array(state)) and np.array_equal(np.array(out2), np.array(out))
        for r in range(rows):
            o1, s1 = alone[r]
            assert np.array_equal(np.array(out[r * 16 : r * 16 + 1]), np.array(o1)), (rows, r)
            assert np.array_equal(np.array(state[r * 16 : r * 16 + 1]), np.array(s1)), (rows, r)


def test_the_step_runs_inside_compiled_graphs_and_on_views(delta_step):
    rng = np.random.default_rng(9)
    q, k, v, g, beta, state = (mx.array(a) for a in inputs(rng, 4, 16, 24))
    f = mx.compile(lambda q, state: delta_step(q * 2, k, v, g, beta, state))
    for got, want in zip(f(q, state), delta_step(q * 2, k, v, g, beta, state)):
        assert np.array_equal(np.array(got), np.array(want))
    wide = mx.array(rng.standard_normal((4, 24, 16), dtype=np.float32))
    view = wide.swapaxes(1, 2)  # [4, 16, 24], not row-contiguous: copied inside the op
    qv = mx.array(rng.standard_normal((16, 4), dtype=np.float32)).T  # [4, 16], a transposed view
    got_out, got_state = delta_step(qv, k, v, g, beta, view)
    want_out, want_state = oracle(*(np.array(t) for t in (qv, k, v, g, beta, view)))
    assert np.allclose(np.array(got_state), want_state, atol=1e-4)
    assert np.allclose(np.array(got_out), want_out, atol=1e-4)
    lead = [a.reshape(2, 2, *a.shape[1:]) for a in (q, k, v, g, beta, state)]  # [rows, heads, ...]: any lead dims
    for got, want in zip(delta_step(*lead), delta_step(q, k, v, g, beta, state)):
        assert np.array_equal(np.array(got).reshape(np.array(want).shape), np.array(want))


def test_the_step_refuses_what_it_does_not_compute(delta_step):
    q, k, v, d, b, s = (mx.zeros(shape) for shape in [(2, 4), (2, 4), (2, 8), (2,), (2,), (2, 4, 8)])
    for call, what in [
        (lambda: delta_step(q, k, v, d, b, s.astype(mx.bfloat16)), "float32"),
        (lambda: delta_step(q, k, v, d, b, mx.zeros((3, 4, 8))), "must match"),
        (lambda: delta_step(q, k, v[:, :5], d, b, s), "must match"),
        (lambda: delta_step(q, k, v, d, b, mx.zeros((2, 4))), "expected"),
        (lambda: delta_step(q, k, mx.zeros((2, 513)), d, b, mx.zeros((2, 4, 513))), "up to 512"),
    ]:
        with pytest.raises(ValueError, match=what):
            call()


def graph(*outputs: mx.array) -> str:
    import io

    buf = io.StringIO()
    mx.export_to_dot(buf, *outputs)
    return buf.getvalue()


def layer_inputs(rng, B: int, H: int, dk: int, dv: int, state_dtype=mx.float32):
    q, k = (mx.array(rng.standard_normal((B, H, dk), dtype=np.float32)) for _ in range(2))
    q, k = (t / mx.linalg.norm(t, axis=-1, keepdims=True) for t in (q, k))
    v = mx.array(rng.standard_normal((B, H, dv), dtype=np.float32))
    g = mx.array(-rng.uniform(0, 3, (B, H)).astype(np.float32))
    beta = mx.array(rng.uniform(0, 1, (B, H)).astype(np.float32))
    state = mx.array(rng.standard_normal((B, H, dk, dv), dtype=np.float32)).astype(state_dtype)
    return q, k, v, g, beta, state


def test_the_recurrent_form_takes_the_kernel_on_float32_and_matches_mlx_ops(delta_step):
    """`_recurrent_step` (every decode, draft and verify step of a GDN layer) runs the kernel, and its result is
    MLX's own ops' result within fp32 rounding; a token sequence through `recurrent_gated_delta` records each
    token's state as the steps one at a time leave it, bit for bit (a verify pass keeps what decoding would)."""
    rng = np.random.default_rng(11)
    q, k, v, g, beta, state = layer_inputs(rng, 2, 4, 16, 32)
    out, new = _recurrent_step(q, k, v, g, beta, state)
    assert "DeltaStep" in graph(out, new)
    with attention.differentiable():  # MLX's ops (training): the reference
        ref_out, ref_new = _recurrent_step(q, k, v, g, beta, state)
    assert "DeltaStep" not in graph(ref_out, ref_new)
    assert np.allclose(np.array(new), np.array(ref_new), atol=2e-5)
    assert np.allclose(np.array(out), np.array(ref_out), atol=2e-5)

    S = 4
    qs, ks, vs, gs, bs, _ = zip(*(layer_inputs(rng, 2, 4, 16, 32) for _ in range(S)))
    record: list[mx.array] = []
    outs, last = recurrent_gated_delta(*(mx.stack(t, axis=1) for t in (qs, ks, vs, gs, bs)), state, record=record)
    s = state
    for t in range(S):
        o, s = _recurrent_step(qs[t], ks[t], vs[t], gs[t], bs[t], s)
        assert np.array_equal(np.array(record[t]), np.array(s)), t
        assert np.array_equal(np.array(outs[:, t]), np.array(o)), t
    assert np.array_equal(np.array(last), np.array(s))


def test_the_kernel_stays_out_of_training_and_other_dtypes(delta_step):
    rng = np.random.default_rng(12)
    q, k, v, g, beta, state = layer_inputs(rng, 1, 2, 8, 8)
    with attention.differentiable():
        grad = mx.grad(lambda q: _recurrent_step(q, k, v, g, beta, state)[0].sum())(q)  # MLX's ops: a gradient
    assert grad.shape == q.shape and bool(mx.all(mx.isfinite(grad)))
    out, new = _recurrent_step(q, k, v, g, beta, state.astype(mx.bfloat16))
    assert "DeltaStep" not in graph(out, new)


def test_turned_off_the_recurrent_form_is_mlx_ops():
    code = ("import json, hetero, mlx.core as mx\nfrom hetero.host import kernels\n"
            "from hetero.models.gated_delta import _recurrent_step\n"
            "z = mx.zeros((1, 2, 4)); out, s = _recurrent_step(z, z, z, mx.zeros((1, 2)), mx.zeros((1, 2)),"
            " mx.zeros((1, 2, 4, 4)))\n"
            "import io; buf = io.StringIO(); mx.export_to_dot(buf, out, s)\n"
            "print(json.dumps({'kernel': 'DeltaStep' in buf.getvalue(), 'why': kernels.why_not('HETERO_DELTA_KERNEL'),"
            " 'few_rows': kernels.few_rows() is not None}))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HETERO_DELTA_KERNEL": "0"})
    assert run.returncode == 0, run.stderr
    status = json.loads(run.stdout)
    assert status == {"kernel": False, "why": "turned off (HETERO_DELTA_KERNEL=0)", "few_rows": True}, status
