"""The Core ML backend's logic off a Mac: fp32 inputs held until Core ML lets go of them, compilation keyed by the
package's content with an atomic replace, compiled folders removed with their package, context buckets sharing
their weights in one multifunction package, and the placement report. Each test names the real macOS call that
the injected function stands for; nothing else is replaced."""

from __future__ import annotations

import gc
import json
import shutil
import sys
import tempfile
import types
import weakref
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetero.coreml.backends.compiled import (
    compile_package,
    compiled_owner,
    compiled_path,
    package_digest,
    remove_compiled,
)
from hetero.coreml.backends.coreml_macos import (
    CoreML,
    InputHold,
    ProgramRunner,
    _refcount,
    available,
    declared_inputs,
    default_function,
    macos_version,
    multifunction_packages,
)
from hetero.coreml.backends.placement import (
    OFF_ANE_BUDGET,
    OpDevice,
    PlacementStatus,
    check_placement,
    device_kind,
    placement_report,
    placement_status,
)
from hetero.coreml.target import MACOS14, MACOS15, target_for
from hetero.coreml.backends.reference_executor import ReferenceExecutor
from hetero.coreml.export import export_coreml, lint_export
from hetero.errors import HeteroError
from test_coreml_graphs import save_checkpoint, tiny_model

SHAPES = {"x": (1, 8, 1, 64), "mask": (1, 1, 64, 64)}


class CoreMLStandIn:
    """Stands for `CompiledMLModel.predict` (coremltools `Model::predict`): it keeps a reference to every input
    array it is given, as the binding's `PybindCompatibleArray` does while Core ML's MLE5 engine keeps its input
    ports bound, until `release()` (Core ML's `resetAfterLingering`, about a second later on its own queue), and
    returns fp32 outputs, as the binding widens Core ML's fp16 ones."""

    def __init__(self):
        self.bound: list[np.ndarray] = []
        self.seen: list[dict] = []

    def __call__(self, feed: dict) -> dict:
        self.seen.append({k: (v.dtype, v.flags.c_contiguous, v.shape) for k, v in feed.items()})
        self.bound.extend(feed.values())
        return {"out": np.asarray(feed["x"], np.float32) * 2}

    def release(self) -> None:
        self.bound.clear()


# ----------------------------------------------------------------------------------------------------------
# Inputs: fp32, fresh, held until released


def inputs(seed: int = 0, dtype=np.float16) -> dict:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()}


def test_inputs_reach_predict_as_fresh_c_contiguous_fp32_copies():
    core = CoreMLStandIn()
    run = ProgramRunner("p", core, SHAPES)
    given = inputs()
    given["x"] = np.asfortranarray(given["x"])
    out = run(given)
    assert core.seen == [{k: (np.dtype(np.float32), True, s) for k, s in SHAPES.items()}]
    assert all(a is not given[k] for k, a in zip(SHAPES, core.bound))  # never the caller's array
    assert np.array_equal(core.bound[0], given["x"].astype(np.float32))  # fp16 -> fp32 exact
    assert out["out"].dtype == np.float32 and np.array_equal(out["out"], given["x"].astype(np.float32) * 2)
    already = inputs(1, np.float32)
    run(already)
    assert core.bound[2] is not already["x"]  # an fp32 input is copied too: the caller may reuse or free its own


def test_bad_inputs_are_one_line_errors():
    run = ProgramRunner("layer03_attention_part0.mlpackage:ctx512", CoreMLStandIn(), SHAPES)
    with pytest.raises(HeteroError, match=r"missing inputs \['mask'\]"):
        run({"x": np.zeros(SHAPES["x"])})
    with pytest.raises(HeteroError, match=r"ctx512: input x has shape \(1, 8, 1, 32\)"):
        run({"x": np.zeros((1, 8, 1, 32)), "mask": np.zeros(SHAPES["mask"])})


def test_refcount_reads_the_object_header_without_a_reference():
    a = np.zeros(3)
    held = [a, a]
    assert _refcount(id(a)) == sys.getrefcount(a) - 1  # getrefcount's own argument is one more
    del held
    assert _refcount(id(a)) == sys.getrefcount(a) - 1


