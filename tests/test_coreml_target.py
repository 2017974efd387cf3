"""The lane on every macOS from 14: the export's target picked by the OS (fp16, single-function packages, Core ML
spec 8 below macOS 15), named in every key and directory, a package built for another OS never loaded, the OS's
refusal of a specification named as the OS's, and a 4-bit checkpoint's split loading and running on macOS 14.0.

Core ML itself is the stand-in of tests/fake_mac.py wherever a Mac's answer is needed (each of its calls names the
real one); the exports, the worker, the lane and the split are hetero's own."""

from __future__ import annotations

import struct
import types
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetero.checkpoint.loader import load_model
from hetero.cli.quantize import quantize_checkpoint
from hetero.coreml.backends import coreml_macos
from hetero.coreml.backends.coreml_macos import CoreMLProgram, package_facts
from hetero.coreml.backends.footprint import (
    NEURAL_FOOTPRINT_FIELD, PHYS_FOOTPRINT_FIELD, RUSAGE_INFO_V4, RUSAGE_INFO_V6, UUID_BYTES, linux_resident,
    mac_footprint, parse_rusage,
)
from hetero.coreml.backends.reference_executor import ReferenceExecutor
from hetero.coreml.export import export_coreml, lint_export
from hetero.coreml.fp16 import fp16_values
from hetero.coreml.target import (
    MACOS14, MACOS15, SpecRefused, check_spec, check_target, max_spec, target_for, weight_form_for,
)
from hetero.errors import HeteroError
from hetero.pipeline import configure, load_programs, verify
from hetero.pipeline.programs import model_dir
from hetero.pipeline.run import export_key
from fake_mac import mac  # noqa: F401  (fixture)
from test_coreml_graphs import save_checkpoint, tiny_model


@given(major=st.integers(14, 40), minor=st.integers(0, 9))
def test_the_target_follows_the_os(major, minor):
    """Below macOS 15: fp16 weights, one package per bucket, spec 8 (what macOS 14.x compiles); from 15 on: every
    weight form, multifunction packages, spec 9; and no target ever needs a spec the OS does not compile."""
    target = target_for((major, minor))
    assert target is (MACOS14 if major < 15 else MACOS15)
    assert target.spec <= max_spec((major, minor))
    assert (target.forms, target.multifunction) == ((("fp16",), False) if major < 15 else
                                                    (("fp16", "lut", "blockwise"), True))
    form, note = weight_form_for("lut", target)
    assert (form, note is None) == (("fp16", False) if major < 15 else ("lut", True))


def test_below_macos_14_no_target_loads_and_a_newer_spec_is_refused_as_the_os():
    with pytest.raises(HeteroError, match="needs macOS 14 or later"):
        target_for((13, 6))
    check_spec(8, (14, 0), "p")
    with pytest.raises(SpecRefused, match="the OS refuses it; re-export for this Mac \\(macos14-spec8\\)"):
        check_spec(9, (14, 0), "p")
    check_spec(10, (26, 0), "p")  # macOS 26 compiles coremltools' iOS 26 spec
    with pytest.raises(HeteroError, match="exported for macos15-spec9, not this Mac's macos14-spec8: not loaded"):
        check_target("macos15-spec9", MACOS14, "an export")


@pytest.fixture(scope="module")
def q4(tmp_path_factory) -> Path:
    """`hetero convert --quantize 4` of a tiny checkpoint: every projection a 4-bit matrix."""
    tmp = tmp_path_factory.mktemp("q4")
    return quantize_checkpoint(str(save_checkpoint(tiny_model(5), tmp / "f32")), tmp / "q4", bits=4, group_size=32)


