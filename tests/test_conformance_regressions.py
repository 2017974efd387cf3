"""Each failure the conformance harness found (or issue 46 reported), kept with the smallest config that shows it.

- An all-attention checkpoint has no GDN conv to tell transformers' layout (zero-centred norms) from MLX's (the +1
  stored): its norms went without their +1 and the logits came out 100% off. The files' writer decides now.
- QSA at budgets past 8: the indexer's scores tie exactly (relu(q.k) = 0 for a block whose every head's dot is
  negative), torch's top-k leaves the order of ties unspecified, and which tied block a query keeps moved the logits
  0.01-0.3. hetero keeps the lower index, and so does the oracle (`conformance_checks.stable_topk`); with that rule
  fixed the logits agree within 1e-4 at every position at every budget.
- The issue's MoE prompt lengths (129, 256, 257 tokens, past the expert paths' switches) and its first-call
  statefulness, kept as they were reported: both agree now.
- A draw whose massive activations cancel (a residual channel written in one layer, taken back in another): one
  transformers fp32 run is one sample of rounding and can be the lucky one; the bound now reads fp32's spread.
"""

from __future__ import annotations

import json
from pathlib import Path

import hetero  # noqa: F401  (the fast BLAS before MLX)
import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten

import conformance_checks as cc
import qwen4_checkpoint as qc
from conformance_space import Draw
from hetero.checkpoint.loader import load_model

TOL = 1e-4


def _logits(model, tokens: list[int]) -> np.ndarray:
    return np.array(model(mx.array([tokens]))[0][0])


def _tokens(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(2, vocab, n).tolist()


# ---------------------------------------------------------------------------------------------------------------
# All-attention layouts: the norms' +1


ALL_ATTENTION = Draw(arch="qwen3_5_moe_text", prompt=24, seed=3, config=dict(
    vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=8, linear_value_head_dim=8,
    num_hidden_layers=1, layer_types=["full_attention"], tie_word_embeddings=True, num_experts=2,
    num_experts_per_tok=1, moe_intermediate_size=8, shared_expert_intermediate_size=8, eos_token_id=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5}))


