"""The planner's split of a model across hosts (issue 15): balanced by cost, contiguous, no empty rank, the
embedding on rank 0 and lm_head / MTP on the last rank; `hetero plan --hosts N`: memory per host (from the config
arithmetic), the pipelined prefill and the decode with link hops, and an unknown link that stays unknown."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetero.cli.main import main
from hetero.errors import HeteroError
from hetero.models.qwen3_5 import ModelArgs
from hetero.planner import PlanRequest, make_plan, recommend
from hetero.planner.hosts import layer_costs, pipeline_wall, split_layers
from hetero.planner.report import plan_lines
from hetero.planner.shape import model_shape
from hetero.profiles import load_profile

DATA = Path(__file__).parent / "data"
BUNDLED = Path(__file__).resolve().parents[1] / "hetero" / "bundled" / "config.json"
CONFIGS = {p.stem: json.loads(p.read_text()) for p in sorted(DATA.glob("*.json"))}


def shape(name: str):
    return model_shape(CONFIGS[name])


def check_partition(ranges: list[range], n_layers: int, n_ranks: int) -> None:
    assert len(ranges) == n_ranks
    assert all(len(r) > 0 and r.step == 1 for r in ranges)  # no empty rank
    assert ranges[0].start == 0 and ranges[-1].stop == n_layers
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))  # contiguous, in order
    assert [i for r in ranges for i in r] == list(range(n_layers))  # every layer once


def brute_force_best(costs, n_ranks: int) -> float:
    """The least possible busiest-rank cost over every contiguous split (small cases only)."""
    from itertools import combinations

    n = len(costs.layers)
    best = float("inf")
    for cuts in combinations(range(1, n), n_ranks - 1):
        bounds = (0, *cuts, n)
        totals = [sum(costs.layers[a:b]) for a, b in zip(bounds, bounds[1:])]
        totals[0] += costs.first
        totals[-1] += costs.last
        best = min(best, max(totals))
    return best


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("n_ranks", [1, 2, 3, 4])
def test_split_real_configs_is_a_balanced_partition(name, n_ranks):
    args, moe = shape(name)
    ranges = split_layers(args, n_ranks)  # as the runtime calls it: the experts' shape read from the args
    assert ranges == split_layers(args, n_ranks, moe=moe)
    check_partition(ranges, args.num_hidden_layers, n_ranks)
    costs = layer_costs(args, moe)
    totals = [sum(costs.layers[i] for i in r) for r in ranges]
    totals[0] += costs.first
    totals[-1] += costs.last
    if n_ranks <= 3:  # exact optimum against every contiguous split
        assert max(totals) == pytest.approx(brute_force_best(costs, n_ranks), rel=1e-12)
    # balanced: the busiest rank is within one layer's cost of an even share of the whole
    assert max(totals) <= sum(totals) / n_ranks + max(costs.layers) + costs.last


def test_split_weighs_attention_above_gdn_layers():
    """At a long prompt an attention layer costs more than a GDN layer, so a 2-way split of 27B is not 32/32
    by count but by cost; and the last rank, which also runs lm_head and the MTP layer, takes fewer layers."""
    args, moe = shape("qwen3.5-27b")
    costs = layer_costs(args, moe)
    attn = [c for c, t in zip(costs.layers, args.layer_types) if t == "full_attention"]
    gdn = [c for c, t in zip(costs.layers, args.layer_types) if t == "linear_attention"]
    assert min(attn) > max(gdn)
    assert costs.last > 0 and costs.first == 0
    a, b = split_layers(args, 2, moe=moe)
    assert len(b) < len(a)


def test_split_bundled_args_and_errors():
    args = ModelArgs.from_config(json.loads(BUNDLED.read_text()))
    for n in range(1, args.num_hidden_layers + 1):
        check_partition(split_layers(args, n), args.num_hidden_layers, n)
    assert split_layers(args, args.num_hidden_layers) == [range(i, i + 1) for i in range(args.num_hidden_layers)]
    with pytest.raises(HeteroError, match="at least one layer"):
        split_layers(args, args.num_hidden_layers + 1)
    with pytest.raises(HeteroError):
        split_layers(args, 0)


def test_split_is_deterministic():
    args, moe = shape("qwen3-next-80b-a3b")
    assert split_layers(args, 3, moe=moe) == split_layers(args, 3, moe=moe)


# ----------------------------------------------------------------------------------------------------------
# `hetero plan --hosts N`

PROFILE = load_profile("m4-max")
Q27 = CONFIGS["qwen3.5-27b"]


def weights_by_arithmetic(config: dict, layers: range, first: bool, last: bool, bytes_per: float) -> float:
    """A dense config's weight bytes for a rank holding `layers`, from the config fields alone."""
    t = config.get("text_config") or config
    h, V, I = t["hidden_size"], t["vocab_size"], t["intermediate_size"]
    H, Hkv, D = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    nk, nv, dk, dv = t["linear_num_key_heads"], t["linear_num_value_heads"], t["linear_key_head_dim"], t["linear_value_head_dim"]
    attn = h * (2 * H * D + 2 * Hkv * D + H * D)
    conv = 2 * nk * dk + nv * dv
    gdn = h * (conv + nv * dv + 2 * nv) + conv * 4 + nv * dv * h
    mlp = 3 * h * I
    n = sum((attn if t["layer_types"][i] == "full_attention" else gdn) + mlp for i in layers)
    vocab = (1 if first else 0) + (2 if last and not first else 1 if last else 0)  # embedding; lm_head (+ a copy of it for MTP)
    mtp = attn + mlp + 2 * h * h if last else 0
    return (n + vocab * V * h + mtp) * bytes_per


