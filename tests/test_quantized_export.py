"""The ANE's share of a quantized checkpoint is exported in the checkpoint's own quantization, exactly: per-group
lookup tables (`constexpr_lut_to_dense`) whose entries are MLX's dequantized weights rounded once to fp16.

The reference is `mx.dequantize` of the same packed weights, scales and biases in fp32 (the checkpoint's bf16 or
fp16 scales widen exactly; MLX's quantized matmul applies them in fp32 too), rounded to fp16 where the ANE stores
its weights. Checked bit for bit on the tables, on a `hetero convert --quantize 4` checkpoint's whole export through
the reference executor, and on one Qwen3.5-27B-shaped layer whose programs must pass the lint and match MLX's
quantized matmul."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from hetero.checkpoint.loader import load_model
from hetero.cli.quantize import quantizable, quantize_checkpoint
from hetero.coreml.backends.accuracy import compare
from hetero.coreml.backends.reference_executor import ReferenceExecutor
from hetero.coreml.export import PieceSlice, build_piece, export_coreml, palettize, weights_nbytes
from hetero.coreml.graphs.lint import lint_package
from hetero.coreml.graphs.package import save_program
from hetero.coreml.graphs.palette import pack, unpack
from hetero.coreml.manifest import read_manifest
from hetero.planner import PlanRequest, make_plan
from hetero.planner.slices import lut_bytes_per_weight
from hetero.profiles import load_profile
from tests.test_coreml_graphs import TINY, bc1s, fp16_exact, from_bc1s, save_checkpoint, tiny_model

CONFIGS = Path(__file__).resolve().parent / "data"


def mlx_fp16(layer: nn.QuantizedLinear) -> np.ndarray:
    """MLX's dequantized weight of a quantized layer, in fp32, rounded once to fp16."""
    f32 = lambda a: a.astype(mx.float32)  # noqa: E731
    w = mx.dequantize(layer.weight, f32(layer.scales), f32(layer.biases), layer.group_size, layer.bits)
    return np.array(w).astype(np.float16)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool((np.asarray(a, np.float16).view(np.uint16) == np.asarray(b, np.float16).view(np.uint16)).all())


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("store", [mx.bfloat16, mx.float16, mx.float32])
def test_tables_are_mlx_dequantize_bit_for_bit(bits, group, store):
    """Scales and biases stored in the checkpoint's dtype (hetero convert keeps the source's: fp32 scales round
    s * k + b in fp32 before fp16, which a table computed any other way missed in 0.1% of weights)."""
    rng = np.random.default_rng(bits * group)
    w = mx.array(rng.normal(0, 0.02, (96, 512)).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    layer = nn.QuantizedLinear(512, 96, bias=False, group_size=group, bits=bits)
    layer.weight, layer.scales, layer.biases = wq, s.astype(store), b.astype(store)
    p = palettize(layer.weight, layer.scales, layer.biases, bits, group)
    want = mlx_fp16(layer)
    assert same_bits(pack(unpack(np.array(wq), bits, 512), bits).view(np.float16), np.array(wq).view(np.float16))
    assert same_bits(p.dense(), want)
    assert same_bits(p[10:50].dense(), want[10:50])
    assert same_bits(p[:, 16:208].dense(), want[:, 16:208])  # a column range that cuts groups: tables repeat
    assert p.nbytes == 96 * 512 * bits // 8 + 96 * (512 // group) * 2**bits * 2


@pytest.mark.parametrize("bits,group", [(3, 32), (4, 128), (2, 64)])
def test_the_export_unpacks_only_the_slice_it_needs(bits, group):
    """`linear_weight` slices the packed rows and whole groups (and words) before making tables: the same weights as
    slicing MLX's whole dequantized matrix, for row index arrays and column ranges that cut groups."""
    from hetero.coreml.export import linear_weight

    rng = np.random.default_rng(bits)
    layer = nn.QuantizedLinear(512, 80, bias=False, group_size=group, bits=bits)
    layer.weight, layer.scales, layer.biases = mx.quantize(mx.array(rng.normal(0, 0.02, (80, 512)).astype(np.float32)),
                                                           group_size=group, bits=bits)
    want = mlx_fp16(layer)
    rows = np.array([3, 1, 40, 41, 79])
    assert same_bits(linear_weight(layer, rows).dense(), want[rows])
    for a, b in [(0, 512), (64, 192), (32, 480), (96, 160)]:
        got = linear_weight(layer, slice(10, 30), slice(a, b))
        assert same_bits(got.dense(), want[10:30, a:b]), (a, b)


def test_a_table_costs_less_than_fp16_only_up_to_four_bits():
    assert lut_bytes_per_weight(4, 64) == 1.0 and lut_bytes_per_weight(2, 64) == 0.375
    assert lut_bytes_per_weight(8, 64) > 2  # so an 8-bit checkpoint's share is exported as fp16 (exact too)


def _quantized_tiny(tmp_path: Path) -> Path:
    src = save_checkpoint(tiny_model(11), tmp_path / "float")
    return quantize_checkpoint(str(src), tmp_path / "q4", bits=4, group_size=32)


def test_export_of_a_converted_checkpoint_equals_mlx_dequantize_bit_for_bit(tmp_path):
    """`hetero convert --quantize 4` (group 32), exported at fraction 0.5: every compressed weight the reference
    executor expands equals the slice of MLX's dequantized weight that program needs (q and gate rows picked per
    head, o_proj and down_proj columns), and the packages are no larger than the tables."""
    from hetero.coreml.graphs.ops import norm_shift

    q4 = _quantized_tiny(tmp_path)
    manifest = export_coreml(str(q4), tmp_path / "out", 0.5, chunk=64, contexts=[128])
    net, _, _ = load_model(str(q4))
    args = net.args
    D, group = args.head_dim, args.num_attention_heads // args.num_key_value_heads
    checked = 0
    for entry in manifest["programs"]:
        layer = net.layers[entry["layer"]]
        a, b = entry["part"]
        if entry["piece"] == "attention":
            attn = layer.self_attn
            q = mlx_fp16(attn.q_proj).reshape(args.num_attention_heads, 2 * D, -1)[a * group : b * group]
            up = np.float16(2.0 ** norm_shift(args.rms_norm_eps))  # q and k times 2^4 (exact): their norms' epsilon
            want = {"q_proj_weight": q[:, :D].reshape(-1, q.shape[-1]) * up, "gate_proj_weight": q[:, D:].reshape(-1, q.shape[-1]),
                    "k_proj_weight": mlx_fp16(attn.k_proj)[a * D : b * D] * up, "v_proj_weight": mlx_fp16(attn.v_proj)[a * D : b * D],
                    "o_proj_weight": mlx_fp16(attn.o_proj)[:, a * group * D : b * group * D]}
        elif entry["piece"] == "mlp":
            want = {"gate_proj_0_weight": mlx_fp16(layer.mlp.gate_proj)[a:b], "up_proj_0_weight": mlx_fp16(layer.mlp.up_proj)[a:b],
                    "down_proj_0_weight": mlx_fp16(layer.mlp.down_proj)[:, a:b]}
        else:
            want = {"z_proj_weight": mlx_fp16(layer.linear_attn.in_proj_z)[a:b]}
        got = ReferenceExecutor(tmp_path / "out" / entry["file"], entry.get("function")).weights()
        assert sorted(got) == sorted(want), entry["file"]
        for name, w in want.items():
            assert same_bits(got[name][:, :, 0, 0], w), f"{entry['file']} {name}"
            checked += 1
    assert checked >= 8 * 2  # every layer's mlp and mixer share
    assert read_manifest(tmp_path / "out")["programs"][0]["weight_bytes"] > 0


def _random_quantized_gdn_layer(args, seed: int):
    """A Qwen3.5 GDN decoder layer quantized as `hetero convert --quantize 4` quantizes it (group 64; in_proj_a /
    in_proj_b stay float), with random 4-bit weights drawn directly: uniform indices, bf16 scales of a
    N(0, 1/fan_in) weight's range and biases -scale * U(6, 9) (the float weights are never made), and
    1 + 0.3 N(0, 1) norms."""
    from hetero.models.qwen3_5 import DecoderLayer

    layer = DecoderLayer(args, "linear_attention")  # lazy: its own random init is never evaluated
    nn.quantize(layer, group_size=64, bits=4, class_predicate=quantizable(64))
    rng = np.random.default_rng(seed)
    new = []
    for k, v in tree_flatten(layer.parameters()):
        if k.endswith("norm.weight"):
            new.append((k, mx.array(1 + 0.3 * rng.standard_normal(v.shape), dtype=mx.float32)))
        elif k.endswith(".weight") and v.dtype == mx.uint32:
            new.append((k, mx.array(rng.integers(0, 2**32, v.shape, dtype=np.uint32))))
            scale = 6 / 15 / np.sqrt(v.shape[1] * 8) * (0.5 + rng.random((v.shape[0], v.shape[1] * 8 // 64)))
            new.append((k[: -len("weight")] + "scales", mx.array(scale.astype(np.float32)).astype(mx.bfloat16)))
            bias = -scale * rng.uniform(6, 9, scale.shape)
            new.append((k[: -len("weight")] + "biases", mx.array(bias.astype(np.float32)).astype(mx.bfloat16)))
    layer.load_weights(new, strict=False)
    mx.eval(layer.parameters())
    return layer


def test_real_27b_layer_quantized_export_lints_and_matches_mlx_quantized_matmul(tmp_path):
    """One GDN layer at Qwen3.5-27B shapes (hidden 5120, MLP 17408, z 6144 rows), random 4-bit weights, the share
    `hetero plan --bits 4 --ane-fraction 0.5` gives it (8704 MLP channels, all 6144 z rows): each program passes
    the ANE lint, its package holds the tables' bytes (not fp16's), its expanded weights equal MLX's bit for bit, and
    its output on a 64-token chunk matches MLX's quantized matmul (mx.quantized_matmul on the same packed weights)."""
    config = json.loads((CONFIGS / "qwen3.5-27b.json").read_text())
    plan = make_plan(PlanRequest(config, load_profile("m3-ultra"), 0.5, 4096, chunk=64, bits=4))
    args = plan.args
    layer = _random_quantized_gdn_layer(args, seed=27)
    model = type("One", (), {"layers": [layer]})()
    slices = [s for s in plan.slices if s.layer == 0]
    assert [(s.piece, s.stop - s.start) for s in slices] == [("gdn_in_proj", 6144), ("mlp", 8704)]

    rng = np.random.default_rng(27)
    x = mx.array(fp16_exact(rng.standard_normal((40, args.hidden_size)) * 2))  # a padded last chunk: 40 of 64 rows
    for s in slices:
        (part,) = plan.program_parts(s)
        shape, weights, build = build_piece(args, model, PieceSlice(0, s.piece, part.start, part.stop), 64, 64)
        path = save_program(build(shape, weights), tmp_path / f"{s.piece}.mlpackage")
        report = lint_package(path, plan.program_budget)
        assert not report.errors, report.lines()
        blob = path / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
        assert weights_nbytes(weights) <= blob.stat().st_size < 1.01 * weights_nbytes(weights) + 65536
        ex = ReferenceExecutor(path)
        xn = layer.post_attention_layernorm(x) if s.piece == "mlp" else layer.input_layernorm(x)  # the GPU's norm
        out = ex({"x": bc1s(np.array(xn), 64)})
        rows = slice(part.start, part.stop)
        if s.piece == "mlp":
            mlp = layer.mlp
            assert same_bits(ex.weights()["down_proj_0_weight"][:, :, 0, 0], mlx_fp16(mlp.down_proj)[:, rows])
            g, u = (_qmm(xn, p, rows) for p in (mlp.gate_proj, mlp.up_proj))  # [40, 8704]
            ref = _qmm(nn.silu(g) * u, mlp.down_proj, cols=rows)  # [40, hidden]
            ours = from_bc1s(out["out"], 40)
        else:
            z = layer.linear_attn.in_proj_z
            assert same_bits(ex.weights()["z_proj_weight"][:, :, 0, 0], mlx_fp16(z)[rows])
            ref = _qmm(xn, z, rows)  # [40, 6144]
            ours = from_bc1s(out["z"], 40)
        m = compare(ours, np.array(ref))
        assert m["cosine"] >= 0.9999 and m["psnr_db"] >= 60, (s.piece, m)


def _qmm(x: mx.array, layer: nn.QuantizedLinear, rows: slice = slice(None), cols: slice = slice(None)) -> mx.array:
    """x @ W[rows, cols].T with MLX's quantized matmul on the packed weights (rows and whole groups of columns)."""
    g, per_word = layer.group_size, 32 // layer.bits
    c0, c1, _ = cols.indices(layer.weight.shape[1] * per_word)
    w = layer.weight[rows, c0 // per_word : c1 // per_word]
    s, b = layer.scales[rows, c0 // g : c1 // g], layer.biases[rows, c0 // g : c1 // g]
    return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=g, bits=layer.bits)


def test_split_prefill_of_a_4bit_bundled_model_runs_its_lookup_table_programs_and_verifies(tmp_path, monkeypatch):
    """`hetero convert --quantize 4` of the bundled model, split at 0.5 through the ANE lane's worker (the reference
    executor here): the programs it exports hold the 4-bit tables (not fp16), and --verify's check passes (fp32
    here; bf16 on a 4-bit checkpoint: tests/test_verify_layouts.py)."""
    import hetero
    from hetero.pipeline import configure, verify

    monkeypatch.setenv("HETERO_HOME", str(tmp_path / "home"))
    engine = hetero.load(str(quantize_checkpoint(None, tmp_path / "q4", bits=4, group_size=64)), mx.float32)
    run = configure(engine, 0.5, 64)
    assert run.plan.storage.bits == 4
    prompt = np.random.default_rng(1).integers(0, engine.model.args.vocab_size, 200).tolist()
    check = verify(run, prompt, n_tokens=8)
    assert check["match"] and check["greedy_match_tokens"] == 8, check
    (manifest,) = (tmp_path / "home" / "coreml").rglob("manifest.json")
    programs = json.loads(manifest.read_text())["programs"]
    h = engine.model.args.hidden_size
    mlp = next(p for p in programs if p["piece"] == "mlp")
    channels = mlp["part"][1] - mlp["part"][0]
    assert mlp["weight_bytes"] == 3 * h * channels * lut_bytes_per_weight(4, 64)  # the tables (the norm runs on the GPU)


@pytest.mark.skipif(__import__("platform").system() != "Darwin", reason="Core ML predictions need macOS (15+ here)")
def test_coreml_runs_the_lookup_table_programs_like_the_reference_executor(tmp_path):
    """On a Mac: every program of a 4-bit export loads in Core ML (macOS 15: constexpr_lut_to_dense with a table per
    row and group) and matches the reference executor, which expands the same tables."""
    from hetero.coreml.backends.coreml_macos import load

    q4 = _quantized_tiny(tmp_path)
    manifest = export_coreml(str(q4), tmp_path / "out", 0.5, chunk=64, contexts=[128])
    rng = np.random.default_rng(3)
    for p in manifest["programs"]:
        inputs = {name: rng.standard_normal(shape).astype(np.float16) * (0 if name.startswith("mask") else 1)
                  for name, shape in p["inputs"].items()}
        ours = load(tmp_path / "out" / p["file"], p.get("function"), report=False)(inputs)
        ref = ReferenceExecutor(tmp_path / "out" / p["file"], p.get("function"))(inputs)
        assert all(compare(ours[k], ref[k])["cosine"] >= 0.9999 for k in ref), p["file"]
