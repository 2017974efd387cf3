"""`hetero doctor`'s choice between the two exact weight forms of `--ane-weights` on the Mac it runs on.

Both forms hold MLX's 4-bit weights bit for bit (`hetero.coreml.graphs.palette`): `lut`, a lookup table per row and group
(`constexpr_lut_to_dense`), and `blockwise`, `constexpr_blockwise_shift_scale` where every group of a matrix has an
exact scale and offset. Which one the Neural Engine runs faster, whether Core ML keeps both on it, and whether its
shift-scale decompression really gives the tables' weights are facts of a Mac, not of the export. So the doctor
builds one MLP program whose every group has an exact shift-scale form, saves it in each form, lints both, runs both
on the same input and, where Core ML runs (`load` given: `coreml_macos.load`, i.e. `CompiledMLModel(...).predict`
with CPU_AND_NE and `MLComputePlan` for the placement), times and places them and recommends one:

- `blockwise` only when its outputs equal the tables' bit for bit on this Mac, Core ML places it wholly on the
  Neural Engine (or cannot say), and it is at least `FASTER` of the tables' time per call faster;
- `lut` otherwise (the default: a gather, no decompression arithmetic to trust).

Off a Mac the two forms still pass the lint and the reference executor here, and the doctor says plainly that the
timing needs a Mac.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hetero.cli.measure import Timer, timed
from hetero.errors import HeteroError

FORMS = ("lut", "blockwise")
FASTER = 0.95  # blockwise is recommended when its time per call is at most this share of the tables'
SHAPE = dict(hidden=512, channels=1024, chunk=256, bits=4, group=64)  # an MLP slice of a small model


def exact_weights(rows: int, cols: int, bits: int, group: int, rng: np.random.Generator):
    """A `Palettized` [rows, cols] matrix as MLX quantizes it (packed indices, fp16 scales and biases, tables from
    `mx.dequantize`) whose every group has an exact shift-scale form: bias = -2^(bits-1) * scale (a power-of-two
    offset), the scale's sign random (negative ones take the mirrored form)."""
    import mlx.core as mx

    from hetero.coreml.export import palettize
    from hetero.coreml.graphs.palette import pack

    indices = rng.integers(0, 2**bits, (rows, cols), dtype=np.uint8)
    magnitude = 2 / (2**bits - 1) / np.sqrt(cols) * rng.uniform(0.5, 1.5, (rows, cols // group))
    scales = (magnitude * rng.choice([-1.0, 1.0], magnitude.shape)).astype(np.float16)  # [rows, groups]
    biases = (-(2.0 ** (bits - 1)) * scales.astype(np.float32)).astype(np.float16)  # exact: a power of two times
    w = palettize(mx.array(pack(indices, bits)), mx.array(scales), mx.array(biases), bits, group).with_affine()
    if w.shift_scale() is None:
        raise HeteroError("internal: the doctor's weights have no exact shift-scale form")
    return w


def save_forms(folder: Path, shape: dict = SHAPE, seed: int = 0) -> dict[str, Path]:
    """One MLP program (`shape`) saved in each weight form, the same weights: form -> package."""
    from hetero.coreml.graphs.mlp import MLPShape, MLPWeights, build_mlp
    from hetero.coreml.graphs.package import save_program

    rng = np.random.default_rng(seed)
    h, c, bits, g = shape["hidden"], shape["channels"], shape["bits"], shape["group"]
    blockwise = MLPWeights(*(exact_weights(r, k, bits, g, rng) for r, k in ((c, h), (c, h), (h, c))))
    lut = MLPWeights(*(w.without_affine() for w in (blockwise.gate, blockwise.up, blockwise.down)))
    built = MLPShape(h, c, shape["chunk"])
    return {form: save_program(build_mlp(built, w), folder / f"doctor_mlp_{form}.mlpackage")
            for form, w in (("lut", lut), ("blockwise", blockwise))}


def compare_forms(load: Callable[[Path], Callable] | None, timer: Timer = timed, repeats: int = 5,
                  shape: dict = SHAPE) -> dict:
    """Both weight forms of one program: lint, outputs on the same input (from `load`'s programs, else the
    reference executor's), and where `load` is given (the real call on a Mac: `coreml_macos.load`), each form's
    median seconds per call (`timer`, after a warm-up) and Core ML's placement (the program's `placement_status()`),
    with the recommended form. Off a Mac (`load` None) `recommended` is None and `line` says the timing needs one."""
    from hetero.coreml.backends.reference_executor import ReferenceExecutor
    from hetero.coreml.graphs.lint import lint_package

    rng = np.random.default_rng(1)
    feed = {"x": rng.standard_normal((1, shape["hidden"], 1, shape["chunk"])).astype(np.float16)}
    found: dict = {"program": f"MLP {shape['hidden']}x{shape['channels']}, {shape['bits']}-bit group "
                              f"{shape['group']}, chunk {shape['chunk']}", "forms": {}}
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for form, path in save_forms(Path(tmp), shape).items():
            lint = lint_package(path)
            entry = {"lint_errors": len(lint.errors), "lint_warnings": len(lint.warnings),
                     "package_bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file())}
            program = load(path) if load is not None else ReferenceExecutor(path)
            outputs[form] = {k: np.asarray(v, np.float32) for k, v in program(feed).items()}
            if load is not None:
                entry["seconds_per_call"] = timer(f"weights {form}", lambda: program(feed), repeats)
                status = getattr(program, "placement_status", None)
                entry["placement"] = status().to_dict() if status is not None else {
                    "status": "unavailable", "line": "no compute plan for this program"}
            found["forms"][form] = entry
    found["identical_outputs"] = all(
        np.array_equal(outputs["lut"][k].view(np.uint32), outputs["blockwise"][k].view(np.uint32))
        for k in outputs["lut"])
    found["timed_on"] = "core ml" if load is not None else None
    found["recommended"], found["why"] = _recommend(found)
    found["line"] = _line(found)
    return found


def _recommend(found: dict) -> tuple[str | None, str]:
    forms = found["forms"]
    if found["timed_on"] is None:
        return None, ("timing and placement need a Mac (Core ML's CompiledMLModel.predict on the Neural Engine, "
                      "MLComputePlan); run `hetero doctor --json` there. The default, lut, stays")
    lut, blockwise = forms["lut"], forms["blockwise"]
    if blockwise["lint_errors"]:
        return "lut", "the blockwise program fails the ANE lint"
    if not found["identical_outputs"]:
        return "lut", "Core ML's shift-scale outputs differ from the tables' here: its decompression is not exact"
    if blockwise["placement"].get("ok") is False:
        return "lut", ("Core ML does not keep the blockwise program on the Neural Engine "
                       f"({blockwise['placement']['line']})")
    if lut["placement"].get("ok") is False:
        return "blockwise", ("Core ML does not keep the tables' program on the Neural Engine "
                             f"({lut['placement']['line']})")
    ratio = blockwise["seconds_per_call"] / max(lut["seconds_per_call"], 1e-12)
    if ratio <= FASTER:
        return "blockwise", f"blockwise takes {ratio:.2f}x the tables' time per call, with the same outputs"
    return "lut", f"blockwise takes {ratio:.2f}x the tables' time per call (not below {FASTER})"


def _line(found: dict) -> str:
    forms = found["forms"]
    lint = ", ".join(f"{f} {forms[f]['lint_errors']} lint errors" for f in FORMS)
    same = "identical" if found["identical_outputs"] else "DIFFERENT"
    if found["recommended"] is None:
        return f"{found['program']}: {lint}, outputs {same} (reference executor); {found['why']}"
    times = ", ".join(f"{f} {forms[f]['seconds_per_call'] * 1e3:.3f} ms/call "
                      f"(placement {forms[f]['placement']['status']})" for f in FORMS)
    return f"{found['program']}: {times}; outputs {same}; use --ane-weights {found['recommended']}: {found['why']}"


def split_forms(found: dict, form: str, programs) -> dict:
    """The split's own matrices (`programs`: the loaded `Programs`): per embedding, and how many have an exact
    shift-scale form; a recommendation of blockwise for a model none of whose matrices has one falls back to lut
    (its programs would be the tables' anyway), and `found` says so."""
    forms, capable = dict(programs.weight_forms), programs.blockwise_capable
    quantized = forms.get("lut", 0) + forms.get("blockwise", 0)
    if found["recommended"] == "blockwise" and capable == 0:
        found["recommended"] = "lut"
        found["why"] = "no quantized matrix of this model's split has an exact shift-scale form: both forms are tables"
        found["line"] = _line(found)
    embedded = ", ".join(f"{n} {kind}" for kind, n in sorted(forms.items())) or "no"
    return {"form": form, "matrices": forms, "blockwise_capable": capable, "quantized": quantized,
            "line": f"{embedded} matrices; {capable} of the {quantized} quantized ones have an exact shift-scale "
                    "form (what --ane-weights blockwise embeds as shift-scale)"}
