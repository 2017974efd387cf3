"""`hetero tune --devices` (hetero/cli/measure.py and its command-line path): with a scripted timer and tiny
programs, the this-machine profile it saves holds exactly the figures its timings give; the median timer on a
fake clock; the planner reads what was saved."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest

import hetero.cli.main

from hetero.checkpoint.dtypes import default_dtype
from hetero.cli.main import main
import hetero.cli.measure as measure_mod
from hetero.cli.measure import Sizes, decode_verify, median_seconds
from hetero.planner import PlanRequest, decode_bytes_per_token, make_plan, model_shape
from hetero.profiles import THIS_MACHINE, load_profile

DATA = Path(__file__).parent / "data"
TINY = Sizes(chunk=64, hidden=64, out=128, reduce_elements=4096, recurrence_tokens=64, mlp_channels=128,
             gdn=dict(hidden=64, key_heads=2, value_heads=4, key_dim=32, value_dim=32),
             attention=dict(hidden=64, heads=2, kv_heads=1, head_dim=64, chunk=64, context=128),
             decode_hidden=64, decode_intermediate=192, draft_depth=3)
# Seconds one call of each measurement takes, as the scripted timer reports them.
SECONDS = {"gpu matmul": 0.002, "gpu bandwidth": 0.004, "host bandwidth": 0.003, "gpu recurrence": 0.2, "gpu cache fill d32": 0.001,
           "gpu attention d32": 0.020, "gpu cache fill d64": 0.001, "gpu attention d64": 0.030,
           "decode step": 0.010, "verify pass": 0.016, "ane mlp": 0.006, "ane call": 0.0005,
           "ane attention d32": 0.012, "ane attention d64": 0.020}


class ScriptedTimer:
    """A `Timer` that runs each measured call once (so a broken measurement still fails) and reports the scripted
    seconds for it."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds, self.calls = seconds, []

    def __call__(self, what, fn, repeats):
        fn()
        self.calls.append(what)
        return self.seconds[what]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """`hetero tune --devices` once, through the command line, with the scripted timer and tiny sizes."""
    home = tmp_path_factory.mktemp("hetero-home")
    timer, lines = ScriptedTimer(SECONDS), []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HETERO_HOME", str(home))
        mp.setattr(hetero.cli.main, "measure", functools.partial(measure_mod.measure, report=lines.append, timer=timer,
                                                            sizes=TINY))  # the name `hetero tune --devices` calls
        rc = main(["tune", "--devices"])
        profile = load_profile(THIS_MACHINE)
    saved = json.loads((home / "settings.json").read_text())
    return rc, timer, lines, profile, saved


def test_tune_devices_times_each_measurement_once_and_saves_the_profile(tuned):
    rc, timer, _, profile, saved = tuned
    assert rc == 0
    assert sorted(timer.calls) == sorted(SECONDS)  # every figure comes from its own timing, none twice
    assert profile.measured and profile.name == THIS_MACHINE
    assert json.dumps(saved).count('"mtp_verify_ratio"') == 1  # stored once, in the settings file


