"""The offload planner and the memory governor on the real Qwen3.5 / Qwen3-Next configs (tests/data/, copied
from shared/reference/configs/): caps and their reasons, alignment, effective fractions, FLOP shares, the cost
model's predictions, profiles with unknown values, the governor's budget lines, and one-line errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from hetero.cli import main
from hetero.errors import HeteroError
from hetero.planner import (
    ALIGN,
    ane_slices,
    ane_weight_bytes,
    chunk_spans,
    decode_bytes_per_token,
    govern,
    make_plan,
    model_shape,
    recommend,
)
from hetero.profiles import THIS_MACHINE, load_profile, profile_names

DATA = Path(__file__).parent / "data"
CONFIGS = {p.stem: json.loads(p.read_text()) for p in DATA.glob("*.json")}
Q27 = CONFIGS["qwen3.5-27b"]
Q9 = CONFIGS["qwen3.5-9b"]
NO_ANE_LIMIT = dataclasses.replace(load_profile("m4-pro"), ane_process_weight_limit_gb=None)


def by_kind(plan):
    return {p.kind: p for p in plan.pieces}


def test_gdn_in_proj_is_capped_at_its_z_rows_with_the_reason():
    """27B: z = 48*128 = 6144 of qkv 10240 + z 6144 + b 48 + a 48 = 16480 rows: 0.50 asked, 0.37 given."""
    plan = make_plan(Q27, NO_ANE_LIMIT, 0.5, context=4096)
    gdn = by_kind(plan)["gdn_in_proj"]
    assert (gdn.units, gdn.ane_units) == (16480, 6144)
    assert gdn.ane_share == pytest.approx(6144 / 16480)
    assert "qkv, b, a feed the recurrence" in gdn.cap_reason
    assert "gdn_in_proj: requested 0.50, effective 0.37 (" in "\n".join(plan.caps())
    for kind in ("gdn_recurrence", "gdn_out_proj", "lm_head", "mtp"):  # the exact path takes nothing
        assert by_kind(plan)[kind].ane_share == 0 and by_kind(plan)[kind].cap_reason


def test_uncapped_pieces_take_the_requested_fraction():
    plan = make_plan(Q27, NO_ANE_LIMIT, 0.5, context=4096)
    assert by_kind(plan)["attention"].ane_units == 2 and by_kind(plan)["attention"].cap_reason is None  # 2 of 4 KV groups
    assert by_kind(plan)["mlp"].ane_units == 8704 and by_kind(plan)["mlp"].cap_reason is None


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.77])
def test_slices_are_aligned_and_near_the_request(name, fraction):
    args, moe = model_shape(CONFIGS[name])
    plan = make_plan(CONFIGS[name], NO_ANE_LIMIT, fraction, context=2048)
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
    plan = make_plan(Q27, NO_ANE_LIMIT, 0.5, context=T, chunk=C)
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


def test_ane_memory_limit_scales_the_plan_down_and_says_so():
    """27B at 0.5 would put ~22 GB of fp16 weights on the ANE; a process keeps about 3.5 GB there."""
    prof = load_profile("m4-pro")
    plan = make_plan(Q27, prof, 0.5, context=4096)
    assert ane_weight_bytes(plan.pieces) <= prof.ane_process_weight_limit_gb * 1e9
    assert plan.sliced_fraction < 0.5
    assert any("ANE memory" in c for c in plan.caps())
    small = make_plan(Q9, prof, 0.1, context=4096)  # fits: no memory cap
    assert not any("ANE memory" in c for c in small.caps())


def test_split_is_gpu_only_at_zero_and_faster_when_balanced():
    zero = make_plan(Q9, NO_ANE_LIMIT, 0.0, context=8192).predicted
    assert zero["split_prefill_s"] == pytest.approx(zero["gpu_only_prefill_s"])
    half = make_plan(Q9, NO_ANE_LIMIT, 0.3, context=8192).predicted
    assert half["split_prefill_s"] < half["gpu_only_prefill_s"]
    ttft = make_plan(Q9, NO_ANE_LIMIT, 0.3, context=8192, prompt_tokens=2048).predicted["ttft_s"]
    assert ttft < half["split_prefill_s"]


def test_recommend_is_the_fastest_fraction_on_the_grid():
    f, plan = recommend(Q9, NO_ANE_LIMIT, 8192, 512)
    best = plan.predicted["split_prefill_s"]
    for g in (0.0, 0.1, 0.25, 0.5, 0.75, 1.0):
        assert best <= make_plan(Q9, NO_ANE_LIMIT, g, 8192).predicted["split_prefill_s"] + 1e-9
    assert 0 < f < 1


def test_recommend_keeps_a_kind_the_ane_runs_slowly_on_the_gpu_and_says_why():
    slow = dataclasses.replace(NO_ANE_LIMIT, ane_attention_efficiency=0.02)  # e.g. an emulated softmax
    f, plan = recommend(Q9, slow, 8192, 512)
    assert "attention" not in plan.offload and plan.offload  # the others still take a share
    attn = by_kind(plan)["attention"]
    assert attn.ane_units == 0 and attn.cap_reason.startswith("kept on the GPU")
    assert plan.to_dict()["offload"] == list(plan.offload)
    everything = make_plan(Q9, slow, f, 8192).predicted["split_prefill_s"]
    assert plan.predicted["split_prefill_s"] < everything
    fast_f, fast = recommend(Q9, NO_ANE_LIMIT, 8192, 512)
    assert "attention" in fast.offload  # at the peak-figure rate, attention is worth offloading


def test_ane_attention_pays_for_its_whole_static_bucket():
    """Static shapes: every chunk's ANE attention covers the whole cache bucket (the prompt's chunks rounded up to
    a power of two), so 3 chunks (a bucket of 4) cost the ANE exactly 3/4 of 4 chunks, not the causal share."""
    def busy(n: int) -> float:
        return make_plan(Q9, NO_ANE_LIMIT, 0.5, n, 512, offload=("attention",)).predicted["split_ane_busy_s"]

    assert busy(1536) == pytest.approx(busy(2048) * 3 / 4, abs=2e-4)  # predictions are rounded to 1e-4 s


def test_decode_roofline_is_bandwidth_over_bytes_and_mtp_scales_it():
    args, moe = model_shape(Q9)
    plan = make_plan(Q9, NO_ANE_LIMIT, 0.0, context=4096, bits=4, accepted_length=2.5)
    step = decode_bytes_per_token(args, moe, plan.storage, 4096, 2)
    assert plan.predicted["decode_roofline_tps"] == pytest.approx(273e9 / step, rel=1e-3)
    assert plan.predicted["decode_roofline_tps"] < plan.predicted["decode_mtp_tps"] < 2.5 * plan.predicted["decode_roofline_tps"]
    one = make_plan(Q9, NO_ANE_LIMIT, 0.0, context=4096, bits=4, accepted_length=1.0).predicted
    assert one["decode_mtp_tps"] < one["decode_roofline_tps"]  # drafts that never land only cost


def test_profiles_keep_unknown_values_unknown():
    names = profile_names()
    assert {"m4-pro", "m3-ultra", "m5-max", THIS_MACHINE} <= set(names)
    for name in names:
        if name == THIS_MACHINE:
            continue
        prof = load_profile(name)
        for field in prof.unknown:  # listed as unknown -> null, never a number
            assert getattr(prof, field, None) is None, (name, field)
    m5 = make_plan(Q9, load_profile("m5-max"), 0.5, context=4096)
    assert m5.predicted["gpu_only_prefill_s"] is None and m5.predicted["ttft_s"] is None
    assert any("unknown" in u for u in m5.unknown)
    assert m5.predicted["decode_roofline_tps"] is not None  # bandwidth is published


def test_this_machine_profile_needs_tune(monkeypatch, tmp_path):
    monkeypatch.setenv("HETERO_HOME", str(tmp_path))
    with pytest.raises(HeteroError, match="tune --devices"):
        load_profile(THIS_MACHINE)


# ----------------------------------------------------------------------------------------------------------
# Memory governor


@pytest.mark.parametrize("gb", [36, 64, 192, 512])
def test_budget_lines_add_up_and_the_window_is_the_largest_aligned_fit(gb):
    plan = make_plan(Q27, load_profile("m3-ultra"), 0.05, context=4096, bits=4, memory_gb=gb)
    m = plan.memory
    assert sum(b for _, b in m.lines) == m.wirable_bytes == int(gb * 1e9 * 0.75)
    assert m.context_window % plan.chunk == 0 and m.context_window <= 262144
    unused = dict(m.lines)["unused (below one aligned step, or past the model maximum)"]
    if m.context_window < 262144:  # one more chunk of KV would not fit
        assert 0 <= unused < plan.chunk * m.kv_bytes_per_token
    lines = dict(m.lines)
    assert lines["Core ML packages (ANE share, fp16)"] == ane_weight_bytes(plan.pieces) > 0


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
        make_plan(Q27, NO_ANE_LIMIT, **args)
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
    plan = make_plan(Q9, NO_ANE_LIMIT, 0.4, context=2048)
    assert ane_slices(args, 0.4) == plan.slices
    assert {s.layer for s in plan.slices if s.piece == "attention"} == {i for i, t in enumerate(args.layer_types) if t == "full_attention"}


def test_chunk_spans_cover_the_prompt():
    starts, sizes = chunk_spans(1000, 256)
    assert list(starts) == [0, 256, 512, 768] and list(sizes) == [256, 256, 256, 232]
    assert np.sum(sizes) == 1000