def test_inputs_live_until_core_ml_releases_them_and_are_freed_on_the_callers_side():
    """While the stand-in for Core ML's bound input ports holds the arrays, the hold keeps its own reference (so
    Core ML's release, off-thread on a Mac, is never the last one); once released, the next call frees them."""
    core = CoreMLStandIn()
    run = ProgramRunner("p", core, SHAPES)
    run(inputs())
    first = [weakref.ref(a) for a in core.bound]
    assert len(run.hold.calls) == 1 and run.hold.nbytes == sum(int(np.prod(s)) * 4 for s in SHAPES.values())
    run(inputs(1))  # Core ML still holds the first call's arrays: nothing may be dropped
    assert len(run.hold.calls) == 2 and all(r() is not None for r in first)
    core.release()  # Core ML's queue drops its references: not the last ones, so nothing is freed there
    assert all(r() is not None for r in first)
    run(inputs(2))  # the sweep sees both earlier calls back at the hold's own reference and frees them here
    gc.collect()
    assert all(r() is None for r in first) and len(run.hold.calls) == 1


def test_a_call_is_kept_while_any_one_of_its_arrays_is_still_bound():
    hold = InputHold()
    a, b = np.zeros(4), np.ones(4)
    hold.keep([a, b])
    bound = b  # Core ML still holds one of the two
    del a, b
    assert hold.sweep() == 0 and len(hold.calls) == 1
    del bound
    assert hold.sweep() == 1 and hold.calls == []


class ReleasesAtOnce(CoreMLStandIn):
    """`CompiledMLModel.predict` where Core ML unbinds its input ports before the call returns."""

    def __call__(self, feed: dict) -> dict:
        out = super().__call__(feed)
        self.release()
        return out


def test_a_jobs_inputs_go_when_it_returns():
    """Inputs Core ML has let go of are freed as the job returns, not kept until the program's next call."""
    run = ProgramRunner("p", ReleasesAtOnce(), SHAPES)
    given = inputs()
    run(given)
    assert run.hold.calls == [] and run.hold.nbytes == 0


def test_programs_sharing_a_hold_free_each_others_released_inputs():
    """The worker's programs share one hold (`PROCESS_HOLD`): program A's inputs, released by Core ML after A's job,
    go at program B's job, not at A's next call (which may never come: one program per layer and piece)."""
    hold, core_a = InputHold(), CoreMLStandIn()
    a = ProgramRunner("a", core_a, SHAPES, hold)
    b = ProgramRunner("b", ReleasesAtOnce(), SHAPES, hold)
    a(inputs())
    first = [weakref.ref(x) for x in core_a.bound]
    assert len(hold.calls) == 1  # still bound by Core ML
    core_a.release()
    b(inputs(1))
    gc.collect()
    assert all(r() is None for r in first) and hold.calls == []


# ----------------------------------------------------------------------------------------------------------
# What a Mac's OS and coremltools install allow


def test_coremltools_without_its_native_library_is_not_available():
    """`import coremltools` works here, but this coremltools has no `coremltools.libcoremlpython` (as where pip fell
    back to the sdist): on macOS that would fail every compile and prediction, so the lane is not available.
    `CoreML.native` stands for the real import of `coremltools.libcoremlpython`; `system` for `platform.system()`."""
    darwin = lambda: "Darwin"  # noqa: E731  platform.system() on a Mac
    ok, why = available(CoreML(system=darwin))  # the real import of the native library, which this install lacks
    assert not ok and "no native library" in why and "libcoremlpython" in why
    assert available(CoreML(system=darwin, native=lambda: None)) == (True, "")  # a Mac with coremltools' wheel
    ok, why = available(CoreML(system=lambda: "Linux", native=lambda: None))
    assert not ok and "only on macOS" in why


def test_multifunction_packages_from_macos_15_only():
    """`mac_ver` stands for `platform.mac_ver()[0]`. Multifunction packages are written at the macOS 15 spec and the
    binding refuses a function name before it."""
    mac = lambda v: CoreML(system=lambda: "Darwin", mac_ver=lambda: v)  # noqa: E731
    assert macos_version(mac("14.6.1")) == (14, 6, 1) and macos_version(mac("15.0")) == (15, 0)
    assert macos_version(CoreML(system=lambda: "Linux", mac_ver=lambda: "")) is None  # not a Mac
    assert not multifunction_packages((14, 6, 1)) and target_for((14, 6, 1)) is MACOS14
    assert multifunction_packages((15, 0)) and multifunction_packages((26, 1)) and multifunction_packages(None)
    assert target_for((26, 1)) is target_for(None) is MACOS15
    with pytest.raises(HeteroError, match="needs macOS 14 or later"):
        target_for((13, 7))


