"""ANE lint: walk a saved program's MIL and report what the Neural Engine is known to reject or run badly.

Errors (the ANE rejects the program or Core ML silently moves it to the CPU/GPU):
    fp16        a compute op, input or output that is not fp16
    axis        a tensor axis above 16384
    rank        a tensor of rank above 4
    dynamic     a symbolic or flexible (range / enumerated) shape
    pow         the `pow` op
    rsqrt-norm  a norm built as reduce -> (add eps) -> rsqrt/sqrt: overflows in fp16; use layer_norm(concat[x, -x])
    inf         an infinite or NaN constant (masks must use large finite negatives)
    subnormal   a scalar constant (an epsilon, a scale) below fp16's smallest normal number, 2^-14: hardware that
                flushes subnormals to zero turns a norm's epsilon into 0 and a zero row into 0/0 (weight arrays may
                hold tiny values; only scalars are checked)
    weights     more weight bytes than the per-program budget (the functions of a multifunction package share
                equal constants: each is counted once; a lookup table's indices and shift-scale data count at
                their bit width)
    seq         a (1, C, 1, S) input or output whose S is not a multiple of 64
    ane-op      an op outside the ones documented to run on the Neural Engine (`ANE_OPS`), or one of them in a form
                it does not run (einsum other than its BC1S attention form, a softmax or norm over the batch axis):
                Core ML would place it on the CPU or GPU (gather, scatter, control flow, pow, ...)
Warnings (runs, but slower or partly off the ANE):
    align       an input or output whose last axis is not a multiple of 64 bytes

The documented ops (`ANE_OPS`) are those of Apple's own Neural Engine reference (apple/ml-ane-transformers:
1x1 `conv` projections, `layer_norm`, `einsum` "nchw,nwhu->nchu" scores, `softmax`, elementwise math, `split` /
`concat` / `reshape` / `transpose`; "Deploying Transformers on the Apple Neural Engine", machinelearning.apple.com,
2022) and the elementwise and reduction ops Core ML's MIL defines for fp16 tensors of rank <= 4 that the ANE
compiler accepts (matmul, the activations, reduce_max / min / sum / mean), every tensor at most rank 4. Every builder's
program stays inside them (tests/test_coreml_lint.py checks each program kind).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from coremltools.converters.mil.mil import Program, types
from coremltools.converters.mil.mil.types.symbolic import is_symbolic

from hetero.coreml.graphs.ops import FP16_TINY, MAX_AXIS, SEQ_MULTIPLE

WEIGHT_BUDGET = int(1.5 * 2**30)  # bytes of weights per program (the ANE's own limit is about 2 GB)
MAX_RANK = 4
NORM_REDUCES = {"reduce_mean", "reduce_sum", "reduce_sum_square"}
ROOTS = {"rsqrt", "sqrt"}
PASS_THROUGH = {"add", "mul", "real_div", "sub", "maximum"}  # what may sit between the reduce and the root (eps, 1/n)
ANE_OPS = frozenset({
    "conv", "matmul", "einsum",  # projections, attention products
    "add", "sub", "mul", "real_div", "maximum", "minimum",  # elementwise
    "exp", "sigmoid", "silu", "gelu", "relu", "tanh", "clip", "softmax", "layer_norm",  # activations, norms
    "abs", "square", "sqrt", "rsqrt",  # elementwise unary (a reduce -> rsqrt norm has a rule of its own)
    "reduce_max", "reduce_min", "reduce_sum", "reduce_mean",  # reductions (keep_dims, one non-batch axis)
    "concat", "split", "slice_by_index", "reshape", "transpose", "identity",  # data movement
})
EINSUM_FORM = "nchw,nwhu->nchu"  # the one rank-4 einsum MIL (and the ANE reference) defines


@dataclass(frozen=True)
class Finding:
    """One rule violation: severity `error` or `warning`, the rule's name, what and where."""

    severity: str
    rule: str
    message: str
    where: str = ""


@dataclass
class LintReport:
    """The findings for one program."""

    program: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    def rules(self, severity: str | None = None) -> set[str]:
        """Names of the rules broken (optionally only at one severity)."""
        return {f.rule for f in self.findings if severity is None or f.severity == severity}

    def lines(self) -> list[str]:
        return [f"{self.program}: {f.severity} [{f.rule}] {f.message}" + (f" ({f.where})" if f.where else "") for f in self.findings]


