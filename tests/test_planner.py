"""The offload planner and the memory governor on the real Qwen3.5 / Qwen3-Next configs (tests/data/, copied
from shared/reference/configs/): caps and their reasons, alignment, effective fractions, FLOP shares, the cost
model's predictions, profiles with unknown values, the governor's budget lines, and one-line errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from hetero.cli.main import main
from hetero.errors import HeteroError
from hetero.planner import (
    ALIGN,
    PROGRAM_WEIGHT_BUDGET,
    ane_slices,
    ane_weight_bytes,
    chunk_spans,
    decode_bytes_per_token,
    govern,
    make_plan,
    model_shape,
    program_spans,
    recommend,
    verify_cost,
)
from hetero.planner.plan import parse_pieces
from hetero.planner.shape import Storage
from hetero.planner.slices import OFFLOADABLE, ane_bytes_per_weight, largest_program_bytes, unit_bytes
from hetero.profiles import THIS_MACHINE, load_profile, profile_names
from hetero.planner.plan import PlanRequest

DATA = Path(__file__).parent / "data"
CONFIGS = {p.stem: json.loads(p.read_text()) for p in DATA.glob("*.json")}
Q27 = CONFIGS["qwen3.5-27b"]
Q9 = CONFIGS["qwen3.5-9b"]
NO_ANE_LIMIT = dataclasses.replace(load_profile("m4-pro"), ane_process_weight_limit_gb=None)


def by_kind(plan):
    return {p.kind: p for p in plan.pieces}


def test_gdn_in_proj_is_capped_at_its_z_rows_with_the_reason():
    """27B: z = 48*128 = 6144 of qkv 10240 + z 6144 + b 48 + a 48 = 16480 rows: 0.50 asked, 0.37 given."""
    plan = make_plan(PlanRequest(Q27, NO_ANE_LIMIT, 0.5, context=4096))
    gdn = by_kind(plan)["gdn_in_proj"]
    assert (gdn.units, gdn.ane_units) == (16480, 6144)
    assert gdn.ane_share == pytest.approx(6144 / 16480)
    assert "qkv, b, a feed the recurrence" in gdn.cap_reason
    assert "gdn_in_proj: requested 0.50, effective 0.37 (" in "\n".join(plan.caps())
    for kind in ("gdn_recurrence", "gdn_out_proj", "lm_head", "mtp"):  # the exact path takes nothing
        assert by_kind(plan)[kind].ane_share == 0 and by_kind(plan)[kind].cap_reason


def test_uncapped_pieces_take_the_requested_fraction():
    plan = make_plan(PlanRequest(Q27, NO_ANE_LIMIT, 0.5, context=4096))
    assert by_kind(plan)["attention"].ane_units == 2 and by_kind(plan)["attention"].cap_reason is None  # 2 of 4 KV groups
    assert by_kind(plan)["mlp"].ane_units == 8704 and by_kind(plan)["mlp"].cap_reason is None


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.77])
def test_slices_are_aligned_and_near_the_request(name, fraction):
    args, moe = model_shape(CONFIGS[name])
    plan = make_plan(PlanRequest(CONFIGS[name], NO_ANE_LIMIT, fraction, context=2048))
    kinds = by_kind(plan)
    attn = kinds["attention"]
    assert attn.unit == "kv_groups" and attn.ane_units == round(fraction * args.num_key_value_heads + 1e-9)
    for s in plan.slices:  # whole KV groups; channel and row slices in multiples of 64
        assert s.start == 0 and (s.piece == "attention" or s.stop % ALIGN == 0)
    if "mlp" in kinds:
        assert abs(kinds["mlp"].ane_units - fraction * args.intermediate_size) <= ALIGN / 2
    if kinds["attention"].ane_units != fraction * args.num_key_value_heads:
        assert "whole KV groups" in attn.cap_reason
    if moe is not None:  # MoE configs: the routed experts stay on the GPU, and say why
        assert "mlp" not in kinds and kinds["moe"].ane_share == 0 and "routed" in kinds["moe"].cap_reason


def test_flop_shares_add_up_and_match_the_closed_form():
    """Attention FLOPs over a chunked prefill: projections 2*params*T plus 4*H*D per visible pair, T(T+1)/2 pairs."""
    T, C = 5000, 512
    args, _ = model_shape(Q27)
    plan = make_plan(PlanRequest(Q27, NO_ANE_LIMIT, 0.5, context=T, chunk=C))
    attn = by_kind(plan)["attention"]
    H, D = args.num_attention_heads, args.head_dim
    closed = attn.layers * (2.0 * attn.params * T + 4.0 * H * D * T * (T + 1) / 2)
    assert plan.flops["attention"][0] == pytest.approx(closed, rel=1e-12)
    total = sum(t for t, _ in plan.flops.values())
    ane = sum(p.ane_share * plan.flops[p.kind][0] for p in plan.pieces)
    assert plan.effective_fraction == pytest.approx(ane / total)
    shares = plan.to_dict()["pieces"]
    assert sum(p["flop_share"] for p in shares.values()) == pytest.approx(1.0, abs=1e-5)
    assert 0 < plan.effective_fraction < 0.5  # the exact path keeps part of the work on the GPU


def test_a_measured_process_limit_scales_the_plan_down_and_says_so():
    """27B at 0.5 would put ~22 GB of fp16 weights on the ANE; a profile that measured a per-process limit of
    3.5 GB (none documented) caps the whole plan at it."""
    prof = dataclasses.replace(load_profile("m4-pro"), ane_process_weight_limit_gb=3.5)
    plan = make_plan(PlanRequest(Q27, prof, 0.5, context=4096))
    assert ane_weight_bytes(plan.pieces) <= prof.ane_process_weight_limit_gb * 1e9
    assert plan.sliced_fraction < 0.5
    assert any("ANE memory" in c and "3.5 GB per process this profile measured" in c for c in plan.caps())
    small = make_plan(PlanRequest(Q9, prof, 0.1, context=4096))  # fits: no memory cap
    assert not any("ANE memory" in c for c in small.caps())


def test_split_is_gpu_only_at_zero_and_faster_when_balanced():
    zero = make_plan(PlanRequest(Q9, NO_ANE_LIMIT, 0.0, context=8192)).predicted
    assert zero["split_prefill_s"] == pytest.approx(zero["gpu_only_prefill_s"])
    half = make_plan(PlanRequest(Q9, NO_ANE_LIMIT, 0.3, context=8192)).predicted
    assert half["split_prefill_s"] < half["gpu_only_prefill_s"]
    ttft = make_plan(PlanRequest(Q9, NO_ANE_LIMIT, 0.3, context=8192, prompt_tokens=2048)).predicted["ttft_s"]
    assert ttft < half["split_prefill_s"]


def test_recommend_is_the_fastest_fraction_on_the_grid():
    f, plan = recommend(PlanRequest(Q9, NO_ANE_LIMIT, context=8192, chunk=512))
    best = plan.predicted["split_prefill_s"]
    for g in (0.0, 0.1, 0.25, 0.5, 0.75, 1.0):
        assert best <= make_plan(PlanRequest(Q9, NO_ANE_LIMIT, g, 8192)).predicted["split_prefill_s"] + 1e-9
    assert 0 < f < 1


def test_recommend_keeps_a_kind_the_ane_runs_slowly_on_the_gpu_and_says_why():
    slow = dataclasses.replace(NO_ANE_LIMIT, ane_attention_efficiency=0.02)  # e.g. an emulated softmax
    f, plan = recommend(PlanRequest(Q9, slow, context=8192, chunk=512))
    assert "attention" not in plan.offload and plan.offload  # the others still take a share
    attn = by_kind(plan)["attention"]
    assert attn.ane_units == 0 and attn.cap_reason.startswith("kept on the GPU")
    assert plan.to_dict()["offload"] == list(plan.offload)
    everything = make_plan(PlanRequest(Q9, slow, f, 8192)).predicted["split_prefill_s"]
    assert plan.predicted["split_prefill_s"] < everything
    _, balanced = recommend(PlanRequest(Q9, NO_ANE_LIMIT, context=8192, chunk=512))
    assert balanced.offload == ("mlp",)  # the MLPs alone balance the lanes: no need for the bucket-padded attention
    quick = dataclasses.replace(NO_ANE_LIMIT, ane_fp16_tflops=3 * NO_ANE_LIMIT.ane_fp16_tflops)
    _, fast = recommend(PlanRequest(Q9, quick, context=8192, chunk=512))
    assert "attention" in fast.offload  # an ANE with time to spare after every MLP takes attention heads too


def test_ane_attention_pays_for_its_chunks_static_bucket():
    """Static shapes: each chunk's ANE attention covers the smallest power-of-two bucket holding its cache and
    itself (512-token chunks: 512, 1024, 2048, 2048 for the first four), never the causal share alone."""
    def busy(n: int) -> float:
        plan = make_plan(PlanRequest(Q9, NO_ANE_LIMIT, 0.5, n, 512, offload=("attention",)))
        return plan.predicted["split_ane_busy_s"]

    third, fourth = busy(1536) - busy(1024), busy(2048) - busy(1536)
    assert fourth == pytest.approx(third, abs=3e-4)  # both over a 2048 bucket (predictions rounded to 1e-4 s)
    assert busy(1024) - busy(512) < third  # the second chunk's bucket is 1024
    from hetero.planner import context_buckets

    assert context_buckets(2048, 512) == [512, 1024, 2048] and context_buckets(2049, 512) == [512, 1024, 2048, 4096]


def test_decode_roofline_is_bandwidth_over_bytes_and_mtp_scales_it():
    args, moe = model_shape(Q9)
    plan = make_plan(PlanRequest(Q9, NO_ANE_LIMIT, 0.0, context=4096, bits=4, accepted_length=2.5))
    step = decode_bytes_per_token(args, moe, plan.storage, 4096, 2)
    pr = plan.predicted
    assert pr["decode_roofline_tps"] == pytest.approx(273e9 / step, rel=1e-3)
    assert pr["decode_plain_tps"] == pytest.approx(273e9 * NO_ANE_LIMIT.decode_efficiency / step, rel=1e-3)
    assert pr["decode_plain_tps"] < pr["decode_mtp_tps"] < 2.5 * pr["decode_plain_tps"]
    one = make_plan(PlanRequest(Q9, NO_ANE_LIMIT, 0.0, context=4096, bits=4, accepted_length=1.0)).predicted
    assert one["decode_mtp_tps"] < one["decode_plain_tps"]  # drafts that never land only cost


def test_profiles_keep_unknown_values_unknown():
    names = profile_names()
    assert {"m4-pro", "m3-ultra", "m5-max", THIS_MACHINE} <= set(names)
    for name in names:
        if name == THIS_MACHINE:
            continue
        prof = load_profile(name)
        for field in prof.unknown:  # listed as unknown -> null, never a number
            assert getattr(prof, field, None) is None, (name, field)
    m5 = make_plan(PlanRequest(Q9, load_profile("m5-max"), 0.5, context=4096))
    assert m5.predicted["gpu_only_prefill_s"] is None and m5.predicted["ttft_s"] is None
    assert any("unknown" in u for u in m5.unknown)
    assert m5.predicted["decode_roofline_tps"] is not None  # bandwidth is published


def test_this_machine_profile_needs_tune(monkeypatch, tmp_path):
    monkeypatch.setenv("HETERO_HOME", str(tmp_path))
    with pytest.raises(HeteroError, match="tune --devices"):
        load_profile(THIS_MACHINE)


# ----------------------------------------------------------------------------------------------------------
# Caps from facts: ~2 GB per ANE program (several programs per share), no documented per-process limit

APPLE = [n for n in profile_names() if n != THIS_MACHINE]


def test_m3_ultra_27b_at_half_gives_gdn_its_z_share_and_no_process_cap():
    """The measured run: Qwen3.5-27B 4-bit on an M3 Ultra at a requested 0.5 put the z share (0.37) of the GDN
    input projections and half of each MLP on the Neural Engine: no 3.5 GB per-process cap shrinks the plan."""
    plan = make_plan(PlanRequest(Q27, load_profile("m3-ultra"), 0.5, context=4096, bits=4))
    kinds = by_kind(plan)
    assert kinds["gdn_in_proj"].ane_share == pytest.approx(6144 / 16480) and round(kinds["gdn_in_proj"].ane_share, 2) == 0.37
    assert kinds["mlp"].ane_units == 8704 and kinds["attention"].ane_units == 2
    assert plan.sliced_fraction == 0.5 and not any("ANE memory" in c for c in plan.caps())
    assert ane_weight_bytes(plan.pieces) > 20e9  # far above the old 3.5 GB "limit", as the real run was


def test_plan_command_shows_the_z_share_for_27b_on_m3_ultra(capsys):
    argv = ["plan", "--model", str(DATA / "qwen3.5-27b.json"), "--bits", "4", "--profile", "m3-ultra",
            "--ane-fraction", "0.5", "--context", "4096", "--pieces", "all"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "gdn_in_proj: requested 0.50, effective 0.37 (only the z rows may leave" in out
    assert "ANE memory" not in out and "ANE programs: 128 (attention 16, mlp 64, gdn_in_proj 48)" in out
    assert "no per-process limit on the ANE's weights is documented or measured" in out


@pytest.mark.parametrize("name", APPLE)
def test_no_profile_claims_a_per_process_ane_limit(name):
    prof = load_profile(name)
    assert prof.ane_process_weight_limit_gb is None and "ane_process_weight_limit_gb" in prof.unknown
    assert prof.ane_program_weight_limit_gb == 2.0  # the documented one stays
    plan = make_plan(PlanRequest(Q9, prof, 0.3, context=2048))
    assert plan.sliced_fraction == 0.3
    assert any(u.startswith("ane_process_weight_limit_gb: no per-process limit") for u in plan.unknown)


def test_a_layer_share_above_the_program_budget_is_exported_as_several_programs():
    """A (made-up) bf16 27B with 200704 intermediate channels: half of one layer's MLP is 100352 channels x 3 x 5120
    fp16 weights = 3.08 GB, above the ~2 GB one program holds: 2 programs per layer, each within the budget."""
    big = json.loads(json.dumps(Q27))
    big["text_config"]["intermediate_size"] = 200704
    plan = make_plan(PlanRequest(big, load_profile("m3-ultra"), 0.5, context=2048))
    mlp = by_kind(plan)["mlp"]
    per_program = PROGRAM_WEIGHT_BUDGET // (3 * 5120 * 2) // ALIGN * ALIGN  # channels one program may carry
    assert mlp.ane_units == 100352 and -(-100352 // per_program) == 2
    assert plan.programs["mlp"] == 2 * 64 and plan.to_dict()["pieces"]["mlp"]["programs"] == 128
    spans = program_spans(mlp, plan.program_budget)
    assert spans[0][0] == 0 and spans[-1][1] == mlp.ane_units and all(a % ALIGN == 0 for a, _ in spans)
    for a, b in spans:
        assert (b - a) * 3 * 5120 * 2 <= PROGRAM_WEIGHT_BUDGET < 2**31
    assert plan.to_dict()["ane_programs"]["count"] == sum(plan.programs.values())
    # 0.13 GB per layer: one each
    small = make_plan(PlanRequest(Q27, load_profile("m3-ultra"), 0.5, context=2048, bits=4))
    assert small.programs == {"attention": 16, "mlp": 64, "gdn_in_proj": 48}


def test_a_lower_per_program_limit_in_a_profile_means_more_programs():
    prof = dataclasses.replace(load_profile("m3-ultra"), ane_program_weight_limit_gb=0.1)
    plan = make_plan(PlanRequest(Q27, prof, 0.5, context=2048))  # bf16: fp16 on the ANE
    assert plan.program_budget == int(0.1e9)
    assert plan.programs["mlp"] == 64 * 3  # 8704 channels x 30720 bytes = 0.27 GB per layer: three 0.1 GB programs
    at4 = make_plan(PlanRequest(Q27, prof, 0.5, context=2048, bits=4))  # 4-bit tables: 15360 bytes per channel, 0.13 GB
    assert at4.programs["mlp"] == 64 * 2


# ----------------------------------------------------------------------------------------------------------
# MTP decode pays a verify pass per round; Apple predictions against published Qwen3.5-27B 4-bit measurements


def _draft_bytes(config, storage, context):
    """Bytes of one MTP draft step: the MTP layer, lm_head and the MTP layer's KV."""
    args, moe = model_shape(config)
    mtp = next(p for p in make_plan(PlanRequest(config, NO_ANE_LIMIT, 0.0, context=context)).pieces if p.kind == "mtp")
    kv = args.mtp_num_hidden_layers * 2 * args.num_key_value_heads * args.head_dim * 2 * context
    return storage.nbytes(mtp.params + args.vocab_size * args.hidden_size) + kv