def test_one_host_agrees_with_the_single_host_plan():
    plan = make_plan(PlanRequest(Q27, PROFILE, 0.0, context=16384, bits=4, hosts=1))
    pr, hp = plan.predicted, plan.hosts.predicted
    assert hp["prefill_s"] == pytest.approx(pr["gpu_only_prefill_s"], abs=1e-3)
    assert hp["decode_plain_tps"] == pytest.approx(pr["decode_plain_tps"], abs=0.01)
    assert hp["decode_mtp_tps"] == pytest.approx(pr["decode_mtp_tps"], abs=0.01)
    assert plan.hosts.ranks[0].weight_bytes == pytest.approx(sum(p.layers * plan.storage.nbytes(p.params) for p in plan.pieces))


def test_memory_per_host_and_where_the_head_lives():
    plan = make_plan(PlanRequest(Q27, PROFILE, 0.0, context=32768, hosts=3, memory_gb=32))
    ranks = plan.hosts.ranks
    assert [r.layers for r in ranks] == split_layers(plan.args, 3)
    assert ranks[0].extras == ["embedding"] and ranks[1].extras == []
    assert ranks[-1].extras == ["final norm + lm_head", "MTP head"]
    for r in ranks:
        want = weights_by_arithmetic(Q27, r.layers, r.rank == 0, r.rank == 2, 2.0)
        assert r.weight_bytes == pytest.approx(want, rel=1e-9)
        attn = sum(Q27["text_config"]["layer_types"][i] == "full_attention" for i in r.layers)
        assert r.kv_bytes_per_token == (attn + (1 if r.rank == 2 else 0)) * 2 * 4 * 256 * 2  # + the MTP layer's KV
        assert r.memory_bytes < 32e9 * 0.75 and 0 < r.window <= 262144
    assert plan.memory is None  # --memory-gb is each host's here: the one-host budget is not the question
    lines = "\n".join(plan_lines(plan))
    assert f"context window across hosts (32 GB each): {min(r.window for r in ranks)} tokens" in lines
    # 27 GB of bf16 on two 16 GB hosts
    small = make_plan(PlanRequest(Q27, PROFILE, 0.0, context=32768, hosts=2, memory_gb=16))
    assert [r.window for r in small.hosts.ranks] == [0, 0]
    assert "a host does not fit" in "\n".join(plan_lines(small))


def test_unknown_link_stays_unknown():
    plan = make_plan(PlanRequest(Q27, PROFILE, 0.0, context=16384, bits=4, hosts=2))
    hp = plan.hosts.predicted
    assert hp["prefill_s"] is None and hp["decode_plain_tps"] is None and hp["decode_mtp_tps"] is None
    assert hp["link_s_per_chunk"] is None
    assert hp["busiest_rank_prefill_s"] > 0  # what needs no link is still predicted
    assert any("link between hosts" in u for u in plan.hosts.unknown)
    d = plan.to_dict()["hosts"]
    assert d["link_gbps"] is None and d["predicted"]["prefill_s"] is None


