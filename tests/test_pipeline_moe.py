"""The two-lane split on a mixture-of-experts checkpoint: the ANE takes channels of each MoE layer's shared expert
(the MLP program over the shared expert's weights) beside attention heads and GDN z rows; the GPU runs the router,
the routed experts, the rest of the shared expert and its sigmoid gate after the merge. Split prefill against the
GPU-only run (logits, caches, greedy continuation), the merge of one layer against the model's own MoE block, and
`hetero run --ane-fraction 0.3 --verify`, `hetero plan --recommend` and `--ane-fraction auto` on the checkpoint.

The fixture is a qwen3_5_moe checkpoint written by hetero.training.hf_export (per-expert tensors, an MTP layer with its
own experts) with a byte-level BPE tokenizer: 4 layers alternating GDN and attention, every one MoE, 4 experts of
which 2 per token, a shared expert 128 channels wide (two 64-channel units, so a fraction can take half of it).
"""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from hetero.cli.main import main
from hetero.decode.prefill import prefill
from hetero.models.moe import SparseMoeBlock
from hetero.models.qwen3_5 import Model, ModelArgs
from hetero.pipeline import GpuMoERest, configure, verify
from hetero.pipeline.shares import from_bc1s, to_bc1s
from hetero.training.hf_export import hf_config, save_hf_checkpoint
from hetero.training.tokenizer_train import save_tokenizer, train_tokenizer
from tiny_checkpoint import TEXT

SHARED = 128  # shared expert channels: 2 units of 64
CONFIG = dict(
    model_type="qwen3_5_moe_text", hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=SHARED,
    mtp_num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=4096,
)


def write_moe_checkpoint(path, seed: int = 3):
    """A random qwen3_5_moe checkpoint (fp32) with an MTP head and a tokenizer, via hetero.training.hf_export.

    Norm scales 1 + 0.3 N(0, 1), matrices N(0, 1/fan_in) (experts per expert), lm_head N(0, 9/fan_in): every block
    moves the residual stream visibly, so a wrong merge shows in the logits, and greedy choices are clear.
    """
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer([TEXT] * 4, vocab_size=320)
    save_tokenizer(tok, path)
    vocab = 64 * math.ceil(tok.get_vocab_size() / 64)
    model = Model(ModelArgs.from_config(dict(CONFIG, vocab_size=vocab)), with_mtp=True)
    rng = np.random.default_rng(seed)
    params = []
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("linear_attn.norm.weight"):
            v = 0.5 + rng.random(p.shape)
        elif name.endswith("norm.weight"):
            v = 1.0 + 0.3 * rng.standard_normal(p.shape)
        elif name.endswith("A_log"):
            v = rng.uniform(math.log(0.05), math.log(5.0), p.shape)
        elif name.endswith(("dt_bias", "embed_tokens.weight")):
            v = rng.standard_normal(p.shape)
        elif name == "lm_head.weight":
            v = 3.0 * rng.standard_normal(p.shape) / math.sqrt(p.shape[1])
        else:
            v = rng.standard_normal(p.shape) / math.sqrt(p.shape[-1])
        params.append((name, mx.array(v.astype(np.float32))))
    model.update(tree_unflatten(params))
    config = hf_config(model.args, eos_token_id=[2], full_attention_interval=2)
    save_hf_checkpoint(model, config, path, dtype=mx.float32)
    return path


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return write_moe_checkpoint(tmp_path_factory.mktemp("moe-pipe") / "ckpt")


@pytest.fixture(scope="module")
def moe_engine(moe_checkpoint):
    """The checkpoint as `hetero run` loads it (same identity, so the tests and the CLI share one export)."""
    import hetero

    engine = hetero.load(moe_checkpoint)
    assert engine.config["model_type"] == "qwen3_5_moe" and engine.model.has_mtp
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in engine.model.layers)
    return engine


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


ALL = ("attention", "mlp", "gdn_in_proj", "shared_expert")
# (fraction, piece kinds offloaded, shared-expert channels on the ANE, attention KV heads, GDN z rows of 128)
CASES = [
    (0.3, ALL, 64, 1, 128),  # half the shared expert and of the KV heads: both lanes merge on every layer
    (1.0, ("shared_expert",), SHARED, 0, 0),  # the whole shared expert on the ANE, nothing else
    (0.2, ALL, 0, 0, 64),  # the shared expert rounds to no channel: MoE layers whole, GDN z rows split
]
TOKENS = 120  # 2 chunks of 64 (the second padded, reading the first's cache): context bucket 128, as PROMPT's