def test_a_4bit_checkpoint_exports_fp16_programs_of_spec_8_for_macos_14(q4, tmp_path):
    """Asked for the tables, an export for macOS 14 embeds fp16 weights (saying why) in single-function packages
    of spec 8, whose outputs equal the macOS 15 export's table programs bit for bit (the tables' values are MLX's
    rounded once; fp16 holds the same values)."""
    contexts = [64, 128]
    m14 = export_coreml(q4, tmp_path / "m14", 0.5, chunk=64, contexts=contexts, target=MACOS14, form="lut")
    m15 = export_coreml(q4, tmp_path / "m15", 0.5, chunk=64, contexts=contexts, target=MACOS15, form="lut")
    assert (m14["target"], m14["ane_weights"], m15["ane_weights"]) == ("macos14-spec8", "fp16", "lut")
    assert "needs macOS 15" in m14["weight_form_note"] and "weight_form_note" not in m15
    files14 = sorted({p["file"] for p in m14["programs"]})
    assert all(package_facts(tmp_path / "m14" / f).spec == 8 for f in files14)
    assert all(package_facts(tmp_path / "m14" / f).default is None for f in files14)  # no function names
    assert {package_facts(tmp_path / "m15" / p["file"]).spec for p in m15["programs"]} == {9}
    assert all(set(p["weight_forms"]) == {"fp16"} for p in m14["programs"])
    by_key = {(p["layer"], p["piece"], p["part"][0], p["context"]): p for p in m15["programs"]}
    rng = np.random.default_rng(0)
    for p in m14["programs"]:
        q = by_key[(p["layer"], p["piece"], p["part"][0], p["context"])]
        feed = {k: rng.standard_normal(v).astype(np.float32) for k, v in p["inputs"].items()}
        ours = ReferenceExecutor(tmp_path / "m14" / p["file"])(feed)
        theirs = ReferenceExecutor(tmp_path / "m15" / q["file"], q.get("function"))(feed)
        assert all(np.array_equal(ours[k].view(np.uint32), theirs[k].view(np.uint32)) for k in ours), p["file"]
    assert not any(r.errors for r in lint_export(tmp_path / "m14"))


def test_a_4bit_checkpoints_split_loads_and_runs_on_macos_14_0(q4, mac):
    """The first Mac run's worst case: macOS 14.0 (no multifunction packages, no tables, no compute plan) and a 4-bit
    checkpoint. Its split exports fp16 programs for macos14-spec8, one package per bucket, which the stand-in's
    Core ML compiles (it refuses spec 9, as macOS 14 does) and loads without a function name (which its binding
    refuses); the prompt runs through the worker and matches the GPU-only run."""
    ml = mac("macos_14_0")
    assert coreml_macos.this_target(ml) is MACOS14
    model, path, config = load_model(str(q4), dtype=mx.float32)
    engine = types.SimpleNamespace(model=model, config=config, path=path, name=str(path), identity="q4-macos14@test")
    run = configure(engine, 0.5, 64)
    ids = np.random.default_rng(2).integers(0, 256, 150).tolist()  # three chunks: buckets 64, 128 and 256
    split = run.splitter(len(ids))
    assert split.backend.startswith("Core ML stand-in (macOS 14.0)") and split.programs.weights == "fp16"
    check = verify(run, ids, n_tokens=4)
    assert check["match"], check
    assert split.programs.loaded_functions() == 3 * len(split.programs.attention)  # every bucket, each its own
    exports = [d.name for d in model_dir(export_key(engine)).glob("f*") if d.is_dir()]
    assert exports and all(d.endswith("_macos14-spec8_wfp16") for d in exports)  # the form built, not the one asked


def test_a_package_built_for_another_os_is_never_loaded(q4, mac, tmp_path):
    """A macOS 15 export (tables, spec 9) is refused by name on macOS 14.0 before anything compiles; were it loaded
    anyway, the stand-in's Core ML compile (and the lane's own check before it) names the OS's refusal."""
    m15 = export_coreml(q4, tmp_path / "m15", 0.5, chunk=64, contexts=[128], target=MACOS15)
    mac("macos_14_0")
    with pytest.raises(HeteroError, match="exported for macos15-spec9, not this Mac's macos14-spec8"):
        load_programs(tmp_path / "m15", coreml_macos.load)
    table = next(p["file"] for p in m15["programs"] if p["piece"] == "mlp")
    with pytest.raises(SpecRefused, match="the OS refuses it"):
        CoreMLProgram(tmp_path / "m15" / table)


