"""Small MIL helpers shared by the graph builders: program assembly, conv1x1, exact RMSNorm, finite masks."""

from __future__ import annotations

import math
from collections.abc import Callable

import coremltools as ct
import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Function, Program, Var, types
from coremltools.converters.mil.mil.types.type_mapping import string_to_nptype

from hetero.coreml.graphs.palette import Palettized

# Oldest OS whose Core ML runs every op the builders emit on the ANE and offers MLComputePlan (14.4+).
DEPLOYMENT_TARGET = ct.target.macOS14
# Per-group lookup tables (`constexpr_lut_to_dense` with tables per block) and `constexpr_blockwise_shift_scale`
# are iOS 18 / macOS 15 ops.
PALETTIZED_TARGET = ct.target.macOS15
MAX_AXIS = 16384  # the ANE rejects (or falls off) tensors with any axis above this
SEQ_MULTIPLE = 64  # chunk sizes (the S axis) are multiples of this
MASK_NEG = -30000.0  # "minus infinity" for fp16 masks: finite, and MASK_NEG + MASK_NEG still fits fp16 (max 65504)


def build_program(inputs: dict[str, tuple[int, ...]], body: Callable[[dict[str, Var]], dict[str, Var]],
                  weights: object = None) -> Program:
    """A one-function MIL program with fp16 `inputs` (name -> static shape) whose outputs are `body`'s dict.

    Same as `@mb.program`, but with named inputs known only at run time (that decorator reads them from the
    Python function's signature). Outputs are renamed to the dict's keys. `weights` (a builder's weights
    dataclass) sets the opset: macOS 15 where any of them is `Palettized`, else macOS 14.
    """
    specs = {name: mb.TensorSpec(shape=shape, dtype=types.fp16) for name, shape in inputs.items()}
    with Function(specs, opset_version=target_for(weights)) as func:
        outputs = body(dict(func.inputs))
        func.set_outputs([mb.identity(x=var, name=name) for name, var in outputs.items()])
    prog = Program()
    prog.add_function("main", func)
    return prog


def target_for(weights: object) -> ct.target:
    """The opset a builder's weights need: lookup tables per group exist from macOS 15 on."""
    fields = vars(weights).values() if weights is not None and hasattr(weights, "__dict__") else ()
    return PALETTIZED_TARGET if any(isinstance(v, Palettized) for v in fields) else DEPLOYMENT_TARGET


def fp16(a: np.ndarray) -> np.ndarray:
    """Weights are embedded as fp16 constants: the whole program computes in fp16."""
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32).astype(np.float16))


def conv1x1(x: Var, weight: np.ndarray | Palettized, name: str, bias: np.ndarray | None = None) -> Var:
    """A projection in BC1S layout: x (1, Cin, 1, S), weight [Cout, Cin] (and an optional bias [Cout], fp16) ->
    (1, Cout, 1, S).

    A `Palettized` weight is embedded as its indices and per-group tables (`constexpr_lut_to_dense`), or, where it
    carries an exact shift-scale form for every block (`Palettized.shift_scale`), as `constexpr_blockwise_shift_scale`:
    Core ML expands either to the same fp16 weight, which the conv then reads."""
    cout, cin = weight.shape
    extra = {} if bias is None else {"bias": fp16(bias)}
    if isinstance(weight, Palettized):
        return mb.conv(x=x, weight=compressed_weight(weight, f"{name}_weight"), name=name, **extra)  # (1, Cout, 1, S)
    return mb.conv(x=x, weight=fp16(weight).reshape(cout, cin, 1, 1), name=name, **extra)  # (1, Cout, 1, S)


def compressed_weight(w: Palettized, name: str) -> Var:
    """The conv weight (Cout, Cin, 1, 1) fp16 of a `Palettized` matrix: shift-scale where it has an exact one, else
    its tables."""
    found = w.shift_scale()
    return lut_weight(w, name) if found is None else shift_scale_weight(*found, w.bits, name)


def shift_scale_weight(data: np.ndarray, scale: np.ndarray, offset: np.ndarray, bits: int, name: str) -> Var:
    """The conv weight (Cout, Cin, 1, 1) fp16 = scale * (data - offset) per block (`constexpr_blockwise_shift_scale`,
    iOS 18): data [Cout, Cin] as uint4 (bits <= 4) or uint8, scale and offset [Cout, blocks] fp16."""
    cout, cin = data.shape
    width = "uint4" if bits <= 4 else "uint8"
    q = data.reshape(cout, cin, 1, 1).astype(string_to_nptype(width))  # sub-byte in the blob
    blocks = scale.shape[1]
    return mb.constexpr_blockwise_shift_scale(
        data=q, scale=np.ascontiguousarray(scale, np.float16).reshape(cout, blocks, 1, 1),
        offset=np.ascontiguousarray(offset, np.float16).reshape(cout, blocks, 1, 1), name=name)  # (Cout, Cin, 1, 1)


def weight_form(weight: np.ndarray | Palettized) -> str:
    """How `conv1x1` embeds a weight: `fp16`, `lut` (per-group tables) or `blockwise` (shift-scale)."""
    if not isinstance(weight, Palettized):
        return "fp16"
    return "lut" if weight.shift_scale() is None else "blockwise"