def lint_program(prog: Program, name: str = "program", weight_budget: int = WEIGHT_BUDGET) -> LintReport:
    """Check every function of a MIL program against the ANE rules (see the module docstring)."""
    report = LintReport(name)
    add = lambda sev, rule, msg, where="": report.findings.append(Finding(sev, rule, msg, where))  # noqa: E731
    weight_bytes, stored = 0, set()  # stored: the constants already counted (functions share equal ones)
    shared = len(prog.functions) > 1
    for fname, func in prog.functions.items():
        boundary = [(f"input {n}", v) for n, v in func.inputs.items()] + [(f"output {v.name}", v) for v in func.outputs]
        for where, var in boundary:
            _check_tensor(var, where, add)
            shape = var.shape
            if var.dtype != types.fp16:
                add("error", "fp16", f"{where} is {types.builtin_to_string(var.dtype)}, not fp16", where)
            if _static(shape) and len(shape) == 4 and shape[2] == 1 and shape[3] % SEQ_MULTIPLE:
                add("error", "seq", f"{where} has S = {shape[3]}, not a multiple of {SEQ_MULTIPLE}", where)
            if _static(shape) and shape and (shape[-1] * 2) % 64:
                add("warning", "align", f"{where}'s last axis ({shape[-1]}) is not a multiple of 64 bytes", where)
        for op in _walk(func.operations):
            where = f"{op.op_type} {op.name}"
            if op.op_type == "const":
                val = op.outputs[0].val
                floating = isinstance(val, np.ndarray) and np.issubdtype(val.dtype, np.floating)
                if floating or _compressed_part(op):
                    size = _stored_bytes(op.outputs[0])
                    if shared:  # a multifunction package stores each distinct constant once
                        digest = (val.dtype.str, val.shape, hashlib.sha1(np.ascontiguousarray(val)).digest())
                        weight_bytes += 0 if digest in stored else size
                        stored.add(digest)
                    else:
                        weight_bytes += size
                if floating:
                    if not np.isfinite(val).all():
                        kind = "-inf" if np.isneginf(val).any() else ("inf" if np.isinf(val).any() else "NaN")
                        add("error", "inf", f"constant holds {kind}: masks need large finite negatives", where)
                elif isinstance(val, (float, np.floating)) and not np.isfinite(val):
                    add("error", "inf", f"constant {val}: masks need large finite negatives", where)
                scalar = np.ndim(val) == 0 or (floating and val.size == 1)
                if scalar and isinstance(np.ravel(val)[0], (float, np.floating)) and 0 < abs(float(np.ravel(val)[0])) < FP16_TINY:
                    add("error", "subnormal", f"constant {float(np.ravel(val)[0]):.3g} is subnormal in fp16 (below 2^-14): "
                        "scale what it meets by a power of two instead", where)
                continue
            if op.op_type == "pow":
                add("error", "pow", "pow is not an ANE op (square with mul; RMSNorm with layer_norm(concat[x, -x]))", where)
            if op.op_type in ROOTS and _fed_by_reduce(op):
                add("error", "rsqrt-norm", "norm built as reduce -> rsqrt overflows fp16; use layer_norm(concat[x, -x])", where)
            why = _not_on_ane(op)
            if why:
                add("error", "ane-op", why, where)
            for var in op.outputs:
                _check_tensor(var, where, add)
                if types.is_tensor(var.sym_type) and var.dtype != types.fp16:
                    add("error", "fp16", f"computes in {types.builtin_to_string(var.dtype)}, not fp16", where)
    if weight_bytes > weight_budget:
        add("error", "weights", f"{weight_bytes / 2**30:.2f} GiB of weights, above the {weight_budget / 2**30:.2f} GiB budget")
    return report


def lint_package(path: str | os.PathLike, weight_budget: int = WEIGHT_BUDGET) -> LintReport:
    """Lint a saved .mlpackage: its MIL program, plus flexible input shapes declared in its spec."""
    import coremltools as ct

    from hetero.coreml.graphs.package import load_program

    path = Path(path)
    report = lint_program(load_program(path), path.name, weight_budget)
    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    for inp in spec.description.input:
        if inp.type.WhichOneof("Type") == "multiArrayType" and inp.type.multiArrayType.WhichOneof("ShapeFlexibility"):
            report.findings.append(Finding("error", "dynamic", f"input {inp.name} has a flexible shape", f"input {inp.name}"))
    return report


