"""Quantized mixture-of-experts checkpoints: mlx-community's `switch_mlp` layout, both ways.

One tiny random `qwen3_5_moe` model (8 experts, top-3, shared expert, an MTP head whose drafts mostly agree with
the backbone; every width a multiple of the group size) is written as an HF checkpoint by hetero.training.hf_export
(experts fused, the layout mlx-lm's qwen3_5_moe reads), then quantized twice: by `mlx_lm.convert` (4 bits, group
32; mlx-lm keeps the router and the shared expert's gate at 8 bits, group 64) and by `hetero convert --quantize`.
Hetero must load mlx-lm's output with mlx-lm's logits and greedy tokens, mlx-lm must load hetero's output with
hetero's logits, and on the quantized experts (`gather_qmm`) the compiled decode step and MTP decoding must give
exactly what the op-by-op graph and plain decoding give.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from test_speculative import agreeing_model

import hetero  # noqa: F401  (MKL under MLX before any model runs)
from hetero.checkpoint.loader import load_model
from hetero.checkpoint.preflight import preflight
from hetero.cli.quantize import quantize_checkpoint
from hetero.decode.prefill import prefill
from hetero.decode.records import MTPStats
from hetero.decode.sampling import Sampler, SamplingParams
from hetero.decode.solo import decode_tokens
from hetero.decode.solo import decode_tokens
from hetero.models import moe
from hetero.models.qwen3_5 import Model, ModelArgs
from hetero.training.hf_export import hf_config, save_hf_checkpoint
from hetero.training.tokenizer_train import save_tokenizer, train_tokenizer
from tiny_checkpoint import TEXT

GROUP, BITS = 32, 4
ROUTER = {"group_size": 64, "bits": 8}  # mlx-lm's quant_predicate for qwen3_5_moe
RTOL = 1e-4  # max |ours - theirs| <= RTOL * max |theirs|; measured ~4e-6 (fp32 accumulation order only)
NEW_TOKENS = 24
GREEDY = SamplingParams()
CONFIG = dict(
    model_type="qwen3_5_moe_text", hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
    head_dim=32, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
    vocab_size=256, layer_types=["linear_attention", "full_attention"] * 2,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
    mtp_num_hidden_layers=1, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64,
    shared_expert_intermediate_size=64, tie_word_embeddings=False,
)


def agreeing_moe_model(seed: int, alpha: float = 0.3) -> Model:
    """Random MoE model whose MTP head mostly predicts the backbone (test_speculative.agreeing_model)."""
    return agreeing_model(seed, 0, alpha, ModelArgs.from_config(CONFIG))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """{"hf": float HF checkpoint, "mlx_lm": its `mlx_lm.convert -q` output, "hetero": its `hetero convert
    --quantize` output}."""
    from mlx_lm.convert import convert

    root = tmp_path_factory.mktemp("moe-q")
    model = agreeing_moe_model(3)
    hf = root / "hf"
    save_hf_checkpoint(model, hf_config(model.args, eos_token_id=[], full_attention_interval=2), hf,
                       dtype=mx.float32, experts="fused")
    save_tokenizer(train_tokenizer([TEXT] * 4, vocab_size=256), hf)
    convert(str(hf), str(root / "mlx_lm"), quantize=True, q_group_size=GROUP, q_bits=BITS)
    quantize_checkpoint(str(hf), root / "hetero", bits=BITS, group_size=GROUP)
    return {"hf": hf, "mlx_lm": root / "mlx_lm", "hetero": root / "hetero"}


def mlx_lm_model(path: Path):
    from mlx_lm import load

    model, tokenizer = load(str(path))
    model.set_dtype(mx.float32)
    tokenizer._eos_token_ids = set()  # decode exactly max_tokens, as hetero does without EOS ids
    return model, tokenizer


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, CONFIG["vocab_size"], n).tolist()


def hetero_logits(model: Model, ids: list[int]) -> np.ndarray:
    logits, _ = prefill(model, ids, model.make_cache(), chunk=512, all_logits=True)
    return np.array(logits.astype(mx.float32))


def mlx_lm_logits(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def assert_close(ours: np.ndarray, theirs: np.ndarray) -> None:
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    assert err <= RTOL, f"max |diff| / max |ref| = {err:.2e}"


def config_quantization(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization"]


def test_mlx_lm_checkpoint_loads_with_its_quantization(checkpoints):
    """mlx-lm's output is the switch_mlp layout with 8-bit routers, and hetero builds exactly those modules."""
    path = checkpoints["mlx_lm"]
    names = mx.load(str(path / "model.safetensors"))
    for part in ("weight", "scales", "biases"):
        assert names[f"language_model.model.layers.0.mlp.switch_mlp.gate_proj.{part}"].shape[0] == 8
    assert not any(".experts." in n or n.startswith("mtp.") for n in names)  # stacked; mlx-lm drops the MTP head
    q = config_quantization(path)
    assert q["language_model.model.layers.3.mlp.gate"] == ROUTER
    assert q["language_model.model.layers.3.mlp.shared_expert_gate"] == ROUTER
    assert preflight(path).ok

    model, _, _ = load_model(path, dtype=mx.float32)
    block = model.model.layers[1].mlp
    assert isinstance(block, moe.SparseMoeBlock)
    for proj in (block.switch_mlp.gate_proj, block.switch_mlp.up_proj, block.switch_mlp.down_proj):
        assert isinstance(proj, moe.QuantizedSwitchLinear) and (proj.group_size, proj.bits) == (GROUP, BITS)
    for router in (block.gate, block.shared_expert_gate):
        assert isinstance(router, nn.QuantizedLinear) and (router.group_size, router.bits) == (64, 8)


