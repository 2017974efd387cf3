"""The planner's split of a model across hosts (issue 15): balanced by cost, contiguous, no empty rank, the
embedding on rank 0 and lm_head / MTP on the last rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetero.errors import HeteroError
from hetero.models.qwen3_5 import ModelArgs
from hetero.planner.hosts import layer_costs, split_layers
from hetero.planner.shape import model_shape

REF = Path(__file__).resolve().parents[2] / "shared" / "reference" / "configs"
BUNDLED = Path(__file__).resolve().parents[1] / "hetero" / "bundled" / "config.json"
CONFIGS = {p.stem: json.loads(p.read_text()) for p in sorted(REF.glob("*.json"))}


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
    ranges = split_layers(args, n_ranks, moe=moe)
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
