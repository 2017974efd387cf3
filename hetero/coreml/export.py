"""The Core ML export of the ANE's share of prefill: `.mlpackage` programs plus `manifest.json`.

`export_plan` exports a `Plan` (hetero.planner): per layer, the slice of each offloadable piece the plan gives
the ANE (shared/DESIGN.md section 4), each as the programs the plan cuts it into (none carrying more than the
plan's `program_budget` bytes of weights), written next to a manifest that records the model's identity and
weight hashes, the plan's slices, every program's shapes, the chunk size, the context buckets and the coremltools
version. An MoE layer's `shared_expert` slice is the MLP program over the shared expert's weights (the router and
the routed experts never leave the GPU). The pipeline exports its split's plan on first use
(`hetero.pipeline.programs.ensure_export`); `hetero convert --coreml` plans a fraction for a checkpoint
(`export_coreml`), exports it into a directory and lints it. With several context buckets, an attention slice's
buckets are the functions of one package (`ctx<T>`, weights stored once; the manifest entries name their
`function`). A re-run reuses every package whose key (weights hash + shape + builder version) is unchanged and
removes the others together with the folders Core ML compiled from them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, fields, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from hetero.checkpoint.loader import load_model
from hetero.coreml.backends.coreml_macos import compiled_owner, remove_compiled
from hetero.coreml.manifest import TEXT, listed_files, read_manifest
from hetero.coreml.manifest import write as write_manifest
from hetero.errors import HeteroError
from hetero.models.interface import Args, CausalLM, DecoderLayer
from hetero.planner import PieceSlice, Plan
from hetero.planner.plan import PlanRequest
from hetero.planner.recommend import split_plan
from hetero.planner.slices import LUT_BITS
from hetero.profiles import default_profile_name, load_profile

BUILDER_VERSION = 2  # bump when a builder's graph changes: invalidates reuse of packages built before
DEFAULT_CHUNK = 256
DEFAULT_CONTEXT = 4096


# ----------------------------------------------------------------------------------------------------------
# Weights of a slice, as numpy (fp32), from the MLX model


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


WEIGHT_FORMS = ("lut", "blockwise")  # `--ane-weights`: how quantized weights reach the ANE (both exact)
DEFAULT_WEIGHT_FORM = "lut"


def check_weight_form(form: str) -> str:
    """`form` when it is one of `WEIGHT_FORMS`; else one HeteroError line."""
    if form not in WEIGHT_FORMS:
        raise HeteroError(f"--ane-weights {form!r}: must be one of {', '.join(WEIGHT_FORMS)}")
    return form


def in_form(weights, form: str):
    """A slice's weights in the export form `form`: `lut` keeps quantized matrices as per-group tables only;
    `blockwise` keeps each group's exact shift-scale form too, which `hetero.coreml.graphs.ops.conv1x1` uses for every
    matrix whose every block has one (the others stay tables)."""
    from hetero.coreml.graphs.palette import Palettized

    check_weight_form(form)
    return replace(weights, **{name: (a.with_affine() if form == "blockwise" else a.without_affine())
                               for name, a in _fields(weights).items() if isinstance(a, Palettized)})


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
                form: str = DEFAULT_WEIGHT_FORM):
    """(shape, weights, builder) of one program: the slice `s` for chunks of `chunk` tokens up to `context`, with the
    channels and output scale `plan`'s ranges give it, its quantized weights in the form `form` (`WEIGHT_FORMS`)."""
    shape, weights, build = _build_piece(args, model, s, chunk, context, plan)
    return shape, in_form(weights, form), build


