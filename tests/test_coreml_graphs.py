"""Each Core ML prefill graph, saved as an .mlpackage and run by the reference executor, equals the MLX
computation of the same piece (cosine >= 0.9999, PSNR >= 60 dB) on random inputs: tiny random models, and one
attention KV group and an MLP slice with real Qwen3.5-27B dimensions (random weights)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from hetero.coreml.backends.accuracy import compare
from hetero.coreml.backends.reference_executor import ReferenceExecutor
from hetero.coreml.pieces import PieceSlice, attention_weights, build_piece, gdn_in_proj_weights, mlp_weights
from hetero.coreml.graphs.attention import AttentionShape, attention_masks, build_attention, cache_inputs, rope_tables
from hetero.coreml.graphs.gdn import GDNInProjShape, build_gdn_in_proj
from hetero.coreml.graphs.mlp import MLPShape, build_mlp
from hetero.coreml.graphs.package import save_program
from hetero.models.cache import KVCache
from hetero.models.qwen3_5 import MLP, Attention, Model, ModelArgs

COSINE, PSNR = 0.9999, 60.0
CONFIGS = Path(__file__).resolve().parent / "data"  # the released configs, copied into the repository

# A tiny Qwen3.5 text model: 4 layers alternating GDN / attention, head_dim 32 with 8 rotary dims, 2 KV groups.
TINY = dict(
    model_type="qwen3_5_text", vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, full_attention_interval=2,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, partial_rotary_factor=0.25, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def tiny_model(seed: int = 0, config: dict | None = None) -> Model:
    """A random MLX model (fp32): norm scales 1 + 0.3 N(0, 1), projections N(0, 1/fan_in), lm_head N(0, 4/fan_in).

    Larger than MLX's default init, so that each attention layer moves the logits visibly (a wrong RoPE or
    mask then shows in the prefill test) and the logits spread over a few units.
    """
    mx.random.seed(seed)
    model = Model(ModelArgs.from_config(config or TINY), with_mtp=False)
    rng = np.random.default_rng(seed)
    new = []
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("norm.weight"):
            new.append((k, mx.array(1 + 0.3 * rng.standard_normal(v.shape), dtype=mx.float32)))
        elif k.endswith("proj.weight") or k == "lm_head.weight":
            gain = 2.0 if k == "lm_head.weight" else 1.0
            new.append((k, mx.array(gain * rng.standard_normal(v.shape) / np.sqrt(v.shape[-1]), dtype=mx.float32)))
    model.load_weights(new, strict=False)
    mx.eval(model.parameters())
    return model


def save_checkpoint(model: Model, path: Path, config: dict | None = None) -> Path:
    """Write `model` as a converted (MLX-layout) checkpoint directory that hetero's loader reads back."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or TINY))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return path


def fp16_exact(a: np.ndarray) -> np.ndarray:
    """Round inputs to fp16 for both sides, so that input rounding is not counted as graph error."""
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def bc1s(x: np.ndarray, chunk: int) -> np.ndarray:
    """[s, C] -> (1, C, 1, chunk), zero-padded."""
    return np.pad(x.T, ((0, 0), (0, chunk - x.shape[0])))[None, :, None, :].astype(np.float16)


def from_bc1s(y: np.ndarray, s: int) -> np.ndarray:
    """(1, C, 1, chunk) -> [s, C]."""
    return y[0, :, 0, :s].T.astype(np.float32)


def assert_close(ours: np.ndarray, ref: np.ndarray, what: str) -> dict:
    m = compare(ours, ref)
    assert m["cosine"] >= COSINE and m["psnr_db"] >= PSNR, f"{what}: {m}"
    return m


def mlx_attention_slice(args: ModelArgs, attn: Attention, kv: range) -> Attention:
    """An MLX Attention holding only KV heads `kv`, their query heads and their o_proj columns."""
    group = args.num_attention_heads // args.num_key_value_heads
    D, h = args.head_dim, args.hidden_size
    sub = Attention(ModelArgs(**{**args.__dict__, "num_attention_heads": len(kv) * group, "num_key_value_heads": len(kv)}))
    heads = slice(kv.start * group * 2 * D, kv.stop * group * 2 * D)
    sub.load_weights([
        ("q_proj.weight", attn.q_proj.weight[heads]),
        ("k_proj.weight", attn.k_proj.weight[kv.start * D : kv.stop * D]),
        ("v_proj.weight", attn.v_proj.weight[kv.start * D : kv.stop * D]),
        ("o_proj.weight", attn.o_proj.weight[:, kv.start * group * D : kv.stop * group * D]),
        ("q_norm.weight", attn.q_norm.weight), ("k_norm.weight", attn.k_norm.weight),
    ])
    return sub


