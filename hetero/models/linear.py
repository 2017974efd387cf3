"""Linear layers whose few-row products take the CPU BLAS's fast path.

A verify pass (MTP) or a batched decode round multiplies a few rows (2-6) by each weight matrix. On MLX's CPU
backend `x @ W.T` goes to sgemm with M = rows, and MKL handles that shape badly: on the large bench model's
shapes 4 rows cost 1.5-3.0x one row, though the product is bound by reading W once. Computed the other way round,
`(W @ x.T).T` (M = output channels, N = rows), the same 4 rows cost 1.2-1.8x one row (measured with MKL 2025 on
this project's 2-core x86 machines: (8192 x 1024) 25.0 ms against 13.4 ms for 16 matrices; `bench/batched.py
--part linear` measures it again). One row and many rows keep `x @ W.T`, which is as fast or faster there.

Only the CPU backend takes the transposed form: Metal's kernels are not measured here, so the GPU path is MLX's own.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

FEW_ROWS = range(2, 7)  # row counts that run as (W @ x.T).T on the CPU


def project(x: mx.array, weight: mx.array) -> mx.array:
    """x [..., in] @ weight [out, in].T -> [..., out], transposed for few rows on the CPU backend."""
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if rows not in FEW_ROWS or mx.default_device() != mx.cpu:
        return x @ weight.T
    flat = x.reshape(rows, x.shape[-1])  # [rows, in]
    return (weight @ flat.T).T.reshape(*x.shape[:-1], weight.shape[0])  # [out, rows] -> [..., out]


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same quantization) that multiplies through `project`."""

    def __call__(self, x: mx.array) -> mx.array:
        y = project(x, self["weight"])
        return y + self["bias"] if "bias" in self else y