def _build_piece(args: Args, model: CausalLM, s: PieceSlice, chunk: int, context: int, plan: Plan | None):
    from hetero.coreml.graphs.attention import AttentionShape, build_attention
    from hetero.coreml.graphs.gdn import GDNInProjShape, build_gdn_in_proj
    from hetero.coreml.graphs.mlp import MLPShape, build_mlp

    layer, units = model.layers[s.layer], range(s.start, s.stop)
    channels, shift = piece_scaling(plan, s) if plan is not None else (None, 0)
    if s.piece == "attention":
        group = args.num_attention_heads // args.num_key_value_heads
        shape = AttentionShape(
            hidden=args.hidden_size, heads=len(units) * group, kv_heads=len(units), head_dim=args.head_dim,
            rotary_dims=args.rotary_dims, chunk=chunk, cache_slots=context - chunk, eps=args.rms_norm_eps,
        )
        return shape, attention_weights(args, layer, units), build_attention
    if s.piece in ("mlp", "shared_expert"):  # the shared expert: a dense SwiGLU on the same normed input
        mlp = layer.mlp.shared_expert if s.piece == "shared_expert" else layer.mlp
        channels = np.arange(s.start, s.stop) if channels is None else channels
        return MLPShape(args.hidden_size, len(units), chunk), mlp_weights(mlp, channels, shift), build_mlp
    if s.piece != "gdn_in_proj":
        raise HeteroError(f"layer {s.layer}: no ANE program for piece {s.piece!r}")
    return GDNInProjShape(args.hidden_size, len(units), chunk), gdn_in_proj_weights(layer, units, shift), build_gdn_in_proj


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


# ----------------------------------------------------------------------------------------------------------
# The export


def check_shapes(chunk: int, contexts: list[int]) -> None:
    """Chunk a positive multiple of 64; each context bucket a multiple of 64 holding at least one chunk."""
    if chunk <= 0 or chunk % 64:
        raise HeteroError(f"--chunk-size {chunk}: must be a positive multiple of 64")
    for c in contexts:
        if c < chunk or c % 64:
            raise HeteroError(f"--context {c}: must be a multiple of 64 and at least the chunk size ({chunk})")


def model_identity(path: Path, config: dict, args: Args) -> dict:
    """What names the exported model: its directory, config hash and shape."""
    return {
        "path": str(path),
        "config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
        "model_type": args.model_type,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "layer_types": args.layer_types,
    }


def function_name(context: int) -> str:
    """The function of an attention package that serves context bucket `context`."""
    return f"ctx{context}"


def remove_export(package: Path) -> None:
    """Delete an exported package together with every folder Core ML compiled from it (and half-made ones)."""
    shutil.rmtree(package, ignore_errors=True)
    remove_compiled(package)


def remove_orphans(out: Path, packages: set[str]) -> None:
    """Delete compiled folders in `out` whose package is not among `packages` (file names): left by an export
    that removed its package before compiled folders were cleaned up with it."""
    stems = {Path(p).stem for p in packages}
    for entry in out.iterdir():
        owner = compiled_owner(entry.name)
        if owner is not None and owner not in stems:
            shutil.rmtree(entry, ignore_errors=True)


def _link_package(src: Path, dst: Path) -> bool:
    """A package of another export in `dst` (hard links, copies where the file system refuses them); False (and
    nothing left at `dst`) when neither works."""
    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    try:
        shutil.copytree(src, dst, copy_function=link)
        return True
    except OSError:
        remove_export(dst)
        return False


def export_coreml(
    model: str | os.PathLike | None,
    out: str | os.PathLike,
    fraction: float,
    chunk: int = DEFAULT_CHUNK,
    contexts: list[int] | None = None,
    budget: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    kinds: tuple[str, ...] | None = None,
    multifunction: bool | None = None,
    form: str = DEFAULT_WEIGHT_FORM,
) -> dict:
    """`hetero convert --coreml`: load `model`, plan `fraction` of the piece kinds in `kinds` (default: those whose
    share shortens the predicted prefill, as the runtime's split offloads) for prefill chunks of `chunk` tokens
    (with the profile a split is planned with; `budget` overrides its weight bytes per program) and export that
    plan into `out` (`export_plan`, which `multifunction` and the weight form `form` are passed to); returns the
    manifest."""

    contexts = sorted(set(contexts or [DEFAULT_CONTEXT]))
    check_shapes(chunk, contexts)
    check_weight_form(form)
    loaded = load_model(model)  # its own dtype: slices are widened to fp32 one at a time
    net, _, config = loaded
    context = min(contexts[-1], net.args.max_position_embeddings)  # the plan's predictions only; slices are per layer
    request = PlanRequest(config, load_profile(default_profile_name()), fraction, context, chunk, budget=budget)
    plan = split_plan(request, kinds)
    return export_plan(plan, loaded, out, contexts, progress, multifunction, form)