def lut_weight(w: Palettized, name: str) -> Var:
    """The conv weight (Cout, Cin, 1, 1) fp16 of a `Palettized` matrix: tables (Cout, Cin / block, 1, 1, 2^bits, 1)
    indexed by `bits`-wide indices, one table per row and block of input channels."""
    cout, cin = w.shape
    indices = w.indices.reshape(cout, cin, 1, 1).astype(string_to_nptype(f"uint{w.bits}"))  # sub-byte in the blob
    lut = np.ascontiguousarray(w.lut, dtype=np.float16).reshape(cout, cin // w.block, 1, 1, 2**w.bits, 1)
    return mb.constexpr_lut_to_dense(indices=indices, lut=lut, name=name)  # (Cout, Cin, 1, 1)


FP16_TINY = 2.0**-14  # fp16's smallest normal number: a constant below it is subnormal (the ANE may flush it)


def norm_shift(eps: float) -> int:
    """The k for which an RMSNorm over 2^k x (epsilon eps x 4^k: the same result, exactly) has a normal fp16 epsilon
    with a factor of two to spare: 4 for Qwen's 1e-6, 0 for an epsilon already normal."""
    k = 0
    while eps * 4.0**k < 2 * FP16_TINY:
        k += 1
    return k


def scaled(weight: np.ndarray | Palettized, factor: float) -> np.ndarray | Palettized:
    """A weight times a power of two (exact in fp16 unless it overflows or underflows): lookup tables scale their
    entries."""
    if isinstance(weight, Palettized):
        affine = sb = None
        if weight.affine is not None:  # the scales scale; the offsets stay (exactness is checked where it is emitted)
            affine = weight.affine.copy()
            affine[..., 0] = (affine[..., 0].astype(np.float32) * factor).astype(np.float16)
        if weight.scale_bias is not None:  # MLX's scale and bias both scale: w = s k + b
            sb = weight.scale_bias * np.float32(factor)
        lut = (weight.lut.astype(np.float32) * factor).astype(np.float16)
        return Palettized(weight.indices, lut, weight.bits, affine, sb)
    return weight * np.float32(factor)


def rms_norm(x: Var, weight: np.ndarray | None, eps: float, axis: int, name: str) -> Var:
    """x * rsqrt(mean(x^2, axis) + eps) * weight, exactly, as `layer_norm(concat[x, -x])` keeping the first half.

    Why exact: concat[x, -x] has mean 0 over `axis`, so layer_norm's variance is mean(x^2) over x itself and its
    output's first half is the RMSNorm of x. Why not reduce_mean -> rsqrt or pow: the ANE runs layer_norm as one
    fused op, while x^2 summed in fp16 overflows for |x| > 256 and pow is not an ANE op.
    """
    n = x.shape[axis]
    both = mb.concat(values=[x, mb.mul(x=x, y=np.float16(-1.0), name=f"{name}_neg")], axis=axis, name=f"{name}_cat")
    gamma = None if weight is None else fp16(np.concatenate([weight, weight]))  # the second half is dropped
    normed = mb.layer_norm(x=both, axes=[axis], gamma=gamma, epsilon=np.float16(eps), name=f"{name}_ln")
    end = list(x.shape)
    end[axis] = n
    return mb.slice_by_index(x=normed, begin=[0] * x.rank, end=end, name=name)  # x's shape


def split_channels(x: Var, sizes: list[int], axis: int, name: str) -> list[Var]:
    """Consecutive slices of `x` along `axis` with the given sizes (slice_by_index: the ANE's cheapest split)."""
    parts, start = [], 0
    for i, size in enumerate(sizes):
        begin = [0] * x.rank
        end = list(x.shape)
        begin[axis], end[axis] = start, start + size
        parts.append(mb.slice_by_index(x=x, begin=begin, end=end, name=f"{name}_{i}"))
        start += size
    return parts


def blocks(total: int, block: int, multiple: int = 1) -> list[int]:
    """Split `total` into the fewest near-equal sizes <= `block`, each a multiple of `multiple` (bar the last)."""
    if total <= block:
        return [total]
    n = -(-total // block)
    size = -(-total // n)
    size = min(-(-size // multiple) * multiple, block - block % multiple)
    out = []
    while total > 0:
        out.append(min(size, total))
        total -= out[-1]
    return out


def head_of(t: Var, i: int, name: str) -> Var:
    """Head i of a (1, H, a, b) tensor as (1, 1, a, b)."""
    _, _, a, b = t.shape
    return mb.slice_by_index(x=t, begin=[0, i, 0, 0], end=[1, i + 1, a, b], name=name)


def softmax_parts(scores: list[Var], axis: int, name: str) -> tuple[list[Var], Var]:
    """A softmax over `axis` spelled out across segments of keys (cache blocks, then the chunk): each segment's
    exp(s - shared max - ln n) and their sum; a segment's probabilities are its exps over the sum."""
    peak = None
    for i, s in enumerate(scores):
        m = mb.reduce_max(x=s, axes=[axis], keep_dims=True, name=f"{name}_max{i}")  # the keys' axis kept, size 1
        peak = m if peak is None else mb.maximum(x=peak, y=m, name=f"{name}_peak{i}")
    if len(scores) > 1:
        # exp(s - max - ln n) keeps each segment's sum <= its length, so the total stays below fp16's 65504.
        peak = mb.add(x=peak, y=np.float16(math.log(len(scores))), name=f"{name}_shift")
    exps = [mb.exp(x=mb.sub(x=s, y=peak, name=f"{name}_d{i}"), name=f"{name}_e{i}") for i, s in enumerate(scores)]
    den = None
    for i, e in enumerate(exps):
        part = mb.reduce_sum(x=e, axes=[axis], keep_dims=True, name=f"{name}_sum{i}")
        den = part if den is None else mb.add(x=den, y=part, name=f"{name}_den{i}")
    return exps, den