def test_core_mls_own_refusal_of_a_spec_is_named_as_the_os(q4, mac, tmp_path):
    """A macOS whose Core ML is older than its version says (the stand-in compiles spec 8 only while reporting 15.0):
    the lane's table lets spec 9 through, Core ML's compiler refuses it in its own words, and the lane names that
    the OS's refusal."""
    m15 = export_coreml(q4, tmp_path / "m15", 0.5, chunk=64, contexts=[128], target=MACOS15)
    mac("macos_15_old_core_ml")
    table = next(p["file"] for p in m15["programs"] if p["piece"] == "mlp")
    with pytest.raises(SpecRefused, match="intended for a newer version of Xcode.*the OS refuses it"):
        CoreMLProgram(tmp_path / "m15" / table)


# ----------------------------------------------------------------------------------------------------------
# Memory: the footprint now, never a peak


def rusage_bytes(phys: int, neural: int) -> bytes:
    """A `rusage_info_v6` as `proc_pid_rusage` fills it (the fields hetero reads set, the rest noise)."""
    buf = bytearray(np.random.default_rng(0).integers(0, 255, 1024, dtype=np.uint8).tobytes())
    struct.pack_into("<Q", buf, UUID_BYTES + 8 * PHYS_FOOTPRINT_FIELD, phys)
    struct.pack_into("<Q", buf, UUID_BYTES + 8 * NEURAL_FOOTPRINT_FIELD, neural)
    return bytes(buf)


def test_the_footprint_comes_from_proc_pid_rusage_v6_else_v4():
    """`rusage` stands for `proc_pid_rusage(getpid(), flavor, &info)`: v6 gives the phys footprint and the Neural
    Engine's; a kernel that refuses v6 still gives v4's footprint; one that refuses both says nothing."""
    buf = rusage_bytes(123 << 20, 45 << 20)
    v6 = mac_footprint(lambda flavor: buf)
    assert (v6.bytes, v6.neural_bytes, v6.source) == (123 << 20, 45 << 20, "phys_footprint")
    v4 = mac_footprint(lambda flavor: buf if flavor == RUSAGE_INFO_V4 else None)
    assert (v4.bytes, v4.neural_bytes) == (123 << 20, None)
    assert mac_footprint(lambda flavor: None) is None
    assert parse_rusage(buf, RUSAGE_INFO_V6).to_dict() == {"bytes": 123 << 20, "neural_bytes": 45 << 20,
                                                           "source": "phys_footprint"}
    here = linux_resident()
    assert here is not None and here.bytes > 0 and here.source == "resident"


# ----------------------------------------------------------------------------------------------------------
# fp16 rounding, subnormals without a gather (kept as a regression: the rewrite that made it 3x faster)


def test_fp16_values_round_every_subnormal_step_and_tie_as_numpy_does():
    """Every fp16 subnormal, and the fp32 values just below, at and above each halfway point between two of them
    (both signs), alone and among many normal values (the rounding's two paths for subnormals): the bit arithmetic
    equals numpy's fp32 -> fp16 -> fp32 casts."""
    k = np.arange(0, 1025, dtype=np.float64)  # 0 .. 2^10 subnormal steps of 2^-24 (the last: 2^-14, normal)
    half = (k[:-1] + 0.5) * 2.0**-24
    grid = np.concatenate([k * 2.0**-24, half]).astype(np.float32)
    near = np.concatenate([grid, np.nextafter(grid, np.float32(1)), np.nextafter(grid, np.float32(0))])
    values = np.concatenate([near, -near]).astype(np.float32)
    normal = np.random.default_rng(0).standard_normal(64 * values.size).astype(np.float32) + 8
    for a in (values, np.concatenate([values, normal])):  # dense subnormals (a masked add), sparse (picked out)
        want = a.astype(np.float16).astype(np.float32)
        assert np.array_equal(fp16_values(a).view(np.uint32), want.view(np.uint32))


def test_convert_builds_for_the_target_asked(tmp_path, capsys):
    """`hetero convert --coreml --target macos14` on any machine: the programs a macOS 14 Mac loads, said so."""
    from hetero.cli.main import main
    from hetero.coreml.export import read_manifest

    assert main(["convert", "--coreml", "--ane-fraction", "0.5", "--context", "256,512", "--target", "macos14",
                 "--out", str(tmp_path / "m14")]) == 0
    manifest = read_manifest(tmp_path / "m14")
    assert manifest["target"] == "macos14-spec8" and all("function" not in p for p in manifest["programs"])
    assert "for macos14-spec8" in capsys.readouterr().out