@pytest.mark.parametrize("fraction, offload, channels, heads, z", CASES)
def test_split_prefill_matches_gpu_only_on_moe(moe_engine, fraction, offload, channels, heads, z):
    """Every layer, GDN and attention alike, gives the ANE its planned shared-expert channels; the split's logits
    and caches are within the verify tolerance of the GPU-only run and 32 greedy tokens identical."""
    model = moe_engine.model
    run = configure(moe_engine, fraction, 64, offload=offload)
    ids = _prompt(TOKENS, model.args.vocab_size)
    split = run.splitter(len(ids))
    progs = split.programs
    for i, layer in enumerate(model.layers):
        assert progs.share("shared_expert", i) == channels, i
        assert progs.share("mlp", i) == 0  # no dense MLP in an MoE layer
        assert progs.share("gdn_in_proj" if layer.is_linear else "attention", i) == (z if layer.is_linear else heads)
        assert (i in split.pieces.moe_rest) == bool(channels)
        if channels:
            # a GPU shared rest only if any channel is left
            assert (split.pieces.moe_rest[i].shared is None) == (channels == SHARED)
    check = verify(run, ids, n_tokens=32)
    assert check["match"], check
    assert check["greedy_match_tokens"] == 32
    # the GDN recurrence of layer 0 never sees the ANE's numbers (z and the MLP come after it)
    split_cache, gpu_cache = model.make_cache(), model.make_cache()
    split.run(ids, split_cache, logits=False)
    prefill(model, ids, gpu_cache, 64)
    np.testing.assert_allclose(np.array(split_cache[0].recurrent), np.array(gpu_cache[0].recurrent), rtol=1e-6,
                               atol=1e-6)
    assert split_cache[1].offset == gpu_cache[1].offset == TOKENS


def test_quantized_moe_split_matches_gpu_only(moe_checkpoint):
    """4-bit weights (group 32, so the shared expert's down_proj splits at column 64): the exporter dequantizes the
    ANE's channels, the GPU rest slices the packed rows and columns and the routed experts run `gather_qmm`."""
    import types

    import mlx.nn as nn

    import hetero

    engine = hetero.load(moe_checkpoint)
    nn.quantize(engine.model, group_size=32, bits=4)
    mx.eval(engine.model.parameters())  # on this thread: the lanes evaluate on their own
    moe = engine.model.layers[1].mlp
    assert isinstance(moe.shared_expert.down_proj, nn.QuantizedLinear) and hasattr(moe.switch_mlp.gate_proj, "scales")
    engine = types.SimpleNamespace(model=engine.model, config=engine.config, path=engine.path,
                                   identity=f"{engine.identity}-q4", weights_fingerprint="q4g32")
    run = configure(engine, 0.5, 64, offload=("shared_expert",))
    assert all(run.splitter(TOKENS).pieces.moe_rest[i].shared is not None for i in range(4))  # both lanes' channels
    check = verify(run, _prompt(TOKENS, engine.model.args.vocab_size, seed=1), n_tokens=16)
    assert check["match"] and check["greedy_match_tokens"] == 16, check


@pytest.mark.parametrize("layer", [0, 1])
def test_one_layers_merge_equals_the_moe_block(moe_engine, layer):
    """The merge of one MoE layer (GDN layer 0, attention layer 1) on a random residual stream: the ANE program's
    shared channels plus the GPU rest, gated, equal the model's own block within fp16 rounding; leaving the ANE's
    share out, or the gate unapplied, is far outside that."""
    model = moe_engine.model
    split = configure(moe_engine, 0.3, 64).splitter(TOKENS)
    rest: GpuMoERest = split.pieces.moe_rest[layer]
    block = model.layers[layer]
    h = mx.array(np.random.default_rng(7).standard_normal((1, 50, model.args.hidden_size)).astype(np.float32))
    want = np.array(block.mlp(block.post_attention_layernorm(h)))[0]  # [50, hidden]
    normed = block.post_attention_layernorm(h)  # [1, 50, hidden]: the programs read the GPU lane's normed input
    x = to_bc1s(normed, 64)
    ane = sum(from_bc1s(program({"x": x})["out"], 50) for program, _ in split.programs.shared_expert[layer])
    ane = mx.array(ane)[None]  # [1, 50, hidden]: channels [0, 64) of the shared expert
    routed, shared, gate = rest(normed)  # shared: channels [64, 128)
    got = np.array(rest.finish(routed, ane + shared, gate))[0]
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 5e-3 * scale
    assert np.abs(np.array(rest.finish(routed, shared, gate))[0] - want).max() > 0.05 * scale
    assert np.abs(np.array(routed + ane + shared)[0] - want).max() > 0.05 * scale


