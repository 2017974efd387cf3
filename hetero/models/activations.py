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
import numpy as np

from hetero.models import attention  # its `differentiable()` mode marks training

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


# The prefill forms below evaluate their input and run numpy's SIMD exp on it (about 0.7 ns per element here, against
# ~6 ns for the power form): for large arrays on the CPU that are evaluated now anyway, never inside `mx.compile`
# (callers pass them only prefill chunks of more than 16 tokens per sequence; compiled steps run at most 16) nor
# under `attention.differentiable()` (training: no gradient through numpy).
EAGER_MIN = 1 << 15  # elements from which they run in numpy (smaller arrays: the lazy forms above)
EAGER_MIN_TOKENS = 17  # tokens per sequence from which a caller may use them (compiled steps run at most 16)


def _eager(x: mx.array) -> bool:
    return _power_form(x) and x.size >= EAGER_MIN and not attention.differentiating()


def _exp_now(x: mx.array, sign: float) -> tuple[mx.array, np.ndarray] | None:
    """exp(sign * x) into a fresh buffer, evaluated now with numpy's exp: (that array, a writable numpy view of its
    buffer, for the caller to finish in place); None when x stays lazy (small, not fp32 on the CPU, in training, or
    a buffer MLX laid out otherwise)."""
    if not _eager(x):
        return None
    out = -x if sign < 0 else x + 0.0  # [...] a new buffer nothing else holds
    mx.eval(out)
    view = np.asarray(out)
    if not (view.flags.c_contiguous and view.flags.writeable):
        return None
    with np.errstate(over="ignore"):  # exp overflows to inf: 1 / (1 + inf) = 0 and x / inf = 0, as they should
        np.exp(view, out=view)
    return out, view


def sigmoid_now(x: mx.array) -> mx.array:
    """`sigmoid(x)` of a prefill chunk's array, evaluated now (a hyper-connection's 4 x hidden-wide mix weights:
    3.3 ms against 1.1 ms for a 512-token chunk of the bench model)."""
    if (done := _exp_now(x, -1.0)) is None:
        return sigmoid(x)
    out, view = done
    view += 1.0
    np.reciprocal(view, out=view)
    return out


def exp_now(x: mx.array) -> mx.array:
    """`exp(x)` of a prefill chunk's array, evaluated now (the chunked delta rule's decays)."""
    done = _exp_now(x, 1.0)
    return exp(x) if done is None else done[0]


def silu_now(x: mx.array) -> mx.array:
    """`silu(x)` of a prefill chunk's array, evaluated now (the GDN's convolution output)."""
    if (done := _exp_now(x, -1.0)) is None:
        return silu(x)
    out, view = done
    view += 1.0
    np.divide(np.asarray(x), view, out=view)  # x was evaluated with `out`
    return out


def silu_mul_halves_now(y: mx.array) -> mx.array:
    """`silu(gate) * up` of a fused gate|up product's output y [..., 2 x w] (gate the first w channels, up the
    rest), evaluated now: numpy reads both halves in place, where `silu_mul_now` on the two split views would
    first copy the strided gate half (MLX's negation of a strided view: 0.23 ms against 0.09 ms for a routed-expert
    bucket's [40, 45, 128]). The same numbers as `silu_mul_now(gate, up)`."""
    w = y.shape[-1] // 2
    if not _eager(y[..., :w]):  # as `silu_mul_now` decides for the gate half
        return silu(y[..., :w]) * y[..., w:]
    mx.eval(y)
    a = np.asarray(y)
    out = mx.zeros((*y.shape[:-1], w), dtype=y.dtype)  # [..., w] a fresh buffer for the result
    mx.eval(out)
    view = np.asarray(out)
    if not (a.flags.c_contiguous and view.flags.c_contiguous and view.flags.writeable):
        return silu(y[..., :w]) * y[..., w:]
    gate, up = a[..., :w], a[..., w:]
    np.negative(gate, out=view)
    with np.errstate(over="ignore"):  # exp overflows to inf: gate / inf = 0, as it should
        np.exp(view, out=view)
    view += 1.0
    np.divide(gate, view, out=view)
    view *= up
    return out


def silu_mul_now(gate: mx.array, up: mx.array) -> mx.array:
    """`silu(gate) * up` of a prefill chunk's arrays (same shape), evaluated now (the routed experts' SwiGLU)."""
    if gate.shape != up.shape or (done := _exp_now(gate, -1.0)) is None:
        return silu(gate) * up
    out, view = done
    view += 1.0
    mx.eval(up)
    np.divide(np.asarray(gate), view, out=view)
    view *= np.asarray(up)
    return out
