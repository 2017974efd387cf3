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

Neither form streams the weights once from 4 rows, and that bounds 4 batched requests at about 2x one (issue 36's
target is 2.5x on the large model). Every other path a Python caller reaches was measured on the same weights
(`python bench/row_kernels.py`, bench/results/row_kernels.json and the run before it in git; two runs on a machine
loaded by other jobs, so indicative: MLX's own 4-row ratio read 2.5-4.1x there against the 2.0x above), 4 rows
against 1 row, 1 / 2 threads:

    MKL through ctypes: sgemm either form, sgemv per row, packed weights    2.5-3.4x / 2.5-3.6x
    two MLX CPU streams, 2 rows each on one MKL thread each                   - / 2.2-3.4x MLX's one row
    numpy's bundled OpenBLAS, either form                 one row 2.4-3.4x MKL's; 4 rows 2.1-2.9x MKL's one row
    a 4-row AVX2 kernel reading each weight once (bench/row_kernel.c)        1.06-1.36x / 1.18x

MKL's packed, gemv and direct forms do no better than MLX's call, two streams pay each stream's 2-row pass on one
core, and OpenBLAS's single row is slower than MKL's: nothing reachable without compiled code brings 4 rows near
one. The hand-written kernel shows the hardware allows it (its one row on both cores, 41 ms for the 1.1 GB of
weights in the quieter run, is about MKL's own speed), so the design that removes the bound is a custom few-row
kernel: an MLX C++ extension on Linux, Metal's own kernels on a Mac. Its bound for the whole step is in the README
(issue 36's figures).
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
