"""The planner on the mixture-of-experts configs (issue 14): total and active parameters, bytes per decoded token
(active experts only), MoE FLOPs, memory with every expert resident, the ANE candidates (attention heads and the
shared expert; routed experts stay on the GPU). Expected values are worked out here from the config fields, not
from the planner's own functions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetero.cli.main import main
from hetero.planner import PlanRequest, Storage, make_plan, model_shape, prefill_buffer_bytes, recommend
from hetero.planner.predict import Lanes, dense_experts_on_ane
from hetero.profiles import load_profile

DATA = Path(__file__).parent / "data"
A3B = json.loads((DATA / "qwen3.5-35b-a3b.json").read_text())
NEXT = json.loads((DATA / "qwen3-next-80b-a3b.json").read_text())
PROFILE = load_profile("m4-max")


def arithmetic(config: dict) -> dict:
    """Weights of the network from its config fields alone (matrices and the conv kernel; norm vectors aside)."""
    t = config.get("text_config") or config
    h, L, V = t["hidden_size"], t["num_hidden_layers"], t["vocab_size"]
    H, Hkv, D = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    nk, nv, dk, dv = t["linear_num_key_heads"], t["linear_num_value_heads"], t["linear_key_head_dim"], t["linear_value_head_dim"]
    E, k, I, Is = t["num_experts"], t["num_experts_per_tok"], t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
    n_attn = L // t.get("full_attention_interval", 4)
    n_gdn = L - n_attn
    attn = h * H * D * 2 + 2 * h * Hkv * D + H * D * h  # q and its gate, k, v, o
    conv = 2 * nk * dk + nv * dv
    gdn = h * conv + h * nv * dv + 2 * h * nv + conv * t.get("linear_conv_kernel_dim", 4) + nv * dv * h
    expert = 3 * h * I
    router = h * E + h  # router, and the shared expert's sigmoid gate (one output)
    moe_all = router + E * expert + 3 * h * Is
    moe_active = router + k * expert + 3 * h * Is
    mtp = t.get("mtp_num_hidden_layers", 0)
    mtp_all = mtp * (attn + moe_all) + (2 * h * h if mtp else 0)
    mtp_active = mtp * (attn + moe_active) + (2 * h * h if mtp else 0)
    gdn_state = nv * dk * dv * 4 + 3 * conv * 4  # fp32 state and the conv window of kernel - 1 inputs
    return dict(
        total=n_attn * attn + n_gdn * gdn + L * moe_all + 2 * V * h + mtp_all,
        active=n_attn * attn + n_gdn * gdn + L * moe_active + 2 * V * h + mtp_active,
        mtp_total=mtp_all,
        decode_weights=n_attn * attn + n_gdn * gdn + L * moe_active + V * h,  # lm_head whole, the embedding one row
        kv_per_token=n_attn * 2 * Hkv * D * 2,  # bf16 K and V of the attention layers
        gdn_state=n_gdn * gdn_state,
        moe_token_flops=2 * (router + k * expert),
        shared_token_flops=2 * 3 * h * Is,
        dense_expert_flops=2 * E * expert,
        layers=L, experts=E, per_token=k, expert_params=expert, hidden=h, shared=Is, intermediate=I,
    )


@pytest.mark.parametrize("config, total_b, active_b", [(A3B, 35, 3), (NEXT, 80, 3)])
def test_total_and_active_parameters(config, total_b, active_b):
    want = arithmetic(config)
    plan = make_plan(PlanRequest(config, PROFILE, 0.0, context=4096))
    n = plan.parameters
    assert n.total == want["total"] and n.active == want["active"] and n.mtp_total == want["mtp_total"]
    # the names: about 35B / 80B in all, about 3B active (3.5B / 3.9B with both 0.5B / 0.3B vocab matrices)
    assert abs(n.total / 1e9 - total_b) < 1.0
    assert abs(n.active / 1e9 - active_b) < 1.0
    assert n.active < n.total / 10


@pytest.mark.parametrize("config", [A3B, NEXT])
@pytest.mark.parametrize("bits", [16, 4])
def test_bytes_per_decoded_token_read_only_the_active_experts(config, bits):
    want = arithmetic(config)
    context = 8192
    plan = make_plan(PlanRequest(config, PROFILE, 0.0, context=context, bits=bits))
    per_weight = 2.0 if bits == 16 else bits / 8 + 4 / 64  # 4-bit: packed nibbles + fp16 scale and bias per 64
    weights = want["decode_weights"] * per_weight
    step = weights + want["kv_per_token"] * context + 2 * want["gdn_state"]  # the state is read and written
    pr = plan.predicted
    assert pr["decode_weight_bytes_per_token"] == pytest.approx(weights, rel=1e-9)
    assert pr["decode_bytes_per_token"] == pytest.approx(step, rel=1e-9)
    # far below the resident weights: the other experts are never read
    assert weights < 0.15 * want["total"] * per_weight
    assert pr["decode_roofline_tps"] == pytest.approx(PROFILE.memory_bandwidth_gbs * 1e9 / step, abs=0.01)


def test_mtp_round_reads_the_experts_its_verify_tokens_pick():
    """A verify pass over depth + 1 tokens reads the union of their experts (expected E(1 - (1 - k/E)^t) per layer
    under uniform routing), which makes MTP on the 35B-A3B worth less than on a dense model."""
    want = arithmetic(A3B)
    context, depth, accepted = 8192, 3, 2.5
    plan = make_plan(PlanRequest(A3B, PROFILE, 0.0, context=context, bits=4, draft_depth=depth,
                                 accepted_length=accepted))
    per_weight = 0.5 + 4 / 64
    E, k = want["experts"], want["per_token"]
    step = want["decode_weights"] * per_weight + want["kv_per_token"] * context + 2 * want["gdn_state"]
    union = E * (1 - (1 - k / E) ** (depth + 1))
    extra = want["layers"] * (union - k) * want["expert_params"] * per_weight
    t = A3B["text_config"]
    mtp_active = want["active"] - (want["decode_weights"] + t["vocab_size"] * t["hidden_size"])  # the head's own part
    draft = (mtp_active + t["vocab_size"] * t["hidden_size"]) * per_weight + 2 * t["num_key_value_heads"] * t["head_dim"] * 2 * context
    ratio = 1 + (PROFILE.mtp_verify_ratio - 1) * depth / (PROFILE.mtp_verify_tokens - 1)
    rate = PROFILE.memory_bandwidth_gbs * 1e9 * PROFILE.decode_efficiency
    assert plan.predicted["decode_mtp_tps"] == pytest.approx(accepted * rate / (ratio * step + extra + depth * draft), abs=0.01)
    assert any("reads the experts they pick" in a for a in plan.assumptions)


def test_moe_flops_count_the_active_experts_only():
    want = arithmetic(A3B)
    tokens = 4096
    plan = make_plan(PlanRequest(A3B, PROFILE, 0.0, context=tokens))
    assert plan.flops["moe"][0] == pytest.approx(want["layers"] * tokens * want["moe_token_flops"], rel=1e-12)
    assert plan.flops["shared_expert"][0] == pytest.approx(want["layers"] * tokens * want["shared_token_flops"], rel=1e-12)
    assert "mlp" not in plan.flops  # every layer of these models is an MoE layer


@pytest.mark.parametrize("config", [A3B, NEXT])
def test_memory_counts_every_expert(config):
    want = arithmetic(config)
    plan = make_plan(PlanRequest(config, PROFILE, 0.0, context=4096, bits=4, memory_gb=128))
    weights = dict(plan.memory.lines)["weights (4-bit, group size 64)"]
    assert weights == int(want["total"] * (0.5 + 4 / 64))
    # one chunk's transients hold every token's top-k experts' gate, up and product rows and their outputs
    args, moe = model_shape(config)
    h, k = want["hidden"], want["per_token"]
    routed = 512 * 4 * (want["experts"] + k * (3 * want["intermediate"] + h) + 3 * want["shared"])
    assert prefill_buffer_bytes(args, 512, moe) - prefill_buffer_bytes(args, 512) == routed  # no dense MLP layer


def test_ane_candidates_attention_and_shared_expert_not_routed_experts():
    plan = make_plan(PlanRequest(A3B, PROFILE, 0.5, context=4096))
    kinds = {p.kind: p for p in plan.pieces}
    assert kinds["attention"].ane_units == 1  # 1 of 2 KV groups
    assert (kinds["shared_expert"].units, kinds["shared_expert"].ane_units) == (512, 256)
    assert kinds["moe"].ane_units == 0
    reason = kinds["moe"].cap_reason
    assert "routed experts stay on the GPU" in reason
    assert "32x the routed FLOPs" in reason and "1.61 GB of fp16 weights per layer" in reason  # 256 / 8; 3*2048*512*256*2
    per_layer = {(s.layer, s.piece) for s in plan.slices}
    for i in range(40):
        assert (i, "shared_expert") in per_layer and (i, "moe") not in per_layer and (i, "mlp") not in per_layer
    # each shared-expert slice is one program: 256 channels x 3 x 2048 x fp16 bytes
    s = next(s for s in plan.slices if s.piece == "shared_expert")
    assert plan.program_parts(s) == [s]


def test_dense_static_formulation_loses_on_the_cost_model():
    """All experts dense on the ANE: 32x the FLOPs of the routed ones, 64 GB of fp16 weights; even a balanced token
    split between the lanes would save under 3% of the routed experts' own GPU time (docs/planner.md)."""
    want = arithmetic(A3B)
    args, moe = model_shape(A3B)
    lanes = Lanes.of(PROFILE)
    tokens = 16384
    d = dense_experts_on_ane(args, moe, lanes, tokens)
    assert d.ane_s == pytest.approx(40 * tokens * want["dense_expert_flops"] / lanes.ane_flops, rel=1e-12)
    assert d.gpu_s == pytest.approx(40 * tokens * want["moe_token_flops"] / lanes.gpu_flops, rel=1e-12)
    assert d.ane_s > 30 * d.gpu_s
    assert d.best_saving_s < 0.03 * d.gpu_s
    assert d.ane_weight_bytes == 40 * want["experts"] * want["expert_params"] * 2
    gpu_only = make_plan(PlanRequest(A3B, PROFILE, 0.0, context=tokens)).predicted["gpu_only_prefill_s"]
    assert d.best_saving_s < 0.01 * gpu_only


