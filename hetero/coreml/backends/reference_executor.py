"""The portable reference executor: runs exactly the MIL program of a saved .mlpackage with numpy.

This is not the Neural Engine; it is what lets the whole export pipeline run and be checked on machines without
one. Each op computes in fp32 (so sums and dot products accumulate in fp32) and its result is rounded to fp16,
as the ANE stores every intermediate tensor in fp16; the rounded values are held in fp32 arrays (bit arithmetic,
`hetero.coreml.fp16`), so no op pays numpy's slow fp16 casts; outputs come back the same way. Only the ops the
`hetero.coreml.graphs` builders emit are implemented; a program with any other op is refused at load time, naming it.

Numpy semantics come from coremltools where they fit: the elementwise-binary and reduction ops' own
`get_operator()`, and the `value_inference` of the data-movement ops, matmul, exp, sigmoid and softmax. conv (1x1
only), reshape, silu, gelu, layer_norm and einsum (a batched matmul: coremltools' is an unblocked `np.einsum`) are
written here (layer_norm's and gelu's results are tested equal to
coremltools' own; layer_norm is here because coremltools' numpy version took a seventh of an MLP program's time,
gelu because coremltools' exact mode calls `math.erf` once per element). Data-movement ops move
the values as they are: no rounding, the same values.

Compressed weights, the two forms `hetero.coreml.graphs.palette` exports MLX's quantized weights in, are expanded once at
load, as Core ML does before the weights are used (`weights()` returns them): `constexpr_lut_to_dense` (per-block
lookup tables) is a gather, so the fp16 weights are the table entries themselves; `constexpr_blockwise_shift_scale`
(scale * (data - offset) per block) is expanded by coremltools' own numpy semantics for the op (its `decompress`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from hetero.coreml.backends.compiled import package_signature
from hetero.coreml.fp16 import fp16_values
from hetero.errors import HeteroError

# Ops whose numpy semantics are the coremltools op's own `value_inference`.
VALUE_INFERENCE_OPS = frozenset({"identity", "concat", "slice_by_index", "transpose", "matmul", "exp", "sigmoid",
                                 "softmax"})
DATA_MOVEMENT_OPS = frozenset({"identity", "concat", "slice_by_index", "transpose", "reshape"})
# Ops whose coremltools class exposes its numpy function through `get_operator()`.
OPERATOR_OPS = frozenset({"add", "sub", "mul", "real_div", "maximum", "minimum"})
REDUCE_OPS = frozenset({"reduce_max", "reduce_min", "reduce_mean", "reduce_sum"})
OWN_OPS = frozenset({"const", "conv", "reshape", "silu", "gelu", "layer_norm", "einsum"})
# expanded once at load (Core ML: at load or just in time)
CONSTEXPR_OPS = frozenset({"constexpr_lut_to_dense", "constexpr_blockwise_shift_scale"})
SUPPORTED_OPS = VALUE_INFERENCE_OPS | OPERATOR_OPS | REDUCE_OPS | OWN_OPS | CONSTEXPR_OPS


class _Value:
    """What coremltools' `value_inference` reads from an op input: `.val` (and its shape)."""

    def __init__(self, a: Any):
        self.val = self.sym_val = a
        self.shape = getattr(a, "shape", ())
        self.rank = len(self.shape)


