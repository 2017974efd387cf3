"""exp, sigmoid and SiLU in the form that is fastest on the device running them.

MLX's CPU backend evaluates `exp` (and `sigmoid`, which uses it) at ~18-23 ns per element on the
project's x86 machines, while `power(2, x)` runs at ~6 ns and multiplications at ~0.5 ns; with
exp(x) = 2^(x log2 e) the results agree to the same ~1e-6 relative error as `mx.exp` itself. A
512-token prefill chunk spent a third of its time in these activations, so on the CPU fp32
takes the power form, at every size so that prefill and decode compute the same function (fp32 only:
x log2 e rounded to bf16 would cost precision). Metal keeps the single fused kernels.

The model uses these and no `mlx.nn` activation: those are `mx.compile`d once for all threads, and MLX 0.32
aborts at process exit after such a function ran on a worker thread (the server's, the pipeline's); the model's
own compiled steps are compiled per thread instead (`compiled.py`).
"""

from __future__ import annotations

import math

import mlx.core as mx

LOG2E = 1.0 / math.log(2.0)


def _power_form(x: mx.array) -> bool:
    return x.dtype == mx.float32 and mx.default_device() == mx.cpu


def exp(x: mx.array) -> mx.array:
    """e^x, elementwise."""
    return mx.power(2.0, x * LOG2E) if _power_form(x) else mx.exp(x)


def sigmoid(x: mx.array) -> mx.array:
    """1 / (1 + e^-x), elementwise."""
    return mx.reciprocal(1.0 + mx.power(2.0, x * -LOG2E)) if _power_form(x) else mx.sigmoid(x)


def silu(x: mx.array) -> mx.array:
    """x * sigmoid(x), elementwise."""
    return x / (1.0 + mx.power(2.0, x * -LOG2E)) if _power_form(x) else x * mx.sigmoid(x)


def gelu(x: mx.array) -> mx.array:
    """x * Phi(x) with the exact (erf) normal CDF, elementwise (the vision tower's patch merger)."""
    return 0.5 * x * (1.0 + mx.erf(x * (1.0 / math.sqrt(2.0))))


def gelu_tanh(x: mx.array) -> mx.array:
    """GELU's tanh approximation (torch's `approximate="tanh"`), elementwise (the vision blocks' MLP)."""
    return 0.5 * x * (1.0 + mx.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
