"""GPU-only and the split priced as they run on this machine (hetero/planner/predict.py): the CPU wavefront's lanes,
two CPU lanes contending for the machine, and an ANE lane that computes on the GPU path's cores (the reference
executor here) priced as such rather than as a free device."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hetero.planner import make_plan, recommend
from hetero.planner.plan import PlanRequest
from hetero.planner.predict import Lanes, split_gpu_scale, wavefront_wall
from hetero.profiles import Profile

BENCH_SHAPE = dict(  # bench/ttft.py's model: the bundled layer pattern, 512 wide
    model_type="qwen3_5_text", hidden_size=512, num_hidden_layers=8, intermediate_size=1536,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4,
    vocab_size=4096, partial_rotary_factor=0.25, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    max_position_embeddings=32768,
)
# a measured CPU profile's rates (bench/ttft.py's model, one BLAS thread per lane, this project's 2-core machines)
CPU = dict(name="this-machine", chip="cpu", source="test", measured=True, memory_bandwidth_gbs=23.2,
           gpu_fp32_tflops=0.0673, ane_fp16_tflops=0.081, ane_bandwidth_gbs=None, ram_gb=25.0, gpu_efficiency=1.0,
           ane_efficiency=1.0, ane_dispatch_s=1.6e-4, gpu_recurrence_efficiency=0.08, gpu_attention_efficiency=1.3,
           gpu_attention_score_s=1.7e-9, ane_attention_efficiency=0.16, ane_attention_score_s=6.55e-9,
           ane_process_weight_limit_gb=None, cpu_cores=2, lane_threads=1, ane_on_cpu=True)
ONE_CORE_EACH = dict(CPU, prefill_lanes=1, lane_contention=0.9)  # GPU-only on one core; each lane a core of its own
DEFAULT_PATH = dict(CPU, prefill_lanes=2, lane_contention=0.9)  # GPU-only as the two-lane wavefront


def simulate(chunk_s: list[float], lanes: int, layers: int) -> float:
    """The wavefront event by event (an oracle for `wavefront_wall`): layer i of chunk k starts when its lane is
    free, its layer i - 1 and chunk k - 1's layer i are done."""
    n, free, prev = len(chunk_s), [0.0] * lanes, [0.0] * layers
    for k, t in enumerate(chunk_s):
        lane, ends = (n - 1 - k) % lanes, []
        for i in range(layers):
            start = max(free[lane] if i == 0 else ends[-1], prev[i] if k else 0.0)
            ends.append(start + t / layers)
        free[lane], prev = ends[-1], ends
    return prev[-1]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(0.01, 5.0), min_size=1, max_size=20), st.integers(1, 3), st.integers(1, 12))
def test_the_wavefront_wall_is_the_event_by_event_schedule(chunk_s, lanes, layers):
    wall = wavefront_wall(np.array(chunk_s), lanes, layers)
    assert wall == pytest.approx(simulate(chunk_s, lanes, layers) if lanes > 1 and len(chunk_s) > 1 else sum(chunk_s))
    assert max(chunk_s) - 1e-9 <= wall <= sum(chunk_s) + 1e-9  # never faster than a chunk alone, nor than one lane


def test_two_lanes_of_even_chunks_take_half_the_chunks_and_one_layer():
    assert wavefront_wall(np.full(8, 1.0), 2, 4) == pytest.approx(4 + 1 / 4)
    assert wavefront_wall(np.full(7, 1.0), 2, 4) == pytest.approx(4)


def test_gpu_only_is_priced_on_the_wavefronts_lanes_under_contention():
    one, two = Profile.from_dict(ONE_CORE_EACH), Profile.from_dict(DEFAULT_PATH)
    alone = make_plan(PlanRequest(BENCH_SHAPE, one, 0.0, 8192, 512)).predicted["gpu_only_prefill_s"]
    wave = make_plan(PlanRequest(BENCH_SHAPE, two, 0.0, 8192, 512)).predicted["gpu_only_prefill_s"]
    # 16 chunks: each lane runs 8, at 0.9 of the rate, plus a layer of lag: about 0.56x the one lane
    assert wave == pytest.approx(alone / 2 / 0.9, rel=0.08) and wave < 0.6 * alone