def test_known_link_pipelines_the_prefill_and_pays_hops_per_token():
    gbps, ms = 40.0, 0.2
    one = make_plan(PlanRequest(Q27, PROFILE, 0.0, context=16384, bits=4, hosts=1)).hosts
    two = make_plan(PlanRequest(Q27, PROFILE, 0.0, context=16384, bits=4, hosts=2, link_gbps=gbps,
                                link_latency_ms=ms)).hosts
    p2 = two.predicted
    busiest = max(r.prefill_s for r in two.ranks)
    assert busiest <= p2["prefill_s"] < one.predicted["prefill_s"]
    assert p2["prefill_s"] < 0.6 * one.predicted["prefill_s"]  # close to the slowest rank's share, not the sum
    hidden = Q27["text_config"]["hidden_size"]
    hop = ms / 1e3 + hidden * 2 * 8 / (gbps * 1e9)  # one bf16 hidden state
    back = ms / 1e3 + 64 * 8 / (gbps * 1e9)  # the sampled token back to rank 0
    assert p2["decode_plain_tps"] == pytest.approx(1 / (sum(r.decode_s for r in two.ranks) + hop + back), abs=0.01)
    assert sum(r.decode_s for r in two.ranks) == pytest.approx(sum(r.decode_s for r in one.ranks), rel=1e-9)
    assert p2["link_s_per_chunk"] == pytest.approx(ms / 1e3 + 512 * hidden * 2 * 8 / (gbps * 1e9), abs=1e-6)


def test_pipeline_wall_is_a_flow_shop():
    # rank 0: 1 s per chunk, rank 1: 2 s, 0.5 s per message: rank 1 waits for the first chunk only
    assert pipeline_wall([[1, 1, 1], [2, 2, 2]], [0.5] * 3) == pytest.approx(1 + 0.5 + 3 * 2)
    # a slow link becomes the bottleneck: three messages of 3 s back to back
    assert pipeline_wall([[1, 1, 1], [1, 1, 1]], [3.0] * 3) == pytest.approx(1 + 3 * 3 + 1)
    assert pipeline_wall([[1, 2, 3]], [0.0] * 3) == pytest.approx(6)


def test_plan_cli_hosts_unknown_and_given_link():
    cmd = [sys.executable, "-m", "hetero", "plan", "--model", str(DATA / "qwen3.5-35b-a3b.json"), "--profile",
           "m4-max", "--bits", "4", "--context", "16384", "--hosts", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "hosts: 2" in text and "link: bandwidth and latency unknown (measure with `iperf3" in text
    for line in ("prefill (16384 tokens, pipelined by chunk) unknown (measure with", "plain decode       unknown (measure with",
                 "decode with MTP    unknown (measure with"):
        assert line in text
    rows = [ln for ln in text.splitlines() if ln.strip().startswith(("0 ", "1 ")) and " GB " in ln]
    args, moe = shape("qwen3.5-35b-a3b")
    assert [ln.split()[1] for ln in rows] == [f"{r.start}-{r.stop - 1}" for r in split_layers(args, 2, moe=moe)]
    assert rows[0].endswith("embedding") and rows[1].endswith("final norm + lm_head, MTP head")
    assert main(["plan", "--model", str(DATA / "qwen3.5-35b-a3b.json"), "--profile", "m4-max", "--bits", "4",
                 "--context", "16384", "--hosts", "2", "--link-gbps", "80", "--link-latency-ms", "0.05"]) == 0
    assert main(["plan", "--model", str(DATA / "qwen3.5-35b-a3b.json"), "--hosts", "41"]) == 1  # 40 layers
    with pytest.raises(SystemExit) as e:  # a usage error: one line, exit 1
        main(["plan", "--model", str(DATA / "qwen3.5-35b-a3b.json"), "--hosts", "2", "--link-gbps", "0"])
    assert e.value.code == 1



def test_recommend_with_hosts_uses_each_hosts_memory():
    """27B in bf16 fits no single 32 GB host, but three of them: the fraction search must not ask one host."""
    with pytest.raises(HeteroError, match="no room"):
        make_plan(PlanRequest(Q27, PROFILE, 0.0, context=32768, memory_gb=32))
    fraction, plan = recommend(PlanRequest(Q27, PROFILE, context=32768, hosts=3, memory_gb=32))
    assert plan.requested_fraction == fraction and plan.memory is None
    assert [r.layers for r in plan.hosts.ranks] == split_layers(plan.args, 3)
    assert all(r.window > 0 for r in plan.hosts.ranks)


def test_split_without_the_mtp_head_gives_the_last_rank_more():
    """The bundled model at 16K: attention layers (3 and 7) dominate; the MTP head's pass over the prompt costs about
    one more attention layer, so with it the last rank holds layer 7 alone, without it half the model."""
    args = ModelArgs.from_config(json.loads(BUNDLED.read_text()))
    assert split_layers(args, 2) == [range(0, 7), range(7, 8)]
    assert split_layers(args, 2, mtp=False) == [range(0, 4), range(4, 8)]
    costs, bare = layer_costs(args), layer_costs(args, mtp=False)
    assert costs.layers == bare.layers and costs.last > 5 * bare.last