@pytest.mark.parametrize("form", ["pairs", "sorted", "grouped"])
def test_logits_match_mlx_lm_on_its_quantized_checkpoint(checkpoints, form, monkeypatch):
    """Every form of the routed experts (gather_qmm per pair, sorted by expert, grouped) gives mlx-lm's logits."""
    ids = prompt(160, 1)
    theirs = mlx_lm_logits(mlx_lm_model(checkpoints["mlx_lm"])[0], ids)
    model, _, _ = load_model(checkpoints["mlx_lm"], dtype=mx.float32)
    monkeypatch.setattr(moe.SwitchGLU, "form", lambda self, *sizes: form)
    ours = hetero_logits(model, ids)
    assert_close(ours, theirs)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    if form == "pairs":  # the weights really are the rounded ones: the float model is far outside the tolerance
        float_model, _, _ = load_model(checkpoints["hf"], dtype=mx.float32)
        assert np.abs(hetero_logits(float_model, ids) - theirs).max() > 100 * RTOL * np.abs(theirs).max()


def test_greedy_tokens_match_mlx_lm(checkpoints):
    from mlx_lm import stream_generate

    model, _, _ = load_model(checkpoints["mlx_lm"], dtype=mx.float32)
    theirs_model, tokenizer = mlx_lm_model(checkpoints["mlx_lm"])
    ids = prompt(40, 2)
    ours = list(decode_tokens(model, ids, Sampler(GREEDY), NEW_TOKENS, set()))
    theirs = [int(r.token) for r in stream_generate(theirs_model, tokenizer, ids, max_tokens=NEW_TOKENS)]
    assert ours == theirs and len(ours) == NEW_TOKENS
    assert len(set(ours)) > 3, "a degenerate continuation would not test much"


