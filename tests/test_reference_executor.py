"""The reference executor (fp32 compute, fp16 at op boundaries, refuses unknown ops by name), the export driver
(the planner's slices, weight-budget split, manifest round trip and reuse, `hetero convert --coreml`), and a whole prefill
whose attention layers all run through exported programs against the MLX-only prefill."""

from __future__ import annotations

import json
import os
import shutil

import mlx.core as mx
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

from hetero.cli.main import main
from hetero.coreml.backends import coreml_macos
from hetero.coreml.backends.accuracy import compare
from hetero.coreml.backends.reference_executor import ReferenceExecutor
from hetero.coreml.backends.reference_prefill import prefill_with_attention_programs
from hetero.coreml.export import PieceSlice, build_piece, export_coreml
from hetero.coreml.graphs.attention import AttentionShape, attention_masks, cache_inputs, rope_tables
from hetero.coreml.graphs.ops import DEPLOYMENT_TARGET
from hetero.coreml.graphs.package import save_functions, save_program
from hetero.coreml.manifest import read_manifest
from hetero.decode.prefill import prefill
from hetero.errors import HeteroError
from hetero.models.qwen3_5 import ModelArgs
from hetero.planner import ane_slices
from hetero.planner.slices import split_for_budget, unit_bytes
from test_coreml_graphs import TINY, save_checkpoint, tiny_model

BC1S = (1, 64, 1, 64)


def program(body, shape=BC1S):
    @mb.program(input_specs=[mb.TensorSpec(shape=shape, dtype=types.fp16)], opset_version=DEPLOYMENT_TARGET)
    def prog(x):
        return body(x)

    return prog


def test_refuses_an_unknown_op_by_name(tmp_path):
    path = save_program(program(lambda x: mb.relu(x=x)), tmp_path / "relu.mlpackage")
    with pytest.raises(HeteroError, match="'relu'"):
        ReferenceExecutor(path)


def test_refuses_a_conv_that_is_not_1x1(tmp_path):
    w = np.ones((8, 64, 1, 3), np.float16)
    path = save_program(program(lambda x: mb.conv(x=x, weight=w, pad_type="same")), tmp_path / "conv.mlpackage")
    with pytest.raises(HeteroError, match="1x1"):
        ReferenceExecutor(path)({"x": np.zeros(BC1S, np.float16)})


def test_rounds_to_fp16_at_each_op_boundary(tmp_path):
    """(1 + 2^-12) - 1: in fp32 2^-12, but 1 + 2^-12 rounds to 1 in fp16 before the subtraction."""
    tiny = np.float16(2.0**-12)
    path = save_program(program(lambda x: mb.sub(x=mb.add(x=x, y=tiny), y=np.float16(1.0))), tmp_path / "r.mlpackage")
    out = ReferenceExecutor(path)({"x": np.ones(BC1S, np.float16)})
    assert out[next(iter(out))].max() == 0.0


def test_accumulates_in_fp32(tmp_path):
    """A sum of 4096 ones is 4096; summed in fp16 it would stop at 2048 (2048 + 1 rounds to 2048)."""
    path = save_program(program(lambda x: mb.reduce_sum(x=x, axes=[3], keep_dims=True), shape=(1, 1, 1, 4096)), tmp_path / "s.mlpackage")
    out = ReferenceExecutor(path)({"x": np.ones((1, 1, 1, 4096), np.float16)})
    assert out[next(iter(out))].item() == 4096.0


@pytest.mark.parametrize("axis", [1, 3])
def test_own_layer_norm_equals_coremltools_value_inference(tmp_path, axis):
    """layer_norm is written in the executor (for speed, in fp32); coremltools' own (float64 inside) rounded to
    fp16 gives the same values but for a rare one-ulp tie at a rounding boundary."""
    from coremltools.converters.mil.mil.ops.defs.iOS15.normalization import layer_norm

    rng = np.random.default_rng(axis)
    x = (rng.standard_normal(BC1S) * 30).astype(np.float16)
    gamma = rng.standard_normal(BC1S[axis]).astype(np.float16)
    path = save_program(program(lambda v: mb.layer_norm(x=v, axes=[axis], gamma=gamma, epsilon=np.float16(1e-5))),
                        tmp_path / "ln.mlpackage")
    ours = ReferenceExecutor(path)({"x": x})
    ours = ours[next(iter(ours))]

    class Shim:  # what value_inference reads: .val of each input (no input types: skip its const-only check)
        _input_types: dict = {}

        def __init__(self, **kw):
            for k, v in kw.items():
                setattr(self, k, None if v is None else type("V", (), {"val": v})())

    want = layer_norm.value_inference(Shim(x=x.astype(np.float32), axes=np.array([axis]),
                                           gamma=gamma.astype(np.float32), beta=None, epsilon=np.float32(1e-5)))
    want = np.asarray(want).astype(np.float16)
    assert np.array_equal(ours, ours.astype(np.float16).astype(np.float32))  # fp16 values (held in fp32)
    ours = ours.astype(np.float16)
    assert (np.abs(ours.astype(np.float32) - want) <= np.spacing(np.abs(want))).all()
    assert (ours == want).mean() >= 0.99