def test_recommend_on_moe_tries_the_shared_expert():
    fraction, plan = recommend(PlanRequest(A3B, PROFILE, context=4096))
    assert 0 < fraction <= 1 and plan.predicted["split_prefill_s"] <= plan.predicted["gpu_only_prefill_s"]
    assert {p.kind for p in plan.pieces if p.ane_units} <= {"attention", "gdn_in_proj", "shared_expert"}


def test_plan_cli_shows_total_active_and_bytes_per_token(capsys):
    want = arithmetic(A3B)
    assert main(["plan", "--model", str(DATA / "qwen3.5-35b-a3b.json"), "--profile", "m4-max", "--context", "4096"]) == 0
    out = capsys.readouterr().out
    assert f"parameters: {want['total'] / 1e9:.2f}B total (MTP head {want['mtp_total'] / 1e9:.2f}B), " \
           f"{want['active'] / 1e9:.2f}B active per token" in out
    assert "experts: 256 per MoE layer (40 layers), 8 routed + 1 shared per token" in out
    step = want["decode_weights"] * 2 + want["kv_per_token"] * 4096 + 2 * want["gdn_state"]
    assert f"bytes per decoded token: {step / 1e9:.2f} GB at 4096 tokens of context" in out
    assert main(["plan", "--model", str(DATA / "qwen3.5-35b-a3b.json"), "--profile", "m4-max", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["parameters"]["total"] == want["total"] and d["experts"]["experts"] == 256


def tiny_moe_model(experts: int = 8, per_token: int = 2):
    """A small qwen3_5_moe_text network built in memory (random weights: only its shapes are read here)."""
    from hetero.models.qwen3_5 import Model, ModelArgs

    t = dict(A3B["text_config"], hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, vocab_size=512, num_experts=experts, num_experts_per_tok=per_token,
             moe_intermediate_size=32, shared_expert_intermediate_size=48, max_position_embeddings=4096)
    t["layer_types"] = t["layer_types"][:4]
    config = dict(A3B, text_config=t)
    return config, Model(ModelArgs.from_config(config), with_mtp=True)


def test_planner_counts_match_a_built_moe_network():
    """The planner's totals against an MoE network as the model code builds it: every weight matrix and conv kernel
    (norm weights, A_log and dt_bias aside) is counted once, the experts all of them."""
    from mlx.utils import tree_flatten

    config, model = tiny_moe_model()
    sizes = {k: v.size for k, v in tree_flatten(model.parameters())}
    vectors = sum(n for k, n in sizes.items() if k.endswith(("norm.weight", "A_log", "dt_bias")) or ".pre_fc_norm_" in k)
    n = make_plan(PlanRequest(config, PROFILE, 0.0, context=1024)).parameters
    assert n.total == sum(sizes.values()) - vectors
    expert_params = sum(n for k, n in sizes.items() if ".switch_mlp." in k)
    assert expert_params == 5 * 8 * 3 * 64 * 32  # four backbone layers and the MTP layer, 8 experts each
    assert n.total - n.active == expert_params * (8 - 2) // 8  # only the unpicked experts are inactive


def test_loaded_budget_and_split_of_a_built_moe_network():
    """The governor of a loaded MoE model counts every expert's bytes and the MoE prefill buffers; the runtime's
    `split_layers(model.args, n)` works on its args."""
    from mlx.utils import tree_flatten

    from hetero.planner import loaded_budget, split_layers

    config, model = tiny_moe_model()
    budget = loaded_budget(model, memory_gb=4.0)
    lines = dict(budget.lines)
    assert lines["weights (as loaded)"] == sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    args, moe = model_shape(config)
    assert moe.per_token == 2 and lines["transient prefill buffers (chunk 512)"] == prefill_buffer_bytes(args, 512, moe)
    ranges = split_layers(model.args, 2)
    assert [i for r in ranges for i in r] == [0, 1, 2, 3] and all(ranges)
