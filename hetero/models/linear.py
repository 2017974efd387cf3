"""Linear layers whose few-row products take the CPU BLAS's fast path.

A verify pass (MTP) or a batched decode round multiplies a few rows by each weight matrix. On MLX's CPU backend
`x @ W.T` goes to sgemm with M = rows, and MKL handles most such shapes badly. Computed the other way round,
`(W @ x.T).T` (M = output channels, N = rows), the same products cost less from 4 rows up. Measured on this
project's 2-core x86 machines with MKL 2026.2 over every weight matrix of the large bench model (`python
bench/batched.py --part linear`, results in bench/results/linear_rows.json on both cores and
linear_rows_1thread.json on one), the cost against one row:

    rows                 2     3     4     5     8    16    32    48    64
    x @ W.T   2 cores  1.12  1.19  1.96  2.02  2.55  3.34  3.70  4.34  5.18
    (W @ x.T).T        2.01  2.04  2.01  2.02  2.01  1.96  2.62  3.18  5.28
    x @ W.T   1 core   1.13  1.20  2.06  2.12  2.71  3.09  3.36  4.06  4.84
    (W @ x.T).T        1.95  1.98  1.96  1.97  1.98  1.93  2.56  3.24  4.78

Two and three rows stream the weights nearly as fast as one in MKL's own form, which the transposed one loses;
from 4 to 48 rows the transposed form reads the weights once for all of them; at 64 the two meet. (MKL 2025 had
been measured the other way for 2-3 rows; its successor's few-row kernel changed that.)

Only the CPU backend takes the transposed form: Metal's kernels are not measured here, so the GPU path is MLX's own.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

TRANSPOSED_ROWS = range(4, 49)  # row counts that run as (W @ x.T).T on the CPU


def project(x: mx.array, weight: mx.array) -> mx.array:
    """x [..., in] @ weight [out, in].T -> [..., out], transposed for 4-48 rows on the CPU backend."""
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if rows not in TRANSPOSED_ROWS or mx.default_device() != mx.cpu:
        return x @ weight.T
    flat = x.reshape(rows, x.shape[-1])  # [rows, in]
    return (weight @ flat.T).T.reshape(*x.shape[:-1], weight.shape[0])  # [out, rows] -> [..., out]


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same quantization) that multiplies through `project`."""

    def __call__(self, x: mx.array) -> mx.array:
        y = project(x, self["weight"])
        return y + self["bias"] if "bias" in self else y