class ReferenceExecutor:
    """Loads one .mlpackage and runs one of its functions with numpy (fp32 compute, fp16 at op boundaries): the
    function named `function`, else the package's default one (`main` in a single-function package)."""

    def __init__(self, path: str | os.PathLike, function: str | None = None):
        self.path = Path(path)
        program = _read(self.path)
        self.function_name = program.default_function_name if function is None else function
        if self.function_name not in program.functions:
            raise HeteroError(f"{self.path.name} has no function {self.function_name!r} "
                              f"(it has {', '.join(sorted(program.functions))})")
        self.function = program.functions[self.function_name]
        self.ops = list(self.function.operations)
        unknown = sorted({op.op_type for op in self.ops} - SUPPORTED_OPS)
        if unknown:
            raise HeteroError(
                f"{self.path.name}: op {unknown[0]!r} is not implemented by the reference executor "
                f"(it runs only the ops the hetero.coreml.graphs builders emit: {', '.join(sorted(SUPPORTED_OPS))})"
            )
        self.input_shapes = {name: tuple(var.shape) for name, var in self.function.inputs.items()}
        self.output_names = [var.name for var in self.function.outputs]
        self._last_use = _last_uses(self.ops, self.output_names)
        # Constants widened to fp32 once (exact: every fp16 value is an fp32 value), not at every call.
        self._consts = {op.outputs[0].name: _f32(op.outputs[0].val) for op in self.ops if op.op_type == "const"}
        self._expanded = {}  # constexpr output name -> its fp16 weight (held in fp32, as every value here)
        for op in self.ops:
            if op.op_type in CONSTEXPR_OPS:
                self._expanded[op.outputs[0].name] = _f32(expand(op))
                for var in op.inputs.values():  # the tables, indices, scales, ... are read by nothing else
                    self._consts.pop(var.name, None)
        self._consts.update(self._expanded)

    def weights(self) -> dict[str, np.ndarray]:
        """The fp16 weights the program's compressed constants expand to (constexpr output name -> array)."""
        return {name: a.astype(np.float16) for name, a in self._expanded.items()}

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the program on `inputs` (name -> array of the declared shape; any float dtype, rounded to fp16 as
        Core ML would); returns the outputs by name as fp16 values held in fp32 arrays."""
        missing = set(self.input_shapes) - set(inputs)
        if missing:
            raise ValueError(f"{self.path.name}: missing inputs {sorted(missing)}")
        env: dict[str, np.ndarray] = {}
        for name, shape in self.input_shapes.items():
            a = np.asarray(inputs[name])
            if a.shape != shape:
                raise ValueError(f"{self.path.name}: input {name} has shape {a.shape}, the program takes {shape}")
            env[name] = _round(a)  # fp16 values (held in fp32, as every value in `env`)
        for i, op in enumerate(self.ops):
            out = op.outputs[0]
            if op.op_type == "const" or op.op_type in CONSTEXPR_OPS:
                if out.name in self._consts:  # a table or index array only its constexpr read is not kept
                    env[out.name] = self._consts[out.name]
                continue
            result = _run(op, {k: _fetch(env, v) for k, v in op.inputs.items()})
            env[out.name] = result if op.op_type in DATA_MOVEMENT_OPS else _round(result)  # moved values stay fp16
            for name in self._last_use.get(i, ()):  # free what no later op reads: attention makes big temporaries
                env.pop(name, None)
        return {name: env[name] for name in self.output_names}


_LAST_READ: list = []  # [(package key, Program)]: the functions of one package are loaded one after another


def _read(path: Path) -> Any:
    """The package's MIL program (every function), read once for consecutive loads of the same unchanged
    package: reading parses all its functions, so loading its 7 buckets one by one would parse 49."""
    from hetero.coreml.graphs.package import load_program  # imports coremltools (seconds): only once a program loads

    key = package_signature(path) if path.is_dir() else None
    if key is not None and _LAST_READ and _LAST_READ[0][0] == key:
        return _LAST_READ[0][1]
    try:
        program = load_program(path)
    except (FileNotFoundError, ValueError) as e:
        raise HeteroError(f"cannot load Core ML program: {e}") from None
    _LAST_READ[:] = [(key, program)]
    return program


def _fetch(env: dict[str, np.ndarray], var: Any) -> Any:
    if isinstance(var, (list, tuple)):
        return [_fetch(env, v) for v in var]
    return env[var.name] if var.name in env else var.val


def _last_uses(ops: list, keep: list[str]) -> dict[int, list[str]]:
    """op index -> names of values read for the last time there (outputs are kept)."""
    last: dict[str, int] = {}
    for i, op in enumerate(ops):
        for var in op.inputs.values():
            for v in var if isinstance(var, (list, tuple)) else [var]:
                last[v.name] = i
    out: dict[int, list[str]] = {}
    for name, i in last.items():
        if name not in keep:
            out.setdefault(i, []).append(name)
    return out


def _f32(a: Any) -> Any:
    """fp16 tensors are widened to fp32 for the op's arithmetic; integer parameters pass unchanged."""
    a = np.asarray(a)
    return a.astype(np.float32) if a.dtype == np.float16 else a


def _round(a: Any) -> np.ndarray:
    """Store an op's result as the ANE would: every float rounded to the nearest fp16 value (ties to even), kept
    in an fp32 array so that the next op reads it without a conversion (numpy's fp16 casts cost ~5 ns/element)."""
    a = np.asarray(a)
    if not np.issubdtype(a.dtype, np.floating):
        return a
    if a.dtype == np.float16:
        return a.astype(np.float32)
    if a.dtype != np.float32:  # one rounding straight to fp16, as the cast would (no double rounding via fp32)
        return a.astype(np.float16).astype(np.float32)
    return fp16_values(a)