@pytest.mark.parametrize("ratio", [1.0, 1.57, 2.5])
def test_mtp_decode_pays_the_profiles_verify_ratio(ratio):
    """tok/s = L / ((ratio x step + k x draft) / (bandwidth x efficiency)): one verify pass over k+1 tokens
    costs `ratio` plain steps."""
    prof = dataclasses.replace(load_profile("m3-ultra"), mtp_verify_ratio=ratio, mtp_verify_tokens=4)
    plan = make_plan(PlanRequest(Q27, prof, 0.0, context=4096, bits=4, accepted_length=2.6, draft_depth=3))
    args, moe = model_shape(Q27)
    step = decode_bytes_per_token(args, moe, plan.storage, 4096, 2)
    rate = 819e9 * prof.decode_efficiency
    expect = 2.6 * rate / (ratio * step + 3 * _draft_bytes(Q27, plan.storage, 4096))
    assert plan.predicted["decode_mtp_tps"] == pytest.approx(expect, abs=0.006)


def test_a_verify_pass_costing_one_plain_step_was_the_old_overestimate():
    """Counting a verify pass as one plain step (the old model) predicts far above the ~60 tok/s measured."""
    one = dataclasses.replace(load_profile("m3-ultra"), mtp_verify_ratio=1.0, decode_efficiency=1.0)
    old = make_plan(PlanRequest(Q27, one, 0.0, context=4096, bits=4, accepted_length=2.6)).predicted["decode_mtp_tps"]
    new = make_plan(PlanRequest(Q27, load_profile("m3-ultra"), 0.0, context=4096, bits=4, accepted_length=2.6))
    new = new.predicted["decode_mtp_tps"]
    assert old > 100 and abs(new - 60) / 60 < 0.15


