"""Linear layers whose few-row products take the CPU BLAS's fast path.

A verify pass (MTP) or a batched decode round multiplies a few rows (2-5) by each weight matrix. On MLX's CPU
backend `x @ W.T` goes to sgemm with M = rows, and MKL handles that shape badly. Computed the other way round,
`(W @ x.T).T` (M = output channels, N = rows), the same products cost less. Measured on this project's 2-core x86
machines with MKL 2025 over every weight matrix of the large bench model (`python bench/batched.py --part linear`,
results in bench/results/batched.json), the cost against one row:

    rows            2      3      4      5      6      8
    x @ W.T       1.60   2.64   2.52   2.36   2.23   2.61
    (W @ x.T).T   1.36   1.59   1.85   2.01   2.39   3.04

and a whole forward pass over 4 tokens fell from 2.27-2.39 to 1.89-1.94 one-token passes. One row and six or more
keep `x @ W.T`, which is as fast or faster there.

Only the CPU backend takes the transposed form: Metal's kernels are not measured here, so the GPU path is MLX's own.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

FEW_ROWS = range(2, 6)  # row counts that run as (W @ x.T).T on the CPU


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
