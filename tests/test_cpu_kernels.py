"""The CPU kernels (attention, activations) against float64 oracles and against MLX's own kernels."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from hetero.models import activations as act
from hetero.models import attention
from hetero.models.attention import attend


def oracle(q: mx.array, k: mx.array, v: mx.array, scale: float) -> np.ndarray:
    """Causal attention in float64 with the queries at the last L key positions."""
    qn, kn, vn = (np.array(a.astype(mx.float32)).astype(np.float64) for a in (q, k, v))
    group = qn.shape[1] // kn.shape[1]
    kn, vn = np.repeat(kn, group, axis=1), np.repeat(vn, group, axis=1)
    L, S = qn.shape[2], kn.shape[2]
    scores = qn @ kn.transpose(0, 1, 3, 2) * scale  # [B, H, L, S]
    future = np.arange(S)[None, :] > np.arange(L)[:, None] + (S - L)
    scores[..., future] = -np.inf
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ vn


def assert_matches_oracle(kernel, shape: tuple[int, ...], mask: str | None) -> None:
    """`kernel(q, k, v, scale)` on random inputs of `shape` (B, H, Hkv, L, S, D) is within 5e-5 of the float64
    oracle, and no further from it than twice MLX's own fused kernel."""
    B, H, Hkv, L, S, D = shape
    mx.random.seed(sum(shape))
    q, k = mx.random.normal((B, H, L, D)) * 3, mx.random.normal((B, Hkv, S, D)) * 3
    v = mx.random.normal((B, Hkv, S, D))
    want = oracle(q, k, v, D**-0.5)
    got = np.array(kernel(q, k, v, D**-0.5))
    fused = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask))
    assert np.abs(got - want).max() <= 5e-5
    assert np.abs(got - want).max() <= 2 * np.abs(fused - want).max() + 1e-6


SHAPES = [  # B, H, Hkv, L, S, D
    (1, 4, 2, 512, 512, 64),  # first prefill chunk
    (1, 4, 2, 96, 1000, 64),  # a later chunk over a cache
    (2, 6, 2, 40, 40, 32),  # batch of two, group of three
    (1, 8, 1, 33, 70, 16),  # multi-query
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [attention.BLOCK_SCORES, 3000])
def test_numpy_kernel_matches_float64_oracle(shape, block, monkeypatch):
    monkeypatch.setattr(attention, "BLOCK_SCORES", block)  # 3000 forces many query blocks per head
    assert_matches_oracle(attention._numpy_causal, shape, mask="causal")


def test_future_keys_get_exactly_zero_weight():
    """Keys after a query's position are masked even when their scores dwarf the visible ones."""
    B, H, Hkv, L, S, D = 1, 2, 1, 64, 64, 16
    q = mx.ones((B, H, L, D))
    k = mx.concatenate([mx.zeros((B, Hkv, 1, D)), mx.full((B, Hkv, S - 1, D), 50.0)], axis=2)
    v = mx.concatenate([mx.ones((B, Hkv, 1, D)), mx.full((B, Hkv, S - 1, D), 1e12)], axis=2)
    out = np.array(attend(q, k, v, D**-0.5))
    assert np.array_equal(out[:, :, 0], np.ones((B, H, D), np.float32))  # the first query sees one key
    assert np.isfinite(out).all()


def test_low_precision_inputs_keep_their_dtype():
    q, k, v = (mx.random.normal((1, 2, 48, 32)).astype(mx.bfloat16) for _ in range(3))
    out = attend(q, k, v, 32**-0.5)
    assert out.dtype == mx.bfloat16
    want = oracle(q, k, v, 32**-0.5)
    assert np.abs(np.array(out.astype(mx.float32)) - want).max() < 2e-2  # bf16 output rounding


def test_long_query_blocks_on_the_cpu_take_the_numpy_kernel(monkeypatch):
    calls = []
    real = attention._numpy_causal
    monkeypatch.setattr(attention, "_numpy_causal", lambda *a: calls.append(a[0].shape) or real(*a))
    q = mx.random.normal((1, 2, attention.MIN_QUERIES, 16))
    kv = mx.random.normal((1, 2, 100, 16))
    attend(q, kv, kv, 0.25)
    attend(q[:, :, :4], kv, kv, 0.25)  # a verify block stays on MLX's kernel
    assert calls == [(1, 2, attention.MIN_QUERIES, 16)]