def test_verify_cost_is_linear_in_the_tokens_through_the_measured_point():
    assert verify_cost(1.6, 4, 4) == pytest.approx(1.6) and verify_cost(1.6, 4, 1) == pytest.approx(1.0)
    assert verify_cost(1.6, 4, 2) == pytest.approx(1.2) and verify_cost(1.6, 4, 7) == pytest.approx(2.2)
    prof = load_profile("m3-ultra")
    k1 = make_plan(PlanRequest(Q27, prof, 0.0, context=4096, bits=4, draft_depth=1))
    assert "a verify pass over 2 tokens costs 1.19 plain steps" in "\n".join(k1.assumptions)


def test_without_a_verify_ratio_mtp_decode_is_unknown():
    prof = dataclasses.replace(load_profile("m3-ultra"), mtp_verify_ratio=None)
    plan = make_plan(PlanRequest(Q27, prof, 0.0, context=4096, bits=4))
    assert plan.predicted["decode_mtp_tps"] is None and plan.predicted["decode_plain_tps"] is not None
    assert any("no MTP verify cost" in u for u in plan.unknown)


# Published measurements of Qwen3.5-27B at 4-bit (docs/planner.md, Apple calibration): (profile, what, figure,
# make_plan keywords). The planner must land within 15% of each.
PUBLISHED = [
    ("m3-ultra", "decode_roofline_tps", 51.0, dict(context=4096)),
    ("m3-ultra", "decode_plain_tps", 40.7, dict(context=4096)),
    ("m3-ultra", "decode_mtp_tps", 60.0, dict(context=4096, accepted_length=2.6, draft_depth=3)),
    ("m3-ultra", "gpu_only_prefill_s", 39.0, dict(context=15600)),
    ("m4-pro", "decode_mtp_tps", 18.0, dict(context=4096, accepted_length=2.6, draft_depth=3)),
    ("m4-pro", "mtp_over_plain", 1.4, dict(context=4096, accepted_length=2.6, draft_depth=3)),
]


