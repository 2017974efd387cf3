"""Causal scaled-dot-product attention over a KV cache, with a numpy kernel for MLX's CPU backend.

On Metal, `mx.fast.scaled_dot_product_attention` is the right kernel for every shape. On MLX's CPU
backend (Linux, or a Mac asked to run on the CPU) its softmax runs MLX's scalar `exp`, measured at ~21 ns
per element on the project's x86 machines against ~0.7 ns for numpy's SIMD `exp`, so a 512-token prefill
chunk over a 16K-token context spends nearly all its time in the softmax (0.77 s against 0.13 s for the
kernel below). Long query blocks on the CPU therefore run here: two BLAS matmuls around a numpy softmax,
computed block by block so the score matrix stays small, and only over the keys each block can see.
Decode and verify steps (a few queries) stay on MLX, where the whole step remains one lazy graph.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

MIN_QUERIES = 32  # query blocks at least this long take the numpy kernel on the CPU
BLOCK_SCORES = 1 << 24  # scores held at once (64 MiB of fp32)
FLOOR = -41.0  # exp(FLOOR) ~ 1.6e-18: exponents are clipped here so no subnormal reaches the matmul


def attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """Causal attention of queries [B, H, L, D] over keys/values [B, Hkv, S, D] -> [B, H, L, Dv].

    The queries sit at the last L of the S positions (a prefill chunk or verify block after the cache);
    H is a multiple of Hkv (grouped-query attention).
    """
    L = queries.shape[2]
    if L >= MIN_QUERIES and mx.default_device() == mx.cpu:
        return _numpy_causal(queries, keys, values, scale)
    mask = "causal" if L > 1 else None
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def _numpy_causal(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    B, H, L, D = queries.shape
    _, Hkv, S, Dv = values.shape
    G = H // Hkv
    offset = S - L  # position of the first query
    q32 = queries.astype(mx.float32) * scale
    k32, v32 = keys.astype(mx.float32), values.astype(mx.float32)
    mx.eval(q32, k32, v32)
    q, k, v = np.asarray(q32), np.asarray(k32), np.asarray(v32)
    out = np.empty((B, H, L, Dv), np.float32)
    step = max(1, min(L, BLOCK_SCORES // (G * S)))  # query positions per block
    below = np.tril(np.ones((step, step), np.float32))  # 1 where key <= query inside the diagonal block
    for b in range(B):
        for h in range(Hkv):
            v_sum = np.concatenate([v[b, h], np.ones((S, 1), np.float32)], axis=1)  # [S, Dv+1]: last column sums
            for i0 in range(0, L, step):
                n = min(step, L - i0)
                end = offset + i0 + n  # keys visible to the block's last query
                qb = q[b, h * G : (h + 1) * G, i0 : i0 + n].reshape(G * n, D)  # [G*n, D]
                scores = (qb @ k[b, h, :end].T).reshape(G, n, end)  # [G, n, end]
                diag = scores[:, :, end - n :]  # [G, n, n]: the block's own positions
                diag[:, below[:n, :n] == 0] = -np.inf
                scores -= scores.max(axis=2, keepdims=True)
                np.maximum(scores, FLOOR, out=scores)
                np.exp(scores, out=scores)
                diag *= below[:n, :n]  # masked keys weigh exactly 0
                o = scores.reshape(G * n, end) @ v_sum[:end]  # [G*n, Dv+1]
                o = (o[:, :Dv] / o[:, Dv:]).reshape(G, n, Dv)
                out[b, h * G : (h + 1) * G, i0 : i0 + n] = o
    return mx.array(out).astype(queries.dtype)
