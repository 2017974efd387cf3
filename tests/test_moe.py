"""Mixture-of-experts models: Qwen3.5-MoE (`qwen3_5_moe` nested, `qwen3_5_moe_text` flat) and Qwen3-Next with experts.

Parity: each layout is written by HF transformers itself (`save_pretrained`, per-expert tensors) from a tiny randomised
model, and hetero's logits over a 300-token prompt (which runs the grouped expert form) and its greedy continuation
(the per-pair form, compiled) must match. The three cases between them cover renormalised and plain top-k weights,
top-k == number of experts, and dense layers among sparse ones. The other checkpoint conventions (transformers'
fused `experts.gate_up_proj`, mlx-lm's stacked `switch_mlp` written by `mlx_lm.convert`) must give the very same
logits. Routing is checked against a plain numpy reference, MTP and batched decoding on an MoE checkpoint with an
MTP head (written by hetero.training.hf_export: HF cannot build the MTP head).
"""

from __future__ import annotations

import itertools
import json
import math
import re
import shutil
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from test_speculative import agreeing_model

import torch
import transformers  # noqa: F401  (a test dependency: missing, the module fails rather than skips)
from mlx_lm import convert
from mlx_lm import utils as mlx_lm_utils

import helpers
from hetero.checkpoint.loader import load_model, load_weights
from hetero.checkpoint.preflight import preflight
from hetero.cli import main as cli
from hetero.decode.records import MTPStats
from hetero.decode.sampling import Sampler, SamplingParams
from hetero.decode.solo import batch_generate
from hetero.decode.solo import decode_tokens
from hetero.decode.solo import decode_tokens
from hetero.errors import HeteroError
from hetero.models import moe
from hetero.models.compiled import PerThread
from hetero.models.qwen3_5 import Model, ModelArgs
from hetero.training.hf_export import hf_config, save_hf_checkpoint

PROMPT_LEN = 300  # > 4 GDN chunks of 64; 300 * top-k pairs take the grouped expert form
NEW_TOKENS = 24
RTOL = 1e-4  # max |ours - ref| <= RTOL * max |ref|, fp32 throughout
GREEDY = SamplingParams()
MOE = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=helpers.HIDDEN, num_position_embeddings=16)


def _moe_text(**updates) -> dict:
    text = dict(helpers.TEXT, **{**MOE, **updates})
    text.pop("intermediate_size")  # Qwen3.5-MoE has no dense MLP
    return text


def save_moe_nested(path: Path, seed: int = 11):
    """`qwen3_5_moe`: text under text_config (no intermediate_size), weights under model.language_model.*, a vision
    tower to skip; every layer MoE, top-3 of 8 renormalised (HF's Qwen3.5-MoE router always renormalises)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 2],
            "mrope_interleaved": True}
    config = Qwen3_5MoeConfig(
        text_config=dict(_moe_text(), full_attention_interval=helpers.INTERVAL, rope_parameters=rope), vision_config=VISION,
        image_token_id=helpers.VOCAB - 4, video_token_id=helpers.VOCAB - 3, vision_start_token_id=helpers.VOCAB - 2,
        vision_end_token_id=helpers.VOCAB - 1,
    )
    model = Qwen3_5MoeForConditionalGeneration(config).float().eval()
    helpers.randomize_(model, seed)
    model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["full_attention_interval"] = helpers.INTERVAL  # real configs carry it (mlx-lm needs it)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return model


def save_moe_flat(path: Path, seed: int = 12):
    """`qwen3_5_moe_text` (flat model.*), tied embeddings, top-k == number of experts (4 of 4)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(
        **_moe_text(num_experts=4, num_experts_per_tok=4), full_attention_interval=helpers.INTERVAL, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
    )
    model = Qwen3_5MoeForCausalLM(config).float().eval()
    helpers.randomize_(model, seed)
    model.tie_weights()
    model.save_pretrained(path)
    helpers._patch_config(path, full_attention_interval=helpers.INTERVAL)
    return model