@pytest.mark.parametrize("name, what, published, kw", PUBLISHED, ids=[f"{p[0]}-{p[1]}" for p in PUBLISHED])
def test_apple_predictions_are_within_15_percent_of_published(name, what, published, kw):
    pr = make_plan(PlanRequest(Q27, load_profile(name), 0.0, bits=4, **kw)).predicted
    got = pr["decode_mtp_tps"] / pr["decode_plain_tps"] if what == "mtp_over_plain" else pr[what]
    assert abs(got - published) / published <= 0.15, (name, what, got, published)


# ----------------------------------------------------------------------------------------------------------
# Memory governor


@pytest.mark.parametrize("gb", [36, 64, 192, 512])
def test_budget_lines_add_up_and_the_window_is_the_largest_aligned_fit(gb):
    plan = make_plan(PlanRequest(Q27, load_profile("m3-ultra"), 0.05, context=4096, bits=4, memory_gb=gb))
    m = plan.memory
    assert sum(b for _, b in m.lines) == m.wirable_bytes == int(gb * 1e9 * 0.75)
    assert m.context_window % plan.chunk == 0 and m.context_window <= 262144
    unused = dict(m.lines)["unused (below one aligned step, or past the model maximum)"]
    if m.context_window < 262144:  # one more chunk of KV would not fit
        assert 0 <= unused < plan.chunk * m.kv_bytes_per_token
    lines = dict(m.lines)
    coreml = "Core ML programs (ANE share, 4-bit lookup tables per group of 64, exact)"
    assert lines[coreml] == ane_weight_bytes(plan.pieces, plan.storage) > 0


