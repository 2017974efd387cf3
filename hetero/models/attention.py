"""Causal scaled-dot-product attention over a KV cache, with a numpy kernel for MLX's CPU backend.

On Metal, `mx.fast.scaled_dot_product_attention` is the right kernel for every shape. On MLX's CPU
backend (Linux, or a Mac asked to run on the CPU) its softmax runs MLX's scalar `exp`, measured at ~21 ns
per element on the project's x86 machines against ~0.7 ns for numpy's SIMD `exp`, so a 512-token prefill
chunk over a 16K-token context spends nearly all its time in the softmax (0.77 s against 0.13 s for the
kernel below). Long query blocks on the CPU therefore run here: MLX's two matmuls around a softmax that numpy
computes in place on the evaluated scores (a writable view of MLX's buffer; numpy runs no BLAS here, so its
thread pool never competes with MLX's), block by block so the score matrix stays small, and only over the
keys each block can see.
A few queries (decode and verify steps) over a long cache run the same softmax in numpy (`_numpy_few`), with the
product by V split into chunks of keys (`_weighted_values`): in a decode step of the bundled model at 30K keys, MLX's
kernel spent ~6.5 ms per layer, this one ~3.2 ms (1.6 ms reading K, 1.3 ms reading V, 0.2 ms for the softmax and
the wait), which is the time numpy takes to sum an array as large as K and V (~9 GB/s, measured under load).
Over a shorter cache (< `MIN_KEYS`) they stay on MLX, where the whole step remains one lazy graph that evaluates
while Python builds the next: the numpy kernel evaluates mid-step, which made whole decode runs after a 4K-token
prompt ~10% slower and after a 6K-token one ~10% faster. MLX's `exp` as `power(2, x log2 e)` (`activations.exp`),
which keeps the graph lazy, was slower than numpy's in whole decode runs at 8K and 30K keys (135 and 70 against 140
and 79 tok/s).
The numpy kernel evaluates mid-graph and has no gradient, so training runs inside `differentiable()`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

MIN_QUERIES = 32  # query blocks at least this long take the numpy kernel on the CPU
MIN_KEYS = 6144  # shorter query blocks over at least this many keys take `_numpy_few` on the CPU
VALUE_CHUNK = 512  # keys per product in `_weighted_values` (512 and 1024 ran alike; 2048 was 10x slower)
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


def differentiating() -> bool:
    """Whether this thread is inside `differentiable()` (training): MLX's own ops only, which autodiff traces."""
    return getattr(_mode, "differentiable", False)


def attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """Causal attention of queries [B, H, L, D] over keys/values [B, Hkv, S, D] -> [B, H, L, Dv].

    The queries sit at the last L of the S positions (a prefill chunk or verify block after the cache);
    H is a multiple of Hkv (grouped-query attention).
    """
    L, S = queries.shape[2], keys.shape[2]
    if mx.default_device() == mx.cpu and not differentiating():
        if L >= MIN_QUERIES:
            return _numpy_causal(queries, keys, values, scale)
        if S >= MIN_KEYS:
            return _numpy_few(queries, keys, values, scale)
    mask = "causal" if L > 1 else None
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def _numpy_causal(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    B, H, L, _ = queries.shape
    step = block_queries(B, H, L, keys.shape[2])
    below = np.tril(np.ones((step, step), np.float32))  # 1 where key <= query inside the diagonal block
    future = np.where(below > 0, 0.0, -np.inf).astype(np.float32)  # additive mask of the same block

    def softmax(s: np.ndarray, i0: int) -> None:
        n = s.shape[-2]
        _softmax_in_place(s, below[:n, :n], future[:n, :n])

    return blocked_numpy(queries, keys, values, scale, softmax)


def block_queries(B: int, H: int, L: int, S: int) -> int:
    """Query positions per block of `blocked_numpy`: its scores [B, H, n, S] stay within BLOCK_SCORES."""
    return max(1, min(L, BLOCK_SCORES // (B * H * S)))


def blocked_numpy(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                  softmax: Callable[[np.ndarray, int], None]) -> mx.array:
    """Attention of queries [B, H, L, D] (the last L of S positions) over keys/values [B, Hkv, S, D] -> [B, H, L, Dv]
    by blocks of queries: MLX's matmuls around a softmax numpy computes in place. `softmax(s, i0)` turns the scores
    s [B, Hkv, G, n, end] of queries i0..i0+n (over the keys up to the block's last query) into unnormalized weights,
    in place; the ones column appended to V sums them."""
    B, H, L, D = queries.shape
    _, Hkv, S, Dv = values.shape
    G = H // Hkv
    offset = S - L  # position of the first query
    q = (queries.astype(mx.float32) * scale).reshape(B, Hkv, G, L, D)  # [B, Hkv, G, L, D]
    k_t = keys.astype(mx.float32).swapaxes(-1, -2)  # [B, Hkv, D, S]
    ones = mx.ones((B, Hkv, S, 1), mx.float32)
    v_sum = mx.concatenate([values.astype(mx.float32), ones], axis=-1)  # [B, Hkv, S, Dv+1]: last column sums
    step = block_queries(B, H, L, S)
    outs = []
    for i0 in range(0, L, step):
        n = min(step, L - i0)
        end = offset + i0 + n  # keys visible to the block's last query
        qb = q[:, :, :, i0 : i0 + n].reshape(B, Hkv, G * n, D)  # [B, Hkv, G*n, D]
        scores = qb @ k_t[..., :end]  # [B, Hkv, G*n, end]
        softmax(_writable(scores).reshape(B, Hkv, G, n, end), i0)
        o = scores @ v_sum[:, :, :end]  # [B, Hkv, G*n, Dv+1]
        o = (o[..., :Dv] / o[..., Dv:]).reshape(B, Hkv, G, n, Dv)
        mx.eval(o)  # frees this block's scores before the next block's
        outs.append(o)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.reshape(B, H, L, Dv).astype(queries.dtype)


def attend_selected(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array) -> mx.array:
    """Attention of queries [B, H, L, D] (the last L of T positions) over keys/values [B, Hkv, T, D], each query to
    the keys `mask` [B, 1, L, T] or [L, T] allows -> [B, H, L, D].

    On MLX's CPU backend a prefill chunk's softmax runs in numpy (the module docstring says why: MLX's scalar exp there
    cost a 4K-token prefill of the bench model more than its attention matmuls); elsewhere, and for a few queries,
    `mx.fast.scaled_dot_product_attention` with the mask. Qwen4-Exp's QSA layers attend so (`qsa.QSAAttention`)."""
    if mx.default_device() != mx.cpu or queries.shape[2] < MIN_QUERIES:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    B, _, L, _ = queries.shape
    T = keys.shape[2]
    allowed = np.broadcast_to(np.array(mask).reshape(-1, L, T), (B, L, T))  # [B, L, T]

    def softmax(s: np.ndarray, i0: int) -> None:  # s [B, Hkv, G, n, end]
        n, end = s.shape[-2:]
        keep = allowed[:, None, None, i0 : i0 + n, :end]  # [B, 1, 1, n, end]
        np.copyto(s, -np.inf, where=~keep)
        s -= s.max(axis=-1, keepdims=True)  # every query keeps at least one key
        np.maximum(s, FLOOR, out=s)  # no subnormal reaches the matmul
        np.exp(s, out=s)
        s *= keep  # dropped keys weigh exactly 0

    return blocked_numpy(queries, keys, values, scale, softmax)


def _numpy_few(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """`attend` for a few queries (decode, verify) over a long cache: MLX's two matmuls read K and V once, numpy's
    SIMD `exp` runs the softmax in place between them, and numpy sums its rows (no ones column: that would copy V)."""
    B, H, L, D = queries.shape
    _, Hkv, S, Dv = values.shape
    G = H // Hkv
    q = (queries.astype(mx.float32) * scale).reshape(B, Hkv, G * L, D)  # [B, Hkv, G*L, D]: head h = kv * G + g
    scores = q @ keys.astype(mx.float32).swapaxes(-1, -2)  # [B, Hkv, G*L, S]
    view = _writable(scores)
    below = np.tril(np.ones((L, L), np.float32))  # the block's own positions: 1 where key <= query
    _softmax_in_place(view.reshape(B, Hkv, G, L, S), below, np.where(below > 0, 0.0, -np.inf).astype(np.float32))
    sums = mx.array(view.sum(axis=-1, keepdims=True))  # [B, Hkv, G*L, 1]
    out = _weighted_values(scores, values.astype(mx.float32)) / sums  # [B, Hkv, G*L, Dv]
    return out.reshape(B, H, L, Dv).astype(queries.dtype)


def _weighted_values(p: mx.array, values: mx.array) -> mx.array:
    """p [B, Hkv, M, S] @ values [B, Hkv, S, Dv] -> [B, Hkv, M, Dv] for a few rows M, as a batch of products over
    `VALUE_CHUNK` keys each, summed: one product over all S keys ran at half the speed of reading V (MKL's gemm
    for 2 rows and a long inner dimension; 1.6 ms against 0.41 ms at 16K keys)."""
    B, Hkv, M, S = p.shape
    Dv = values.shape[-1]
    n = S // VALUE_CHUNK
    whole = n * VALUE_CHUNK
    p_chunks = p[..., :whole].reshape(B, Hkv, M, n, VALUE_CHUNK).transpose(0, 1, 3, 2, 4)  # [B, Hkv, n, M, chunk]
    v_chunks = values[:, :, :whole].reshape(B, Hkv, n, VALUE_CHUNK, Dv)  # [B, Hkv, n, chunk, Dv]: a view, no copy
    out = (p_chunks @ v_chunks).sum(axis=2)  # [B, Hkv, M, Dv]
    if whole < S:
        out = out + p[..., whole:] @ values[:, :, whole:]  # the last S % VALUE_CHUNK keys
    return out


def _writable(scores: mx.array) -> np.ndarray:
    """`scores` evaluated, as a numpy view of MLX's own buffer: a softmax written into it is what MLX multiplies
    next."""
    mx.eval(scores)
    view = np.asarray(scores)
    if not (view.flags.c_contiguous and view.flags.writeable):
        raise RuntimeError("attention scores are not a writable contiguous MLX buffer; the softmax would be lost")
    return view


def _softmax_in_place(s: np.ndarray, below: np.ndarray, future: np.ndarray) -> None:
    """Unnormalized causal softmax of scores s [B, Hkv, G, n, end] whose n queries sit at the last n keys:
    exp(s - row max), with exponents clipped at FLOOR and the keys after each query weighing exactly 0.
    `below` [n, n] is 1 where key <= query inside the block, `future` its additive mask (0 or -inf)."""
    n = s.shape[-2]
    diag = s[..., s.shape[-1] - n :]  # [B, Hkv, G, n, n]: the block's own positions
    if n > 1:
        diag += future
    s -= s.max(axis=-1, keepdims=True)
    np.maximum(s, FLOOR, out=s)
    np.exp(s, out=s)
    if n > 1:
        diag *= below  # masked keys weigh exactly 0