def export_plan(
    plan: Plan,
    loaded: tuple,
    out: str | os.PathLike,
    contexts: list[int],
    progress: Callable[[int, int], None] | None = None,
    multifunction: bool | None = None,
    form: str = DEFAULT_WEIGHT_FORM,
    reuse: str | os.PathLike | None = None,
) -> dict:
    """Export the ANE's share of `plan` into `out`: each of its slices as the programs it cuts them into, attention
    for every context bucket in `contexts`; returns the manifest (also written there).

    `form`: how quantized weights are embedded (`WEIGHT_FORMS`; `--ane-weights`): per-group lookup tables, or
    shift-scale for every matrix that has an exact one (the rest tables). Both are MLX's weights bit for bit; the
    form is part of every package's key, so the two never share a package.

    `multifunction`: an attention piece's buckets as the functions of one package, else one single-function
    package per bucket; None decides by the OS (`coreml_macos.multifunction_packages`: not before macOS 15).

    `loaded` = (model, path, config) of the checkpoint the plan is for: its weights are exported as they are in
    memory. Packages whose key matches the existing manifest's entry are reused; packages no longer in the plan
    are removed. `reuse`: another export directory (the same split before its ranges grew) whose packages of a
    matching key are hard-linked (else copied) in instead of built.
    """
    from hetero.coreml.graphs.package import save_functions, save_program  # first: quiets coremltools' import warnings

    import coremltools as ct

    contexts = sorted(set(contexts))
    check_shapes(plan.chunk, contexts)
    check_weight_form(form)
    net, path, config = loaded
    args = net.args
    if args.attention_bias:
        raise HeteroError("Core ML export does not support attention biases (attention_bias: true in config.json)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        previous = {p["file"]: p for p in read_manifest(out)["programs"]}
    except HeteroError:  # none, damaged or another format: nothing reused, but its packages are still removed
        previous = {f: {} for f in listed_files(out)}
    try:
        donor = {p["file"]: p for p in read_manifest(reuse)["programs"]} if reuse is not None else {}
    except HeteroError:
        donor = {}

    if multifunction is None:
        from hetero.coreml.backends.coreml_macos import macos_version, multifunction_packages

        multifunction = multifunction_packages(macos_version())
    groups = []  # (slice, part index, part slice, its contexts: every bucket for attention, else [None])
    for s in plan.slices:
        for part, piece in enumerate(plan.program_parts(s)):
            if s.piece != "attention":
                groups.append((s, part, piece, [None]))
            else:  # one package holding every bucket, or one package per bucket
                groups.extend([(s, part, piece, contexts)] if multifunction else
                              [(s, part, piece, [c]) for c in contexts])
    total, programs = sum(len(g[-1]) for g in groups), []
    for s, part, piece, ctxs in groups:
        shape, raw, build = _build_piece(args, net, piece, plan.chunk, ctxs[0] or plan.chunk, plan)
        weights, capable = in_form(raw, form), blockwise_capable(raw)
        shapes = {ctxs[0]: shape}  # every bucket embeds the same weights: only the shapes differ
        shapes.update({c: build_piece(args, net, piece, plan.chunk, c, plan)[0] for c in ctxs[1:]})
        channels, shift = piece_scaling(plan, piece)
        digest = weights_sha256(weights)
        tag = [] if form == DEFAULT_WEIGHT_FORM else [form]  # the tables' keys are those of exports before the flag
        keys = [hashlib.sha256(json.dumps([BUILDER_VERSION, ct.__version__, asdict(piece), asdict(sh), digest, shift]
                                          + tag).encode()).hexdigest() for sh in shapes.values()]
        key = keys[0] if len(keys) == 1 else hashlib.sha256(json.dumps(keys).encode()).hexdigest()
        multi = len(ctxs) > 1  # one package, one function per bucket, the weights stored once
        suffix = f"_ctx{ctxs[0]}" if ctxs[0] and not multi else ""
        file = f"layer{s.layer:02d}_{s.piece}_part{part}{suffix}.mlpackage"
        reused = previous.get(file, {}).get("key") == key and (out / file / "Manifest.json").is_file()
        if not reused and donor.get(file, {}).get("key") == key and (Path(reuse) / file / "Manifest.json").is_file():
            remove_export(out / file)
            reused = _link_package(Path(reuse) / file, out / file)
        if not reused:
            remove_export(out / file)
            if multi:  # built one at a time as the save consumes them
                save_functions(((function_name(c), build(sh, weights)) for c, sh in shapes.items()), out / file)
            else:
                save_program(build(shape, weights), out / file)
        weight_bytes, forms = weights_nbytes(weights), weight_forms(weights)
        for i, (ctx, shape) in enumerate(shapes.items()):
            programs.append(
                {
                    "file": file,
                    **({"function": function_name(ctx)} if multi else {}),
                    "layer": s.layer,
                    "piece": s.piece,
                    "slice": [s.start, s.stop],
                    "part": [piece.start, piece.stop],
                    # the part's units when chosen by range (else the part's own), and its output's 2^-shift
                    **({"channels": channels.tolist()} if channels is not None else {}),
                    "out_shift": shift,
                    "context": ctx,
                    "shape": asdict(shape),
                    "inputs": {k: list(v) for k, v in shape.inputs().items()},
                    "outputs": {k: list(v) for k, v in shape.outputs().items()},
                    "weights_sha256": digest,
                    # the bytes this entry adds: a package's later functions share its first one's weights
                    "weight_bytes": 0 if i else weight_bytes,
                    "weight_forms": forms,  # the slice's matrices per embedding: fp16, lut, blockwise
                    "blockwise_capable": capable,  # of them, those `--ane-weights blockwise` embeds as shift-scale
                    "key": key,
                    "reused": reused,
                }
            )
            if progress is not None:
                progress(len(programs), total)
        del weights, raw  # one slice's fp32 weights at a time
    current = {p["file"] for p in programs}
    for stale in set(previous) - current:
        remove_export(out / stale)
    remove_orphans(out, current)
    manifest = {
        "format": TEXT.format,
        "model": model_identity(path, config, args),
        "coremltools": ct.__version__,
        "builder_version": BUILDER_VERSION,
        "ane_fraction": plan.sliced_fraction,
        "chunk_size": plan.chunk,
        "context_buckets": contexts,
        "weight_budget_bytes": plan.program_budget,
        "ane_weights": form,
        "plan": [asdict(s) for s in plan.slices],
        "programs": programs,
    }
    write_manifest(out, manifest)
    return manifest


# ----------------------------------------------------------------------------------------------------------
# Lint


def lint_export(out: str | os.PathLike, budget: int | None = None) -> list:
    """Lint every package of an export directory (or one .mlpackage) against the ANE's rules; HeteroError when
    there is none. `budget`: weight bytes per program (default: the manifest's, else the lint's own)."""
    from hetero.coreml.graphs.lint import WEIGHT_BUDGET as LINT_BUDGET
    from hetero.coreml.graphs.lint import export_packages, lint_package

    if budget is None and (Path(out) / TEXT.file).is_file():
        budget = read_manifest(out).get("weight_budget_bytes")
    packages = export_packages(out)
    if not packages:
        raise HeteroError(f"{out}: no .mlpackage to lint (pass an export directory or a package)")
    missing = [p for p in packages if not (p / "Manifest.json").is_file()]
    if missing:
        raise HeteroError(f"{missing[0]} is listed in the manifest but missing; re-run hetero convert --coreml")
    return [lint_package(p, budget or LINT_BUDGET) for p in packages]