def save_next_moe(path: Path, seed: int = 13):
    """`qwen3_next` with experts in the released config's form (flat rope fields, no layer_types): top-3 of 8
    *not* renormalised (norm_topk_prob false), layer 2 dense (mlp_only_layers), fused GDN projections."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        **dict(helpers.TEXT, **MOE, linear_value_head_dim=24), full_attention_interval=helpers.INTERVAL,
        tie_word_embeddings=False, norm_topk_prob=False, mlp_only_layers=[2], decoder_sparse_step=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
    )
    model = Qwen3NextForCausalLM(config).float().eval()
    helpers.randomize_(model, seed)
    model.save_pretrained(path)
    helpers._patch_config(path, _drop=("layer_types", "rope_parameters"), full_attention_interval=helpers.INTERVAL,
                          rope_theta=10_000.0, partial_rotary_factor=0.5, rope_scaling=None)
    return model


BUILDERS = {"qwen3_5_moe": save_moe_nested, "qwen3_5_moe_text": save_moe_flat, "qwen3_next": save_next_moe}


@pytest.fixture(scope="module", params=list(BUILDERS))
def case(request, tmp_path_factory):
    """(layout, checkpoint dir, HF model, prompt, HF logits over the prompt): built once per layout."""
    layout = request.param
    path = tmp_path_factory.mktemp(layout)
    hf = BUILDERS[layout](path)
    prompt = helpers.random_tokens(PROMPT_LEN, seed=7)
    ref = helpers.hf_logits(hf, prompt)
    assert ref.std() > 0.5, "the random checkpoint's logits are too flat to make a meaningful comparison"
    return layout, path, hf, prompt, ref


def _assert_close(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} vs reference {ref.shape}"
    err, scale = np.abs(ours - ref).max(), np.abs(ref).max()
    assert err <= RTOL * scale, f"{what}: max |diff| {err:.3g} > {RTOL} * max |ref| ({scale:.3g})"


def _logits(path: Path, prompt: list[int]) -> np.ndarray:
    model, _, _ = load_model(path, dtype=mx.float32)
    return np.array(model(mx.array(prompt)[None])[0][0])


@pytest.fixture
def forms_run(monkeypatch) -> Counter:
    """Counts the routed-expert forms that ran (the real functions, wrapped): "pairs" and "sorted" per `_glu` call
    (sorted_indices False / True), "grouped" per `_grouped` call that built the buckets; a grouped call that fell back
    to sorted (padding over PAD_LIMIT) counts "grouped fell back", then "sorted". Under mx.compile a function runs
    (and counts) when it is traced."""
    ran = Counter()
    glu, grouped = moe.SwitchGLU._glu, moe.SwitchGLU._grouped

    def counted_glu(self, x, indices, sorted_indices):
        ran["sorted" if sorted_indices else "pairs"] += 1
        return glu(self, x, indices, sorted_indices)

    def counted_grouped(self, *args, **kwargs):
        out = grouped(self, *args, **kwargs)
        ran["grouped" if out is not None else "grouped fell back"] += 1
        return out

    monkeypatch.setattr(moe.SwitchGLU, "_glu", counted_glu)
    monkeypatch.setattr(moe.SwitchGLU, "_grouped", counted_grouped)
    return ran


def only(ran: Counter, form: str) -> bool:
    """The forced `form` ran, and no other."""
    return set(ran) == {form}


def test_checkpoint_layout_is_what_the_case_claims(case):
    """Guards the fixtures: per-expert tensors as save_pretrained writes them, the config form named."""
    from safetensors import safe_open

    layout, path, *_ = case
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == layout
    with safe_open(str(path / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert any(re.search(r"\.mlp\.experts\.\d+\.gate_proj\.weight$", n) for n in names)
    assert any(n.endswith("mlp.shared_expert_gate.weight") for n in names)
    if layout == "qwen3_5_moe":
        assert any(n.startswith("model.visual.") for n in names)
        assert "intermediate_size" not in config["text_config"]
    if layout == "qwen3_next":
        assert config["norm_topk_prob"] is False and config["mlp_only_layers"] == [2]
        assert "model.layers.2.mlp.gate_proj.weight" in names  # the dense layer


def test_logits_match_transformers(case, forms_run):
    layout, path, _, prompt, ref = case
    _assert_close(_logits(path, prompt), ref, f"{layout} prompt logits vs transformers")
    assert only(forms_run, "grouped"), forms_run  # the module docstring's claim: a 300-token prompt groups


def test_greedy_continuation_matches_transformers(case, forms_run):
    layout, path, hf, prompt, _ = case
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0,
        )
    expected = out[0, len(prompt):].tolist()
    model, _, _ = load_model(path, dtype=mx.float32)
    forms_run.clear()
    ours = list(decode_tokens(model, prompt, Sampler(GREEDY), max_tokens=NEW_TOKENS, eos_ids=set()))
    assert ours == expected
    assert len(set(ours)) > 3, "a degenerate continuation would not test much"
    # the prompt grouped (300 tokens), the decode steps ran the per-pair form (traced once per compiled step)
    assert set(forms_run) == {"grouped", "pairs"}, forms_run


# ----------------------------------------------------------------------------------------------------------
# The other checkpoint conventions


def write_fused(src: Path, dst: Path) -> Path:
    """`src` rewritten with transformers' fused expert tensors (gate_up_proj [E, 2I, H], down_proj [E, H, I]), in
    numpy, independently of hetero's code; the layout of the released Qwen3.5-MoE checkpoints and the one mlx-lm
    converts."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    pattern = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    out, groups = {}, {}
    for name, value in load_file(str(src / "model.safetensors")).items():
        m = pattern.match(name)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = value
        else:
            out[name] = value
    for mlp, projs in groups.items():
        stacked = {p: np.stack([d[e] for e in sorted(d)]) for p, d in projs.items()}
        out[f"{mlp}.experts.gate_up_proj"] = np.concatenate([stacked["gate_proj"], stacked["up_proj"]], axis=1)
        out[f"{mlp}.experts.down_proj"] = stacked["down_proj"]
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The nested checkpoint in three conventions: per-expert (HF), fused (transformers), switch_mlp (mlx_lm.convert)."""
    root = tmp_path_factory.mktemp("layouts")
    save_moe_nested(root / "per_expert")
    write_fused(root / "per_expert", root / "fused")
    convert(str(root / "fused"), mlx_path=str(root / "switch_mlp"))  # mlx-lm 0.32 reads only the fused form
    return root


def test_expert_layouts_load_to_identical_logits(layouts, forms_run):
    from safetensors import safe_open

    with safe_open(str(layouts / "switch_mlp" / "model.safetensors"), "np") as f:
        assert "language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight" in f.keys()
    with safe_open(str(layouts / "fused" / "model.safetensors"), "np") as f:
        assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    prompt = helpers.random_tokens(80, seed=3)
    per_expert = _logits(layouts / "per_expert", prompt)
    assert np.array_equal(_logits(layouts / "fused", prompt), per_expert)
    assert np.array_equal(_logits(layouts / "switch_mlp", prompt), per_expert)
    for form in ("pairs", "sorted", "grouped"):  # all three forms of the routed experts agree on the whole model
        model, _, _ = load_model(layouts / "switch_mlp", dtype=mx.float32)
        for layer in model.layers:
            layer.mlp.switch_mlp.form = lambda tokens, pairs, f=form: f
        forms_run.clear()
        _assert_close(np.array(model(mx.array(prompt)[None])[0][0]), per_expert, f"{form} form")
        assert only(forms_run, form) and forms_run[form] == len(model.layers), forms_run


def test_every_layout_loads_gate_and_up_as_the_checkpoints_fused_product(layouts):
    """Fused at load, each MoE layer's routed gate|up product is transformers' own gate_up_proj, bit for bit, whichever
    layout it came from (per expert, fused, switch_mlp), and runs as one product (`hetero.models.fused`)."""
    from safetensors.numpy import load_file

    written = load_file(str(layouts / "fused" / "model.safetensors"))
    for layout in ("per_expert", "fused", "switch_mlp"):
        model, _, _ = load_model(layouts / layout, dtype=mx.float32)
        for i, layer in enumerate(model.layers):
            (product, offsets), = layer.mlp.switch_mlp.fused.products
            want = written[f"model.language_model.layers.{i}.mlp.experts.gate_up_proj"]  # [E, 2I, H]
            assert np.array_equal(np.array(product.weight), want), (layout, i)
            assert offsets == [want.shape[1] // 2]


def test_mlx_lm_agrees_on_the_switch_mlp_checkpoint(layouts):
    """Oracle sanity: mlx-lm's own model of the converted checkpoint gives the same logits."""
    prompt = helpers.random_tokens(80, seed=3)
    theirs, _ = mlx_lm_utils.load_model(layouts / "switch_mlp")
    _assert_close(_logits(layouts / "switch_mlp", prompt), np.array(theirs(mx.array(prompt)[None])[0]), "vs mlx-lm")