def test_hetero_convert_writes_mlx_lms_layout(checkpoints):
    """The same tensor names, shapes and packed experts as mlx-lm's own convert, plus the MTP head; hetero keeps
    the GDN's tiny in_proj_a / in_proj_b in float (its own rule) where mlx-lm quantizes them."""
    ours = mx.load(str(checkpoints["hetero"] / "model.safetensors"))
    theirs = mx.load(str(checkpoints["mlx_lm"] / "model.safetensors"))
    kept_float = {n for n in theirs if ".in_proj_a." in n or ".in_proj_b." in n}
    assert {n for n in ours if not n.startswith("mtp.")} == (set(theirs) - kept_float) | {
        n.rsplit(".", 1)[0] + ".weight" for n in kept_float
    }
    assert any(n.startswith("mtp.layers.0.mlp.switch_mlp.") and n.endswith(".scales") for n in ours)
    for name in theirs.keys() - kept_float:
        assert ours[name].shape == theirs[name].shape and ours[name].dtype == theirs[name].dtype, name
        if ".switch_mlp." in name or ".mlp.gate." in name:  # same weights, same mx.quantize: the same bits
            assert mx.array_equal(ours[name], theirs[name]).item(), name
    q, q_theirs = config_quantization(checkpoints["hetero"]), config_quantization(checkpoints["mlx_lm"])
    assert {k: v for k, v in q.items() if not k.startswith("mtp.")} == {k: v for k, v in q_theirs.items() if k != "mode"}
    assert q["mtp.layers.0.mlp.gate"] == ROUTER


def test_mlx_lm_loads_hetero_convert_with_the_same_logits(checkpoints):
    ids = prompt(160, 3)
    model, _, _ = load_model(checkpoints["hetero"], dtype=mx.float32)
    assert isinstance(model.mtp.layers[0].mlp.switch_mlp.up_proj, moe.QuantizedSwitchLinear)
    theirs_model, _ = mlx_lm_model(checkpoints["hetero"])
    ours, theirs = hetero_logits(model, ids), mlx_lm_logits(theirs_model, ids)
    assert_close(ours, theirs)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def decode(model: Model, ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """Greedy one-token steps after a prefill: (tokens, logits [steps, V])."""
    cache = model.make_cache()
    logits, _ = prefill(model, ids, cache)
    tokens, rows = [], []
    for _ in range(steps):
        tokens.append(int(mx.argmax(logits[-1]).item()))
        out, _ = model(mx.array([[tokens[-1]]]), cache)
        logits = out[0]
        rows.append(np.array(logits[-1]))
    return tokens, np.stack(rows)


def test_compiled_decode_step_runs_gather_qmm(checkpoints, monkeypatch):
    """Decode steps run the quantized experts inside the compiled layer functions: gather_qmm is traced once per
    MoE layer at the first step and never called again from Python, and the numbers equal the op-by-op graph's."""
    model, _, _ = load_model(checkpoints["hetero"], dtype=mx.float32)  # fresh: nothing compiled for it yet
    calls = []
    gather_qmm = mx.gather_qmm
    monkeypatch.setattr(mx, "gather_qmm", lambda *a, **k: calls.append(1) or gather_qmm(*a, **k))
    ids = prompt(70, 4)
    cache = model.make_cache()
    logits, _ = prefill(model, ids, cache)
    per_step = []
    for _ in range(8):
        before = len(calls)
        out, _ = model(mx.array([[int(mx.argmax(logits[-1]).item())]]), cache)
        logits = out[0]
        per_step.append(len(calls) - before)
    layers = model.args.num_hidden_layers
    assert per_step[0] == 2 * layers and per_step[1:] == [0] * 7, per_step  # gate|up (one product) and down per layer

    tokens, compiled = decode(model, ids, 12)
    mx.disable_compile()
    try:
        plain_tokens, plain = decode(model, ids, 12)
    finally:
        mx.enable_compile()
    assert tokens == plain_tokens
    np.testing.assert_allclose(compiled, plain, rtol=1e-5, atol=1e-5)


def test_mtp_greedy_equals_plain_on_quantized_moe(checkpoints):
    model, _, _ = load_model(checkpoints["hetero"], dtype=mx.float32)
    assert model.has_mtp
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] * 2
    plain = list(decode_tokens(model, ids, Sampler(GREEDY), 40, set()))
    accepted = []
    for depth in (1, 3):
        stats = MTPStats(depth)
        out = list(decode_tokens(model, ids, Sampler(GREEDY), 40, set(), depth=depth, stats=stats))
        assert out == plain, f"depth {depth}"
        accepted.append(stats.to_dict()["mean_accepted_length"])
    assert 1.2 < accepted[1] < 4.0, f"drafts neither all rejected nor all accepted: {accepted}"
