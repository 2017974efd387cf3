"""The gated delta rule, in its chunked (prefill) and recurrent (decode) forms.

Per value head, with state S [Dk, Dv] in fp32 and per-token decay alpha = exp(g), rate beta:
    S = alpha * S;  u = beta * (v - S^T k);  S = S + k u^T;  o = S^T q
The chunked form computes the same thing for C tokens at a time with matmuls (cumulative decay inside the
chunk, a unit-lower-triangular system for the intra-chunk delta updates). Both take q, k already repeated to
the value heads and normalised (q = l2norm(q) / sqrt(Dk), k = l2norm(k)).
"""

from __future__ import annotations

import mlx.core as mx

from hetero.host import kernels
from hetero.models import activations as act
from hetero.models.attention import differentiating

CHUNK = 64
# Inputs of at most this many tokens (decode, draft and verify steps) run the token-by-token form, longer ones the
# chunked form; the models run their few-token steps as compiled functions below it too (`compiled.py`)
RECURRENT_MAX_TOKENS = 16
TINY = 1e-18  # magnitudes below this are flushed to 0 before matmuls (see _flush)


def _flush(x: mx.array) -> mx.array:
    """Zero out |x| < TINY: products of such values land in fp32's subnormal range, which x86 CPUs compute
    tens of times slower; each flushed value changes results by far less than fp32 rounding does."""
    return mx.where(mx.abs(x) < TINY, 0.0, x)


def _decay(log_decay: mx.array) -> mx.array:
    """exp(log_decay) for log_decay <= 0, flushed to 0 below TINY (no subnormal results).

    Positive inputs (the upper triangle, masked out by the caller) are clipped to 0 so that exp never
    overflows: inf there would make the masked gradient inf * 0 = NaN in training. Only the chunked form (more than
    RECURRENT_MAX_TOKENS tokens, never compiled) calls it: large decays take numpy's exp (`act.exp_now`).
    """
    return mx.where(log_decay < -41.0, 0.0, act.exp_now(mx.clip(log_decay, -41.0, 0.0)))


def _recurrent_step(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """One token: q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]; state [B, H, Dk, Dv] -> (o [B, H, Dv], state).

    Decode and verify steps run it inside the whole layer's compiled function (`DecoderLayer`, `compiled.py`). On the
    CPU it is hetero's own kernel where this machine has it (`hetero.host.kernels.delta_step`: the state read and written
    once, every row alike whatever rows sit beside it; it has no gradient, so not in training), else `mlx_step`.
    """
    if (mx.default_device() == mx.cpu and state.dtype == mx.float32 and v.shape[-1] <= kernels.MAX_VALUE_DIM
            and not differentiating() and (step := kernels.delta_step())):
        f32 = mx.float32
        return tuple(step(q.astype(f32), k.astype(f32), v.astype(f32), g.astype(f32), beta.astype(f32), state))
    return mlx_step(q, k, v, g, beta, state)


def mlx_step(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """`_recurrent_step` in MLX's own ops (any leading dimensions: [..., Dk], [..., Dv], [...], [..., Dk, Dv])."""
    state = state * mx.exp(g)[..., None, None]
    kt = k[..., None, :]  # [..., 1, Dk]
    remembered = (kt @ state)[..., 0, :]  # [..., Dv] = S^T k
    u = beta[..., None] * (v - remembered)  # [..., Dv]
    state = state + kt.swapaxes(-1, -2) * u[..., None, :]  # [..., Dk, Dv]
    return (q[..., None, :] @ state)[..., 0, :], state


def recurrent_gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    record: list[mx.array] | None = None,
) -> tuple[mx.array, mx.array]:
    """Token-by-token delta rule.

    q, k: [B, S, H, Dk]; v: [B, S, H, Dv]; g (log decay), beta: [B, S, H]; state: [B, H, Dk, Dv] fp32.
    Returns (out [B, S, H, Dv] fp32, final state); appends the state after each token to `record` if given.
    """
    outs = []
    for t in range(q.shape[1]):
        o, state = _recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o)
        if record is not None:
            record.append(state)
    return mx.stack(outs, axis=1), state


def _diagonal_blocks(a: mx.array, size: int) -> mx.array:
    """The diagonal size x size blocks of a [..., C, C] -> [..., C/size, size, size]."""
    *lead, c, _ = a.shape
    m = c // size
    grid = a.reshape(*lead, m, size, m, size).swapaxes(-3, -2)  # [..., m, m, size, size]
    return mx.moveaxis(mx.diagonal(grid, axis1=-4, axis2=-3), -1, -3)