def test_an_all_attention_checkpoint_gets_its_norms_plus_one_exactly_once(tmp_path):
    """One full-attention MoE layer (no GDN conv): transformers' checkpoint (`format: pt`) matches transformers,
    and the same weights written by MLX with the +1 stored (`format: mlx`, as mlx-lm and `hetero convert` write
    them) load to the same logits."""
    hf = cc.write(ALL_ATTENTION, tmp_path / "hf")
    tokens = _tokens(24, 62)
    model = load_model(tmp_path / "hf", mx.float32, fuse_projections=False)[0]
    ours = _logits(model, tokens)
    assert cc.relative(ours, cc.hf_logits(hf, tokens)) <= TOL
    converted = tmp_path / "mlx"
    converted.mkdir()
    mx.save_safetensors(str(converted / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (converted / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    assert np.array_equal(_logits(load_model(converted, mx.float32)[0], tokens), ours)


# ---------------------------------------------------------------------------------------------------------------
# QSA at any budget: ties in the indexer's scores


def _issue_layout(budget: int, ratio: int, kv: int) -> dict:
    """The issue's layout: hidden 96, 8 layers (3 GDN + 1 QSA, twice), 4 streams, partial rotary 0.25, untied."""
    return dict(hidden_size=96, num_hidden_layers=8, num_key_value_heads=kv, head_dim=32, indexer_head_dim=16,
                layer_types=(["linear_attention"] * 3 + ["indexed_attention"]) * 2, hc_count=4,
                indexer_budget=budget, indexer_compress_ratio=ratio, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1]})


def _tied_at_boundary(model, tokens: list[int]) -> int:
    """Queries of the first QSA layer whose k-th and (k+1)-th best complete blocks score the same (hetero's own
    scores, as `Indexer.select` computes them)."""
    from hetero.models.qwen4_exp.qsa import rope_at

    layer = next(i for i, l in enumerate(model.layers) if not l.is_linear)
    x = mx.array(tokens)[None]
    captured = {}
    attn = model.layers[layer].self_attn
    real = attn.indexer.select
    attn.indexer.select = lambda q, keys, offset: captured.setdefault("qk", (q, keys)) and real(q, keys, offset)
    try:
        model(x)
    finally:
        del attn.indexer.select
    q, keys = captured["qk"]
    ix = attn.indexer
    n = keys.shape[1] // ix.ratio
    q = rope_at(q, mx.arange(len(tokens)), ix.rotary).astype(mx.float32)
    scores = np.array(mx.maximum(q @ ix.pool(keys, 0, n)[:, None].swapaxes(-1, -2), 0).sum(2))[0]  # [S, NB]
    ties = 0
    for p, row in enumerate(scores):
        complete = (p + 1) // ix.ratio
        if complete > ix.blocks:
            ranked = np.sort(row[:complete])[::-1]
            ties += int(ranked[ix.blocks - 1] == ranked[ix.blocks])
    return ties


@pytest.mark.parametrize("budget, ratio, kv", [(8, 4, 1), (16, 4, 2), (32, 8, 1), (64, 8, 2)])
def test_qsa_matches_transformers_at_every_position_at_any_budget(tmp_path, budget, ratio, kv):
    """The issue's layout at budgets 8-64 (compress ratio 4 or 8, 1 or 2 KV heads), a prompt of 4 budgets: the
    logits within 1e-4 of transformers' at every position, with transformers' ties in index order."""
    hf = qc.build(tmp_path, ple_layer_ids=(1,), seed=budget, **_issue_layout(budget, ratio, kv))
    tokens = _tokens(4 * budget, qc.VOCAB, budget)
    model = load_model(tmp_path, mx.float32)[0]
    assert cc.relative(_logits(model, tokens), cc.hf_logits(hf, tokens)) <= TOL


def test_qsa_ties_keep_the_lower_block(tmp_path):
    """With one indexer head, a block scores exactly 0 whenever its q.k is negative, so many queries choose among
    tied blocks: each keeps the lower index (a stable sort's choice), which the oracle pinned to the same rule
    confirms within 1e-4 at every position."""
    hf = qc.build(tmp_path, ple_layer_ids=(), seed=5, indexer_n_heads=1,
                  **dict(_issue_layout(16, 4, 1), num_hidden_layers=4, layer_types=["linear_attention",
                         "indexed_attention"] * 2))
    tokens = _tokens(96, qc.VOCAB, 5)
    model = load_model(tmp_path, mx.float32)[0]
    assert _tied_at_boundary(model, tokens) > 0  # the case is real: ties decide some queries' blocks
    assert cc.relative(_logits(model, tokens), cc.hf_logits(hf, tokens)) <= TOL


# ---------------------------------------------------------------------------------------------------------------
# The issue's other reports, kept


def test_moe_prompts_past_the_expert_paths_switches_match_transformers(tmp_path):
    """The issue's Qwen3-Next MoE layout (hidden 96, 8 layers, 8 experts top-2, norm_topk_prob false, shared expert
    96, weights as transformers initialises them) at 64-257 tokens: pairs, sorted and grouped expert forms alike."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from helpers import TEXT

    torch.manual_seed(0)
    config = dict(TEXT, hidden_size=96, num_hidden_layers=8, num_experts=8, num_experts_per_tok=2,
                  norm_topk_prob=False, shared_expert_intermediate_size=96, full_attention_interval=4)
    hf = Qwen3NextForCausalLM(Qwen3NextConfig(**config)).eval()
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, mx.float32)[0]
    for n in (64, 129, 256, 257):
        tokens = _tokens(n, 256, n)
        assert cc.relative(_logits(model, tokens), cc.hf_logits(hf, tokens)) <= TOL, n


def test_the_first_logits_call_after_load_is_the_later_ones(tmp_path):
    """`Engine.logits` right after `hetero.load`, again, and chunked across the wavefront: bitwise the same the
    first two times (nothing in the path keeps state between calls)."""
    qc.build(tmp_path, ple_layer_ids=(1,), seed=2, **_issue_layout(16, 4, 1))
    qc.add_tokenizer(tmp_path)
    engine = hetero.load(tmp_path)
    tokens = _tokens(96, qc.VOCAB, 2)
    first, second = engine.logits(tokens), engine.logits(tokens)
    assert np.array_equal(first, second)
    assert cc.relative(engine.logits(tokens, chunk=32), first) <= TOL
    assert json.loads((tmp_path / "config.json").read_text())["indexer_budget"] == 16


def test_moe_experts_run_in_half_precision_on_the_cpu(tmp_path):
    """MLX's CPU `gather_mm` multiplies float32 only ("[GatherMM::eval] Currently only supports float32"): an MoE
    checkpoint loaded in bf16 or fp16 crashed on its first prefill here. Its experts' products now run in fp32 and
    round back, and the logits lie within the dtype's rounding of fp32's."""
    cc.write(ALL_ATTENTION, tmp_path)
    tokens = _tokens(40, 62)
    exact = _logits(load_model(tmp_path, mx.float32)[0], tokens)
    for dtype, tol in ((mx.bfloat16, 5e-2), (mx.float16, 1e-2)):
        half = np.array(load_model(tmp_path, dtype)[0](mx.array([tokens]))[0][0].astype(mx.float32))
        assert cc.relative(half, exact) <= tol, dtype


def test_the_vision_lane_in_bf16_is_held_to_the_towers_own_rounding(tmp_path):
    """A bf16 split with an image: the lane's tower programs (fp16) were held to 60 dB against the bf16 GPU tower,
    whose own rounding lies ~50 dB from the exact tower, so an honest lane failed at 46.6 dB. Against the tower in
    fp32, no lower than the bf16 tower's own run: it passes, and says both."""
    from conformance_vision import check_vision_split

    draw = Draw.from_json(json.loads((Path(__file__).parent / "data" / "conformance" /
                                      "conformance_vision_bf16.json").read_text()))
    cc.write(draw, tmp_path / "vl")
    result = cc.Result()
    check_vision_split(draw, tmp_path / "vl", "bfloat16", result)
    report = result.split["bfloat16"]
    (image,) = report["vision"]
    assert report["match"] and image["ok"], report
    assert image["psnr_db"] >= image["gpu_psnr_db"] and image["gpu_psnr_db"] < 60


def test_verify_in_half_precision_on_a_checkpoint_with_ple(tmp_path):
    """`--verify` in bf16 measures against an fp32 copy of the model, and the copy missed the PLE n-gram tables,
    which a loaded Qwen4-Exp reads from the checkpoint's files (not parameters): every half-precision verify of a
    checkpoint with PLE, the released Flash-Next's included, crashed. The copy reads the same tables now."""
    from hetero.pipeline import configure, verify

    qc.build(tmp_path, ple_layer_ids=(1,), seed=3, shared_expert_intermediate_size=128)
    engine = cc.split_engine(tmp_path, mx.bfloat16)
    check = verify(configure(engine, 0.5, 64, lane="thread"), _tokens(150, qc.VOCAB, 3), n_tokens=4)
    assert check["match"] and check["reference"] == "fp32" and check["gpu_distance"] > 0, check


# ---------------------------------------------------------------------------------------------------------------
# Scaled RoPE: refused before, transformers' own types now

ROPES = {"linear": {"factor": 4.0}, "dynamic": {"factor": 4.0},
         "yarn": {"factor": 4.0, "original_max_position_embeddings": 64}}  # a short original context: the ramp bites


def _rope_draw(arch: str, kind: str, **config) -> Draw:
    rope = {"rope_type": kind, "rope_theta": 10_000.0, "partial_rotary_factor": 0.5, **ROPES[kind]}
    base = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], tie_word_embeddings=False,
                intermediate_size=256, eos_token_id=1, rope_parameters=rope)
    return Draw(arch=arch, prompt=150, seed=7, config={**base, **config}, weights={"gain": 0.5})


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_scaled_rope_matches_transformers(tmp_path, kind):
    """Linear, yarn (its frequency ramp and attention factor) and dynamic RoPE on a Qwen3.5 layout, 150 tokens past
    yarn's original 64: the logits within 1e-4 of transformers' at every position."""
    draw = _rope_draw("qwen3_5_text", kind)
    hf = cc.write(draw, tmp_path)
    tokens = cc.prompt_tokens(draw)
    assert cc.relative(_logits(load_model(tmp_path, mx.float32)[0], tokens), cc.hf_logits(hf, tokens)) <= TOL


