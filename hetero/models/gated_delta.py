"""The gated delta rule, in its chunked (prefill) and recurrent (decode) forms.

Per value head, with state S [Dk, Dv] in fp32 and per-token decay alpha = exp(g), rate beta:
    S = alpha * S;  u = beta * (v - S^T k);  S = S + k u^T;  o = S^T q
The chunked form computes the same thing for C tokens at a time with matmuls (cumulative decay inside the
chunk, a unit-lower-triangular system for the intra-chunk delta updates). Both take q, k already repeated to
the value heads and normalised (q = l2norm(q) / sqrt(Dk), k = l2norm(k)).
"""

from __future__ import annotations

import mlx.core as mx

CHUNK = 64


def recurrent_gated_delta(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """Token-by-token delta rule.

    q, k: [B, S, H, Dk]; v: [B, S, H, Dv]; g (log decay), beta: [B, S, H]; state: [B, H, Dk, Dv] fp32.
    Returns (out [B, S, H, Dv] fp32, final state).
    """
    outs = []
    for t in range(q.shape[1]):
        state = state * mx.exp(g[:, t])[..., None, None]  # [B, H, Dk, Dv]
        kt = k[:, t][..., None, :]  # [B, H, 1, Dk]
        remembered = (kt @ state)[..., 0, :]  # [B, H, Dv] = S^T k
        u = beta[:, t][..., None] * (v[:, t] - remembered)  # [B, H, Dv]
        state = state + kt.swapaxes(-1, -2) * u[..., None, :]  # [B, H, Dk, Dv]
        outs.append((q[:, t][..., None, :] @ state)[..., 0, :])  # [B, H, Dv]
    return mx.stack(outs, axis=1), state


def _unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + a)^-1 for strictly lower-triangular a [..., C, C] (C a power of two).

    a is nilpotent (a^C = 0), so (I + a)^-1 = (I - a)(I + a^2)(I + a^4)...: log2(C) squarings, matmuls only,
    which runs on any device and differentiates.
    """
    n = -a
    inv = mx.eye(a.shape[-1], dtype=a.dtype) + n
    power = n
    for _ in range(a.shape[-1].bit_length() - 2):
        power = power @ power
        inv = inv + inv @ power
    return inv


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
    decay = mx.exp(mx.where(causal, diff, -mx.inf))  # exp(gc_i - gc_j) for j <= i, else 0
    kb = k * beta[..., None]  # [B, H, n, C, Dk]
    strict = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_), k=-1)
    a = mx.where(strict, (kb @ k.swapaxes(-1, -2)) * decay, 0.0)  # [B, H, n, C, C]
    t_inv = _unit_lower_inverse(a)
    u = t_inv @ (v * beta[..., None])  # [B, H, n, C, Dv] new values before the old state's read
    w = t_inv @ (kb * mx.exp(gc)[..., None])  # [B, H, n, C, Dk] decayed keys reading the old state
    intra = (q @ k.swapaxes(-1, -2)) * decay  # [B, H, n, C, C]
    q_dec = q * mx.exp(gc)[..., None]  # [B, H, n, C, Dk]
    k_dec = k * mx.exp(gc[..., -1:] - gc)[..., None]  # [B, H, n, C, Dk]
    chunk_decay = mx.exp(gc[..., -1])[..., None, None]  # [B, H, n, 1, 1]

    outs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state  # [B, H, C, Dv]
        outs.append(q_dec[:, :, i] @ state + intra[:, :, i] @ v_new)  # [B, H, C, Dv]
        state = state * chunk_decay[:, :, i] + k_dec[:, :, i].swapaxes(-1, -2) @ v_new  # [B, H, Dk, Dv]
    out = mx.stack(outs, axis=2).reshape(B, H, n * chunk, Dv)[:, :, :S]  # [B, H, S, Dv]
    return out.transpose(0, 2, 1, 3), state