def test_kv_counts_only_attention_layers_and_the_mtp_layer():
    args, _ = model_shape(Q27)
    b = govern(args, 0, 1e12, 512, kv_bytes=2)
    assert b.kv_bytes_per_token == (16 + 1) * 2 * 4 * 256 * 2
    assert b.context_window == 262144  # never above the model maximum


def test_window_grows_with_memory():
    args, _ = model_shape(Q27)
    windows = [govern(args, 15e9, gb * 1e9, 512).context_window for gb in (24, 28, 32)]
    assert windows[0] < windows[1] < windows[2]


# ----------------------------------------------------------------------------------------------------------
# Errors and the command line


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(fraction=1.5), "between 0 and 1"),
        (dict(fraction=-0.1), "between 0 and 1"),
        (dict(context=300000), "model's maximum"),
        (dict(memory_gb=16), "no room"),  # bf16 27B: 54 GB of weights
        (dict(chunk=100), "multiple of 64"),
        (dict(bits=7), "--bits"),
    ],
)
def test_impossible_requests_are_one_line_errors(kw, match):
    args = dict(fraction=0.5, context=4096) | kw
    with pytest.raises(HeteroError, match=match) as e:
        make_plan(PlanRequest(Q27, NO_ANE_LIMIT, **args))
    assert "\n" not in str(e.value)


