"""Pipeline parallelism across hosts (issue 15): the model's backbone layers split across ranks by the planner's
per-layer cost, never cutting a layer; the embedding lives on rank 0, the final norm, lm_head and the MTP head on
the last rank, and their cost counts on those ranks.

The split balances prefill FLOPs of a `SPLIT_TOKENS`-long prompt in 512-token chunks (attention layers cost more
than GDN layers as the context grows; MoE layers count their active experts). It depends on the config only, so
every rank, the runtime and `hetero plan --hosts` derive the same split.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.errors import HeteroError
from hetero.models.qwen3_5 import ModelArgs
from hetero.planner.cost import chunk_spans, piece_flops
from hetero.planner.shape import MoE, moe_of
from hetero.planner.slices import pieces

SPLIT_TOKENS = 16384  # the prompt length the split balances: a long agent prompt, where pipelining pays
SPLIT_CHUNK = 512


@dataclass(frozen=True)
class LayerCosts:
    """Prefill FLOPs per backbone layer, plus what only rank 0 (embedding) and the last rank (final norm, lm_head
    on the last row, the MTP head over the prompt) compute."""

    layers: list[float]
    first: float
    last: float


def layer_costs(args: ModelArgs, moe: MoE | None = None, tokens: int = SPLIT_TOKENS, chunk: int = SPLIT_CHUNK) -> LayerCosts:
    """FLOPs each backbone layer spends on a `tokens`-long prefill in `chunk`-token chunks (the planner's pieces:
    attention or GDN mixer, then a dense MLP or the MoE block with its active experts)."""
    moe = moe if moe is not None else moe_of(args)
    starts, sizes = chunk_spans(tokens, chunk)
    by_kind = {p.kind: float(piece_flops(p, starts, sizes).sum()) for p in pieces(args, moe, 0.0)}
    f = lambda *kinds: sum(by_kind.get(k, 0.0) for k in kinds)  # noqa: E731
    attention, gdn = f("attention"), f("gdn_in_proj", "gdn_recurrence", "gdn_out_proj")
    moe_layers = set(args.moe_layers)
    per_layer = [(attention if t == "full_attention" else gdn) + (f("moe") if i in moe_layers else f("mlp"))
                 for i, t in enumerate(args.layer_types)]
    return LayerCosts(per_layer, 0.0, f("lm_head", "mtp"))  # the embedding is a gather: no FLOPs


def split_layers(args: ModelArgs, n_ranks: int, *, moe: MoE | None = None, tokens: int = SPLIT_TOKENS,
                 chunk: int = SPLIT_CHUNK) -> list[range]:
    """One `range` of backbone layer indices per rank, contiguous, in order, covering every layer once.

    Rank 0 also holds the embedding, the last rank the final norm, lm_head and the MTP head (their cost counts
    there). The ranges minimise the busiest rank's prefill FLOPs (`layer_costs`: a `tokens`-long prompt in
    `chunk`-token chunks), since a prefill pipelined by chunk takes about the slowest rank's share. Deterministic:
    every rank computes the same split from the same args. `moe`: the routed experts' shape, read from the args
    when not given. Raises HeteroError unless 1 <= n_ranks <= num_hidden_layers (no rank is left empty).
    """
    n_layers = args.num_hidden_layers
    if not 1 <= n_ranks <= n_layers:
        raise HeteroError(f"cannot split {n_layers} layers across {n_ranks} ranks: each rank needs at least one layer")
    return balanced_ranges(layer_costs(args, moe, tokens, chunk), n_ranks)


def balanced_ranges(costs: LayerCosts, n_ranks: int) -> list[range]:
    """Contiguous non-empty ranges minimising the largest rank total (rank 0 adds `first`, the last rank `last`).

    Dynamic programme over (ranks, layers): exact, O(n_ranks x layers^2), which is nothing for a few hundred layers.
    On equal maxima the earliest cut wins, so the answer is the same wherever it is computed.
    """
    c, n = costs.layers, len(costs.layers)
    prefix = [0.0]
    for x in c:
        prefix.append(prefix[-1] + x)

    def part(r: int, i: int, j: int) -> float:  # rank r's total with layers [i, j)
        return prefix[j] - prefix[i] + (costs.first if r == 0 else 0.0) + (costs.last if r == n_ranks - 1 else 0.0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_ranks)]  # best[r][j]: the least max over ranks 0..r holding layers [0, j)
    cut = [[0] * (n + 1) for _ in range(n_ranks)]
    for j in range(1, n + 1):
        best[0][j] = part(0, 0, j)
    for r in range(1, n_ranks):
        for j in range(r + 1, n + 1):
            for i in range(r, j):  # rank r takes [i, j); ranks 0..r-1 hold [0, i), one layer each at least
                v = max(best[r - 1][i], part(r, i, j))
                if v < best[r][j]:
                    best[r][j], cut[r][j] = v, i
    bounds, j = [n], n
    for r in range(n_ranks - 1, 0, -1):
        j = cut[r][j]
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]