def run_attention_case(tmp_path: Path, args: ModelArgs, model: Model, layer_idx: int, kv: range, start: int, s: int,
                       chunk: int, slots: int, key_block: int, seed: int = 0, layout: str = "heads"
                       ) -> tuple[np.ndarray, dict]:
    """Chunk of s tokens at `start` (cache filled by MLX with `start` random tokens) through the program and MLX.

    Returns the program's partial output [s, hidden] after asserting it and its K/V match MLX's slice.
    """
    rng = np.random.default_rng(seed)
    layer = model.layers[layer_idx]
    sub = mlx_attention_slice(args, layer.self_attn, kv)
    prior = mx.array(fp16_exact(rng.standard_normal((1, start, args.hidden_size)) * 2))
    x = mx.array(fp16_exact(rng.standard_normal((1, s, args.hidden_size)) * 2))
    cache = KVCache()
    if start:
        sub(layer.input_layernorm(prior), cache)
    prior_k, prior_v = (np.array(a[:, :, :start]) for a in (cache.keys, cache.values)) if start else (
        np.zeros((1, len(kv), 0, args.head_dim), np.float32),) * 2
    ref = np.array(sub(layer.input_layernorm(x), cache)[0])  # [s, hidden]

    shape = AttentionShape(
        hidden=args.hidden_size, heads=sub.n_heads, kv_heads=len(kv), head_dim=args.head_dim,
        rotary_dims=args.rotary_dims, chunk=chunk, cache_slots=slots, eps=args.rms_norm_eps, key_block=key_block,
        layout=layout,
    )
    path = save_program(build_attention(shape, attention_weights(args, layer, kv)),
                        tmp_path / f"attn_{layer_idx}_{kv.start}_{layout}.mlpackage")
    normed = np.array(layer.input_layernorm(x)[0])  # the GPU lane's normed input (zero rows past s: padding)
    inputs = {"x": bc1s(normed, chunk), **rope_tables(start, shape, args.rope_theta), **attention_masks(start, shape)}
    inputs.update(cache_inputs(prior_k, prior_v, shape))
    out = ReferenceExecutor(path)(inputs)
    ours = from_bc1s(out["out"], s)
    metrics = {"out": assert_close(ours, ref, "attention output")}
    metrics["k_new"] = assert_close(out["k_new"][:, :, :s], np.array(cache.keys[:, :, start : start + s]), "new keys")
    metrics["v_new"] = assert_close(out["v_new"][:, :, :s], np.array(cache.values[:, :, start : start + s]), "new values")
    return ours, metrics


LAYOUTS = ["heads", "keys_on_channels"]  # hetero.coreml.graphs.attention.LAYOUTS: both compute the same attention


@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention_whole_layer_matches_mlx(tmp_path, layout):
    """Fraction 1.0, second chunk over a cache split into two key blocks (keys_on_channels: its softmax spelled out
    over the blocks on axis 1), last chunk padded (40 of 64 rows)."""
    model = tiny_model(1)
    _, metrics = run_attention_case(tmp_path, model.args, model, 1, range(0, 2), start=64, s=40, chunk=64, slots=128,
                                    key_block=64, layout=layout)
    assert metrics["out"]["cosine"] >= COSINE


