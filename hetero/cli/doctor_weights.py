"""`hetero doctor`'s choice among the three exact weight forms of `--ane-weights` on the Mac it runs on.

All three hold MLX's quantized weights exactly (`hetero.coreml.graphs.palette`): `fp16` (the weights expanded, MLX's
own rounded once: what every macOS runs), `lut` (a lookup table per row and group, `constexpr_lut_to_dense`, macOS 15)
and `blockwise` (`constexpr_blockwise_shift_scale` where every group of a matrix has an exact scale and offset, macOS
15). Whether the Neural Engine keeps a compressed form on it, runs it as fast as fp16, and keeps its weights
compressed in memory (or expands the tables to fp16 at load: 21.8 GB instead of 10.9 GB for a 27B at 0.5) are facts
of a Mac. So the doctor builds the plan's MLP program (`hetero.cli.doctor_probes`: the planned share of channels, at
the checkpoint's bits and group, 4-bit group 64 for a float checkpoint) in each form the Mac's target allows, the same
weights in each, lints them, runs them on the same input and, where Core ML runs (`load` given), times each, places
it and measures the resident memory its load adds (the process footprint, `proc_pid_rusage`), then recommends:

- `lut` only where it is on the Neural Engine (placement within its cost budget), at least as fast as fp16 and
  measurably smaller in memory (at most `SMALLER` of fp16's footprint growth);
- `blockwise` under the same conditions, with outputs equal to the tables' bit for bit, and at most `FASTER` of
  the tables' time where the tables qualify too;
- `fp16` otherwise: exact, uncompressed, the form every macOS runs.

Below macOS 15 the compressed forms are unavailable (said, with why). Off a Mac the forms still pass the lint and the
reference executor here, and the doctor says plainly that the timing needs a Mac.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from hetero.cli.measure import Timer, timed
from hetero.coreml.target import WEIGHT_FORMS
from hetero.errors import HeteroError

FORMS = WEIGHT_FORMS  # fp16, lut, blockwise
AS_FAST = 1.0  # a compressed form qualifies at most this share of fp16's time per call
SMALLER = 0.8  # ... and at most this share of fp16's resident memory growth ("measurably smaller")
FASTER = 0.95  # blockwise over lut: at most this share of the tables' time
DEFAULT_QUANT = (4, 64)  # the forms of a float checkpoint's programs are compared as a 4-bit one's would be


def exact_weights(rows: int, cols: int, bits: int, group: int, rng: np.random.Generator):
    """A `Palettized` [rows, cols] matrix as MLX quantizes it (packed indices, fp16 scales and biases, tables from
    `mx.dequantize`) whose every group has an exact shift-scale form: bias = -2^(bits-1) * scale (a power-of-two
    offset), the scale's sign random (negative ones take the mirrored form)."""
    import mlx.core as mx

    from hetero.coreml.graphs.palette import pack
    from hetero.coreml.pieces import palettize

    indices = rng.integers(0, 2**bits, (rows, cols), dtype=np.uint8)
    magnitude = 2 / (2**bits - 1) / np.sqrt(cols) * rng.uniform(0.5, 1.5, (rows, cols // group))
    scales = (magnitude * rng.choice([-1.0, 1.0], magnitude.shape)).astype(np.float16)  # [rows, groups]
    biases = (-(2.0 ** (bits - 1)) * scales.astype(np.float32)).astype(np.float16)  # exact: a power of two times
    w = palettize(mx.array(pack(indices, bits)), mx.array(scales), mx.array(biases), bits, group).with_affine()
    if w.shift_scale() is None:
        raise HeteroError("internal: the doctor's weights have no exact shift-scale form")
    return w


def form_probes(mlp, quant: tuple[int, int] | None, forms: tuple[str, ...]) -> dict:
    """The plan's MLP probe (`doctor_probes.Probe`) in each form of `forms`: a quantized checkpoint's at its `quant`,
    the same weights in each; a float checkpoint's fp16 program is its own MLP probe, its compressed forms those of
    a 4-bit copy (`DEFAULT_QUANT`)."""
    from dataclasses import replace

    return {form: mlp if form == "fp16" and quant is None else replace(mlp, form=form, quant=quant or DEFAULT_QUANT)
            for form in forms}


def compare_forms(mlp, root: Path, target, load: Callable[[Path], Callable] | None, quant=None,
                  timer: Timer = timed, memory: Callable[[], object] | None = None, repeats: int = 5) -> dict:
    """The three weight forms of the plan's MLP program (`mlp`, a probe) for a Mac of `target`: each built and linted,
    and where `load` is given (the real call on a Mac: `coreml_macos.load`) run on the same input (are the outputs
    identical?), timed (median seconds per call, `timer`, after a warm-up), placed (the program's
    `placement_status()`) and weighed (the footprint its load adds, `memory`: `coreml_macos.memory_now`), with the
    recommended form. Off a Mac (`load` None) `recommended` is None and `line` says the rest needs one."""
    from hetero.cli.doctor_probes import probe_inputs, probe_package
    from hetero.coreml.graphs.lint import lint_package

    runnable = tuple(f for f in FORMS if f in target.forms)
    probes = form_probes(mlp, quant, runnable)
    feed = probe_inputs(probes[runnable[0]], 1e6)
    found: dict = {"program": probes[runnable[0]].title + ")",
                   "quantization": list(quant or DEFAULT_QUANT), "forms": {}}
    outputs = {}
    for form in FORMS:
        if form not in runnable:
            found["forms"][form] = {"available": False,
                                    "why": f"needs macOS 15 (Core ML spec 9); this Mac's target is {target.name}"}
            continue
        path = probe_package(probes[form], root)
        lint = lint_package(path)
        entry = {"available": True, "lint_errors": len(lint.errors), "lint_warnings": len(lint.warnings),
                 "package_bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file())}
        if load is None:  # off a Mac: built and linted (running them would compare the reference with itself)
            found["forms"][form] = entry
            continue
        before = memory() if memory is not None else None
        try:
            program = load(path)
        except HeteroError as e:  # this Mac cannot load the form (its OS refused the spec): the others still compete
            found["forms"][form] = {**entry, "available": False, "why": str(e)}
            continue
        outputs[form] = {k: np.asarray(v, np.float32) for k, v in program(feed).items()}
        entry["resident_bytes"] = _growth(before, memory() if memory is not None else None)
        entry["seconds_per_call"] = timer(f"weights {form}", lambda: program(feed), repeats)
        status = getattr(program, "placement_status", None)
        entry["placement"] = status().to_dict() if status is not None else {
            "status": "unavailable", "ok": None, "line": "no compute plan for this program"}
        found["forms"][form] = entry
    # whether Core ML computes every form to the same bits (None off a Mac: the forms' weights are equal by
    # construction, tests/test_weight_forms.py; what only a Mac can say is whether its decompression is exact)
    shared = [o for f, o in outputs.items() if quant is not None or f != "fp16"]  # the forms of the same weights
    found["identical_outputs"] = all(_same(shared[0], o) for o in shared) if shared else None
    found["timed_on"] = "core ml" if load is not None else None
    found["recommended"], found["why"] = recommend(found)
    found["line"] = _line(found)
    return found


def _growth(before, after) -> int | None:
    """Footprint bytes a load added (its Neural Engine share included); None where either reading is missing."""
    if before is None or after is None:
        return None
    return int(after.bytes + (after.neural_bytes or 0) - before.bytes - (before.neural_bytes or 0))


def _same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)) for k in a)