def test_yarn_rotates_the_qsa_indexer_and_the_split_programs_alike(tmp_path):
    """Qwen4-Exp with yarn: QSA's indexer rotates its queries and block keys by the same scaled frequencies
    (transformers' shared cos and sin), and the split's attention programs take them from their rope tables: the
    logits match transformers and the split in fp32 passes `--verify`."""
    hf = qc.build(tmp_path, ple_layer_ids=(1,), seed=4, shared_expert_intermediate_size=128,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5,
                                   "factor": 4.0, "original_max_position_embeddings": 64, "mrope_section": [2, 1, 1]})
    tokens = _tokens(150, qc.VOCAB, 4)
    assert cc.relative(_logits(load_model(tmp_path, mx.float32)[0], tokens), cc.hf_logits(hf, tokens)) <= TOL
    from hetero.pipeline import configure, verify

    engine = cc.split_engine(tmp_path, mx.float32)
    check = verify(configure(engine, 0.5, 64, lane="thread"), tokens, n_tokens=4)
    assert check["match"], check


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen4_exp_text"])
def test_an_mlp_activation_other_than_silu_is_refused_in_one_line(tmp_path, arch):
    """transformers applies `hidden_act` to the MLPs (and the GDN conv); hetero ran SiLU whatever the config said,
    logits off without a word. A config with another activation is refused at load, in one line that names it."""
    from hetero.errors import HeteroError

    if arch == "qwen4_exp_text":
        qc.build(tmp_path, ple_layer_ids=(), seed=1, hidden_act="gelu")
    else:
        cc.write(Draw(**{**_rope_draw(arch, "linear").__dict__, "config": {
            **_rope_draw(arch, "linear").config, "hidden_act": "gelu"}}), tmp_path)
    with pytest.raises(HeteroError, match="unsupported hidden_act 'gelu'") as e:
        load_model(tmp_path, mx.float32)
    assert "\n" not in str(e.value)