def test_macos_14_gets_one_single_function_package_per_bucket(checkpoint, tmp_path):
    """The export for a macOS 14 Mac: each attention bucket its own single-function package (no function name to
    pass the binding), computing exactly what the macOS 15 package's function for that bucket computes."""
    contexts = [64, 128, 256]
    single = export_coreml(checkpoint, tmp_path / "m14", 0.5, chunk=64, contexts=contexts, target=target_for((14, 6)))
    multi = export_coreml(checkpoint, tmp_path / "m15", 0.5, chunk=64, contexts=contexts, target=target_for((15, 0)))
    attn = [p for p in single["programs"] if p["piece"] == "attention" and p["layer"] == 1]
    assert [(p["file"], p["context"]) for p in attn] == [
        (f"layer01_attention_part0_ctx{c}.mlpackage", c) for c in contexts]
    assert all("function" not in p for p in single["programs"])
    assert all(default_function(tmp_path / "m14" / p["file"]) is None for p in attn)
    by_ctx = {p["context"]: p for p in multi["programs"] if p["piece"] == "attention" and p["layer"] == 1}
    rng = np.random.default_rng(0)
    for p in attn:
        x = {k: rng.standard_normal(v).astype(np.float16) for k, v in p["inputs"].items()}
        ours = ReferenceExecutor(tmp_path / "m14" / p["file"])(x)
        theirs = ReferenceExecutor(tmp_path / "m15" / by_ctx[p["context"]]["file"], by_ctx[p["context"]]["function"])(x)
        assert ours.keys() == theirs.keys()
        for k in ours:
            np.testing.assert_array_equal(ours[k], theirs[k])
    assert not any(r.errors for r in lint_export(tmp_path / "m14"))
    assert (single["target"], multi["target"]) == ("macos14-spec8", "macos15-spec9")


# ----------------------------------------------------------------------------------------------------------
# Compilation keyed by content, replaced atomically


def fake_package(path: Path, weights: bytes = b"w" * 64) -> Path:
    (path / "Data" / "com.apple.CoreML" / "weights").mkdir(parents=True)
    (path / "Manifest.json").write_text("{}")
    (path / "Data" / "com.apple.CoreML" / "model.mlmodel").write_bytes(b"spec")
    (path / "Data" / "com.apple.CoreML" / "weights" / "weight.bin").write_bytes(weights)
    return path


class CompilerStandIn:
    """Stands for `coremltools.models.utils.compile_model(src, dst)`: compiles (here: copies the weights and
    writes coremldata.bin) into a fresh folder, then `shutil.move`s it to `dst`, which nests it inside `dst` when
    `dst` already exists. `fail_after` raises once the build is half-moved (a crashed or killed compile)."""

    def __init__(self, fail_after: bool = False):
        self.calls, self.fail_after = [], fail_after

    def __call__(self, src: str, dst: str) -> str:
        self.calls.append((src, dst))
        build = Path(tempfile.mkdtemp()) / "compiled.mlmodelc"
        build.mkdir()
        (build / "weights.bin").write_bytes((Path(src) / "Data/com.apple.CoreML/weights/weight.bin").read_bytes())
        if self.fail_after:
            Path(dst).mkdir()
            (Path(dst) / "weights.bin").write_bytes(b"half")
            raise RuntimeError("compiler crashed")
        (build / "coremldata.bin").write_bytes(b"ok")
        shutil.move(str(build), dst)
        return dst


def test_compiles_into_a_folder_named_by_the_content_and_reuses_it(tmp_path):
    pkg = fake_package(tmp_path / "layer00_mlp_part0.mlpackage")
    compiler = CompilerStandIn()
    target = compile_package(pkg, compiler)
    assert target == compiled_path(pkg, package_digest(pkg)) and target.name.startswith("layer00_mlp_part0.")
    assert (target / "coremldata.bin").is_file() and len(compiler.calls) == 1
    assert compile_package(pkg, compiler) == target and len(compiler.calls) == 1  # same content: reused
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([pkg.name, target.name])  # no temporary left