@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention_first_chunk_without_cache(tmp_path, layout):
    model = tiny_model(2)
    run_attention_case(tmp_path, model.args, model, 3, range(0, 2), start=0, s=64, chunk=64, slots=0, key_block=64,
                       layout=layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention_slices_match_mlx_and_add_up_to_the_layer(tmp_path, layout):
    """Each KV-group slice equals MLX's slice; their partial o_proj sums add up to the whole layer's output
    (keys_on_channels: every key on one axis, the native softmax over axis 1)."""
    model = tiny_model(3)
    args = model.args
    run = lambda kv: run_attention_case(tmp_path, args, model, 1, kv, start=64, s=64, chunk=64, slots=192,  # noqa: E731
                                        key_block=16384, layout=layout)[0]
    assert_close(run(range(0, 1)) + run(range(1, 2)), run(range(0, 2)), "sum of slices")


@pytest.mark.parametrize("channels, shift", [(np.arange(0, 128), 0), (np.r_[0:64, 128:192], 3)])
def test_mlp_slice_matches_mlx(tmp_path, channels, shift):
    """A 128-of-192-channel slice (the first 128, or blocks 0 and 2: any set, as ranges choose them), processed in
    two channel blocks, equals MLX's MLP over those channels; an output shift of 3 comes out 8 times smaller."""
    model = tiny_model(4)
    args, layer = model.args, model.layers[0]
    rng = np.random.default_rng(4)
    x = mx.array(fp16_exact(rng.standard_normal((1, 50, args.hidden_size)) * 2))
    mlp = layer.mlp
    idx = mx.array(channels)
    sub = MLP(args.hidden_size, len(channels))
    sub.load_weights([("gate_proj.weight", mlp.gate_proj.weight[idx]), ("up_proj.weight", mlp.up_proj.weight[idx]),
                      ("down_proj.weight", mlp.down_proj.weight[:, idx])])
    normed = layer.post_attention_layernorm(x)  # [1, 50, hidden]: the GPU lane's normed input
    ref = np.array(sub(normed)[0])  # [50, hidden]
    shape = MLPShape(args.hidden_size, len(channels), chunk=64, channel_block=64)
    path = save_program(build_mlp(shape, mlp_weights(mlp, channels, shift)), tmp_path / "mlp.mlpackage")
    out = ReferenceExecutor(path)({"x": bc1s(np.array(normed[0]), 64)})
    assert_close(from_bc1s(out["out"], 50) * 2.0**shift, ref, "mlp slice")


def test_gdn_in_proj_z_rows_match_mlx(tmp_path):
    model = tiny_model(5)
    args = model.args
    layer = model.layers[0]
    rng = np.random.default_rng(5)
    x = mx.array(fp16_exact(rng.standard_normal((1, 64, args.hidden_size)) * 2))
    normed = layer.input_layernorm(x)  # [1, 64, hidden]: the GPU lane's normed input
    ref = np.array(layer.linear_attn.in_proj_z(normed)[0, :, :32])  # [64, 32]
    shape = GDNInProjShape(args.hidden_size, 32, chunk=64)
    path = save_program(build_gdn_in_proj(shape, gdn_in_proj_weights(layer, range(0, 32))), tmp_path / "z.mlpackage")
    out = ReferenceExecutor(path)({"x": bc1s(np.array(normed[0]), 64)})
    assert_close(from_bc1s(out["z"], 64), ref, "gdn z rows")


def test_build_piece_shapes_follow_the_slice():
    model = tiny_model(6)
    shape, w, _ = build_piece(model.args, model, PieceSlice(1, "attention", 1, 2), chunk=64, context=256)
    assert (shape.heads, shape.kv_heads, shape.cache_slots) == (2, 1, 192)
    assert w.q.shape == (64, 64) and w.o.shape == (64, 64)


def real_27b_args() -> ModelArgs:
    return ModelArgs.from_config(json.loads((CONFIGS / "qwen3.5-27b.json").read_text()))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_real_27b_attention_kv_group_matches_mlx(tmp_path, layout):
    """One KV group (6 query heads of 24, head_dim 256, hidden 5120) of a Qwen3.5-27B attention layer, random
    weights, second 64-token chunk over 64 cached positions, in either layout."""
    args = real_27b_args()
    # One KV group of the real layer is exactly a layer with 6 query heads and 1 KV head: build only that.
    group = args.num_attention_heads // args.num_key_value_heads
    args.num_attention_heads, args.num_key_value_heads = group, 1
    layer = _random_attention_layer(args, seed=7)
    model = type("One", (), {"layers": [layer]})()
    run_attention_case(tmp_path, args, model, 0, range(0, 1), start=64, s=64, chunk=64, slots=64, key_block=16384,
                       layout=layout)


def _random_attention_layer(args: ModelArgs, seed: int):
    """A full-attention decoder layer with std 1/sqrt(fan_in) projections and 1 + 0.3 N(0,1) norm scales."""
    from hetero.models.qwen3_5 import DecoderLayer

    mx.random.seed(seed)
    layer = DecoderLayer(args, "full_attention")
    rng = np.random.default_rng(seed)
    layer.mlp = nn.Identity()  # not needed here: keep the test's memory small
    new = []
    for k, v in tree_flatten(layer.parameters()):
        if k.endswith("norm.weight"):
            new.append((k, mx.array(1 + 0.3 * rng.standard_normal(v.shape), dtype=mx.float32)))
        else:
            new.append((k, mx.random.normal(v.shape) / np.sqrt(v.shape[-1])))
    layer.load_weights(new)
    mx.eval(layer.parameters())
    return layer