def _run(op: Any, args: dict[str, Any]) -> np.ndarray:
    kind = op.op_type
    if kind in VALUE_INFERENCE_OPS:
        shim = type("Inputs", (), {"_input_types": {}})()  # `_input_types` empty: skip the const-only precondition
        widen = (lambda v: v) if kind in DATA_MOVEMENT_OPS else _f32
        for name, value in args.items():
            setattr(shim, name, [_Value(widen(v)) for v in value] if isinstance(value, list) else _Value(widen(value)))
        for name in type(op).input_spec.input_types:  # absent optional inputs read as None
            if not hasattr(shim, name):
                setattr(shim, name, None)
        return type(op).value_inference(shim)
    if kind in OPERATOR_OPS:
        return op.get_operator()(_f32(args["x"]), _f32(args["y"]))
    if kind in REDUCE_OPS:
        return op.get_operator()(_f32(args["x"]), axis=tuple(args["axes"]), keepdims=bool(args["keep_dims"]))
    if kind == "conv":
        return _conv1x1(op, args)
    if kind == "reshape":
        return np.reshape(args["x"], tuple(int(d) for d in args["shape"]))
    if kind == "silu":
        x = _f32(args["x"])
        with np.errstate(over="ignore"):  # exp(-x) past fp32's range is inf, and x / inf the -0 SiLU tends to
            den = np.exp(-x)
        den += 1.0
        return np.divide(x, den, out=den)
    if kind == "layer_norm":
        return _layer_norm(args)
    if kind == "gelu":
        return gelu(_f32(args["x"]), str(args.get("mode", "EXACT")))
    if kind == "einsum":
        return einsum(str(args["equation"]), *(_f32(v) for v in args["values"]))
    raise HeteroError(f"op {kind!r} is not implemented by the reference executor")  # unreachable: checked at load