def test_a_reexported_package_never_loads_the_old_build(tmp_path):
    """The old code's `compile_model(pkg, <stem>.mlmodelc)` with that folder present nested the new build inside
    it and loaded the old one; here a new content hash names a new folder, and the old builds are removed."""
    pkg = fake_package(tmp_path / "p.mlpackage", b"old weights")
    legacy = tmp_path / "p.mlmodelc"  # what an older hetero compiled beside the package
    legacy.mkdir()
    old = compile_package(pkg, CompilerStandIn())
    shutil.rmtree(pkg)
    fake_package(pkg, b"new weights")
    new = compile_package(pkg, CompilerStandIn())
    assert new != old and (new / "weights.bin").read_bytes() == b"new weights"
    assert not old.exists() and not legacy.exists()


def test_a_crashed_compile_leaves_nothing_a_later_run_would_load(tmp_path):
    pkg = fake_package(tmp_path / "p.mlpackage")
    with pytest.raises(RuntimeError, match="crashed"):
        compile_package(pkg, CompilerStandIn(fail_after=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.mlpackage"]  # the half-made build went with its temp
    killed = tmp_path / ".compiling-p.abc123"  # what a killed process leaves: never a name that is loaded
    (killed / "p.x.mlmodelc").mkdir(parents=True)
    target = compile_package(pkg, CompilerStandIn())
    assert (target / "coremldata.bin").read_bytes() == b"ok" and compiled_owner(killed.name) == "p"
    remove_compiled(pkg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.mlpackage"]


def test_a_compile_that_writes_nothing_is_an_error(tmp_path):
    pkg = fake_package(tmp_path / "p.mlpackage")
    with pytest.raises(HeteroError, match="coremldata.bin"):
        compile_package(pkg, lambda src, dst: Path(dst).mkdir())
    with pytest.raises(HeteroError, match="not an .mlpackage"):
        compile_package(tmp_path / "missing.mlpackage", CompilerStandIn())


def test_a_concurrent_compile_of_the_same_content_is_kept(tmp_path):
    pkg = fake_package(tmp_path / "p.mlpackage")
    target = compiled_path(pkg, package_digest(pkg))

    def racing(src: str, dst: str) -> str:  # another process's rename lands while this one compiles
        CompilerStandIn()(src, str(target))
        return CompilerStandIn()(src, dst)

    assert compile_package(pkg, racing) == target and (target / "coremldata.bin").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["p.mlpackage", target.name])


def test_the_digest_follows_every_file_of_the_package(tmp_path):
    a = fake_package(tmp_path / "a.mlpackage")
    b = fake_package(tmp_path / "b.mlpackage")
    assert package_digest(a) == package_digest(b)
    assert package_digest(fake_package(tmp_path / "c.mlpackage", b"w" * 63 + b"x")) != package_digest(a)
    first = package_digest(b)
    shutil.rmtree(b)  # as an export rewrites a package: removed, then saved anew
    fake_package(b, b"w" * 63)  # another size: same-size rewrites within a clock tick are the memo's blind spot
    assert package_digest(b) != first
    (b / "Data/com.apple.CoreML/extra.bin").write_bytes(b"")  # a new file, even an empty one, counts
    assert package_digest(b) != first and package_digest(a) == first


def test_compiled_folder_names_map_back_to_their_package():
    assert compiled_owner("layer03_attention_part0.0123456789abcdef.mlmodelc") == "layer03_attention_part0"
    assert compiled_owner("layer03_attention_part0.mlmodelc") == "layer03_attention_part0"  # an older hetero's
    assert compiled_owner(".compiling-layer03_attention_part0.k2j3h4") == "layer03_attention_part0"
    assert compiled_owner("layer03_attention_part0.mlpackage") is None and compiled_owner("manifest.json") is None


# ----------------------------------------------------------------------------------------------------------
# The export: buckets as functions of one package, compiled folders removed with their package


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tiny_model(5), tmp_path_factory.mktemp("tiny") / "ckpt")


def test_context_buckets_share_one_package_and_its_weights(checkpoint, tmp_path):
    single = export_coreml(checkpoint, tmp_path / "one", 0.5, chunk=64, contexts=[256])
    multi = export_coreml(checkpoint, tmp_path / "three", 0.5, chunk=64, contexts=[64, 128, 256])
    attn = [p for p in multi["programs"] if p["piece"] == "attention" and p["layer"] == 1]
    assert {p["file"] for p in attn} == {"layer01_attention_part0.mlpackage"}
    assert [(p["function"], p["context"]) for p in attn] == [("ctx64", 64), ("ctx128", 128), ("ctx256", 256)]
    assert [p["weight_bytes"] > 0 for p in attn] == [True, False, False]  # the later functions add none
    assert all("function" not in p for p in single["programs"])  # one bucket: a plain single-function package
    blob = lambda out, f: (out / f / "Data/com.apple.CoreML/weights/weight.bin").stat().st_size  # noqa: E731
    one = next(p["file"] for p in single["programs"] if p["piece"] == "attention" and p["layer"] == 1)
    assert blob(tmp_path / "three", attn[0]["file"]) <= blob(tmp_path / "one", one) + 4096  # stored once, not 3x
    assert declared_inputs(tmp_path / "three" / attn[0]["file"], "ctx128")["k_cache_0"] == tuple(
        attn[1]["inputs"]["k_cache_0"])
    with pytest.raises(HeteroError, match="no function 'ctx512'"):
        declared_inputs(tmp_path / "three" / attn[0]["file"], "ctx512")
    mlp = next(p["file"] for p in multi["programs"] if p["piece"] == "mlp")
    assert declared_inputs(tmp_path / "three" / mlp) == {"x": (1, 64, 1, 64)}
    assert default_function(tmp_path / "three" / attn[0]["file"]) == "ctx64"
    assert default_function(tmp_path / "three" / mlp) is None
    reports = lint_export(tmp_path / "three")
    assert len(reports) == len({p["file"] for p in multi["programs"]}) and not any(r.errors for r in reports)


def test_the_export_removes_compiled_folders_with_their_package(checkpoint, tmp_path):
    """Compiled folders as a Mac leaves them beside each package (`compile_package`): those of packages the new
    plan drops or rebuilds go, with any orphan an older hetero left; those of reused packages stay."""
    out = tmp_path / "export"
    first = export_coreml(checkpoint, out, 0.5, chunk=64, contexts=[128])
    for f in {p["file"] for p in first["programs"]}:
        compile_package(out / f, CompilerStandIn())
    (out / "layer09_mlp_part0.mlmodelc").mkdir()  # an older hetero's, its package long gone
    second = export_coreml(checkpoint, out, 0.5, chunk=64, contexts=[64, 128])  # attention becomes multifunction
    kept = {p["file"] for p in second["programs"] if p["reused"]}
    assert kept and {p["file"] for p in first["programs"] if p["piece"] == "attention"}.isdisjoint(
        p["file"] for p in second["programs"])
    owners = sorted(compiled_owner(e.name) for e in out.iterdir() if compiled_owner(e.name))
    assert owners == sorted(Path(f).stem for f in kept)
    json.loads((out / "manifest.json").read_text())  # written whole


def test_an_export_of_another_format_has_its_packages_and_builds_removed(checkpoint, tmp_path):
    out = tmp_path / "export"
    export_coreml(checkpoint, out, 0.5, chunk=64, contexts=[128])
    manifest = json.loads((out / "manifest.json").read_text())
    old = out / "layer01_attention_part0_ctx64.mlpackage"  # a package only the old-format manifest lists
    fake_package(old)
    compile_package(old, CompilerStandIn())
    manifest["format"] = 2
    manifest["programs"].append({**manifest["programs"][0], "file": old.name})
    (out / "manifest.json").write_text(json.dumps(manifest))
    again = export_coreml(checkpoint, out, 0.5, chunk=64, contexts=[128])
    assert not any(p["reused"] for p in again["programs"])  # another format: nothing trusted
    assert not old.exists() and not any(compiled_owner(e.name) == old.stem for e in out.iterdir())


# ----------------------------------------------------------------------------------------------------------
# Placement: what MLComputePlan says per op, made into a report


def ops(*placed: tuple) -> list[OpDevice]:
    return [OpDevice(*p) for p in placed]


def test_a_program_wholly_on_the_neural_engine():
    placed = placement_report("p", ops(("const", None), ("conv", "ane", ("ane", "cpu"), 0.7),
                                       ("softmax", "ane", ("ane",), 0.3)))
    assert (placed.neural_engine, placed.total, placed.verdict) == (2, 2, "full")  # const ops are never placed


def test_weight_expansion_ops_are_not_counted_as_a_fallback():
    """A quantized export's `constexpr_lut_to_dense` weights: Core ML expands them at load (MLComputePlan may list
    them on the CPU), so they say nothing about where the program's compute runs."""
    placed = placement_report("p", ops(("constexpr_lut_to_dense", "cpu"), ("conv", "ane", ("ane",), 1.0)))
    assert (placed.neural_engine, placed.total, placed.verdict) == (1, 1, "full")


def test_partial_cpu_fallback_is_flagged_with_the_ops_and_their_cost(capsys):
    """What `MLComputePlan.get_compute_device_usage_for_mlprogram_operation` (preferred and supported devices)
    and `get_estimated_cost_for_mlprogram_operation` would give for a program whose gather fell off the ANE."""
    placed = placement_report("layer03_attention_part0.mlpackage:ctx512", ops(
        ("conv", "ane", ("ane", "gpu", "cpu"), 0.6), ("gather", "cpu", ("cpu",), 0.1),
        ("gather", "cpu", ("cpu",), 0.1), ("matmul", "gpu", ("ane", "gpu"), 0.2)))
    assert placed.verdict == "partial" and (placed.neural_engine, placed.cpu, placed.gpu) == (1, 2, 1)
    assert placed.off_ane == {"gather on the CPU": 2, "matmul on the GPU": 1}
    assert placed.off_ane_cost == pytest.approx(0.4) and placed.could_be_on_ane == 1 and placed.ok is False
    check_placement(PlacementStatus(placed.program, "placed", placed))
    err = capsys.readouterr().err
    assert "partial CPU/GPU fallback" in err and "2 gather on the CPU, 1 matmul on the GPU" in err and "40.0%" in err


@given(off=st.floats(0.0, 1.0), ops_off=st.integers(1, 5), on=st.integers(1, 5))
def test_placement_is_judged_by_the_cost_off_the_neural_engine(off, ops_off, on):
    """A program passes when at most 2% of its estimated cost runs off the ANE, however many ops that is: a reshape
    on the CPU is not a fallback worth failing, a projection there is."""
    placed = placement_report("p", ops(*[("conv", "ane", ("ane",), (1 - off) / on)] * on,
                                       *[("reshape", "cpu", ("cpu",), off / ops_off)] * ops_off))
    assert placed.off_ane_cost == pytest.approx(off, abs=1e-9)
    assert placed.ok is (placed.off_ane_cost <= OFF_ANE_BUDGET)
    assert PlacementStatus("p", "placed", placed).to_dict()["ok"] is placed.ok


def test_unplaced_ops_and_functions_are_counted_apart():
    """Ops `MLComputePlan` names no device for (its usage query gives none: the ops of a multifunction package's
    other functions, as `load_from_path` takes no function name) count neither for nor against a program; a
    function with none placed is `unplaced`, not judged."""
    some = placement_report("p", ops(("conv", "ane", ("ane",), 0.9), ("softmax", None, (), None)))
    assert (some.verdict, some.unknown, some.ok, some.off_ane_cost) == ("full", 1, True, 0.0)
    whole = placement_report("p:ctx512", ops(("conv", None), ("softmax", None)))
    assert whole.verdict == "unplaced" and whole.ok is None and "not judged" in whole.line()
    assert PlacementStatus("p:ctx512", "placed", whole).to_dict()["ok"] is None


def test_nothing_on_the_neural_engine_is_shouted_about(capsys):
    placed = placement_report("p", ops(("conv", "cpu"), ("add", None)))
    assert placed.verdict == "none" and placed.off_ane_cost is None and placed.unknown == 1  # no costs given
    check_placement(PlacementStatus("p", "placed", placed))
    assert "NOTHING runs on the Neural Engine" in capsys.readouterr().err
    check_placement(PlacementStatus("p", "unavailable"))  # said once by the doctor, not per program loaded
    assert capsys.readouterr().err == ""
    with pytest.raises(HeteroError, match="unknown device 'tpu'"):
        placement_report("p", ops(("conv", "tpu")))


class ComputePlanStandIn:
    """Stands for coremltools' `MLComputePlan` (`MLComputePlan.load_from_path`'s result): a function's block of
    ops, each op's `MLComputePlanDeviceUsage` (preferred and supported devices, coremltools' device classes) and
    estimated cost; `fail_cost` makes the cost query raise, as a failing Core ML query does."""

    def __init__(self, ops: list[tuple[str, str]], fail_cost: bool = False):
        from coremltools.models import compute_device as cd

        self.devices = {"ane": cd.MLNeuralEngineComputeDevice, "cpu": cd.MLCPUComputeDevice}
        operations = [types.SimpleNamespace(operator_name=name, blocks=[], device=dev) for name, dev in ops]
        block = types.SimpleNamespace(operations=operations)
        self.model_structure = types.SimpleNamespace(program=types.SimpleNamespace(
            functions={"main": types.SimpleNamespace(block=block)}))
        self.fail_cost = fail_cost

    def get_compute_device_usage_for_mlprogram_operation(self, op):
        device = object.__new__(self.devices[op.device])
        return types.SimpleNamespace(preferred_compute_device=device, supported_compute_devices=[device])

    def get_estimated_cost_for_mlprogram_operation(self, op):
        if self.fail_cost:
            raise RuntimeError("Error reading the compute plan\nmore")
        return types.SimpleNamespace(weight=0.5)


def test_a_failing_compute_plan_query_is_reported_as_failed_not_unavailable():
    """`load_plan` stands for `MLComputePlan.load_from_path` (None: a macOS before 14.4 has none)."""
    placed = placement_status("p", lambda: ComputePlanStandIn([("conv", "ane"), ("conv", "ane")]), None)
    assert placed.status == "placed" and placed.to_dict()["ok"] and placed.report.verdict == "full"
    assert placement_status("p", lambda: None, None).to_dict() == {
        "status": "unavailable", "ok": None,
        "line": "p: MLComputePlan unavailable (macOS 14.4+); ANE placement not verified"}

    def refuses():
        raise RuntimeError("MLComputePlan: the model could not be loaded")

    for failing in (refuses, lambda: ComputePlanStandIn([("conv", "ane")], fail_cost=True)):
        found = placement_status("p", failing, None).to_dict()
        assert found["status"] == "failed" and found["ok"] is False and "query failed" in found["line"]
        assert "RuntimeError" in found["error"] and "unavailable" not in found["line"]
    partial = placement_status("p", lambda: ComputePlanStandIn([("conv", "ane"), ("softmax", "cpu")]), None)
    assert partial.to_dict()["ok"] is False and partial.report.verdict == "partial"


def test_device_kinds_from_coremltools_device_classes():
    """The classes `MLComputePlanDeviceUsage` holds (coremltools.models.compute_device), by name."""
    from coremltools.models import compute_device as cd

    kinds = {cls.__name__: device_kind(object.__new__(cls)) for cls in
             (cd.MLNeuralEngineComputeDevice, cd.MLGPUComputeDevice, cd.MLCPUComputeDevice)}
    assert kinds == {"MLNeuralEngineComputeDevice": "ane", "MLGPUComputeDevice": "gpu", "MLCPUComputeDevice": "cpu"}
    assert device_kind(None) is None


# ----------------------------------------------------------------------------------------------------------
# On a Mac only: the real binding releases what the hold keeps

macos = pytest.mark.skipif(sys.platform != "darwin", reason="Core ML predictions need macOS")


@macos
def test_core_ml_releases_its_inputs_so_the_hold_drains(checkpoint, tmp_path):
    """The real `CompiledMLModel.predict`: after a burst of calls and Core ML's ~1 s linger, one more call frees
    every earlier call's inputs (the hold keeps at most the calls Core ML still has bound)."""
    import time

    from hetero.coreml.backends.coreml_macos import load

    manifest = export_coreml(checkpoint, tmp_path / "e", 0.5, chunk=64, contexts=[128])
    p = next(p for p in manifest["programs"] if p["piece"] == "mlp")
    program = load(tmp_path / "e" / p["file"], report=False)
    x = {"x": np.random.default_rng(0).standard_normal(p["inputs"]["x"]).astype(np.float16)}
    for _ in range(20):
        assert program(x)["out"].dtype == np.float32
    time.sleep(3)
    program(x)
    assert len(program.run.hold.calls) <= 2, program.run.hold.nbytes