def test_a_qsa_near_tie_moves_the_logits_and_the_oracle_takes_hetero_s_choice(tmp_path):
    """The issue's layout at budget 512 over 1,536 tokens: one query's two best candidate blocks score 3.9773805
    and 3.9773726, which transformers and hetero (two fp32 computations) order differently, and the logits at that
    position differ by 1e-3. With transformers' choice pinned to hetero's there (`conformance_oracle`, which pins
    only such near-ties), every position agrees within 1e-4."""
    from conformance_oracle import Choices, pinned

    hf = qc.build(tmp_path, ple_layer_ids=(1,), seed=512, **_issue_layout(512, 4, 2))
    tokens = np.random.default_rng(512).integers(2, qc.VOCAB, 3 * 512).tolist()
    model = load_model(tmp_path, mx.float32)[0]
    choices = Choices()
    with choices.recording(model):
        ours = _logits(model, tokens)
    assert cc.relative(ours, cc.hf_logits(hf, tokens)) > TOL  # the tie decides a position
    with pinned(hf, choices):
        assert cc.relative(ours, cc.hf_logits(hf, tokens)) <= TOL
    assert choices.ties == 1


def test_a_split_exports_the_weights_as_loaded_in_its_own_dtype(tmp_path, monkeypatch):
    """A Qwen3-Next checkpoint split in fp32, then in bf16 under the same settings: the bf16 split loaded the
    programs the fp32 run had exported (the files' weights rounded to fp16, not the bf16 weights as loaded) and
    failed `--verify` at 0.0201 against 0.0174, where the same split alone read 0.0097 (bench/conformance.py, seed
    7). Each dtype exports its own programs now, and both splits verify."""
    from hetero.pipeline import configure, verify

    monkeypatch.setenv("HETERO_HOME", str(tmp_path / "home"))
    draw = Draw.from_json(json.loads((Path(__file__).parent / "data" / "conformance" /
                                      "conformance_bf16_after_fp32.json").read_text()))
    cc.write(draw, tmp_path / "ck")
    ids = cc.split_prompt(draw)
    for dtype in (mx.float32, mx.bfloat16):
        report = verify(configure(cc.split_engine(tmp_path / "ck", dtype), 0.5, 64), ids, n_tokens=cc.GREEDY)
        assert report["match"], (dtype, report)
    exports = {p.name.split("_d")[1].split("_")[0] for p in (tmp_path / "home").rglob("f0.*") if p.is_dir()}
    assert exports == {"float32", "bfloat16"}, exports  # one export per dtype the weights were loaded in