def test_a_split_whose_ane_lane_shares_the_cores_is_never_recommended_over_the_wavefront():
    """On the default path here GPU-only already runs on both cores; an ANE lane on the CPU takes one of them, so
    offloading moves work between two equal cores and adds merges: no fraction is predicted faster, and `auto`
    (which starts from this recommendation) means GPU-only. Each lane a core of its own (a Mac's model), the
    split is recommended."""
    for n in (2048, 8192, 16384):
        f, plan = recommend(PlanRequest(BENCH_SHAPE, Profile.from_dict(DEFAULT_PATH), 0.0, n, 512))
        assert f == 0.0 and plan.predicted["split_prefill_s"] == plan.predicted["gpu_only_prefill_s"]
        f, plan = recommend(PlanRequest(BENCH_SHAPE, Profile.from_dict(ONE_CORE_EACH), 0.0, n, 512))
        assert f > 0.5 and plan.predicted["split_prefill_s"] < 0.85 * plan.predicted["gpu_only_prefill_s"]


@settings(max_examples=40, deadline=None)
@given(contention=st.floats(0.5, 1.0), ane_per_core=st.floats(0.3, 1.0), context=st.sampled_from([2048, 8192]))
def test_no_split_beats_the_wavefront_when_the_ane_lane_is_no_faster_per_core(contention, ane_per_core, context):
    p = Profile.from_dict(dict(DEFAULT_PATH, lane_contention=contention,
                               ane_fp16_tflops=CPU["gpu_fp32_tflops"] * ane_per_core))
    for f in (0.25, 0.5, 1.0):
        pr = make_plan(PlanRequest(BENCH_SHAPE, p, f, context, 512, offload=("mlp", "gdn_in_proj"))).predicted
        assert pr["split_prefill_s"] > pr["gpu_only_prefill_s"]


def test_the_splits_gpu_lane_gives_up_a_core_only_where_the_ane_lane_takes_one():
    def scale(**kw) -> float:
        return split_gpu_scale(Profile.from_dict(dict(CPU, **kw)))

    assert scale(prefill_lanes=2, lane_threads=1) == 1.0  # the wavefront's lanes already run one thread each
    assert scale(prefill_lanes=1, lane_threads=2) == 0.5  # one lane on both cores: the split's keeps one
    assert scale(prefill_lanes=1, lane_threads=1) == 1.0  # one lane on one core: the ANE lane has the other
    assert scale(prefill_lanes=1, lane_threads=2, ane_on_cpu=False) == 1.0  # a device of its own (Core ML)
    lanes = Lanes.of(Profile.from_dict(dict(CPU, prefill_lanes=1, lane_threads=2, lane_contention=0.8)))
    split = lanes.split()
    assert split.gpu_flops == pytest.approx(lanes.gpu_flops * 0.4) and split.ane_flops == pytest.approx(
        lanes.ane_flops * 0.8) and split.gpu_score_s == pytest.approx(lanes.gpu_score_s / 0.4)


def test_apple_profiles_price_as_before():
    """A chip profile has no CPU lanes: GPU-only on one lane, the ANE a device of its own, no contention."""
    config = json.loads((Path(__file__).parent / "data" / "qwen3.5-27b.json").read_text())
    from hetero.profiles import load_profile

    p = load_profile("m3-ultra")
    assert (p.prefill_lanes, p.lane_contention, p.ane_on_cpu) == (1, 1.0, False)
    lanes = Lanes.of(p)
    assert lanes.split() is lanes and lanes.gpu_only() is lanes
    plan = make_plan(PlanRequest(config, dataclasses.replace(p), 0.5, 16384, 512, bits=4, offload=("mlp",)))
    assert plan.predicted["split_prefill_s"] < plan.predicted["gpu_only_prefill_s"]