def test_checks_input_names_and_shapes(tmp_path):
    path = save_program(program(lambda x: mb.exp(x=x)), tmp_path / "e.mlpackage")
    ex = ReferenceExecutor(path)
    with pytest.raises(ValueError, match="missing"):
        ex({})
    with pytest.raises(ValueError, match="shape"):
        ex({"x": np.zeros((1, 64, 1, 32), np.float16)})


def test_not_a_package_is_a_one_line_error(tmp_path):
    with pytest.raises(HeteroError, match="not an .mlpackage"):
        ReferenceExecutor(tmp_path)


# ----------------------------------------------------------------------------------------------------------
# Interim plan and budget split


def test_a_multifunction_function_runs_bit_identically_to_its_single_function_program(tmp_path):
    """Each context bucket's function of a weight-sharing package (`save_functions`, coremltools'
    save_multifunction) gives exactly the outputs of the single-function program it was made from."""
    model = tiny_model(8)
    args, rng = model.args, np.random.default_rng(4)
    progs, singles = {}, {}
    for ctx in (128, 256):
        shape, w, build = build_piece(args, model, PieceSlice(1, "attention", 0, 2), chunk=64, context=ctx)
        progs[f"ctx{ctx}"] = build(shape, w)
        singles[ctx] = (shape, save_program(build(shape, w), tmp_path / f"single{ctx}.mlpackage"))
    multi = save_functions(progs.items(), tmp_path / "multi.mlpackage")
    for ctx, (shape, single) in singles.items():
        start = shape.cache_slots - 32  # a chunk whose cache is mostly full
        keys, values = (rng.standard_normal((1, 2, start, args.head_dim)).astype(np.float16) for _ in range(2))
        x = rng.standard_normal((1, args.hidden_size, 1, 64)).astype(np.float16)
        inputs = {"x": x, **rope_tables(start, shape, args.rope_theta), **attention_masks(start, shape),
                  **cache_inputs(keys, values, shape)}
        ours, ref = ReferenceExecutor(multi, f"ctx{ctx}")(inputs), ReferenceExecutor(single)(inputs)
        assert ours.keys() == ref.keys() and all(np.array_equal(ours[k], ref[k]) for k in ref), ctx
    assert ReferenceExecutor(multi).function_name == "ctx128"  # the first function is the default
    with pytest.raises(HeteroError, match="no function 'ctx512'.*ctx128, ctx256"):
        ReferenceExecutor(multi, "ctx512")
    with pytest.raises(HeteroError, match="no function 'ctx128'"):
        ReferenceExecutor(singles[128][1], "ctx128")


def test_a_package_saved_again_at_the_same_path_is_read_again(tmp_path):
    """The executor reads a package once for consecutive loads of its functions, never a stale one."""
    path = save_program(program(lambda x: mb.add(x=x, y=np.float16(1))), tmp_path / "p.mlpackage")
    x = {"x": np.zeros(BC1S, np.float16)}
    ex = ReferenceExecutor(path)
    assert ex(x)[ex.output_names[0]].max() == 1
    shutil.rmtree(path)
    save_program(program(lambda x: mb.add(x=x, y=np.float16(2))), path)
    ex = ReferenceExecutor(path)
    assert ex(x)[ex.output_names[0]].max() == 2


def test_export_slices_come_from_the_planner():
    args = ModelArgs.from_config(TINY)  # 2 KV heads, 192 channels, z 64 of 200 input-projection rows
    plan = ane_slices(args, 0.5)
    assert PieceSlice(1, "attention", 0, 1) in plan and PieceSlice(0, "gdn_in_proj", 0, 64) in plan
    assert {(s.start, s.stop) for s in plan if s.piece == "mlp"} == {(0, 128)}  # 96 rounds (half up) to 128
    assert not [s for s in ane_slices(args, 0.2) if s.piece == "attention"]  # 0.4 of a KV group rounds to none
    assert ane_slices(args, 0.0) == []
    with pytest.raises(HeteroError):
        ane_slices(args, 1.5)