def _bias_draw() -> Draw:
    """A Qwen4-Exp text MoE checkpoint with attention biases (bench/conformance.py --seed 11's qwen4_exp_text 5/60)."""
    return Draw.from_json(json.loads((Path(__file__).parent / "data" / "conformance" /
                                      "conformance_attention_bias_split.json").read_text()))


def test_a_split_keeps_attention_with_biases_on_the_gpu(tmp_path, monkeypatch):
    """The split refused a checkpoint with attention biases outright (the ANE's attention programs take none). Its
    attention stays on the GPU now, with the reason in the plan, and the other kinds still split and verify."""
    from hetero.pipeline import configure, verify

    monkeypatch.setenv("HETERO_HOME", str(tmp_path / "home"))
    draw = _bias_draw()
    cc.write(draw, tmp_path / "ck")
    run = configure(cc.split_engine(tmp_path / "ck", mx.float32), 0.5, 64)
    attention = next(p for p in run.plan.pieces if p.kind == "attention")
    assert attention.ane_units == 0 and "attention_bias" in attention.cap_reason
    assert run.effective_fraction > 0 and not any(s.piece == "attention" for s in run.plan.slices)
    report = verify(run, cc.split_prompt(draw), n_tokens=cc.GREEDY)
    assert report["match"], report


def test_verify_of_a_qwen4_moe_split_whose_last_chunk_is_a_few_tokens(tmp_path, monkeypatch):
    """`--verify` records each layer's routes on the host; a prompt whose last chunk is a few tokens (2 x 64 + 1)
    sent that chunk through Qwen4-Exp's compiled step, where reading the routes crashed ("Attempting to eval an array
    during function transformations"). A recording run takes the uncompiled path now."""
    from hetero.pipeline import configure, verify

    monkeypatch.setenv("HETERO_HOME", str(tmp_path / "home"))
    draw = _bias_draw()
    cc.write(draw, tmp_path / "ck")
    run = configure(cc.split_engine(tmp_path / "ck", mx.float32), 0.5, 64)
    report = verify(run, cc.split_prompt(draw)[: 2 * 64 + 1], n_tokens=4)
    assert report["match"], report


# ---------------------------------------------------------------------------------------------------------------
# fp32's own spread on a draw whose massive activations cancel


CANCELLING = Draw.from_json(json.loads("""{"arch": "qwen3_5_text", "config": {"vocab_size": 128, "hidden_size": 320,
 "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
 "linear_num_value_heads": 6, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
 "num_hidden_layers": 8, "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention",
 "linear_attention", "linear_attention", "linear_attention", "full_attention"], "rope_parameters": {"rope_type":
 "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 2], "mrope_interleaved":
 true}, "rms_norm_eps": 1e-06, "tie_word_embeddings": false, "eos_token_id": 1, "pad_token_id": null, "bos_token_id":
 null, "intermediate_size": 1024}, "prompt": 138, "seed": 621, "weights": {"norm_std": 0.3, "gain": 0.75,
 "embed_std": 0.5, "router_gain": 4.0}, "mtp": true, "depth": 1, "chunks": [16, 100], "vision": null, "outliers":
 {"level": "mild", "layers": [1, 7], "channel": 242, "gain": 56.0, "residual": 3000.0}, "dtype": "bfloat16",
 "source": "released:qwen3.5-27b", "form": "saved"}"""))


