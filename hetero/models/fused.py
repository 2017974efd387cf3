"""A layer's input projections as one product, fused at load: GDN `qkv|z|b|a`, attention `q|k|v`, SwiGLU `gate|up`,
and the routed experts' `gate|up` (`moe.SwitchGLU`: every expert's gate and up rows in one [experts, 2 x width, in]
stack, one `gather_mm` instead of two).

A decode step is about 1,400 small MLX ops on the bundled model, and on the CPU backend dispatching each costs about
as much as its arithmetic; the projections that read the same input run as one matrix product instead of two to four.

The parts keep their checkpoint names and stay the model's parameters. `FusedProjection` concatenates their arrays
once along the output channels (axis 0 of `weight`, `bias`, and of a quantized layer's packed `weight`, `scales`
and `biases`; axis 1 of stacked experts' [experts, out, ...] arrays: quantized weights are fused as they are, never
dequantized, which is exact since each output channel's packed row, scales and biases are its own), then points every part at its rows of
the product's arrays (views that share its memory). So the model holds each weight once, and everything that reads
weights by name (Core ML export, the pipeline's GPU shares, quantization, sharding, checkpoint writers) still sees
the checkpoint's tensors under the checkpoint's names.

Neighbouring parts that cannot share a product (another class, dtype, bit width, group size or mode: a quantized
checkpoint keeps `in_proj_b` / `in_proj_a` in float) are fused in runs of those that can; a layer whose parts all
differ is not fused.

Whatever replaces a part's parameters after fusing (`nn.quantize`, `load_weights`, `set_dtype`) leaves the product
stale: `project_inputs` sees it and runs the parts one by one (correct, as before fusion). Call `unfuse` first to
drop the products, or load with fusion off.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn


def _arrays(module: nn.Module) -> dict[str, mx.array]:
    """A projection's own arrays: weight, and bias / scales / biases where it has them."""
    return {k: v for k, v in module.items() if isinstance(v, mx.array)}


def _out_axis(module: nn.Module) -> int:
    """The axis of the output channels in every array of a projection: 0 for `Linear` ([out, in], bias [out]), 1
    for stacked experts ([experts, out, in])."""
    return module["weight"].ndim - 2


def _rows(a: mx.array, axis: int, start: int, stop: int) -> mx.array:
    """Output channels [start, stop) of an array whose channels lie along `axis` (a view, no copy)."""
    return a[(slice(None),) * axis + (slice(start, stop),)]


def _signature(module: nn.Module) -> tuple:
    """What two projections must share to be one product: class, array names, dtypes and the shapes but for the
    output channels (the input width, packed or not; the experts), bits, group size and mode."""
    axis = _out_axis(module)
    arrays = tuple(sorted((k, v.dtype, v.shape[:axis] + v.shape[axis + 1:]) for k, v in _arrays(module).items()))
    return type(module), arrays, getattr(module, "group_size", None), getattr(module, "bits", None), getattr(
        module, "mode", None)


def _runs(parts: list[nn.Module]) -> Iterator[list[nn.Module]]:
    """Consecutive parts grouped into runs of equal `_signature` (the output order is kept)."""
    run: list[nn.Module] = []
    for part in parts:
        if run and _signature(part) != _signature(run[0]):
            yield run
            run = []
        run.append(part)
    if run:
        yield run


def _concatenate(run: list[nn.Module]) -> nn.Module:
    """One projection of the run's class whose rows are the run's parts in order; each part's arrays become views
    of its rows (so the weights are held once). A single part is returned as it is."""
    if len(run) == 1:
        return run[0]
    axis = _out_axis(run[0])
    fused = copy.copy(run[0])  # same class and settings (bits, group size, mode); its arrays are replaced below
    for name in _arrays(run[0]):
        fused[name] = mx.concatenate([p[name] for p in run], axis=axis)  # [(experts,) sum(out), ...]
    mx.eval(_arrays(fused))
    start = 0
    for part in run:
        rows = part["weight"].shape[axis]
        for name in _arrays(part):
            part[name] = _rows(fused[name], axis, start, start + rows)  # [(experts,) rows, ...] view of its rows
        start += rows
    mx.eval([_arrays(p) for p in run])
    return fused


class FusedProjection:
    """The projections `names` of `owner` (Linear or QuantizedLinear, or stacked experts `SwitchLinear` /
    `QuantizedSwitchLinear`; one input) as few products.

    Called with x [..., in] (and the experts' indices, for stacked experts), returns one output [..., out_i] per
    name, in order: each run of compatible parts is one product whose output is split along its last axis.
    """

    def __init__(self, owner: nn.Module, names: tuple[str, ...]):
        self.names = names
        self.products: list[tuple[nn.Module, list[int]]] = []  # (product, split offsets within its output)
        for run in _runs([owner[n] for n in names]):
            sizes = [p["weight"].shape[_out_axis(p)] for p in run]
            offsets = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
            self.products.append((_concatenate(run), offsets))
        self.views = [owner[n]["weight"] for n in names]  # what the parts held when fused

    @property
    def is_fused(self) -> bool:
        """Whether any two parts share a product (False when every part stands alone)."""
        return len(self.products) < len(self.names)

    def matches(self, owner: nn.Module) -> bool:
        """Whether `owner`'s parts still hold the rows of the products (nothing replaced them since)."""
        return all(owner[n]["weight"] is w for n, w in zip(self.names, self.views))

    def __call__(self, x: mx.array, *args) -> list[mx.array]:
        return run_products(self.products, lambda product: product(x, *args))


def products(owner: nn.Module) -> list[tuple[nn.Module, list[int]]]:
    """What computes `owner.PROJECTIONS`: (product, split offsets within its output) in order; the fused products
    where `fuse` fused them and nothing replaced the parts since, else each part alone."""
    fused = owner.fused
    if fused is not None and fused.matches(owner):
        return fused.products
    return [(owner[n], []) for n in owner.PROJECTIONS]


def run_products(runs: list[tuple], apply) -> list[mx.array]:
    """`apply(product)` [..., sum of its out] for each (product, offsets) of `runs`, split along the last axis
    into one output [..., out_i] per part, in order (a product may be anything `apply` takes, such as a weight)."""
    outs: list[mx.array] = []
    for product, offsets in runs:
        y = apply(product)  # [..., sum of the run's out]
        outs.extend(mx.split(y, offsets, axis=-1) if offsets else [y])  # [..., out_i] each
    return outs


def project_inputs(owner: nn.Module, x: mx.array, *args) -> list[mx.array]:
    """x [..., in] (and the experts' indices, for stacked experts) -> the outputs of `owner.PROJECTIONS` in order,
    as one product where `fuse` fused them."""
    return run_products(products(owner), lambda product: product(x, *args))


def fuse(module: nn.Module) -> int:
    """Fuse the input projections of every layer in `module` (a model, or one of its layers) that lists them in a
    `PROJECTIONS` class attribute; returns how many layers now run fewer products. Parameters must be evaluated."""
    count = 0
    for _, m in module.named_modules():
        names = getattr(type(m), "PROJECTIONS", None)
        if names:
            fused = FusedProjection(m, names)
            m.fused = fused if fused.is_fused else None  # a plain attribute: not a parameter, not a child module
            count += m.fused is not None
    return count


def unfuse(module: nn.Module) -> None:
    """Drop the products of every layer in `module`: the parts run one by one again (their arrays, views of the
    products' rows, stay valid parameters)."""
    for _, m in module.named_modules():
        if getattr(type(m), "PROJECTIONS", None):
            m.fused = None