def test_saved_gpu_figures_are_the_measured_ones(tuned):
    _, _, _, p, _ = tuned
    copies = measure_mod.MAX_COPIES  # tiny layers: each measurement cycles through the most copies, timed as one
    gpu_flops = copies * 2.0 * 64 * 64 * 128 / SECONDS["gpu matmul"]
    assert p.gpu_fp32_tflops == pytest.approx(gpu_flops / 1e12, rel=1e-12)
    assert p.memory_bandwidth_gbs == pytest.approx(4096 * 4 / SECONDS["host bandwidth"] / 1e9, rel=1e-12)  # the faster
    _, gdn = measure_mod._gdn_pieces(TINY.gdn)  # a whole layer timed, its projections taken off
    projections = 64 * (gdn["gdn_in_proj"].token_flops + gdn["gdn_out_proj"].token_flops) / gpu_flops
    rec = 64 * gdn["gdn_recurrence"].token_flops / gpu_flops / (SECONDS["gpu recurrence"] / copies - projections)
    assert 0 < rec < 1 and p.gpu_recurrence_efficiency == pytest.approx(rec, rel=1e-12)
    pairs = 64 * 64 + 64 * 65 / 2  # the chunk over 64 cached tokens plus its causal triangle
    past_projections, core = {}, {}
    for D in (32, 64):  # head sizes 32 and 64: the matmuls double, the softmax (per score) stays
        _, piece = measure_mod._attention_piece(dict(TINY.attention, head_dim=D))
        seconds = (SECONDS[f"gpu attention d{D}"] - SECONDS[f"gpu cache fill d{D}"]) / copies
        past_projections[D] = seconds - piece.token_flops * 64 / gpu_flops
        core[D] = piece.pair_flops * pairs
    efficiency = (core[64] - core[32]) / gpu_flops / (past_projections[64] - past_projections[32])
    per_score = (past_projections[32] - core[32] / gpu_flops / efficiency) / (pairs * 2)
    assert 0 < efficiency < 1 and per_score > 0
    assert p.gpu_attention_efficiency == pytest.approx(efficiency, rel=1e-12)
    assert p.gpu_attention_score_s == pytest.approx(per_score, rel=1e-12)


def test_saved_decode_efficiency_and_verify_ratio_are_the_measured_ones(tuned):
    _, _, lines, p, _ = tuned
    weight_bytes = 3 * 64 * 192 * default_dtype().size  # gate, up and down of the decode MLP
    bandwidth = 4096 * 4 / SECONDS["host bandwidth"]
    assert p.decode_efficiency == pytest.approx(weight_bytes / SECONDS["decode step"] / bandwidth, rel=1e-12)
    assert p.mtp_verify_ratio == pytest.approx(SECONDS["verify pass"] / SECONDS["decode step"], rel=1e-12)
    assert p.mtp_verify_tokens == TINY.draft_depth + 1 == 4
    assert any("a verify pass over 4 tokens costs 1.60 steps" in line for line in lines)


def test_saved_ane_figures_are_the_measured_ones(tuned):
    _, _, _, p, _ = tuned
    ane_flops = 6.0 * 64 * 128 * 64 / (SECONDS["ane mlp"] / measure_mod.MAX_COPIES - SECONDS["ane call"])
    assert p.ane_fp16_tflops == pytest.approx(ane_flops / 1e12, rel=1e-12)
    assert p.ane_dispatch_s == SECONDS["ane call"]
    past_projections, core = {}, {}
    for D in (32, 64):  # one KV group's program over its whole static bucket (64-token chunk, 128-token context)
        _, piece = measure_mod._attention_piece(dict(TINY.attention, head_dim=D))
        seconds = SECONDS[f"ane attention d{D}"] - SECONDS["ane call"]
        past_projections[D] = seconds - piece.token_flops * 64 / ane_flops
        core[D] = piece.pair_flops * 64 * 128
    efficiency = (core[64] - core[32]) / ane_flops / (past_projections[64] - past_projections[32])
    per_score = (past_projections[32] - core[32] / ane_flops / efficiency) / (64 * 128 * 2)
    assert 0 < efficiency < 1 and per_score > 0
    assert p.ane_attention_efficiency == pytest.approx(efficiency, rel=1e-12)
    assert p.ane_attention_score_s == pytest.approx(per_score, rel=1e-12)


def test_no_per_process_ane_limit_is_claimed(tuned):
    _, _, _, p, _ = tuned
    assert p.ane_process_weight_limit_gb is None and "ane_process_weight_limit_gb" in p.unknown


