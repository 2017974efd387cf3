"""A slice of the plan as one program's pieces: its weights from the MLX model (numpy fp32, or a quantized
checkpoint's own lookup tables), in the export's weight form, with the static shape and the builder that makes the
program (`build_piece`), and the hashes and byte counts that key and budget it."""

from __future__ import annotations

import hashlib
import math
from dataclasses import fields, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from hetero.coreml.graphs import LAYOUTS
from hetero.coreml.target import DEFAULT_WEIGHT_FORM, check_weight_form
from hetero.errors import HeteroError
from hetero.models.interface import Args, CausalLM, DecoderLayer
from hetero.planner import PieceSlice, Plan
from hetero.planner.slices import LUT_BITS

DEFAULT_LAYOUT = LAYOUTS[0]  # the attention layout exports take unless told




def linear_weight(layer: nn.Module, rows: slice | np.ndarray = slice(None), cols: slice = slice(None)):
    """Rows `rows` (a range or an index array) and columns `cols` of a Linear's weight [out, in] as the ANE gets
    them: a quantized layer of at most 4 bits as its own per-group lookup tables (`hetero.coreml.graphs.palette.Palettized`:
    each weight exactly MLX's, rounded once to fp16), other layers as fp32 numpy (quantized ones of more bits
    dequantized: a table per group would outweigh fp16). Only the slice is unpacked or widened."""
    pick = mx.array(rows) if isinstance(rows, np.ndarray) else rows
    if isinstance(layer, nn.QuantizedLinear) and getattr(layer, "mode", "affine") == "affine" and layer.bits in LUT_BITS:
        g, per_word = layer.group_size, 32 // math.gcd(32, layer.bits)  # columns per whole word run
        c0, c1, _ = cols.indices(layer.scales.shape[1] * g)
        step = math.lcm(g, per_word)
        a, b = c0 // step * step, -(-c1 // step) * step  # whole groups and words around the columns
        words = slice(a * layer.bits // 32, b * layer.bits // 32)
        p = palettize(layer.weight[pick][:, words], layer.scales[pick][:, a // g : b // g],
                      layer.biases[pick][:, a // g : b // g], layer.bits, g)
        return p if (a, b) == (c0, c1) else p[:, c0 - a : c1 - a]
    if isinstance(layer, nn.QuantizedLinear):
        w = mx.dequantize(layer.weight[pick], layer.scales[pick], layer.biases[pick], layer.group_size, layer.bits)
    else:
        w = layer.weight[pick]
    return np.array(w[:, cols].astype(mx.float32))


def palettize(packed: mx.array, scales: mx.array, biases: mx.array, bits: int, group: int):
    """MLX's affine-quantized matrix as per-group tables: lut[r, g, k] = MLX's dequantized value of index k in
    group g of row r, in fp32 (bf16 and fp16 scales widen exactly; MLX's quantized matmul applies them in fp32),
    rounded once to fp16. Computed by `mx.dequantize` itself, so every entry is MLX's arithmetic, signed zeros
    included. The scales and biases ride along, for the shift-scale form (`Palettized.with_affine`)."""
    from hetero.coreml.graphs.palette import Palettized, pack, table_indices, unpack

    rows, groups = scales.shape
    one = pack(table_indices(bits, group), bits)  # [1, group * bits / 32]: 0..2^bits-1 in one group
    table = mx.array(np.tile(one, (rows, groups)))  # [rows, groups * group * bits / 32]
    s, b = scales.astype(mx.float32), biases.astype(mx.float32)
    lut = mx.dequantize(table, s, b, group_size=group, bits=bits).reshape(rows, groups, group)[:, :, : 2**bits]
    lut = np.array(lut).astype(np.float16)  # [rows, groups, 2^bits]
    scale_bias = np.stack([np.array(s), np.array(b)], axis=-1)  # [rows, groups, 2] fp32
    return Palettized(unpack(np.array(packed), bits, groups * group), lut, bits, scale_bias=scale_bias)


def _vec(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def linear_columns(layer: nn.Module, channels: np.ndarray):
    """Input channels `channels` (any set, taken as its runs of consecutive channels) of a Linear's weight, as
    `linear_weight` gives a column range."""
    from hetero.coreml.graphs.palette import Palettized, concat_columns

    cuts = np.flatnonzero(np.diff(channels) != 1) + 1
    parts = [linear_weight(layer, cols=slice(int(run[0]), int(run[-1]) + 1)) for run in np.split(channels, cuts)]
    if len(parts) == 1:
        return parts[0]
    return concat_columns(parts) if isinstance(parts[0], Palettized) else np.concatenate(parts, axis=1)


def attention_weights(args: Args, layer: DecoderLayer, kv: range):
    """The attention slice for KV heads `kv` (and their query heads) of a decoder layer."""
    from hetero.coreml.graphs.attention import AttentionWeights

    attn, D = layer.self_attn, args.head_dim
    group = args.num_attention_heads // args.num_key_value_heads
    heads = range(kv.start * group, kv.stop * group)
    base = (np.arange(heads.start, heads.stop) * 2 * D)[:, None]  # [Hs, 1]: q_proj has D query, D gate rows per head
    kv_rows = slice(kv.start * D, kv.stop * D)
    return AttentionWeights(
        q=linear_weight(attn.q_proj, (base + np.arange(D)).reshape(-1)),  # [Hs * D, h]
        gate=linear_weight(attn.q_proj, (base + D + np.arange(D)).reshape(-1)),  # [Hs * D, h]
        k=linear_weight(attn.k_proj, kv_rows),
        v=linear_weight(attn.v_proj, kv_rows),
        q_norm=_vec(attn.q_norm.weight),
        k_norm=_vec(attn.k_norm.weight),
        o=linear_weight(attn.o_proj, cols=slice(heads.start * D, heads.stop * D)),
    )


def mlp_weights(mlp: nn.Module, channels: np.ndarray, out_shift: int = 0):
    """The MLP slice for intermediate `channels` (any set) of a SwiGLU `mlp` (a layer's dense MLP or an MoE
    layer's shared expert), its down projection scaled by 2^-out_shift (exact; the merge undoes it)."""
    from hetero.coreml.graphs.mlp import MLPWeights
    from hetero.coreml.graphs.ops import scaled

    down = linear_columns(mlp.down_proj, channels)
    return MLPWeights(
        gate=linear_weight(mlp.gate_proj, channels),
        up=linear_weight(mlp.up_proj, channels),
        down=scaled(down, 2.0**-out_shift) if out_shift else down,
    )


def gdn_in_proj_weights(layer: DecoderLayer, rows: range, out_shift: int = 0):
    """The z-projection slice for `rows` of in_proj_z of a GDN decoder layer, scaled by 2^-out_shift."""
    from hetero.coreml.graphs.gdn import GDNInProjWeights
    from hetero.coreml.graphs.ops import scaled

    z = linear_weight(layer.linear_attn.in_proj_z, slice(rows.start, rows.stop))
    return GDNInProjWeights(z=scaled(z, 2.0**-out_shift) if out_shift else z)


def piece_scaling(plan: Plan, s: PieceSlice) -> tuple[np.ndarray | None, int]:
    """(the channels of a channel piece's part in the layer's order, or None for units in their own order; the
    output's power-of-two shift), from the plan's measured ranges."""
    r = plan.ranges.get(s.layer, s.piece) if plan.ranges is not None else None
    if r is None:
        return None, 0
    return (r.channels(s.start, s.stop) if r.order else None), r.out_shift


def in_form(weights, form: str):
    """A slice's weights in the export form `form` (`hetero.coreml.target.WEIGHT_FORMS`): `fp16` expands every
    quantized matrix to the fp16 weights its tables hold (MLX's, rounded once: the same values, a macOS 14 program);
    `lut` keeps quantized matrices as per-group tables only; `blockwise` keeps each group's exact shift-scale form
    too, which `hetero.coreml.graphs.ops.conv1x1` uses for every matrix whose every block has one (the others stay
    tables)."""
    from hetero.coreml.graphs.palette import Palettized

    check_weight_form(form)

    def embed(a: Palettized):
        if form == "fp16":
            return a.dense().astype(np.float32)  # fp16 values, exact in fp32
        return a.with_affine() if form == "blockwise" else a.without_affine()

    return replace(weights, **{name: embed(a) for name, a in _fields(weights).items() if isinstance(a, Palettized)})


def blockwise_capable(weights) -> int:
    """How many of a slice's matrices `--ane-weights blockwise` embeds as shift-scale (whatever form they are in;
    most are told apart by their scales and biases alone, without the tables)."""
    from hetero.coreml.graphs.palette import Palettized

    return sum(isinstance(a, Palettized) and a.may_shift_scale() and a.with_affine().shift_scale() is not None
               for a in _fields(weights).values())


def weight_forms(weights) -> dict[str, int]:
    """How many of a slice's matrices the program embeds in each form (`fp16`, `lut`, `blockwise`), each field
    counted as `hetero.coreml.graphs.ops.conv1x1` embeds it whole (a builder's channel blocks of it take the same form)."""
    from hetero.coreml.graphs.ops import weight_form

    found: dict[str, int] = {}
    for a in _fields(weights).values():
        if np.ndim(a) == 2 or not isinstance(a, np.ndarray):
            kind = weight_form(a)
            found[kind] = found.get(kind, 0) + 1
    return found


def build_piece(args: Args, model: CausalLM, s: PieceSlice, chunk: int, context: int, plan: Plan | None = None,
                form: str = DEFAULT_WEIGHT_FORM, layout: str = DEFAULT_LAYOUT):
    """(shape, weights, builder) of one program: the slice `s` for chunks of `chunk` tokens up to `context`, with the
    channels and output scale `plan`'s ranges give it, its quantized weights in the form `form` (`WEIGHT_FORMS`),
    attention in `layout` (`hetero.coreml.graphs.attention.LAYOUTS`)."""
    shape, weights, build = raw_piece(args, model, s, chunk, context, plan, layout)
    return shape, in_form(weights, form), build


def piece_shape(args: Args, s: PieceSlice, chunk: int, context: int, layout: str = DEFAULT_LAYOUT):
    """(static shape, builder) of the program of slice `s` (its units, in any order) for chunks of `chunk` tokens up
    to `context`, attention in `layout`: what a program of the plan looks like, without its weights."""
    from hetero.coreml.graphs.attention import AttentionShape, build_attention
    from hetero.coreml.graphs.gdn import GDNInProjShape, build_gdn_in_proj
    from hetero.coreml.graphs.mlp import MLPShape, build_mlp

    units = s.stop - s.start
    if s.piece == "attention":
        group = args.num_attention_heads // args.num_key_value_heads
        return AttentionShape(hidden=args.hidden_size, heads=units * group, kv_heads=units, head_dim=args.head_dim,
                              rotary_dims=args.rotary_dims, chunk=chunk, cache_slots=context - chunk,
                              eps=args.rms_norm_eps, layout=layout), build_attention
    if s.piece in ("mlp", "shared_expert"):  # the shared expert: a dense SwiGLU on the same normed input
        return MLPShape(args.hidden_size, units, chunk), build_mlp
    if s.piece != "gdn_in_proj":
        raise HeteroError(f"layer {s.layer}: no ANE program for piece {s.piece!r}")
    return GDNInProjShape(args.hidden_size, units, chunk), build_gdn_in_proj


def raw_piece(args: Args, model: CausalLM, s: PieceSlice, chunk: int, context: int, plan: Plan | None,
              layout: str = DEFAULT_LAYOUT):
    """`build_piece` with the weights as the model holds them (quantized matrices as tables carrying their scales
    and biases: any form can still be made of them)."""
    shape, build = piece_shape(args, s, chunk, context, layout)
    layer, units = model.layers[s.layer], range(s.start, s.stop)
    channels, shift = piece_scaling(plan, s) if plan is not None else (None, 0)
    if s.piece == "attention":
        return shape, attention_weights(args, layer, units), build
    if s.piece in ("mlp", "shared_expert"):
        mlp = layer.mlp.shared_expert if s.piece == "shared_expert" else layer.mlp
        channels = np.arange(s.start, s.stop) if channels is None else channels
        return shape, mlp_weights(mlp, channels, shift), build
    return shape, gdn_in_proj_weights(layer, units, shift), build


def _fields(weights) -> dict:
    """A weights dataclass's fields as they are (`asdict` would turn a `Palettized` into a dict)."""
    return {f.name: getattr(weights, f.name) for f in fields(weights)}


def weights_sha256(weights) -> str:
    """Hash of a slice's weights exactly as embedded (fp16, or indices and tables), field by field."""
    from hetero.coreml.graphs.ops import fp16
    from hetero.coreml.graphs.palette import Palettized

    h = hashlib.sha256()
    for name, a in _fields(weights).items():
        h.update(name.encode())
        if isinstance(a, Palettized):
            h.update(f"lut{a.bits}:{a.shape}".encode())
            h.update(np.ascontiguousarray(a.indices).tobytes())
            h.update(np.ascontiguousarray(a.lut, dtype=np.float16).tobytes())
            if a.affine is not None:  # the blockwise form: its scales and offsets too
                h.update(np.ascontiguousarray(a.affine, dtype=np.float16).tobytes())
        else:
            h.update(fp16(a).tobytes())
    return h.hexdigest()


def weights_nbytes(weights) -> int:
    """Bytes a slice's weights take in its package: fp16, packed indices plus fp16 tables, or shift-scale data plus
    a scale and offset per block."""
    from hetero.coreml.graphs.palette import Palettized

    def size(a) -> int:
        if not isinstance(a, Palettized):
            return np.asarray(a).size * 2
        return a.nbytes if a.shift_scale() is None else a.shift_scale_nbytes()

    return sum(size(a) for a in _fields(weights).values())