def _qualifies(form: str, forms: dict) -> str | None:
    """Why a compressed form does not qualify against fp16 (None: it does): on the ANE, as fast, measurably smaller."""
    entry, base = forms[form], forms["fp16"]
    if not entry.get("available"):
        return entry["why"]
    if entry["lint_errors"]:
        return "it fails the ANE lint"
    if entry["placement"].get("ok") is not True:
        return f"Core ML does not keep it on the Neural Engine ({entry['placement']['line']})"
    ratio = entry["seconds_per_call"] / max(base["seconds_per_call"], 1e-12)
    if ratio > AS_FAST:
        return f"it takes {ratio:.2f}x fp16's time per call"
    grown, base_grown = entry.get("resident_bytes"), base.get("resident_bytes")
    if grown is None or not base_grown:
        return "its resident memory could not be measured against fp16's"
    if grown > SMALLER * base_grown:
        return (f"its load added {grown / 2**20:.0f} MiB against fp16's {base_grown / 2**20:.0f} MiB (not below "
                f"{SMALLER}x: expanded at load?)")
    return None


def recommend(found: dict) -> tuple[str | None, str]:
    """(the form to use, why) from the forms' findings (`compare_forms`'s `forms`, `identical_outputs`, `timed_on`)."""
    forms = found["forms"]
    if found["timed_on"] is None:
        return None, ("timing, placement and memory need a Mac (Core ML's CompiledMLModel.predict on the Neural "
                      "Engine, MLComputePlan, proc_pid_rusage); run `hetero doctor --json` there")
    if not forms["fp16"].get("available") or forms["fp16"]["lint_errors"]:
        return "fp16", "fp16 itself did not run here (it is still the form every macOS runs)"
    lut, blockwise = _qualifies("lut", forms), _qualifies("blockwise", forms)
    if blockwise is None and not found["identical_outputs"]:
        blockwise = "Core ML's shift-scale outputs differ from the tables' here: its decompression is not exact"
    if blockwise is None and lut is None:
        ratio = forms["blockwise"]["seconds_per_call"] / max(forms["lut"]["seconds_per_call"], 1e-12)
        if ratio > FASTER:
            blockwise = f"blockwise takes {ratio:.2f}x the tables' time per call (not below {FASTER})"
    if blockwise is None:
        return "blockwise", "on the Neural Engine, at least as fast as fp16 and the tables, smaller, exact"
    if lut is None:
        return "lut", f"on the Neural Engine, at least as fast as fp16, smaller in memory; not blockwise: {blockwise}"
    return "fp16", f"lut: {lut}; blockwise: {blockwise}"