def test_stacking_streams_shard_by_shard(layouts, tmp_path):
    """A sharded per-expert checkpoint: every projection arrives stacked [E, out, in], and the load's peak stays
    near the stacked weights (not the single tensors plus the stacked copy of the whole model)."""
    from safetensors.numpy import load_file, save_file

    ckpt = shutil.copytree(layouts / "per_expert", tmp_path / "sharded")
    weights = load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {f"model-0000{i + 1}-of-00003.safetensors": names[i::3] for i in range(3)}  # experts spread over shards
    for shard, part in shards.items():
        save_file({n: weights[n] for n in part}, str(ckpt / shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: s for s, part in shards.items() for n in part}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    args = ModelArgs.from_config(json.loads((ckpt / "config.json").read_text()))
    total = sum(v.nbytes for n, v in weights.items() if not n.startswith("model.visual."))
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()  # other tests' arrays still alive
    loaded = load_weights(ckpt, args)
    peak = mx.get_peak_memory() - before
    assert loaded["model.layers.1.mlp.switch_mlp.down_proj.weight"].shape == (8, helpers.HIDDEN, 32)
    assert not any(".experts." in n for n in loaded) and not any(n.startswith("model.visual.") for n in loaded)
    experts = sum(v.nbytes for n, v in weights.items() if ".experts." in n)
    assert peak <= experts + total // 4, f"peak {peak} bytes for {experts} bytes of experts"
    print(f"load_weights peak {peak} bytes, {experts} bytes of experts, {total} bytes in all")
    del loaded
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    model, _, _ = load_model(ckpt, dtype=mx.float32)  # everything evaluated: the peak is the model, and a little
    peak = mx.get_peak_memory() - before
    assert peak <= total * 1.25, f"peak {peak} bytes for a {total}-byte model"
    assert np.array_equal(np.array(model(mx.array([[1, 2, 3]]))[0][0]), _logits(layouts / "per_expert", [1, 2, 3]))


def test_missing_expert_is_reported(layouts, tmp_path):
    from safetensors.numpy import load_file, save_file

    ckpt = shutil.copytree(layouts / "per_expert", tmp_path / "missing")
    weights = load_file(str(ckpt / "model.safetensors"))
    del weights["model.language_model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    report = preflight(ckpt)
    assert not report.ok and "model.layers.1.mlp.switch_mlp.up_proj.weight" in report.errors[0]
    assert "expert(s) [5]" in report.errors[0]
    with pytest.raises(HeteroError, match=r"expert\(s\) \[5\]"):
        load_model(ckpt)


def test_hetero_check_reports_experts(layouts, capsys):
    assert cli.main(["check", "--model", str(layouts / "switch_mlp")]) == 0
    out = capsys.readouterr().out
    assert "experts: 8 routed + 1 shared, 3 active per token, mixture-of-experts MLP in 4 of 4 layers" in out
    assert "result: OK" in out
    assert cli.main(["check", "--model", str(layouts / "per_expert"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["experts"], report["experts_per_token"], report["moe_layers"], report["ok"]) == (8, 3, 4, True)


# ----------------------------------------------------------------------------------------------------------
# Routing and the block against numpy


def np_route(logits: np.ndarray, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Reference: softmax, the k largest (ties: lower index first), optionally renormalised."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[..., :k]
    w = np.take_along_axis(p, idx, -1)
    return idx, (w / w.sum(-1, keepdims=True) if normalize else w)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_route_matches_numpy(k, normalize):
    rng = np.random.default_rng(k)
    logits = rng.standard_normal((5, 7, 8)).astype(np.float32) * 2
    logits[0, 0] = 0.5  # all tied
    logits[1, 2, [1, 4, 6]] = 10.0  # a three-way tie at the top: top-1/top-3 must take the lower indices first
    logits[2, 3, [0, 7]] = -1.0  # a tie at the bottom
    idx, w = moe.route(mx.array(logits), k, normalize)
    assert idx.shape == (5, 7, k) and idx.dtype == mx.uint32
    by_expert = lambda i, v: (np.sort(i, -1), np.take_along_axis(v, np.argsort(i, -1), -1))  # noqa: E731  order-free
    (ours_idx, ours_w), (ref_idx, ref_w) = by_expert(np.array(idx), np.array(w)), by_expert(*np_route(logits, k, normalize))
    assert np.array_equal(ours_idx, ref_idx)
    np.testing.assert_allclose(ours_w, ref_w, rtol=1e-6, atol=1e-7)
    if k < 8:
        assert sorted(np.array(idx)[1, 2].tolist()) == [1, 4, 6][:k]
        assert sorted(np.array(idx)[0, 0].tolist()) == list(range(k))
    if normalize:
        np.testing.assert_allclose(np.array(w).sum(-1), 1.0, rtol=1e-6)


def random_block(seed: int, num_experts: int, k: int, normalize: bool, dims: int = 16, hidden: int = 12):
    from hetero.models.qwen3_5 import MLP

    block = moe.SparseMoeBlock(dims, num_experts, k, hidden, normalize, shared_expert=MLP(dims, 20))
    rng = np.random.default_rng(seed)
    params = [(n, mx.array((rng.standard_normal(p.shape) / math.sqrt(p.shape[-1])).astype(np.float32)))
              for n, p in tree_flatten(block.parameters())]
    block.update(tree_unflatten(params))
    return block, {n: np.array(v, dtype=np.float64) for n, v in params}


def np_block(w: dict, x: np.ndarray, k: int, normalize: bool) -> np.ndarray:
    """Reference MoE block: a loop over tokens and their experts."""
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    glu = lambda g, u, d, h: d @ (silu(g @ h) * (u @ h))  # noqa: E731
    out = np.zeros_like(x)
    idx, weights = np_route(x @ w["gate.weight"].T, k, normalize)
    for t in range(x.shape[0]):
        for e, c in zip(idx[t], weights[t]):
            out[t] += c * glu(*(w[f"switch_mlp.{p}.weight"][e] for p in ("gate_proj", "up_proj", "down_proj")), x[t])
        gate = 1 / (1 + np.exp(-(w["shared_expert_gate.weight"] @ x[t])))
        out[t] += gate * glu(*(w[f"shared_expert.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")), x[t])
    return out


@pytest.mark.parametrize("num_experts,k,normalize", [(6, 2, True), (6, 2, False), (4, 4, True), (4, 4, False), (5, 1, False)])
def test_block_matches_numpy(num_experts, k, normalize, forms_run):
    block, w = random_block(num_experts * 10 + k, num_experts, k, normalize)
    x = np.random.default_rng(1).standard_normal((1, 40, 16)).astype(np.float32)
    ref = np_block(w, x[0].astype(np.float64), k, normalize)
    for form in ("pairs", "sorted", "grouped"):
        block.switch_mlp.form = lambda tokens, pairs, f=form: f
        forms_run.clear()
        ours = np.array(block(mx.array(x)))[0]
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5, err_msg=form)
        assert only(forms_run, form), forms_run


def test_forms_agree_and_skewed_routing_stays_grouped_in_its_own_bucket(forms_run):
    glu = moe.SwitchGLU(16, 12, 32)
    rng = np.random.default_rng(0)
    glu.update(tree_unflatten([(n, mx.array(rng.standard_normal(p.shape).astype(np.float32)))
                               for n, p in tree_flatten(glu.parameters())]))
    x = mx.array(rng.standard_normal((2, 50, 16)).astype(np.float32))
    spread = mx.array(rng.integers(0, 32, (2, 50, 4)).astype(np.uint32))  # distinct per token not required
    skewed = mx.array(np.concatenate([np.zeros((2, 50, 1)), rng.integers(1, 32, (2, 50, 1))], -1).astype(np.uint32))
    for indices in (spread, skewed):
        pairs = glu(x, indices, "pairs")  # [2, 50, k, 16]
        assert pairs.shape == (*indices.shape, 16)
        for form in ("sorted", "grouped"):
            forms_run.clear()
            np.testing.assert_allclose(np.array(glu(x, indices, form)), np.array(pairs), rtol=1e-5, atol=1e-4)
            assert only(forms_run, form), forms_run  # skewed routing too: grouped, not its sorted fallback
    # every token's first expert is 0: one capacity for all 32 experts would be 3200 rows for 200 pairs; expert 0
    # takes a bucket of its own, and the other 31 (about 3 pairs each) pad to their own largest counts
    layout = moe.Buckets.of(np.array(skewed).reshape(-1), 32, 2)
    assert layout.buckets[0][1].tolist() == [0] and layout.buckets[0][2] == 100
    assert layout.rows <= 1.5 * skewed.size
    assert sorted(layout.pair_row.tolist()) == sorted(set(layout.pair_row.tolist()))  # one row per pair


def test_bucket_cuts_pad_the_fewest_rows():
    """The dynamic programme's cuts against every way of cutting sorted counts into at most B runs."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        counts = np.sort(rng.integers(1, 50, rng.integers(1, 9)))[::-1]
        runs = int(rng.integers(1, 5))
        cuts = moe._cuts(counts, runs)
        assert cuts[0] == 0 and cuts[-1] == len(counts) and len(cuts) - 1 <= runs
        assert all(a < b for a, b in zip(cuts, cuts[1:]))
        padded = lambda edges: sum((b - a) * counts[a] for a, b in zip(edges, edges[1:]))  # noqa: E731
        fewest = min(padded([0, *inner, len(counts)]) for r in range(runs)
                     for inner in itertools.combinations(range(1, len(counts)), r))
        assert padded(cuts) == fewest


# ----------------------------------------------------------------------------------------------------------
# MTP and batched decoding on an MoE checkpoint with an MTP head


def moe_args(vocab: int = 64) -> ModelArgs:
    config = dict(
        model_type="qwen3_5_moe_text", hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        vocab_size=vocab, layer_types=["linear_attention", "full_attention", "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
        mtp_num_hidden_layers=1, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=16,
    )
    return ModelArgs.from_config(config)


def agreeing_moe_model(seed: int, alpha: float = 0.2) -> Model:
    """Random MoE model whose MTP head mostly predicts the backbone (test_speculative.agreeing_model; the experts'
    down_proj scaled by alpha too)."""
    return agreeing_model(seed, 0, alpha, moe_args())


@pytest.fixture(scope="module")
def mtp_moe(tmp_path_factory) -> Model:
    """The agreeing MoE model written as an HF qwen3_5_moe checkpoint (MTP layer with its own experts) and loaded."""
    path = tmp_path_factory.mktemp("mtp-moe")
    built = agreeing_moe_model(5)
    save_hf_checkpoint(built, hf_config(built.args, eos_token_id=[1]), path, dtype=mx.float32)
    model, _, config = load_model(path, dtype=mx.float32)
    assert config["model_type"] == "qwen3_5_moe" and model.has_mtp
    assert isinstance(model.mtp.layers[0].mlp, moe.SparseMoeBlock)
    return model


def test_mtp_greedy_equals_plain_on_moe(mtp_moe):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] * 2
    plain = list(decode_tokens(mtp_moe, prompt, Sampler(GREEDY), 40, set()))
    accepted = []
    for depth in (1, 3):
        stats = MTPStats(depth)
        out = list(decode_tokens(mtp_moe, prompt, Sampler(GREEDY), 40, set(), depth=depth, stats=stats))
        assert out == plain, f"depth {depth}"
        accepted.append(stats.to_dict()["mean_accepted_length"])
    assert 1.2 < accepted[1] < 4.0, f"drafts neither all rejected nor all accepted: {accepted}"


def test_batch_of_two_equals_solo_on_moe(mtp_moe):
    prompts, max_tokens, depths = [[7, 3, 9, 1, 4, 4, 2], [5, 11, 2]], [30, 26], [2, 0]
    requests = batch_generate(mtp_moe, prompts, [Sampler(GREEDY), Sampler(GREEDY)], max_tokens, set(), depths)
    for r, prompt, n, depth in zip(requests, prompts, max_tokens, depths):
        if depth:
            solo = list(decode_tokens(mtp_moe, prompt, Sampler(GREEDY), n, set(), depth=depth))
        else:
            solo = list(decode_tokens(mtp_moe, prompt, Sampler(GREEDY), n, set()))
        assert r.tokens == solo


def test_quantized_experts_run_gather_qmm(forms_run):
    """nn.quantize swaps the stacked experts for QuantizedSwitchLinear (mlx-lm's switch_mlp names + scales/biases);
    its products equal the block's run on the dequantized weights, in every form."""
    import mlx.nn as nn

    block, _ = random_block(3, 6, 2, True, dims=64, hidden=32)
    nn.quantize(block, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, moe.SwitchLinear))
    assert isinstance(block.switch_mlp.gate_proj, moe.QuantizedSwitchLinear)
    assert set(dict(tree_flatten(block.switch_mlp.gate_proj.parameters()))) == {"weight", "scales", "biases"}
    reference, _ = random_block(3, 6, 2, True, dims=64, hidden=32)
    for name in ("gate_proj", "up_proj", "down_proj"):
        q = getattr(block.switch_mlp, name)
        getattr(reference.switch_mlp, name).weight = mx.dequantize(q.weight, q.scales, q.biases, 32, 4)
    x = mx.array(np.random.default_rng(2).standard_normal((1, 40, 64)).astype(np.float32))
    expected = np.array(reference(x))
    for form in ("pairs", "sorted", "grouped"):
        block.switch_mlp.form = lambda tokens, pairs, f=form: f
        forms_run.clear()
        np.testing.assert_allclose(np.array(block(x)), expected, rtol=1e-4, atol=1e-4, err_msg=form)
        assert only(forms_run, form), forms_run


def test_compiled_steps_never_take_the_grouped_form(forms_run, monkeypatch):
    """A compiled attention step of 4 rows x 16 tokens, top-1 of 2 experts (32 pairs per expert, enough to group):
    it must run (the grouped form's mid-graph read would fail inside mx.compile) and equal the plain path."""
    from hetero.models.cache import KVCache
    from hetero.models.qwen3_5 import DecoderLayer

    args = ModelArgs.from_config(dict(moe_args().__dict__, num_experts=2, num_experts_per_tok=1, model_type="qwen3_5_moe_text"))
    layer = DecoderLayer(args, "full_attention", moe=True)
    rng = np.random.default_rng(0)
    layer.update(tree_unflatten([(n, mx.array((rng.standard_normal(p.shape) / math.sqrt(p.shape[-1])).astype(np.float32)))
                                 for n, p in tree_flatten(layer.parameters())]))
    x = mx.array(rng.standard_normal((4, 16, args.hidden_size)).astype(np.float32))
    assert layer.mlp.switch_mlp.form(4 * 16, 4 * 16) == "grouped"  # as one long sequence it would group
    steps, call = [], PerThread.__call__
    monkeypatch.setattr(PerThread, "__call__", lambda self, *a: steps.append(self) or call(self, *a))
    compiled = layer(x, KVCache())  # S <= 16 over a cache: the compiled path
    assert steps == [layer._attention_in, layer._attention_out]  # it ran: projections, then the MLP after attention
    assert only(forms_run, "sorted"), forms_run  # traced inside mx.compile: sorted, never grouped
    np.testing.assert_allclose(np.array(compiled), np.array(layer(x, None)), rtol=1e-5, atol=1e-5)


def test_expert_config_mismatches_are_reported(layouts, tmp_path):
    """Experts of another width, or more experts than config.json says: one line naming the tensors."""
    ckpt = shutil.copytree(layouts / "per_expert", tmp_path / "wide")
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = 40
    (ckpt / "config.json").write_text(json.dumps(config))
    report = preflight(ckpt)
    assert ("model.language_model.layers.0.mlp.experts.*.gate_proj.weight: checkpoint [8, 32, 64], config expects "
            "[8, 40, 64]") in report.shape_mismatches
    config["text_config"].update(moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2)
    (ckpt / "config.json").write_text(json.dumps(config))
    report = preflight(ckpt)
    assert not report.ok and "expert 6 but config.json says num_experts 6" in report.errors[0]