def test_an_fp32_path_is_held_to_fp32_s_own_spread_on_a_draw_whose_outliers_cancel(tmp_path):
    """Found by the seed-21 sweep (a scaled Qwen3.5-27B, mild outliers in layers 1 and 7): layer 1 writes a residual
    channel of ~3e3 and layer 7 takes it back, so one row's logits come out of a cancellation. hetero lay 1.09e-4
    from float64 there, its rounding errors 1.2x transformers' in RMS at every layer, but transformers' one fp32 run
    happened to land 1.4e-5 away, so the bound stayed TOL. Its fp32 runs on the weights moved by one rounding land
    up to ~6e-5 away (`fp32_spread`): the draw is ill-conditioned, and hetero is held to K x that now."""
    hf = cc.write(CANCELLING, tmp_path)
    result = cc.Result()
    cc.check_text(CANCELLING, tmp_path, hf, result)
    assert result.errors["logits"] > TOL  # beyond the fixed bound: the case the spread decides
    assert result.errors["hf_to_fp64"] > TOL / cc.K  # fp32 itself spreads that far on this draw
    assert not result.failures, result.failures


def test_fp32_s_spread_does_not_admit_a_real_error_on_the_same_draw(tmp_path, monkeypatch):
    """The same ill-conditioned draw with hetero's lm_head off by 5e-4 relative (a real error, as a wrong norm
    epsilon or a rounded weight would make): the looser bound still fails it."""
    import hetero.checkpoint.loader as loader

    load = loader.load_model

    def off(*args, **kwargs):
        model, *rest = load(*args, **kwargs)
        model.lm_head.weight = model.lm_head.weight * (1 + 5e-4)
        return (model, *rest)

    monkeypatch.setattr(loader, "load_model", off)
    hf = cc.write(CANCELLING, tmp_path)
    result = cc.Result()
    cc.check_text(CANCELLING, tmp_path, hf, result)
    assert "logits" in result.failures


# ---------------------------------------------------------------------------------------------------------------
# Open: a bf16 split past verify's tolerance


BIASED_OUTLIERS = Draw.from_json(json.loads("""{"arch": "qwen3_next", "config": {"vocab_size": 256, "hidden_size": 96,
 "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8, "linear_num_key_heads": 1,
 "linear_num_value_heads": 3, "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 5,
 "num_hidden_layers": 5, "layer_types": ["linear_attention", "linear_attention", "linear_attention",
 "linear_attention", "full_attention"], "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
 "partial_rotary_factor": 0.25}, "rms_norm_eps": 1e-05, "tie_word_embeddings": true, "attention_bias": true,
 "hidden_act": "silu", "eos_token_id": 1, "pad_token_id": null, "bos_token_id": null, "intermediate_size": 512,
 "num_experts": 0, "mlp_only_layers": []}, "prompt": 2, "seed": 22925, "weights": {"norm_std": 0.1, "gain": 0.75,
 "embed_std": 1.0, "router_gain": 2.0}, "mtp": false, "depth": 2, "chunks": [17, 16], "vision": null, "outliers":
 {"level": "mild", "layers": [1, 2], "channel": 72, "gain": 56.0, "residual": 10000.0}, "dtype": "float16",
 "source": "drawn", "form": "saved"}"""))


@pytest.mark.xfail(strict=True, reason="open (issue 46): the bf16 split lies 2.16x the GPU-only run's distance from "
                   "fp32, past K = 2 plus the fp16 floor; its greedy tokens agree")
def test_a_bf16_split_with_outliers_beside_biased_attention_verifies(tmp_path, monkeypatch):
    """Found by this stop's split draws (seed 3004): a Qwen3-Next checkpoint with attention biases (its attention
    kept on the GPU) and mild massive activations in layers 1-2 (a residual channel of 1e4). fp32 and fp16 splits
    verify (0.0009, 0.0054); the bf16 split reads 0.0275 against its tolerance 0.0265 (2 x GPU-only's 0.0127 +
    the fp16 floor), at the attention layer's values, with greedy 8/8. Kept failing until it is told whether the
    bf16 split is less exact here or verify's one bf16 sample (the GPU-only run) is the edge, as fp32's was in
    the harness (`test_an_fp32_path_is_held_to_fp32_s_own_spread...`)."""
    monkeypatch.setenv("HETERO_HOME", str(tmp_path / "home"))
    result = cc.run_draw(BIASED_OUTLIERS, tmp_path, ("bfloat16",), numerics=False)
    assert not result.failures, result.failures
