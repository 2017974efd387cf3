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
`function`). A re-run reuses every package whose key (weights hash + shape + builder version + target) is
unchanged and removes the others together with the folders Core ML compiled from them.

The export is built for one target (`hetero.coreml.target`): a Mac below macOS 15 gets fp16 weights and one package
per context bucket (Core ML spec 8), from macOS 15 any weight form and multifunction packages (spec 9). The
manifest names the target, and the runtime loads an export only for its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from hetero.checkpoint.loader import load_model
from hetero.coreml.backends.compiled import compiled_owner, remove_compiled
from hetero.coreml.manifest import TEXT, listed_files, read_manifest
from hetero.coreml.manifest import write as write_manifest
from hetero.coreml.pieces import (
    DEFAULT_LAYOUT,
    PieceSlice,
    blockwise_capable,
    build_piece,
    in_form,
    piece_scaling,
    raw_piece,
    weight_forms,
    weights_nbytes,
    weights_sha256,
)
from hetero.coreml.target import DEFAULT_WEIGHT_FORM, WEIGHT_FORMS, Target, check_weight_form, weight_form_for
from hetero.errors import HeteroError
from hetero.models.interface import Args
from hetero.planner import Plan
from hetero.planner.plan import PlanRequest
from hetero.planner.recommend import split_plan
from hetero.planner.slices import split_for_budget
from hetero.profiles import default_profile_name, load_profile

__all__ = ["DEFAULT_WEIGHT_FORM", "WEIGHT_FORMS", "check_weight_form", "export_coreml", "export_plan", "lint_export",
           "read_manifest"]
BUILDER_VERSION = 2  # bump when a builder's graph changes: invalidates reuse of packages built before
DEFAULT_CHUNK = 256
DEFAULT_CONTEXT = 4096


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
    target: Target | None = None,
    form: str = DEFAULT_WEIGHT_FORM,
    layout: str = DEFAULT_LAYOUT,
) -> dict:
    """`hetero convert --coreml`: load `model`, plan `fraction` of the piece kinds in `kinds` (default: those whose
    share shortens the predicted prefill, as the runtime's split offloads) for prefill chunks of `chunk` tokens
    (with the profile a split is planned with; `budget` overrides its weight bytes per program) and export that
    plan into `out` (`export_plan`, which `target`, the weight form `form` and the attention `layout` are passed
    to); returns the manifest."""

    contexts = sorted(set(contexts or [DEFAULT_CONTEXT]))
    check_shapes(chunk, contexts)
    check_weight_form(form)
    loaded = load_model(model)  # its own dtype: slices are widened to fp32 one at a time
    net, _, config = loaded
    context = min(contexts[-1], net.args.max_position_embeddings)  # the plan's predictions only; slices are per layer
    request = PlanRequest(config, load_profile(default_profile_name()), fraction, context, chunk, budget=budget)
    plan = split_plan(request, kinds)
    return export_plan(plan, loaded, out, contexts, progress, target=target, form=form, layout=layout)


def export_target(target: Target | None) -> Target:
    """`target`, or this machine's (`coreml_macos.this_target`: by its macOS version)."""
    if target is not None:
        return target
    from hetero.coreml.backends.coreml_macos import this_target

    return this_target()


def program_groups(plan: Plan, contexts: list[int], target: Target, form: str) -> list[tuple]:
    """(slice, part index, part, its contexts) of every package: each slice cut into the programs of at most the
    plan's budget in the bytes `form` embeds (fp16 parts of a quantized checkpoint are cut at fp16's), an attention
    part holding every bucket in one package where `target` allows it, else one package per bucket ([None]: a
    piece without buckets)."""
    storage = None if form == "fp16" else plan.storage
    groups = []
    for s in plan.slices:
        for part, piece in enumerate(split_for_budget(plan.args, s, plan.program_budget, storage)):
            if s.piece != "attention":
                groups.append((s, part, piece, [None]))
            else:
                groups.extend([(s, part, piece, contexts)] if target.multifunction and len(contexts) > 1 else
                              [(s, part, piece, [c]) for c in contexts])
    return groups