def einsum(equation: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """MIL's `einsum` for the one rank-4 form it defines, "nchw,nwhu->nchu" under any letters (x [B, C, H, W1] times
    y [B, W1, H, W2] over W1, B and H broadcast), as a batched matmul in fp32 (coremltools' own `value_inference` is
    `np.einsum`, the same sums without BLAS)."""
    ins, out = equation.replace(" ", "").split("->")
    a, b = ins.split(",")
    if not (len(a) == len(b) == len(out) == 4 and b == a[0] + a[3] + a[2] + b[3] and out == a[:3] + b[3]):
        raise HeteroError(f"einsum {equation!r}: only MIL's 'nchw,nwhu->nchu' form is implemented")
    prod = np.matmul(x.transpose(0, 2, 1, 3), y.transpose(0, 2, 1, 3))  # [B, H, C, W2]
    return np.ascontiguousarray(prod.transpose(0, 2, 1, 3))  # [B, C, H, W2]


def expand(op: Any) -> np.ndarray:
    """The fp16 weight a compressed constant (`CONSTEXPR_OPS`) stands for."""
    if op.op_type == "constexpr_lut_to_dense":
        return lut_to_dense(op.indices.val, op.lut.val, op.name)
    return shift_scale_to_dense(op.data.val, op.scale.val, None if op.offset is None else op.offset.val, op.name)


def shift_scale_to_dense(data: np.ndarray, scale: np.ndarray, offset: np.ndarray | None,
                         name: str = "constexpr_blockwise_shift_scale") -> np.ndarray:
    """`constexpr_blockwise_shift_scale`: out[i] = scale[i // block] * (data[i] - offset[i // block]) per axis, with
    block[a] = data.shape[a] / scale.shape[a], in the scale's dtype: coremltools' `decompress` (for an integer offset
    and an fp16 scale, each weight is the product rounded once, whatever arithmetic a device uses)."""
    from coremltools.converters.mil.mil.ops.defs.iOS18.compression import constexpr_blockwise_shift_scale as op

    data, scale = np.asarray(data), np.asarray(scale)
    if scale.ndim != data.ndim or any(n % b for n, b in zip(data.shape, scale.shape)):
        raise HeteroError(f"{name}: scales {scale.shape} do not tile data {data.shape}")
    return op.decompress(data, scale, offset)


def lut_to_dense(indices: np.ndarray, lut: np.ndarray, name: str = "constexpr_lut_to_dense") -> np.ndarray:
    """`constexpr_lut_to_dense` without vectors: out[i] = lut[i // block, indices[i]] per axis, where block[a] =
    indices.shape[a] / lut.shape[a] and lut is [*blocks, 2^bits, 1]. A gather: the result is the table's dtype."""
    if lut.shape[-1] != 1:
        raise HeteroError(f"{name}: vector lookup tables (VECTOR_SIZE {lut.shape[-1]}) are not implemented")
    table = lut[..., 0]  # [*blocks, P]
    blocks = table.shape[:-1]
    if len(blocks) != indices.ndim or any(n % b for n, b in zip(indices.shape, blocks)):
        raise HeteroError(f"{name}: tables {lut.shape} do not tile indices {indices.shape}")
    per = [n // b for n, b in zip(indices.shape, blocks)]
    split = [d for b, r in zip(blocks, per) for d in (b, r)]  # each axis as (block, within block)
    grid = table.reshape([d for b in blocks for d in (b, 1)] + [table.shape[-1]])  # broadcasts within a block
    idx = np.asarray(indices).reshape(split)
    out = np.empty(split, table.dtype)
    step = max(1, (1 << 22) // max(1, idx[0].size))  # first-axis blocks per gather: bounded index temporaries
    for a in range(0, blocks[0], step):
        part = idx[a : a + step, ..., None].astype(np.intp)
        out[a : a + step] = np.take_along_axis(grid[a : a + step], part, axis=-1)[..., 0]
    return out.reshape(indices.shape)


def gelu(x: np.ndarray, mode: str = "EXACT") -> np.ndarray:
    """MIL's gelu in fp32: EXACT 0.5 x (1 + erf(x / sqrt 2)), TANH_APPROXIMATION 0.5 x (1 + tanh(sqrt(2/pi)
    (x + 0.044715 x^3))), SIGMOID_APPROXIMATION x sigmoid(1.702 x). Each written without the cancellation of
    1 + erf or 1 + tanh near -1 (0.5 (1 + tanh a) = sigmoid(2a); 1 + erf(-z) = erfc(z)), so that tiny negative
    outputs keep their relative precision as coremltools' float64 semantics do."""
    with np.errstate(over="ignore"):  # exp overflowing to inf gives the limit, x / inf = 0
        if mode == "TANH_APPROXIMATION":
            a = np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x * x * x)
            return x / (1.0 + np.exp(np.float32(-2.0) * a))
        if mode == "SIGMOID_APPROXIMATION":
            return x / (1.0 + np.exp(np.float32(-1.702) * x))
    if mode != "EXACT":
        raise HeteroError(f"op 'gelu' with mode {mode!r} is not implemented by the reference executor")
    tail = _erfc(np.abs(x) * (1.0 / np.sqrt(2.0)))  # erfc(|x| / sqrt 2), float64
    return (0.5 * x * np.where(x < 0, tail, 2.0 - tail)).astype(np.float32)


def _erfc(z: np.ndarray) -> np.ndarray:
    """erfc(z) for z >= 0 in float64, to within 1.2e-7 relative (Numerical Recipes' Chebyshev fit): far below fp16's
    rounding, so an op's fp16 result is the exact one but at a rounding tie."""
    z = z.astype(np.float64)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    return t * np.exp(poly)


def _layer_norm(args: dict[str, Any]) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) * gamma + beta over `axes`, in fp32 (var: the mean squared deviation)."""
    x = _f32(args["x"])
    axes = tuple(int(a) % x.ndim for a in args["axes"])
    centred = x - x.mean(axis=axes, keepdims=True)
    var = np.mean(np.square(centred), axis=axes, keepdims=True)
    centred *= 1.0 / np.sqrt(var + np.float32(args.get("epsilon", 1e-5)))
    shape = [x.shape[a] if a in axes else 1 for a in range(x.ndim)]  # gamma / beta span the normalised axes
    if args.get("gamma") is not None:
        centred *= _f32(args["gamma"]).reshape(shape)
    if args.get("beta") is not None:
        centred += _f32(args["beta"]).reshape(shape)
    return centred


def _conv1x1(op: Any, args: dict[str, Any]) -> np.ndarray:
    """conv with a 1x1 kernel, stride 1, one group: a projection over the channel axis of (1, Cin, 1, S)."""
    w = _f32(args["weight"])  # [Cout, Cin, kh, kw]
    groups = int(args.get("groups", 1))
    strides = [int(s) for s in args.get("strides", [1, 1])]
    if w.shape[2:] != (1, 1) or groups != 1 or strides != [1, 1]:
        raise HeteroError(
            f"op 'conv' ({op.name}) with kernel {w.shape[2:]}, groups {groups}, strides {strides}: "
            f"the reference executor runs only 1x1, one-group, stride-1 convolutions"
        )
    x = _f32(args["x"])  # (B, Cin, H, W)
    if x.shape[0] == 1 and x.shape[2] == 1:  # BC1S: one matrix product [Cout, Cin] @ [Cin, S]
        out = (w[:, :, 0, 0] @ x[0, :, 0, :])[None, :, None, :]  # (1, Cout, 1, S)
    else:
        out = np.einsum("oc,bchw->bohw", w[:, :, 0, 0], x, optimize=True)  # (B, Cout, H, W)
    if args.get("bias") is not None:
        out = out + _f32(args["bias"])[None, :, None, None]
    return out
