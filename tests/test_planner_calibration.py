"""The Apple split prediction against the published split measurements (issue 25, part 6; docs/planner.md, Apple split
calibration).

Published runs of Qwen3.5-27B-class models at 4-bit on an M3 Ultra that put the MLP share and the GDN z rows on the
Neural Engine (requested 0.5 of the GDN input projections, capped at z: 0.375 of z + qkv):

- oMLX, docs/experimental/qwen35_ane_prefill.md (github.com/jundot/omlx), "Qwen3.8-27B-oQ4e validation": prompt
  processing 439.1 -> 517.0 tok/s at 16K (+17.8%), 408.9 -> 486.0 tok/s at 32K (+18.9%).
- The write-up issue 25 quotes: +21% prefill at a requested 0.5 capped to 0.375. Its context is not given; the
  only published figure of that size with that cap we found is the same oMLX page's 32K cold/cache-hit pair
  ("Recurrent-safe GDN validation": about 507 against 416 tok/s, +21.9%), so it is checked at 32K.

The error measured is that of the predicted split time relative to the GPU-only time: predicted split / (GPU-only /
(1 + published gain)) - 1, the published split TTFT in the planner's own GPU-only units (the planner's GPU-only time
is calibrated on stock mlx-lm and runs 9-10% above oMLX's GPU path: the ratio, not the seconds, is what the published
gain measures). It is the honest one here, not the stricter relative error of the gain: the two published 32K gains
of one configuration differ by 11% of the gain (18.9% against 21%) but by 1.7% in split time, and the published runs
are oMLX's lock-step schedule on both ANEs while the plan is this runtime's wavefront on one (docs/planner.md lists
the gain errors too).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hetero.cli.main import main
from hetero.errors import HeteroError
from hetero.planner import Lanes, PlanRequest, make_plan
from hetero.planner.plan import parse_pieces
from hetero.profiles import load_profile

CONFIG = json.loads((Path(__file__).parent / "data" / "qwen3.5-27b.json").read_text())
PROFILE = load_profile("m3-ultra")
TOLERANCE = 0.15  # issue 25: within 15% of the published figure

PUBLISHED = [  # (source, context, published prefill gain: GPU-only time / split time - 1)
    ("oMLX qwen35_ane_prefill.md, Qwen3.8-27B-oQ4e on M3 Ultra, 16K: 439.1 -> 517.0 tok/s", 16384, 0.178),
    ("oMLX qwen35_ane_prefill.md, Qwen3.8-27B-oQ4e on M3 Ultra, 32K: 408.9 -> 486.0 tok/s", 32768, 0.189),
    ("write-up quoted in issue 25, +21% at 0.5 capped to 0.375 (oMLX's 32K cold/hit pair: 416 -> 507 tok/s)", 32768, 0.21),
]


def published_mix(context: int, profile=PROFILE, **kw):
    """The plan of the published piece mix: MLP and GDN z rows at a requested 0.5 (`hetero plan --pieces mlp,z`)."""
    return make_plan(PlanRequest(CONFIG, profile, 0.5, context, bits=4, offload=parse_pieces("mlp,z"), **kw))


@pytest.mark.parametrize("source, context, gain", PUBLISHED, ids=["16K", "32K", "21%"])
def test_published_mix_split_time_is_within_15_percent(source, context, gain):
    predicted = published_mix(context).predicted
    published_split = predicted["gpu_only_prefill_s"] / (1 + gain)
    error = predicted["split_prefill_s"] / published_split - 1
    assert abs(error) <= TOLERANCE, f"{source}: predicted {predicted['speedup']}x, split time off by {error:+.1%}"


def test_published_mix_is_mlp_and_z_only():
    plan = published_mix(16384)
    shares = {p.kind: p.ane_share for p in plan.pieces}
    assert plan.offload == ("mlp", "gdn_in_proj")
    assert shares["mlp"] == 0.5 and shares["attention"] == 0.0
    assert shares["gdn_in_proj"] == pytest.approx(6144 / 16480)  # all of z: the published runs' 0.375 of z + qkv


def test_before_the_fix_the_lane_counted_both_anes():
    """What the plan predicted before: both of the Ultra's ANEs in one lane at the assumed 0.5 (1.56x at 16K,
    against the published 1.178x)."""
    before = published_mix(16384, dataclasses.replace(PROFILE, ane_efficiency=0.5), ane_instances=2)
    assert before.predicted["speedup"] == pytest.approx(1.563, abs=1e-3)
    assert published_mix(16384).predicted["speedup"] < 1.2


def test_the_lane_gets_one_anes_rate():
    one = Lanes.of(PROFILE)
    assert one.ane_flops == pytest.approx(36e12 / 2 * PROFILE.ane_efficiency)  # one die's 18 TFLOPS
    assert Lanes.of(PROFILE, 2).ane_flops == pytest.approx(2 * one.ane_flops)
    m4 = load_profile("m4-pro")  # one ANE: its figure is the lane's
    assert Lanes.of(m4).ane_flops == pytest.approx(m4.ane_fp16_tflops * 1e12 * m4.ane_efficiency)
    with pytest.raises(ValueError, match="2 ANE"):
        Lanes.of(PROFILE, 3)


def test_ane_efficiency_is_the_published_per_request_rate():
    """oMLX's trace: 20.37 ms per ANE request for one ANE's 4,608 gate + 4,608 up channels at 2,048 tokens."""
    per_ane = 2 * 2048 * 5120 * (2 * 4608) / 20.37e-3
    assert PROFILE.ane_efficiency == pytest.approx(per_ane / 18e12, abs=5e-4)


def test_pieces_flag(capsys):
    argv = ["plan", "--model", "tests/data/qwen3.5-27b.json", "--bits", "4", "--profile", "m3-ultra",
            "--context", "16384", "--json"]
    assert main(argv + ["--pieces", "mlp,z"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["offload"] == ["mlp", "gdn_in_proj"] and d["pieces"]["attention"]["effective"] == 0
    assert d["predicted"]["speedup"] == published_mix(16384).predicted["speedup"]
    assert main(argv + ["--pieces", "mlp,lm_head"]) == 1
    err = capsys.readouterr().err
    assert "lm_head cannot take an ANE share" in err and "attention, mlp, gdn_in_proj, shared_expert" in err
    assert len(err.strip().splitlines()) == 1
    assert main(argv + ["--pieces", "mlp", "--recommend"]) == 1
    assert "--recommend chooses the piece kinds" in capsys.readouterr().err
    assert parse_pieces(" gdn_in_proj , mlp ") == ("mlp", "gdn_in_proj")
    with pytest.raises(HeteroError, match="no piece kind"):
        parse_pieces(",")
