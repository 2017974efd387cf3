"""The two exact weight forms of `--ane-weights`: per-group lookup tables (`constexpr_lut_to_dense`) and
`constexpr_blockwise_shift_scale` for every matrix whose every group has an exact scale and offset.

The oracle is MLX: `mx.dequantize` of the same packed weights, scales and biases in fp32, rounded once to fp16
(`mlx_fp16`). Exactness is checked bit for bit (signed zeros included) on what the reference executor expands
from the saved packages, and the two forms' programs must give the same outputs bit for bit there. The doctor's
choice between the forms is tested with the real Core ML call injected (see `core_ml_load`); here it must say
that the timing needs a Mac."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import hetero
from hetero.checkpoint.loader import load_model
from hetero.cli.doctor_weights import FASTER, compare_forms, split_forms
from hetero.cli.main import main
from hetero.cli.quantize import quantize_checkpoint
from hetero.coreml.backends.coreml_macos import PlacementStatus, placement_report, OpDevice
from hetero.coreml.backends.reference_executor import ReferenceExecutor
from hetero.coreml.export import blockwise_capable, export_coreml, lint_export, palettize
from hetero.coreml.graphs.lint import lint_package
from hetero.coreml.graphs.mlp import MLPShape, MLPWeights, build_mlp
from hetero.coreml.graphs.ops import weight_form
from hetero.coreml.graphs.package import load_program, save_program
from hetero.coreml.graphs.palette import shift_scale_dense
from hetero.coreml.manifest import read_manifest
from hetero.errors import HeteroError
from hetero.pipeline import Programs, configure, ensure_export
from hetero.pipeline.run import export_key
from hetero.planner import context_bucket
from tests.test_coreml_graphs import save_checkpoint, tiny_model
from tests.test_quantized_export import mlx_fp16, same_bits

SMALL = dict(hidden=64, channels=128, chunk=64, bits=4, group=64)  # the doctor's program, smaller: seconds


def _quantized(rows: int, cols: int, bits: int, group: int, store, seed: int = 0) -> nn.QuantizedLinear:
    """A layer quantized by MLX's own quantizer (`mx.quantize`) from N(0, 0.02) weights, scales and biases stored in
    `store`."""
    rng = np.random.default_rng(seed)
    layer = nn.QuantizedLinear(cols, rows, bias=False, group_size=group, bits=bits)
    wq, s, b = mx.quantize(mx.array(rng.normal(0, 0.02, (rows, cols)).astype(np.float32)), group_size=group, bits=bits)
    layer.weight, layer.scales, layer.biases = wq, s.astype(store), b.astype(store)
    return layer


def _palettized(layer: nn.QuantizedLinear):
    return palettize(layer.weight, layer.scales, layer.biases, layer.bits, layer.group_size).with_affine()


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("store", [mx.bfloat16, mx.float16, mx.float32])
def test_every_shift_scale_group_is_mlx_dequantize_bit_for_bit(bits, store):
    """Each group given a (scale, offset) reproduces MLX's dequantized weights of that group exactly, a negative
    scale's zero included (MLX gives +0; such groups are mirrored); under MLX's quantizer, scales stored in bf16 or
    fp16, most 3- and 4-bit groups and every 2-bit one have such a form (fp32 scales: none, not being fp16
    numbers), and a matrix takes it only where all of its groups do."""
    layer = _quantized(64, 512, bits, 64, store, seed=bits)
    p, want = _palettized(layer), mlx_fp16(layer)
    exact = np.isfinite(p.affine[..., 0])  # [rows, groups]
    scale, offset, mirrored = (p.affine[..., i].astype(np.float32) for i in range(3))
    q = p.indices.reshape(64, 8, 64).astype(np.float32)  # [rows, groups, group]
    data = np.where(mirrored[..., None] != 0, 2**bits - 1 - q, q)
    got = ((data - offset[..., None]) * scale[..., None]).astype(np.float16)  # one rounding of an exact product
    assert same_bits(got[exact], want.reshape(64, 8, 64)[exact])
    share = exact.mean()
    if store == mx.float32:  # MLX's fp32 scales are not fp16 numbers: no group has the form
        assert share == 0
        return
    assert (mirrored[exact] != 0).any() and (want == 0).any() and not np.signbit(want[want == 0]).any()
    assert share == 1.0 if bits == 2 else 0.5 < share < 1.0, share
    assert (p.shift_scale() is not None) == bool(exact.all())
    raw = palettize(layer.weight, layer.scales, layer.biases, bits, 64)  # as exported: the form made on demand
    assert raw.affine is None and raw.may_shift_scale() == bool(exact.all())
    assert blockwise_capable(MLPWeights(raw, raw, raw)) == (3 if exact.all() else 0)
    if exact.all():
        data, s, o = p.shift_scale()
        assert same_bits(shift_scale_dense(data, s, o), want)


def _exact_layer(rows: int, cols: int, store, seed: int = 0) -> nn.QuantizedLinear:
    """An MLX 2-bit layer (every group of MLX's 2-bit quantizer has an exact shift-scale form)."""
    return _quantized(rows, cols, 2, 32, store, seed=seed)


def test_a_blockwise_program_expands_to_mlx_weights_and_runs_as_the_tables_do(tmp_path):
    """An MLP program whose gate and up take shift-scale (2-bit, every group exact) while down keeps its tables
    (4-bit, some groups inexact): the reference executor expands every weight to MLX's bit for bit, with
    coremltools' own numpy semantics of the op, and the program's output equals the all-tables program's bit for
    bit; both pass the lint, and the package holds the shift-scale bytes."""
    h, c = 128, 256
    gate, up = (_exact_layer(c, h, mx.bfloat16, seed) for seed in range(2))
    down = _quantized(h, c, 4, 64, mx.float16, seed=7)
    w = MLPWeights(*(_palettized(x) for x in (gate, up, down)))
    assert [weight_form(x) for x in (w.gate, w.up, w.down)] == ["blockwise", "blockwise", "lut"]
    tables = MLPWeights(*(x.without_affine() for x in (w.gate, w.up, w.down)))
    paths = {"blockwise": save_program(build_mlp(MLPShape(h, c, 64), w), tmp_path / "b.mlpackage"),
             "lut": save_program(build_mlp(MLPShape(h, c, 64), tables), tmp_path / "l.mlpackage")}
    ops = {f: {op.op_type for op in load_program(p).functions["main"].operations} for f, p in paths.items()}
    assert {"constexpr_blockwise_shift_scale", "constexpr_lut_to_dense"} <= ops["blockwise"]
    assert "constexpr_blockwise_shift_scale" not in ops["lut"]
    ex = {f: ReferenceExecutor(p) for f, p in paths.items()}
    for name, layer in (("gate_proj_0_weight", gate), ("up_proj_0_weight", up), ("down_proj_0_weight", down)):
        for f in paths:
            assert same_bits(ex[f].weights()[name][:, :, 0, 0], mlx_fp16(layer)), (f, name)
    x = np.random.default_rng(0).standard_normal((1, h, 1, 64)).astype(np.float32) * 3
    assert np.array_equal(ex["blockwise"]({"x": x})["out"], ex["lut"]({"x": x})["out"])
    for p in paths.values():
        report = lint_package(p)
        assert not report.findings, report.lines()
    blob = paths["blockwise"] / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
    expected = w.gate.shift_scale_nbytes() + w.up.shift_scale_nbytes() + w.down.nbytes
    assert expected <= blob.stat().st_size < expected + 65536


def test_the_lint_still_counts_shift_scale_weights_against_the_budget(tmp_path):
    """The weights rule sees a shift-scale matrix at its stored size (uint4 data, fp16 scale and offset)."""
    w = MLPWeights(*(_palettized(_exact_layer(r, k, mx.float16, seed)) for seed, (r, k) in
                     enumerate([(256, 128), (256, 128), (128, 256)])))
    path = save_program(build_mlp(MLPShape(128, 256, 64), w), tmp_path / "b.mlpackage")
    stored = sum(x.shift_scale_nbytes() for x in (w.gate, w.up, w.down))
    assert "weights" in lint_package(path, weight_budget=stored - 1).rules("error")
    assert not lint_package(path, weight_budget=stored).errors


@pytest.fixture(scope="module")
def q2(tmp_path_factory) -> Path:
    """`hetero convert --quantize 2` of a tiny bf16 checkpoint (scales and biases stored in bf16, as the source):
    every quantized matrix has an exact shift-scale form."""
    tmp = tmp_path_factory.mktemp("q2")
    model = tiny_model(5)
    model.set_dtype(mx.bfloat16)
    return quantize_checkpoint(str(save_checkpoint(model, tmp / "bf16")), tmp / "q2", bits=2, group_size=32)


def test_the_split_in_either_form_has_its_own_export_with_the_same_weights_and_outputs(q2):
    """`--ane-weights` reaches the split's export cache: each form is exported into its own directory whose
    manifest records it (and how many matrices took shift-scale), no package key is shared, every program expands to
    the same weights bit for bit and gives the same outputs through the reference executor, both pass the lint, and
    the split prefill of the same prompt gives the same hidden state and caches bit for bit."""
    import types

    model, path, config = load_model(str(q2), dtype=mx.float32)
    engine = types.SimpleNamespace(model=model, config=config, path=path, name=str(path), identity="forms@test")
    ids = np.random.default_rng(1).integers(0, 256, 60).tolist()  # one chunk of 64: one context bucket
    found, manifests, dirs = {}, {}, {}
    for form in ("lut", "blockwise"):
        run = configure(engine, 0.5, 64, offload=("attention", "mlp"), lane="thread", weights=form)
        split = run.splitter(len(ids))
        assert split.programs.weights == form and run.ane_block()["weights"] == form
        res = split.run(ids, cache := model.make_cache())
        found[form] = [np.array(res.hidden)] + [np.array(a) for c in cache for a in c.state]
        dirs[form] = ensure_export((model, path, config), export_key(engine), run.plan, context_bucket(60, 64), form)
        manifests[form] = read_manifest(dirs[form])
    assert all(np.array_equal(a, b) for a, b in zip(found["lut"], found["blockwise"]))
    assert dirs["lut"] != dirs["blockwise"] and dirs["blockwise"].name.endswith("_wblockwise")
    assert manifests["lut"]["ane_weights"] == "lut" and manifests["blockwise"]["ane_weights"] == "blockwise"
    pairs = list(zip(manifests["lut"]["programs"], manifests["blockwise"]["programs"]))
    assert {a["piece"] for a, _ in pairs} == {"attention", "mlp"}
    assert all(a["file"] == b["file"] and a["key"] != b["key"] for a, b in pairs)
    assert all(set(b["weight_forms"]) == {"blockwise"} and set(a["weight_forms"]) == {"lut"} for a, b in pairs)
    assert all(a["blockwise_capable"] == b["blockwise_capable"] == b["weight_forms"]["blockwise"] for a, b in pairs)
    rng = np.random.default_rng(0)
    for a, _ in pairs:
        ex = {f: ReferenceExecutor(d / a["file"], a.get("function")) for f, d in dirs.items()}
        wl, wb = ex["lut"].weights(), ex["blockwise"].weights()
        assert sorted(wl) == sorted(wb) and all(same_bits(wl[k], wb[k]) for k in wl), a["file"]
        feed = {k: rng.standard_normal(v).astype(np.float32) for k, v in ex["lut"].input_shapes.items()}
        got = {f: e(feed) for f, e in ex.items()}
        assert all(np.array_equal(got["lut"][k], got["blockwise"][k]) for k in got["lut"]), a["file"]
    for d in dirs.values():
        assert not any(r.errors for r in lint_export(d))


def test_a_bad_weight_form_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["convert", "--coreml", "--ane-fraction", "0.5", "--ane-weights", "int4", "--out", "x"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--ane-weights" in err and "lut" in err
    with pytest.raises(HeteroError, match="--ane-weights 'int4'"):
        export_coreml(None, "unused", 0.5, form="int4")  # before the model loads
    with pytest.raises(HeteroError, match="--ane-weights 'int4'"):
        hetero.prefill(None, [1, 2, 3], ane_fraction=0.5, ane_weights="int4")


# ----------------------------------------------------------------------------------------------------------
# The doctor's choice. The real call is `coreml_macos.load(path, report=False)`: Core ML compiles the package and
# `CompiledMLModel(..., compute_units=CPU_AND_NE).predict` runs it; `placement_status()` queries `MLComputePlan`.
# Injected here: the reference executor stands for predict, a `Placement` for the compute plan's answer, and a
# scripted timer for the clock.


def core_ml_load(placement: dict[str, str], corrupt: str | None = None):
    """A loader standing for `coreml_macos.load`: each program runs through the reference executor (for
    `CompiledMLModel.predict`), reports the placement `placement[form]` (`full` or `partial`, for
    `MLComputePlan`), and the form `corrupt` returns one output value off by one fp16 step."""

    class Program:
        def __init__(self, path: Path):
            self.form = "blockwise" if "blockwise" in path.name else "lut"
            self.run = ReferenceExecutor(path)

        def __call__(self, inputs):
            out = self.run(inputs)
            if self.form == corrupt:
                out["out"].reshape(-1)[0] = np.nextafter(np.float16(out["out"].reshape(-1)[0]), np.float16(1e4))
            return out

        def placement_status(self):
            ops = [OpDevice("conv", "ane"), OpDevice("mul", "ane")]
            if placement[self.form] == "partial":
                ops.append(OpDevice("silu", "cpu", ("cpu", "ane"), 0.1))
            return PlacementStatus(self.form, "placed", placement_report(self.form, ops))

    return Program


def scripted(seconds: dict[str, float]):
    """A `Timer` whose answer is the seconds per call given for the form it times (the call still runs once)."""
    def timer(what: str, fn, repeats: int) -> float:
        fn()
        return seconds[what.split()[-1]]
    return timer


FULL = {"lut": "full", "blockwise": "full"}


def test_the_doctor_recommends_blockwise_when_it_is_faster_exact_and_on_the_ane():
    found = compare_forms(core_ml_load(FULL), scripted({"lut": 1.0, "blockwise": 0.8}), shape=SMALL)
    assert found["recommended"] == "blockwise" and found["identical_outputs"] and found["timed_on"] == "core ml"
    assert found["forms"]["blockwise"]["seconds_per_call"] == 0.8 and found["forms"]["lut"]["placement"]["ok"]
    assert "--ane-weights blockwise" in found["line"]
    json.dumps(found)  # part of `hetero doctor --json`


def test_the_doctor_keeps_the_tables_when_blockwise_is_slower_off_the_ane_or_inexact():
    slower = compare_forms(core_ml_load(FULL), scripted({"lut": 1.0, "blockwise": FASTER + 0.01}), shape=SMALL)
    assert slower["recommended"] == "lut" and "not below" in slower["why"]
    partial = compare_forms(core_ml_load({"lut": "full", "blockwise": "partial"}),
                            scripted({"lut": 1.0, "blockwise": 0.5}), shape=SMALL)
    assert partial["recommended"] == "lut" and "Neural Engine" in partial["why"]
    assert partial["forms"]["blockwise"]["placement"]["verdict"] == "partial"
    inexact = compare_forms(core_ml_load(FULL, corrupt="blockwise"), scripted({"lut": 1.0, "blockwise": 0.5}),
                            shape=SMALL)
    assert inexact["recommended"] == "lut" and not inexact["identical_outputs"] and "not exact" in inexact["why"]
    lut_off = compare_forms(core_ml_load({"lut": "partial", "blockwise": "full"}),
                            scripted({"lut": 1.0, "blockwise": 2.0}), shape=SMALL)
    assert lut_off["recommended"] == "blockwise"


def test_blockwise_is_not_recommended_for_a_model_whose_matrices_have_no_exact_form():
    """A 4-bit model under MLX's quantizer: no whole matrix has a shift-scale form, so both forms are its tables."""
    found = compare_forms(core_ml_load(FULL), scripted({"lut": 1.0, "blockwise": 0.5}), shape=SMALL)
    assert found["recommended"] == "blockwise"
    programs = Programs(64, weights="lut", weight_forms={"lut": 12, "fp16": 2}, blockwise_capable=0)
    split = split_forms(found, "lut", programs)
    assert found["recommended"] == "lut" and "no quantized matrix" in found["why"]
    assert "--ane-weights lut" in found["line"]
    assert split["quantized"] == 12 and split["blockwise_capable"] == 0 and "0 of the 12" in split["line"]


def test_off_a_mac_the_doctor_checks_both_forms_and_says_the_timing_needs_one():
    found = compare_forms(None, shape=SMALL)
    assert found["recommended"] is None and found["timed_on"] is None and found["identical_outputs"]
    assert all(f["lint_errors"] == 0 and "seconds_per_call" not in f for f in found["forms"].values())
    assert "need a Mac" in found["line"] and "hetero doctor --json" in found["line"]
    assert found["forms"]["blockwise"]["package_bytes"] < found["forms"]["lut"]["package_bytes"]