def test_plan_json_has_the_documented_schema(capsys):
    argv = ["plan", "--model", str(DATA / "qwen3.5-27b.json"), "--bits", "4", "--profile", "m4-pro",
            "--context", "8192", "--memory-gb", "64", "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert {"requested_fraction", "effective_fraction", "pieces", "caps", "predicted", "memory"} <= set(d)
    assert {"attention", "mlp", "gdn_in_proj"} <= set(d["pieces"])
    for piece in d["pieces"].values():
        assert {"requested", "effective", "cap_reason"} <= set(piece)
    assert {"gpu_only_prefill_s", "split_prefill_s", "ttft_s", "decode_roofline_tps", "decode_mtp_tps"} <= set(d["predicted"])
    assert d["memory"]["context_window"] > 0 and d["memory"]["lines"]


def test_plan_text_and_errors_on_the_command_line(capsys):
    assert main(["plan", "--model", str(DATA / "qwen3-next-80b-a3b.json"), "--profile", "m3-ultra", "--bits", "4",
                 "--context", "4096", "--recommend"]) == 0
    out = capsys.readouterr().out
    assert "recommended ANE fraction" in out and "moe" in out and "context 4096" in out
    assert main(["plan", "--model", str(DATA / "qwen3.5-9b.json"), "--profile", "nope"]) == 1
    assert "unknown profile" in capsys.readouterr().err


def test_export_slices_equal_the_plan_layers():
    args, _ = model_shape(Q9)
    plan = make_plan(PlanRequest(Q9, NO_ANE_LIMIT, 0.4, context=2048))
    assert ane_slices(args, 0.4) == plan.slices
    assert {s.layer for s in plan.slices if s.piece == "attention"} == {i for i, t in enumerate(args.layer_types) if t == "full_attention"}


def test_chunk_spans_cover_the_prompt():
    starts, sizes = chunk_spans(1000, 256)
    assert list(starts) == [0, 256, 512, 768] and list(sizes) == [256, 256, 256, 232]
    assert np.sum(sizes) == 1000


def test_split_prefill_is_the_busier_lane_plus_the_last_chunks_other_lane():
    """The wavefront: wall = max(GPU busy, ANE busy) + the other lane's share of the last chunk; lock-step stages
    (the previous model) would be the sum over stages of the slower share, never below the busier lane."""
    from hetero.planner import Lanes, chunk_spans, model_shape, pieces, predict_prefill, storage_for

    args, moe = model_shape(Q9)
    lanes, storage = Lanes.of(NO_ANE_LIMIT), storage_for(Q9, None, None)
    ps = pieces(args, moe, 0.5)
    t = predict_prefill(ps, storage, lanes, 8192, 512, True, args.hidden_size)
    one = predict_prefill(ps, storage, lanes, 512, 512, True, args.hidden_size)  # a single chunk: nothing to overlap
    assert max(t.gpu_busy_s, t.ane_busy_s) < t.wall_s < t.gpu_busy_s + t.ane_busy_s
    assert one.wall_s == pytest.approx(one.gpu_busy_s + one.ane_busy_s)  # the chain alternates lanes
    last = predict_prefill(ps, storage, lanes, 8192 - 512, 512, True, args.hidden_size)
    gpu_last, ane_last = t.gpu_busy_s - last.gpu_busy_s, t.ane_busy_s - last.ane_busy_s  # the 16th chunk alone
    assert t.wall_s == pytest.approx(max(t.gpu_busy_s, t.ane_busy_s) + min(gpu_last, ane_last), rel=1e-6)
    gpu_only = predict_prefill(ps, storage, lanes, 8192, 512, False, args.hidden_size)
    assert gpu_only.wall_s == gpu_only.gpu_busy_s and gpu_only.ane_busy_s == 0.0
    assert len(chunk_spans(8192, 512)[0]) == 16


def test_the_governor_counts_every_chunk_a_split_keeps_in_flight():
    """A split prefill holds SPLIT_IN_FLIGHT chunks' buffers at once: the governor's line says so and counts them,
    so the window can only shrink; a GPU-only plan counts one chunk."""
    from hetero.planner import SPLIT_IN_FLIGHT, model_shape, prefill_buffer_bytes

    args, _ = model_shape(Q9)
    split = make_plan(PlanRequest(Q9, NO_ANE_LIMIT, 0.5, 8192, memory_gb=64)).memory
    alone = make_plan(PlanRequest(Q9, NO_ANE_LIMIT, 0.0, 8192, memory_gb=64)).memory
    lines = lambda b: {name: n for name, n in b.lines if name.startswith("transient")}  # noqa: E731
    assert list(lines(split).values()) == [SPLIT_IN_FLIGHT * prefill_buffer_bytes(args, 512)]
    assert f"{SPLIT_IN_FLIGHT} in flight" in next(iter(lines(split)))
    assert list(lines(alone).values()) == [prefill_buffer_bytes(args, 512)]
    assert split.context_window <= alone.context_window


def test_the_gpu_softmax_costs_its_measured_seconds_per_score():
    """A profile's per-score softmax cost adds heads x visible pairs x that cost per attention layer (and the MTP
    layer) to the GPU-only prefill, and the GPU's share of split attention pays its share of it."""
    from hetero.planner import chunk_spans, model_shape
    from hetero.planner.cost import visible_pairs

    args, _ = model_shape(Q9)
    costly = dataclasses.replace(NO_ANE_LIMIT, gpu_attention_score_s=1e-9)
    base = make_plan(PlanRequest(Q9, NO_ANE_LIMIT, 0.0, 8192, 512)).predicted["gpu_only_prefill_s"]
    more = make_plan(PlanRequest(Q9, costly, 0.0, 8192, 512)).predicted["gpu_only_prefill_s"]
    pairs = float(visible_pairs(*chunk_spans(8192, 512)).sum())
    layers = args.layer_types.count("full_attention") + args.mtp_num_hidden_layers
    assert more - base == pytest.approx(layers * args.num_attention_heads * pairs * 1e-9, abs=2e-4)


# ----------------------------------------------------------------------------------------------------------
# The ANE's weights cost what the exporter writes: a quantized checkpoint's own quantization, as lookup tables


def test_the_ane_share_costs_its_lookup_tables_not_fp16():
    """Per weight: the index plus 2^bits fp16 entries per group (1.0 byte at 4 bits, group 64); fp16 (2 bytes) for
    float checkpoints and for 8 bits, whose 256-entry tables would outweigh fp16."""
    assert ane_bytes_per_weight(Storage(4, 64)) == 1.0 and ane_bytes_per_weight(Storage(4, 128)) == 0.75
    assert ane_bytes_per_weight(Storage(2, 64)) == 0.375 and ane_bytes_per_weight(Storage(3, 32)) == 0.875
    assert ane_bytes_per_weight(Storage(8, 64)) == ane_bytes_per_weight(Storage(16)) == ane_bytes_per_weight() == 2.0
    at4 = make_plan(PlanRequest(Q27, load_profile("m3-ultra"), 0.5, context=4096, bits=4))
    bf16 = make_plan(PlanRequest(Q27, load_profile("m3-ultra"), 0.5, context=4096))
    assert ane_weight_bytes(at4.pieces, at4.storage) * 2 == ane_weight_bytes(bf16.pieces, bf16.storage)
    assert sum(p["ane_weight_bytes"] for p in at4.to_dict()["pieces"].values()) == pytest.approx(10.91e9, rel=1e-3)


def test_plan_27b_4bit_at_half_fits_48_gb_with_the_split_cost_beside_its_window(tmp_path, capsys):
    """Refused before (21.8 GB of fp16 ANE weights on top of the GPU's 15.4 GB left no room for one chunk of KV);
    with every kind's share at its 4-bit tables (10.9 GB, `--pieces all`) the split plans, and the plan says what
    it costs against GPU-only."""
    model = tmp_path / "qwen3.5-27b"
    model.mkdir()
    (model / "config.json").write_text((DATA / "qwen3.5-27b.json").read_text())
    argv = ["plan", "--model", str(model), "--bits", "4", "--ane-fraction", "0.5", "--memory-gb", "48",
            "--profile", "m3-ultra", "--pieces", "all"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "10.91 GB  Core ML programs (ANE share, 4-bit lookup tables per group of 64, exact)" in out
    assert "context window: 109568 tokens" in out
    assert "the split costs 11.54 GB (10.91 GB of Core ML programs" in out and "262144 GPU-only" in out
    assert "offloads only" not in out  # the mix the user chose is not second-guessed
    assert main(argv + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["memory"]["context_window"] == 109568 and plan["memory"]["without_split"]["context_window"] == 262144
    assert plan["offload"] == ["attention", "mlp", "gdn_in_proj", "shared_expert"]


@pytest.mark.parametrize("context", [None, "16384"])
def test_plan_offloads_by_default_only_the_kinds_that_shorten_the_prefill_and_leaves_128k_at_48_gb(
        tmp_path, capsys, context):
    """On the calibrated m3-ultra, offloading every kind at 0.5 is slower than GPU-only; by default the plan
    offloads only the MLP's share, which pays, says so with what every kind would have predicted, and leaves a
    window above 128K tokens at 48 GB (the issue's target command, at its default context and at 16K)."""
    model = tmp_path / "qwen3.5-27b"
    model.mkdir()
    (model / "config.json").write_text((DATA / "qwen3.5-27b.json").read_text())
    argv = ["plan", "--model", str(model), "--bits", "4", "--ane-fraction", "0.5", "--memory-gb", "48",
            "--profile", "m3-ultra"] + (["--context", context] if context else [])
    assert main(argv) == 0
    note = [line for line in capsys.readouterr().out.splitlines() if "offloads only" in line]
    assert len(note) == 1 and "(--pieces mlp)" in note[0] and "a 109568-token window" in note[0]
    assert main(argv + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["offload"] == ["mlp"] and plan["memory"]["context_window"] == 143360
    assert plan["predicted"]["split_prefill_s"] < plan["predicted"]["gpu_only_prefill_s"]
    assert main(argv + ["--pieces", "all", "--json"]) == 0
    every = json.loads(capsys.readouterr().out)
    assert every["predicted"]["split_prefill_s"] > plan["predicted"]["split_prefill_s"]


def test_pieces_all_is_every_kind_and_a_bad_kind_names_the_choices():
    assert parse_pieces("all") == OFFLOADABLE and parse_pieces("z,mlp") == ("mlp", "gdn_in_proj")
    with pytest.raises(HeteroError, match="lm_head cannot take an ANE share; choose from .* or all"):
        parse_pieces("mlp,lm_head")


def test_a_measured_instance_window_bounds_every_program_and_an_unknown_one_is_said():
    prof = load_profile("m3-ultra")
    assert prof.ane_instance_weight_window_gb is None and "ane_instance_weight_window_gb" in prof.unknown
    plan = make_plan(PlanRequest(Q27, prof, 0.5, context=2048, bits=4))
    said = [u for u in plan.unknown if u.startswith("ane_instance_weight_window_gb")]
    assert said and "about 4 GiB" in said[0] and "0.13 GB" in said[0]  # 8704 MLP channels x 15360 bytes
    narrow = dataclasses.replace(prof, ane_instance_weight_window_gb=0.05, unknown=[])
    plan = make_plan(PlanRequest(Q27, narrow, 0.5, context=2048, bits=4))
    assert plan.program_budget == int(0.05e9) and plan.programs["mlp"] == 64 * 3
    assert largest_program_bytes(plan.pieces, plan.program_budget, plan.storage) <= 0.05e9
    assert not any(u.startswith("ane_instance_weight_window_gb") for u in plan.unknown)
    for s in plan.slices:  # the exporter's cut (Plan.program_parts) keeps to the window too
        for part in plan.program_parts(s):
            assert (part.stop - part.start) * unit_bytes(plan.args, s.piece, plan.storage) <= 0.05e9


def test_recommend_keeps_the_window_the_context_needs():
    """At 48 GB and a 128K context the fastest split (more ANE weights) would leave too short a window: the
    recommendation is the fastest split that still fits the context, and its assumptions say so."""
    prof = load_profile("m3-ultra")
    free, _ = recommend(PlanRequest(Q27, prof, context=131072, chunk=512, bits=4))
    f, plan = recommend(PlanRequest(Q27, prof, context=131072, chunk=512, bits=4, memory_gb=48))
    assert f < free and plan.memory.context_window >= 131072
    assert any(a.startswith("memory: a faster split") for a in plan.assumptions)
    roomy, _ = recommend(PlanRequest(Q27, prof, context=131072, chunk=512, bits=4, memory_gb=512))
    assert roomy == free