def _line(found: dict) -> str:
    forms = found["forms"]
    lint = ", ".join(f"{f} {forms[f]['lint_errors']} lint errors" for f in FORMS if "lint_errors" in forms[f])
    same = {True: "; outputs identical", False: "; outputs DIFFERENT", None: ""}[found["identical_outputs"]]
    if found["recommended"] is None:
        return f"{found['program']}: {lint}; {found['why']}"
    mib = lambda b: "?" if b is None else f"{b / 2**20:.0f} MiB"  # noqa: E731
    times = ", ".join(f"{f} {forms[f]['seconds_per_call'] * 1e3:.3f} ms/call, +{mib(forms[f]['resident_bytes'])} "
                      f"(placement {forms[f]['placement']['status']})" for f in FORMS if "placement" in forms[f])
    return f"{found['program']}: {times}{same}; use --ane-weights {found['recommended']}: {found['why']}"


def split_forms(found: dict, form: str, programs) -> dict:
    """The split's own matrices (`programs`: the loaded `Programs`): per embedding, and how many have an exact
    shift-scale form; a recommendation of blockwise for a model none of whose matrices has one falls back to the
    tables (its programs would be the tables' anyway), and `found` says so."""
    forms, capable = dict(programs.weight_forms), programs.blockwise_capable
    quantized = forms.get("lut", 0) + forms.get("blockwise", 0)
    if found["recommended"] == "blockwise" and capable == 0:
        lut = _qualifies("lut", found["forms"])
        found["recommended"] = "lut" if lut is None else "fp16"
        found["why"] = ("no quantized matrix of this model's split has an exact shift-scale form: its blockwise "
                        "programs would be the tables" + ("" if lut is None else f", and lut: {lut}"))
        found["line"] = _line(found)
    embedded = ", ".join(f"{n} {kind}" for kind, n in sorted(forms.items())) or "no"
    return {"form": programs.weights, "asked": form, "matrices": forms, "blockwise_capable": capable,
            "quantized": quantized,
            "line": f"{embedded} matrices; {capable} of the {quantized} quantized ones have an exact shift-scale "
                    "form (what --ane-weights blockwise embeds as shift-scale)"}