def _unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + a)^-1 for strictly lower-triangular a [..., C, C] (C a power of two).

    Built bottom-up from diagonal blocks: inv([[A, 0], [B, D]]) = [[A^-1, 0], [-D^-1 B A^-1, D^-1]], doubling
    the block size log2(C) times. Matmuls only, so it runs on any device and differentiates.
    """
    *lead, c, _ = a.shape
    inv = mx.ones((*lead, c, 1, 1), dtype=a.dtype)  # [..., C, 1, 1] the 1x1 diagonal blocks
    size = 1
    while size < c:
        m = c // (2 * size)
        lower = _diagonal_blocks(a, 2 * size)[..., size:, :size]  # [..., m, size, size]
        pairs = inv.reshape(*lead, m, 2, size, size)
        first, second = pairs[..., 0, :, :], pairs[..., 1, :, :]  # [..., m, size, size]
        corner = _flush(-(second @ lower @ first))
        top = mx.concatenate([first, mx.zeros_like(first)], axis=-1)
        inv = mx.concatenate([top, mx.concatenate([corner, second], axis=-1)], axis=-2)  # [..., m, 2size, 2size]
        size *= 2
    return inv[..., 0, :, :]


def chunked_gated_delta(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array, chunk: int = CHUNK
) -> tuple[mx.array, mx.array]:
    """Chunked (parallel) delta rule; same contract as `recurrent_gated_delta`.

    Padding tokens (to a multiple of `chunk`) carry k = v = beta = g = 0, so they leave the state untouched.
    """
    B, S, H, Dk = q.shape
    Dv = v.shape[-1]
    pad = (-S) % chunk
    if pad:
        q, k, v = (mx.pad(t, [(0, 0), (0, pad), (0, 0), (0, 0)]) for t in (q, k, v))
        g, beta = (mx.pad(t, [(0, 0), (0, pad), (0, 0)]) for t in (g, beta))
    n = (S + pad) // chunk

    def chunks(t: mx.array) -> mx.array:  # [B, S', H, ...] -> [B, H, n, C, ...]
        t = t.reshape(B, n, chunk, H, *t.shape[3:])
        return t.transpose(0, 3, 1, 2, *range(4, t.ndim))

    q, k, v = chunks(q), chunks(k), chunks(v)  # [B, H, n, C, D]
    g, beta = chunks(g), chunks(beta)  # [B, H, n, C]
    gc = mx.cumsum(g, axis=-1)  # [B, H, n, C] log decay from chunk start
    causal = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_))
    diff = gc[..., :, None] - gc[..., None, :]  # [B, H, n, C, C]
    decay = mx.where(causal, _decay(diff), 0.0)  # exp(gc_i - gc_j) for j <= i, else 0
    kb = k * beta[..., None]  # [B, H, n, C, Dk]
    strict = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_), k=-1)
    a = mx.where(strict, (kb @ k.swapaxes(-1, -2)) * decay, 0.0)  # [B, H, n, C, C]
    t_inv = _unit_lower_inverse(a)
    u = t_inv @ (v * beta[..., None])  # [B, H, n, C, Dv] new values before the old state's read
    w = _flush(t_inv @ (kb * _decay(gc)[..., None]))  # [B, H, n, C, Dk] decayed keys reading the old state
    intra = (q @ k.swapaxes(-1, -2)) * decay  # [B, H, n, C, C]
    q_dec = q * _decay(gc)[..., None]  # [B, H, n, C, Dk]
    k_dec = k * _decay(gc[..., -1:] - gc)[..., None]  # [B, H, n, C, Dk]
    chunk_decay = _decay(gc[..., -1])[..., None, None]  # [B, H, n, 1, 1]

    outs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state  # [B, H, C, Dv]
        outs.append(q_dec[:, :, i] @ state + intra[:, :, i] @ v_new)  # [B, H, C, Dv]
        state = _flush(state * chunk_decay[:, :, i] + k_dec[:, :, i].swapaxes(-1, -2) @ v_new)  # [B, H, Dk, Dv]
    out = mx.stack(outs, axis=2).reshape(B, H, n * chunk, Dv)[:, :, :S]  # [B, H, S, Dv]
    return out.transpose(0, 2, 1, 3), state