PROMPT = "def add(a, b):\n    return a + b\n" * 8  # 112 tokens: 2 chunks of 64, bucket 128


def test_run_split_verify_on_moe(moe_engine, moe_checkpoint, capsys):
    """`hetero run --ane-fraction 0.3 --verify` on the MoE checkpoint exits 0 with the ANE lane busy, and
    generates what the GPU-only run does."""
    argv = ["run", "--model", str(moe_checkpoint), "--prompt", PROMPT, "--max-tokens", "8", "--ane-fraction", "0.3",
            "--prefill-chunk", "64", "--verify", "--verify-tokens", "8", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ane"]["requested_fraction"] == 0.3 and out["pipeline"]["ane_busy_s"] > 0
    assert out["verify"]["match"] and out["verify"]["greedy_compared_tokens"] == 8
    assert main(["run", "--model", str(moe_checkpoint), "--prompt", PROMPT, "--max-tokens", "8", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["tokens"] == out["tokens"]


def test_plan_recommends_and_auto_runs_on_moe(moe_engine, moe_checkpoint, monkeypatch, tmp_path, capsys):
    """With a measured profile whose ANE is as fast as its GPU, `hetero plan --recommend` on the MoE checkpoint
    gives the ANE shared-expert channels (the routed experts none, with the reason), and `--ane-fraction auto`
    takes such a split, verifies it and prefills through it."""
    from hetero.host.settings import save_device_profile
    from hetero.host.confidence import Estimate
    from hetero.pipeline import auto_fraction, export_root

    export_root().mkdir(parents=True, exist_ok=True)
    (tmp_path / "coreml").symlink_to(export_root())  # the other tests' exports, under this test's own settings
    monkeypatch.setenv("HETERO_HOME", str(tmp_path))
    save_device_profile({"name": "this-machine", "chip": "test", "source": "test", "measured": True,
                         "memory_bandwidth_gbs": 10.0, "gpu_fp32_tflops": 0.01, "ane_fp16_tflops": 0.01,
                         "ane_bandwidth_gbs": None, "ram_gb": 8, "gpu_efficiency": 1.0, "ane_efficiency": 1.0,
                         "ane_process_weight_limit_gb": None})
    assert main(["plan", "--model", str(moe_checkpoint), "--recommend", "--profile", "this-machine", "--chunk", "64",
                 "--context", "4096", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert 0 < plan["recommended_fraction"] <= 1 and "shared_expert" in plan["offload"]
    assert plan["pieces"]["shared_expert"]["ane_units"] > 0
    moe = plan["pieces"]["moe"]
    assert moe["ane_units"] == 0 and "routed experts stay on the GPU" in moe["cap_reason"]
    assert {s["piece"] for s in plan["layers"] if s["layer"] in (0, 1)} >= {"shared_expert"}
    lines: list[str] = []
    # the split's TTFT against GPU-only's is scripted a win (its timing decision is tests/test_auto.py's subject)
    run = auto_fraction(moe_engine, 64, report=lines.append, time_ttft=lambda run, ids: Estimate.of([0.8, 0.82] * 3))
    assert "verified" in lines[-1], lines
    assert "shared_expert" in run.offload
    assert {s.layer for s in run.plan.slices if s.piece == "shared_expert"} == {0, 1, 2, 3}
    ids = moe_engine.tokenizer.encode(PROMPT)
    _, n, _ = run.prefill(ids)
    assert n == len(ids) - 1 and run.last.ane_busy_s > 0
