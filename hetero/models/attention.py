"""Causal scaled-dot-product attention over a KV cache, with a numpy kernel for MLX's CPU backend.

On Metal, `mx.fast.scaled_dot_product_attention` is the right kernel for every shape. On MLX's CPU
backend (Linux, or a Mac asked to run on the CPU) its softmax runs MLX's scalar `exp`, measured at ~21 ns
per element on the project's x86 machines against ~0.7 ns for numpy's SIMD `exp`, so a 512-token prefill
chunk over a 16K-token context spends nearly all its time in the softmax (0.77 s against 0.13 s for the
kernel below). Long query blocks on the CPU therefore run here: MLX's two matmuls around a softmax that numpy
computes in place on the evaluated scores (a writable view of MLX's buffer; numpy runs no BLAS here, so its
thread pool never competes with MLX's), block by block so the score matrix stays small, and only over the
keys each block can see.
Decode and verify steps (a few queries) stay on MLX, where the whole step remains one lazy graph.
The numpy kernel evaluates mid-graph and has no gradient, so training runs inside `differentiable()`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

MIN_QUERIES = 32  # query blocks at least this long take the numpy kernel on the CPU
BLOCK_SCORES = 1 << 21  # scores held at once (8 MiB of fp32: the softmax passes stay in cache; 64 MiB was ~20% slower at 8K-16K)
FLOOR = -41.0  # exp(FLOOR) ~ 1.6e-18: exponents are clipped here so no subnormal reaches the matmul
_mode = threading.local()


@contextmanager
def differentiable() -> Iterator[None]:
    """Within (on this thread), every shape takes MLX's own kernel, which `mx.grad` and `mx.compile` can trace: the
    numpy softmax's in-place update is invisible to autodiff (its gradient came out wrong by 21 where the true one
    is at most 1.5) and it evaluates in the middle of the graph, which a compiled function cannot. For training."""
    before = getattr(_mode, "differentiable", False)
    _mode.differentiable = True
    try:
        yield
    finally:
        _mode.differentiable = before


def attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """Causal attention of queries [B, H, L, D] over keys/values [B, Hkv, S, D] -> [B, H, L, Dv].

    The queries sit at the last L of the S positions (a prefill chunk or verify block after the cache);
    H is a multiple of Hkv (grouped-query attention).
    """
    L = queries.shape[2]
    if L >= MIN_QUERIES and mx.default_device() == mx.cpu and not getattr(_mode, "differentiable", False):
        return _numpy_causal(queries, keys, values, scale)
    mask = "causal" if L > 1 else None
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def _numpy_causal(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    B, H, L, D = queries.shape
    _, Hkv, S, Dv = values.shape
    G = H // Hkv
    offset = S - L  # position of the first query
    q = (queries.astype(mx.float32) * scale).reshape(B, Hkv, G, L, D)  # [B, Hkv, G, L, D]
    k_t = keys.astype(mx.float32).swapaxes(-1, -2)  # [B, Hkv, D, S]
    ones = mx.ones((B, Hkv, S, 1), mx.float32)
    v_sum = mx.concatenate([values.astype(mx.float32), ones], axis=-1)  # [B, Hkv, S, Dv+1]: last column sums
    step = max(1, min(L, BLOCK_SCORES // (B * H * S)))  # query positions per block
    below = np.tril(np.ones((step, step), np.float32))  # 1 where key <= query inside the diagonal block
    future = np.where(below > 0, 0.0, -np.inf).astype(np.float32)  # additive mask of the same block
    outs = []
    for i0 in range(0, L, step):
        n = min(step, L - i0)
        end = offset + i0 + n  # keys visible to the block's last query
        qb = q[:, :, :, i0 : i0 + n].reshape(B, Hkv, G * n, D)  # [B, Hkv, G*n, D]
        scores = qb @ k_t[..., :end]  # [B, Hkv, G*n, end]
        mx.eval(scores)
        view = np.asarray(scores)  # MLX's own buffer: the softmax runs in place, then MLX multiplies by V
        if not (view.flags.c_contiguous and view.flags.writeable):
            raise RuntimeError("attention scores are not a writable contiguous MLX buffer; the softmax would be lost")
        s = view.reshape(B, Hkv, G, n, end)
        diag = s[..., end - n :]  # [B, Hkv, G, n, n]: the block's own positions
        diag += future[:n, :n]
        s -= s.max(axis=-1, keepdims=True)
        np.maximum(s, FLOOR, out=s)
        np.exp(s, out=s)
        diag *= below[:n, :n]  # masked keys weigh exactly 0
        o = scores @ v_sum[:, :, :end]  # [B, Hkv, G*n, Dv+1]
        o = (o[..., :Dv] / o[..., Dv:]).reshape(B, Hkv, G, n, Dv)
        mx.eval(o)  # frees this block's scores before the next block's
        outs.append(o)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.reshape(B, H, L, Dv).astype(queries.dtype)