def _not_on_ane(op) -> str | None:
    """Why an op is outside what the Neural Engine is documented to run (None: it is inside)."""
    kind = op.op_type
    if kind == "const" or kind.startswith("constexpr_"):
        return None  # weights: expanded at load
    if kind == "pow":
        return None  # its own rule says why
    if kind not in ANE_OPS:
        return f"{kind} is not among the ops documented to run on the Neural Engine: Core ML places it off the ANE"
    if kind == "einsum" and _einsum_form(str(op.equation.val)) != EINSUM_FORM:
        return f"einsum {op.equation.val!r}: the ANE's einsum is {EINSUM_FORM!r} (BC1S scores) only"
    axes = op.axes.val if kind.startswith("reduce_") or kind == "layer_norm" else (
        [op.axis.val] if kind == "softmax" and op.axis is not None else None)
    if axes is not None and any(int(a) % op.x.rank == 0 for a in np.ravel(axes)):
        return f"{kind} over the batch axis: the ANE reduces within a sample, over C, H or W"
    return None


def _einsum_form(equation: str) -> str:
    """An einsum equation with its letters renamed in order of appearance ("bkhc,bchq->bkhq" -> "nchw,...")."""
    names, out = {}, []
    for ch in equation.replace(" ", ""):
        if ch.isalpha():
            names.setdefault(ch, "nchwu"[len(names)] if len(names) < 5 else "?")
            out.append(names[ch])
        else:
            out.append(ch)
    return "".join(out)


def _compressed_part(op) -> bool:
    """Whether a const feeds a constexpr op (indices or tables of compressed weights)."""
    return any(child.op_type.startswith("constexpr_") for child in op.outputs[0].child_ops)


def _stored_bytes(var) -> int:
    """Bytes a constant takes in the weight file: sub-byte types (uint4 indices) packed at their bit width."""
    val = np.asarray(var.val)
    bits = var.dtype.get_bitwidth() if types.is_sub_byte(var.dtype) else val.dtype.itemsize * 8
    return -(-val.size * bits // 8)


def _static(shape: tuple) -> bool:
    return not any(is_symbolic(d) for d in shape)


def _check_tensor(var, where: str, add) -> None:
    """Rank, axis size and static-shape rules for one tensor."""
    if not types.is_tensor(var.sym_type):
        return
    shape = var.shape
    if not _static(shape):
        add("error", "dynamic", f"{var.name} has a dynamic shape {shape}", where)
        return
    if len(shape) > MAX_RANK:
        add("error", "rank", f"{var.name} has rank {len(shape)} (shape {shape}), above {MAX_RANK}", where)
    if any(d > MAX_AXIS for d in shape):
        add("error", "axis", f"{var.name} has an axis above {MAX_AXIS} (shape {shape})", where)


def _walk(ops):
    """Every op, including those in nested blocks (control flow)."""
    for op in ops:
        yield op
        for block in op.blocks:
            yield from _walk(block.operations)


def _fed_by_reduce(op, depth: int = 3) -> bool:
    """Whether a root op's input comes from a reduce within `depth` elementwise steps (add eps, scale by 1/n)."""
    for var in op.inputs.values():
        for v in var if isinstance(var, (list, tuple)) else [var]:
            src = v.op
            if src is None or src.op_type == "const":
                continue
            if src.op_type in NORM_REDUCES:
                return True
            if depth > 1 and src.op_type in PASS_THROUGH and _fed_by_reduce(src, depth - 1):
                return True
    return False


def export_packages(directory: str | os.PathLike) -> list[Path]:
    """The packages of an export directory: those its manifest lists, else every *.mlpackage in it."""
    import json

    directory = Path(directory)
    if directory.suffix == ".mlpackage":
        return [directory]
    manifest = directory / "manifest.json"
    if manifest.is_file():
        files = [p["file"] for p in json.loads(manifest.read_text())["programs"]]
        return [directory / f for f in dict.fromkeys(files)]  # a multifunction package is listed once per function
    return sorted(directory.glob("*.mlpackage"))