def test_the_planner_decodes_with_the_saved_figures(tuned):
    """plain decode = bandwidth x measured efficiency / bytes per token; an MTP round pays the measured verify
    ratio: 1/mtp grows by (r' - r) x step / (L x rate) when the ratio does. (The tiny run's bandwidth is raised
    to 100 GB/s so that the rounded predictions resolve; the efficiency and the ratio are the measured ones.)"""
    _, _, _, measured, _ = tuned
    p = dataclasses.replace(measured, memory_bandwidth_gbs=100.0)
    config = json.loads((DATA / "qwen3.5-9b.json").read_text())
    plan = make_plan(PlanRequest(config, p, 0.0, context=2048, accepted_length=2.5))
    args, moe = model_shape(config)
    step = decode_bytes_per_token(args, moe, plan.storage, 2048, 2)
    rate = 100e9 * measured.decode_efficiency
    assert plan.predicted["decode_plain_tps"] == pytest.approx(rate / step, rel=1e-3)
    worse = make_plan(PlanRequest(config, dataclasses.replace(p, mtp_verify_ratio=measured.mtp_verify_ratio + 1.0), 0.0,
                                  context=2048, accepted_length=2.5))
    grown = 1 / worse.predicted["decode_mtp_tps"] - 1 / plan.predicted["decode_mtp_tps"]
    assert grown == pytest.approx(1.0 * step / (2.5 * rate), rel=1e-2)


@pytest.mark.parametrize("verify_s", [0.012, 0.030])
def test_decode_verify_returns_its_own_timings(verify_s):
    timer = ScriptedTimer({"decode step": 0.01, "verify pass": verify_s})
    eff, ratio = decode_verify(1e9, 4, hidden=64, intermediate=192, timer=timer)
    assert ratio == pytest.approx(verify_s / 0.01, rel=1e-12)
    assert eff == pytest.approx(3 * 64 * 192 * default_dtype().size / 0.01 / 1e9, rel=1e-12)
    assert timer.calls == ["decode step", "verify pass"]


def test_decode_verify_runs_on_the_real_clock():
    eff, ratio = decode_verify(1e9, 4, hidden=64, intermediate=192, repeats=1)
    assert eff > 0 and ratio > 0


def test_median_seconds_times_each_call_on_the_clock_after_one_warm_up():
    ticks = iter([10.0, 10.5, 20.0, 23.0, 30.0, 31.0])  # timed calls take 0.5, 3.0 and 1.0 s
    calls = []
    assert median_seconds(lambda: calls.append(1), 3, clock=lambda: next(ticks)) == 1.0
    assert len(calls) == 4  # the warm-up call is not timed


def test_devices_with_a_model_measures_at_that_models_shapes(tmp_path, monkeypatch):
    """`hetero tune --devices --model M` times the GPU and ANE lanes at M's own layer shapes."""
    from hetero.checkpoint.source import BUNDLED_MODEL

    config = json.loads((Path(BUNDLED_MODEL) / "config.json").read_text())["text_config"]
    seen, real = {}, measure_mod.measure

    def spy(sizes=Sizes(), **kw):
        seen["sizes"] = sizes
        return real(report=lambda line: None, timer=ScriptedTimer(SECONDS), sizes=sizes)

    monkeypatch.setenv("HETERO_HOME", str(tmp_path))
    monkeypatch.setattr(hetero.cli.main, "measure", spy)  # the name `hetero tune --devices` calls
    assert main(["tune", "--devices", "--model", str(BUNDLED_MODEL)]) == 0
    z = seen["sizes"]
    assert (z.hidden, z.mlp_channels, z.chunk) == (config["hidden_size"], config["intermediate_size"], 512)
    assert z.gdn == dict(hidden=config["hidden_size"], key_heads=config["linear_num_key_heads"],
                         value_heads=config["linear_num_value_heads"], key_dim=config["linear_key_head_dim"],
                         value_dim=config["linear_value_head_dim"])
    assert (z.attention["heads"], z.attention["kv_heads"], z.attention["head_dim"]) == (
        config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"])
    assert load_profile(THIS_MACHINE).measured


def test_measurements_cycle_through_enough_copies_to_defeat_the_caches():
    """A layer is timed over as many distinct copies as make IN_FLOW_BYTES (at most MAX_COPIES), as a forward
    pass streams its layers' weights: one hot copy overstated the rates."""
    big, copies = measure_mod.IN_FLOW_BYTES, measure_mod._copies
    assert copies(big) == 1 and copies(big // 2) == 2 and copies(big // 4) == 4 and copies(big // 4 - 1) == 5
    assert copies(1) == measure_mod.MAX_COPIES and copies(10 * big) == 1