def test_training_gets_true_gradients_inside_differentiable():
    """The numpy kernel's in-place softmax is invisible to autodiff; inside `differentiable()` a long query block
    takes MLX's kernel, whose gradient equals the one of MLX's reference attention (and compiles)."""
    q = mx.random.normal((1, 2, 40, 16))
    k, v = mx.random.normal((1, 2, 40, 16)), mx.random.normal((1, 2, 40, 16))
    reference = mx.grad(lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal").sum())(q)
    with attention.differentiable():
        ours = mx.grad(lambda q: attend(q, k, v, 0.25).sum())(q)
        compiled = mx.compile(mx.grad(lambda q: attend(q, k, v, 0.25).sum()))(q)
    np.testing.assert_allclose(np.array(ours), np.array(reference), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(compiled), np.array(reference), rtol=1e-5, atol=1e-5)
    outside = mx.grad(lambda q: attend(q, k, v, 0.25).sum())(q)  # the numpy kernel again: not a gradient
    assert np.abs(np.array(outside) - np.array(reference)).max() > 1e-2


FEW_SHAPES = [  # B, H, Hkv, L, S, D: a few queries (decode, verify) over a long cache
    (1, 4, 2, 1, 4096, 64),  # the bundled model's decode step, S a multiple of the value chunk
    (1, 4, 2, 1, 30000, 64),  # a long context, with a remainder after the last whole chunk
    (1, 4, 2, 4, 5000, 64),  # a verify block of four
    (2, 6, 2, 3, 1500, 32),  # batch of two, group of three
    (1, 8, 1, 2, 300, 16),  # multi-query, fewer keys than one chunk
]


@pytest.mark.parametrize("shape", FEW_SHAPES)
def test_few_query_kernel_matches_float64_oracle(shape):
    assert_matches_oracle(attention._numpy_few, shape, mask="causal" if shape[3] > 1 else None)


def test_few_query_kernel_reads_a_cache_buffer_past_its_valid_keys():
    """Decode attends over `KVCache`'s valid prefix, a strided view of a larger buffer whose tail holds other
    (stale) keys: only the prefix may count."""
    B, Hkv, S, D = 1, 2, 2 * attention.VALUE_CHUNK + 7, 64
    mx.random.seed(3)
    k_buf, v_buf = mx.random.normal((B, Hkv, S + 256, D)), mx.random.normal((B, Hkv, S + 256, D))
    k_buf[:, :, S:] = 100.0  # stale keys that would take all the weight if they were read
    v_buf[:, :, S:] = 1e6
    q = mx.random.normal((B, 4, 1, D))
    k, v = k_buf[:, :, :S], v_buf[:, :, :S]
    got = np.array(attention._numpy_few(q, k, v, D**-0.5))
    assert np.abs(got - oracle(q, k, v, D**-0.5)).max() <= 5e-5


def test_future_keys_of_a_verify_block_get_exactly_zero_weight():
    B, H, Hkv, L, S, D = 1, 2, 1, 3, 600, 16
    q = mx.ones((B, H, L, D))
    k = mx.concatenate([mx.zeros((B, Hkv, S - 2, D)), mx.full((B, Hkv, 2, D), 50.0)], axis=2)
    v = mx.concatenate([mx.ones((B, Hkv, S - 2, D)), mx.full((B, Hkv, 2, D), 1e20)], axis=2)  # exp(FLOOR) * 1e20 shows
    out = np.array(attention._numpy_few(q, k, v, D**-0.5))
    assert np.array_equal(out[:, :, 0], np.ones((B, H, D), np.float32))  # the first query sees only zero keys
    assert np.isfinite(out).all()


def test_few_queries_over_a_long_cache_take_the_numpy_kernel(monkeypatch):
    calls = []
    real = attention._numpy_few
    monkeypatch.setattr(attention, "_numpy_few", lambda *a: calls.append(a[1].shape[2]) or real(*a))
    q = mx.random.normal((1, 2, 4, 16))
    short, long = mx.random.normal((1, 2, attention.MIN_KEYS - 1, 16)), mx.random.normal((1, 2, attention.MIN_KEYS, 16))
    attend(q, short, short, 0.25)  # a short cache stays on MLX's kernel, in the lazy graph
    attend(q[:, :, :1], long, long, 0.25)
    attend(q, long, long, 0.25)
    with attention.differentiable():
        attend(q, long, long, 0.25)
    assert calls == [attention.MIN_KEYS, attention.MIN_KEYS]


def test_bundled_model_decodes_the_same_with_either_kernel(monkeypatch):
    """Greedy decode steps and a verify block of the bundled model over the numpy kernel (forced from 64 keys) give
    MLX's kernel's tokens and logits within the parity tests' tolerance."""
    import hetero

    engine = hetero.load()
    model = engine.model
    prompt = mx.array(np.random.default_rng(0).integers(3, model.args.vocab_size, (1, 200)))

    def run(min_keys: int) -> tuple[list[int], np.ndarray]:
        monkeypatch.setattr(attention, "MIN_KEYS", min_keys)
        cache = model.make_cache()
        logits, _ = model(prompt, cache)
        tokens, rows = [], []
        for _ in range(6):  # decode steps
            tokens.append(int(mx.argmax(logits[0, -1]).item()))
            logits, _ = model(mx.array([[tokens[-1]]]), cache)
            rows.append(np.array(logits[0, -1]))
        logits, _ = model(mx.array([tokens[:4]]), cache)  # a verify block of four queries
        rows.extend(np.array(logits[0]))
        return tokens, np.stack(rows)

    tokens_new, logits_new = run(64)
    tokens_old, logits_old = run(1 << 30)
    assert tokens_new == tokens_old
    assert np.abs(logits_new - logits_old).max() <= 1e-4 * np.abs(logits_old).max()  # test_parity's RTOL


ACTIVATIONS = [  # ours, MLX's, float64 oracle
    (act.exp, mx.exp, np.exp),
    (act.sigmoid, mx.sigmoid, lambda x: 1 / (1 + np.exp(-x))),
    (act.silu, lambda x: x * mx.sigmoid(x), lambda x: x / (1 + np.exp(-x))),
]


@pytest.mark.parametrize("ours, theirs, oracle", ACTIVATIONS)
def test_activations_are_as_accurate_as_mlx_own(ours, theirs, oracle):
    x = mx.concatenate([mx.linspace(-87, 87, 20001), mx.random.normal((20000,)) * 4])
    want = oracle(np.array(x).astype(np.float64))
    scale = np.maximum(np.abs(want), 1e-30)
    ours_err = (np.abs(np.array(ours(x)) - want) / scale).max()
    theirs_err = (np.abs(np.array(theirs(x)) - want) / scale).max()
    assert ours_err <= max(2 * theirs_err, 1e-6)


@pytest.mark.parametrize("ours, theirs, oracle", ACTIVATIONS)
def test_activations_keep_low_precision_dtypes(ours, theirs, oracle):
    x = (mx.random.normal((4096,)) * 4).astype(mx.bfloat16)
    got = ours(x)
    assert got.dtype == mx.bfloat16
    assert mx.array_equal(got, theirs(x))  # bf16 takes MLX's own kernel


PREFILL_ACTIVATIONS = [  # ours (numpy's exp on a large array), float64 oracle
    (act.sigmoid_now, lambda x: 1 / (1 + np.exp(-x))),
    (act.exp_now, np.exp),
    (act.silu_now, lambda x: x / (1 + np.exp(-x))),
    (lambda x: act.silu_mul_now(x, x * 0.5 + 1), lambda x: x / (1 + np.exp(-x)) * (x * 0.5 + 1)),
    (lambda x: act.silu_mul_halves_now(mx.concatenate([x, x * 0.5 + 1], axis=-1)),
     lambda x: x / (1 + np.exp(-x)) * (x * 0.5 + 1)),
]


@pytest.mark.parametrize("ours, oracle", PREFILL_ACTIVATIONS)
def test_prefill_activations_are_as_accurate_and_leave_their_inputs(ours, oracle, monkeypatch):
    """The prefill forms (numpy's exp, written into a new MLX buffer) are as accurate as MLX's own kernels, read
    their inputs without writing them, and run in numpy only from EAGER_MIN elements on."""
    x = mx.concatenate([mx.linspace(-87, 87, 20001), mx.random.normal((19999,)) * 4]).reshape(-1, 8)
    assert x.size >= act.EAGER_MIN
    before = np.array(x)
    want = oracle(before.astype(np.float64))
    got = np.array(ours(x))
    assert (np.abs(got - want) / np.maximum(np.abs(want), 1e-30)).max() <= 1e-6
    np.testing.assert_array_equal(np.array(x), before)
    exps, exp = [], np.exp
    monkeypatch.setattr(act.np, "exp", lambda *a, **k: exps.append(1) or exp(*a, **k))
    ours(x)
    ours(x[:100])  # small: the lazy power form
    assert len(exps) == 1


def test_silu_mul_of_fused_halves_equals_silu_mul_of_the_split_halves():
    """A fused gate|up product's SwiGLU read in place gives the very numbers of the split halves' (`moe.SwitchGLU`'s
    grouped form runs the first once gate and up are one product)."""
    y = mx.random.normal((40, 45, 256)) * 4  # a routed-expert bucket's [experts, capacity, 2 x width]
    assert y[..., :128].size >= act.EAGER_MIN
    gate, up = mx.split(y, [128], axis=-1)
    assert mx.array_equal(act.silu_mul_halves_now(y), act.silu_mul_now(gate, up))


def test_prefill_activations_stay_lazy_and_differentiable_in_training():
    x = mx.random.normal((64, 1024))
    with attention.differentiable():
        grad = mx.grad(lambda t: act.sigmoid_now(t).sum())(x)
    s = 1 / (1 + np.exp(-np.array(x).astype(np.float64)))
    np.testing.assert_allclose(np.array(grad), s * (1 - s), rtol=1e-5, atol=1e-7)