def test_split_for_budget_keeps_parts_under_the_budget():
    args = ModelArgs.from_config(TINY)
    parts = split_for_budget(args, PieceSlice(0, "mlp", 0, 192), budget=64 * unit_bytes(args, "mlp"))
    assert [(p.start, p.stop) for p in parts] == [(0, 64), (64, 128), (128, 192)]
    parts = split_for_budget(args, PieceSlice(1, "attention", 0, 2), budget=unit_bytes(args, "attention"))
    assert [(p.start, p.stop) for p in parts] == [(0, 1), (1, 2)]


# ----------------------------------------------------------------------------------------------------------
# Export, manifest, and the whole prefill


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = tiny_model(11)
    return save_checkpoint(model, tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module")
def export_full(checkpoint, tmp_path_factory):
    """Fraction 1.0, chunk 64, context 192, attention split per KV head by a small weight budget."""
    out = tmp_path_factory.mktemp("export") / "coreml"
    args = ModelArgs.from_config(TINY)
    manifest = export_coreml(checkpoint, out, 1.0, chunk=64, contexts=[192], budget=unit_bytes(args, "attention"))
    return out, manifest


def test_manifest_round_trips_and_reuses(export_full, checkpoint):
    out, manifest = export_full
    assert read_manifest(out) == manifest
    assert manifest["chunk_size"] == 64 and manifest["context_buckets"] == [192]
    assert manifest["model"]["config_sha256"] and manifest["coremltools"]
    attn = [p for p in manifest["programs"] if p["piece"] == "attention"]
    assert {tuple(p["part"]) for p in attn} == {(0, 1), (1, 2)}  # split by the budget
    assert all((out / p["file"] / "Manifest.json").is_file() for p in manifest["programs"])
    mtimes = {p["file"]: os.stat(out / p["file"] / "Manifest.json").st_mtime_ns for p in manifest["programs"]}
    again = export_coreml(checkpoint, out, 1.0, chunk=64, contexts=[192], budget=manifest["weight_budget_bytes"])
    assert all(p["reused"] for p in again["programs"])
    assert mtimes == {p["file"]: os.stat(out / p["file"] / "Manifest.json").st_mtime_ns for p in again["programs"]}
    assert [p["key"] for p in again["programs"]] == [p["key"] for p in manifest["programs"]]


def test_damaged_manifest_is_a_one_line_error(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(HeteroError, match="damaged"):
        read_manifest(tmp_path)


def test_prefill_with_every_attention_layer_on_the_executor_matches_mlx(export_full, checkpoint):
    """150 tokens = 3 chunks of 64 (the last padded): same next-token argmax, last logits cosine >= 0.999."""
    from hetero.checkpoint.loader import load_model

    out, _ = export_full
    model, _, _ = load_model(checkpoint, dtype=mx.float32)
    tokens = np.random.default_rng(3).integers(0, TINY["vocab_size"], 150).tolist()
    ref_logits, _ = prefill(model, tokens, model.make_cache(), chunk=64)
    ours, _, cache = prefill_with_attention_programs(model, tokens, out)
    ref, got = np.array(ref_logits[-1]), np.array(ours[-1])
    metrics = compare(got, ref)
    assert int(got.argmax()) == int(ref.argmax())
    assert metrics["cosine"] >= 0.999
    # Tighter than the acceptance bar: a RoPE with the wrong base still reaches cosine 0.999 here, but only ~35 dB.
    assert metrics["psnr_db"] >= 50, metrics
    assert cache[1].offset == 150  # the programs' K/V went into the MLX cache


def test_cli_export_writes_manifest_and_lints_clean(checkpoint, tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["convert", "--model", str(checkpoint), "--coreml", "--ane-fraction", "0.5", "--chunk-size", "64",
            "--context", "128", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "0 errors" in text and "wrote" in text
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["ane_fraction"] == 0.5 and {p["piece"] for p in manifest["programs"]} == {"attention", "mlp", "gdn_in_proj"}
    assert main(["convert", "--lint", str(out)]) == 0


def test_cli_export_rejects_a_bad_chunk_size(checkpoint, tmp_path, capsys):
    argv = ["convert", "--model", str(checkpoint), "--coreml", "--ane-fraction", "0.5", "--chunk-size", "100", "--out", str(tmp_path)]
    assert main(argv) == 1
    assert "multiple of 64" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------
# macOS backend: only where Core ML runs (no mocks of its runtime here)

macos = pytest.mark.skipif(
    __import__("platform").system() != "Darwin", reason="Core ML predictions and MLComputePlan need macOS"
)


@macos
def test_coreml_runtime_matches_the_reference_executor(export_full):
    from hetero.coreml.backends.coreml_macos import load

    out, manifest = export_full
    p = next(p for p in manifest["programs"] if p["piece"] == "mlp")
    x = {"x": np.random.default_rng(0).standard_normal(p["inputs"]["x"]).astype(np.float16)}
    ours = load(out / p["file"])(x)["out"]
    ref = ReferenceExecutor(out / p["file"])(x)["out"]
    assert compare(ours, ref)["cosine"] >= 0.9999


@macos
def test_coreml_runs_each_bucket_function_like_the_reference_executor(checkpoint, tmp_path):
    """A multifunction attention package on the real Core ML (CompiledMLModel with function_name)."""
    manifest = export_coreml(checkpoint, tmp_path / "mf", 0.5, chunk=64, contexts=[64, 128])
    rng = np.random.default_rng(1)
    for p in (p for p in manifest["programs"] if p["piece"] == "attention"):
        shape = AttentionShape(**p["shape"])
        start = shape.cache_slots
        kv = (rng.standard_normal((1, shape.kv_heads, start, shape.head_dim)).astype(np.float16) for _ in range(2))
        inputs = {"x": rng.standard_normal(p["inputs"]["x"]).astype(np.float16), **rope_tables(start, shape, 1e7),
                  **attention_masks(start, shape), **cache_inputs(*kv, shape)}
        ours = coreml_macos.load(tmp_path / "mf" / p["file"], p["function"], report=False)(inputs)
        ref = ReferenceExecutor(tmp_path / "mf" / p["file"], p["function"])(inputs)
        assert all(ours[k].dtype == np.float32 and compare(ours[k], ref[k])["cosine"] >= 0.9999 for k in ref)


@macos
def test_placement_report_counts_ops(export_full):
    from hetero.coreml.backends.coreml_macos import load

    out, manifest = export_full
    placed = load(out / manifest["programs"][0]["file"], report=False).placement()
    if placed is None:
        pytest.skip("MLComputePlan needs macOS 14.4+")
    assert placed.total > 0


def test_coreml_backend_refuses_off_macos(export_full):
    """Off macOS the backend says why in one line instead of failing inside coremltools."""
    from hetero.coreml.backends.coreml_macos import CoreMLProgram, available

    ok, why = available()
    if ok:
        pytest.skip("this machine runs Core ML")
    out, manifest = export_full
    with pytest.raises(HeteroError, match="macOS"):
        CoreMLProgram(out / manifest["programs"][0]["file"])


def test_bundled_model_prefill_with_attention_on_the_executor_matches_mlx(tmp_path):
    """The bundled (trained) model: every attention layer through its programs, the rest on MLX, on real text."""
    import hetero
    from hetero.checkpoint.source import BUNDLED_MODEL

    assert (BUNDLED_MODEL / "model.safetensors").is_file(), "hetero/bundled/ is missing: a failure, never a skip"
    engine = hetero.load()
    model = engine.model
    text = open(__file__).read()[:2000]
    tokens = engine.tokenizer.encode(text)[:200]
    export_coreml(None, tmp_path, 1.0, chunk=64, contexts=[256], kinds=("attention",))
    ref_logits, _ = prefill(model, tokens, model.make_cache(), chunk=64)
    ours, _, _ = prefill_with_attention_programs(model, tokens, tmp_path)
    ref, got = np.array(ref_logits[-1].astype(mx.float32)), np.array(ours[-1].astype(mx.float32))
    metrics = compare(got, ref)
    assert int(got.argmax()) == int(ref.argmax()), metrics
    assert metrics["cosine"] >= 0.999, metrics


def test_fp16_values_equal_numpys_cast_everywhere():
    """The executor's bit-arithmetic rounding equals numpy's fp32 -> fp16 -> fp32 casts on every kind of value:
    ties either way, fp16 subnormals, fp32 subnormals, the overflow edge 65504 / 65520, inf and NaN."""
    from hetero.coreml.fp16 import fp16_values

    rng = np.random.default_rng(0)
    step = np.float32(2.0**-10)  # an fp16 ulp at 1.0
    ties = (1 + step * np.arange(64, dtype=np.float32)) + step / 2  # exactly halfway: half go down, half up
    special = np.array([0.0, -0.0, 2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 1e-40, -1e-40, 65504.0, 65519.0,
                        65520.0, -65520.0, 1e38, np.inf, -np.inf, np.nan], np.float32)
    values = [rng.standard_normal(100_000).astype(np.float32) * scale for scale in (1e-6, 1e-3, 1.0, 100.0, 3e4)]
    a = np.concatenate([ties, -ties, special, *values]).astype(np.float32)
    want = a.astype(np.float16).astype(np.float32)
    got = fp16_values(a)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)  # NaN positions compare equal in assert_array_equal
    assert np.array_equal(np.signbit(got), np.signbit(want))
    grid = fp16_values(a[:, None] * np.ones((1, 3), np.float32)[:, :1])  # 2-D (and a strided view) too
    np.testing.assert_array_equal(grid[:, 0], want)
