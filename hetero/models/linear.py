"""Linear layers whose few-row products take the CPU's fast paths: hetero's own kernel for 1-8 rows, else the BLAS's
better form.

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
(`python bench/row_kernels.py`, bench/results/row_kernels.json, a quiet machine), 4 rows against MLX's one row,
1 / 2 threads:

    MLX, its better form                                                       2.55x / 1.61x
    MKL through ctypes: sgemm either form, sgemv per row, packed weights       2.3-3.0x / 1.4-2.3x
    two MLX CPU streams, 2 rows each on one MKL thread each                    - / 2.71x
    numpy's bundled OpenBLAS, its better form (a host round trip per product)  2.2x / 1.30x
    a 4-row AVX2 kernel reading each weight once (bench/row_kernel.c)          1.31x / 0.67x

Nothing reachable without compiled code brings 4 rows near one row's cost on MLX's own path, except OpenBLAS on two
threads, which needs every product to leave MLX's graph. The hand-written kernel shows what the hardware allows
(1.25x / 1.13x its own one row, and its one row on both cores 36.6 ms for the 1.1 GB of weights against MLX's
63.6), so that is the design taken: `hetero.host.kernels`, the same kernel as an MLX primitive (a C++ extension built
once on the machine), which `project` runs for 1-8 float32 rows on the CPU wherever it could be built. MLX's forms
above remain the path for more rows, other dtypes, and a machine without the kernel (HETERO_FEW_ROW_KERNEL=0
chooses them). Metal's own kernels serve a Mac's GPU.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from hetero.host import kernels

TRANSPOSED_ROWS = range(4, 49)  # row counts that run as (W @ x.T).T on the CPU


def project(x: mx.array, weight: mx.array) -> mx.array:
    """x [..., in] @ weight [out, in].T -> [..., out]. On the CPU backend: 1-8 float32 rows through hetero's own
    kernel where this machine has it (`hetero.host.kernels`), else transposed for 4-48 rows."""
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if mx.default_device() != mx.cpu:
        return x @ weight.T
    if 0 < rows <= kernels.MAX_ROWS and x.dtype == weight.dtype == mx.float32 and (few_rows := kernels.few_rows()):
        return few_rows(x, weight)  # [..., out]
    if rows not in TRANSPOSED_ROWS:
        return x @ weight.T
    flat = x.reshape(rows, x.shape[-1])  # [rows, in]
    return (weight @ flat.T).T.reshape(*x.shape[:-1], weight.shape[0])  # [out, rows] -> [..., out]


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same quantization) that multiplies through `project`."""

    def __call__(self, x: mx.array) -> mx.array:
        y = project(x, self["weight"])
        return y + self["bias"] if "bias" in self else y