def export_plan(
    plan: Plan,
    loaded: tuple,
    out: str | os.PathLike,
    contexts: list[int],
    progress: Callable[[int, int], None] | None = None,
    target: Target | None = None,
    form: str = DEFAULT_WEIGHT_FORM,
    reuse: str | os.PathLike | None = None,
    layout: str = DEFAULT_LAYOUT,
) -> dict:
    """Export the ANE's share of `plan` into `out`: each of its slices as the programs it cuts them into, attention
    for every context bucket in `contexts`; returns the manifest (also written there).

    `target` (default: this machine's): the OS the packages are built for (`hetero.coreml.target`). `form`: how
    quantized weights are embedded (`WEIGHT_FORMS`; `--ane-weights`), as the target allows it
    (`weight_form_for`: fp16 below macOS 15, said in the manifest's `weight_form_note`): fp16, per-group lookup
    tables, or shift-scale for every matrix that has an exact one (the rest tables). All are MLX's weights; target
    and form are part of every package's key. `layout`: the attention programs' (`graphs.attention.LAYOUTS`).

    `loaded` = (model, path, config) of the checkpoint the plan is for: its weights are exported as they are in
    memory. Packages whose key matches the existing manifest's entry are reused; packages no longer in the plan
    are removed. `reuse`: another export directory (the same split before its ranges grew) whose packages of a
    matching key are hard-linked (else copied) in instead of built.
    """
    contexts = sorted(set(contexts))
    check_shapes(plan.chunk, contexts)
    target = export_target(target)
    form, note = weight_form_for(form, target)
    net, path, config = loaded
    if net.args.attention_bias and any(s.piece == "attention" for s in plan.slices):  # (the planner keeps them off)
        raise HeteroError("Core ML export does not support attention biases (attention_bias: true in config.json)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    previous, donor = _manifest_programs(out), _manifest_programs(reuse) if reuse is not None else {}
    groups = program_groups(plan, contexts, target, form)
    total, programs = sum(len(g[-1]) for g in groups), []
    for s, part, piece, ctxs in groups:
        programs += _export_package(plan, net, s, part, piece, ctxs, out, previous, donor, reuse,
                                    target=target, form=form, layout=layout)
        if progress is not None:
            progress(len(programs), total)
    current = {p["file"] for p in programs}
    for stale in set(previous) - current:
        remove_export(out / stale)
    remove_orphans(out, current)
    return _write_manifest(out, plan, loaded, contexts, programs, target=target, form=form, note=note, layout=layout)


def _manifest_programs(out: str | os.PathLike) -> dict[str, dict]:
    """file -> entry of an export's manifest; a damaged one or another format lists its files with no key (nothing
    of it is reused, but its packages are still removed)."""
    try:
        return {p["file"]: p for p in read_manifest(out)["programs"]}
    except HeteroError:
        return {f: {} for f in listed_files(Path(out))}


def package_key(piece: PieceSlice, shapes: list, digest: str, shift: int, target: Target, form: str) -> str:
    """A package's key: builder and coremltools versions, the part, every function's shape, the weights as embedded,
    the output shift, the target and the weight form."""
    import coremltools as ct

    keys = [hashlib.sha256(json.dumps([BUILDER_VERSION, ct.__version__, asdict(piece), asdict(sh), digest, shift,
                                       target.name, form]).encode()).hexdigest() for sh in shapes]
    return keys[0] if len(keys) == 1 else hashlib.sha256(json.dumps(keys).encode()).hexdigest()


def _export_package(plan: Plan, net, s: PieceSlice, part: int, piece: PieceSlice, ctxs: list, out: Path,
                    previous: dict, donor: dict, reuse, *, target: Target, form: str, layout: str) -> list[dict]:
    """One package (built, linked from `reuse` or reused as it is) and its manifest entries, one per function."""
    from hetero.coreml.graphs.package import save_functions, save_program  # first: quiets coremltools' warnings

    args = net.args
    shape, raw, build = raw_piece(args, net, piece, plan.chunk, ctxs[0] or plan.chunk, plan, layout)
    weights, capable = in_form(raw, form), blockwise_capable(raw)
    shapes = {ctxs[0]: shape}  # every bucket embeds the same weights: only the shapes differ
    shapes.update({c: build_piece(args, net, piece, plan.chunk, c, plan, layout=layout)[0] for c in ctxs[1:]})
    channels, shift = piece_scaling(plan, piece)
    digest = weights_sha256(weights)
    key = package_key(piece, list(shapes.values()), digest, shift, target, form)
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
    return [{
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
        "shape": asdict(sh),
        "inputs": {k: list(v) for k, v in sh.inputs().items()},
        "outputs": {k: list(v) for k, v in sh.outputs().items()},
        "weights_sha256": digest,
        # the bytes this entry adds: a package's later functions share its first one's weights
        "weight_bytes": 0 if i else weight_bytes,
        "package_weight_bytes": weight_bytes,  # what each loaded function of it may cost (coremltools#2351)
        "weight_forms": forms,  # the slice's matrices per embedding: fp16, lut, blockwise
        "blockwise_capable": capable,  # of them, those `--ane-weights blockwise` embeds as shift-scale
        "key": key,
        "reused": reused,
    } for i, (ctx, sh) in enumerate(shapes.items())]


def _write_manifest(out: Path, plan: Plan, loaded: tuple, contexts: list[int], programs: list[dict], *,
                    target: Target, form: str, note: str | None, layout: str) -> dict:
    """The manifest, written last and atomically (a stopped export is never read as finished)."""
    import coremltools as ct

    net, path, config = loaded
    manifest = {
        "format": TEXT.format,
        "model": model_identity(path, config, net.args),
        "coremltools": ct.__version__,
        "builder_version": BUILDER_VERSION,
        "target": target.name,
        "target_detail": target.to_dict(),
        "ane_fraction": plan.sliced_fraction,
        "chunk_size": plan.chunk,
        "context_buckets": contexts,
        "weight_budget_bytes": plan.program_budget,
        "ane_weights": form,
        **({"weight_form_note": note} if note else {}),
        "attention_layout": layout,
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
