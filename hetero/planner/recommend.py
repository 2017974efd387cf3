"""`hetero plan --recommend` and `--ane-fraction auto`: the fraction, and the piece kinds that take it, with the
shortest predicted split prefill that, given a memory size, still leaves a context window for the planned context
(the ANE's copy of its share and the wavefront's chunks in flight cost memory the KV cache then lacks)."""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations

from hetero.errors import HeteroError
from hetero.planner.plan import PIECE_ALIASES, Plan, PlanRequest, make_plan
from hetero.planner.shape import model_shape
from hetero.planner.slices import OFFLOADABLE, never_split, pieces


def kind_subsets(config: dict) -> list[tuple[str, ...]]:
    """Every set of piece kinds a split of this model may offload: all of them first, then smaller sets."""
    args, moe = model_shape(config)
    present = {p.kind for p in pieces(args, moe, 0.0)} - set(never_split(args))
    kinds = tuple(k for k in OFFLOADABLE if k in present)  # a dense model has no shared expert to try
    return [OFFLOADABLE] + [c for n in range(len(kinds) - 1, 0, -1) for c in combinations(kinds, n)]


def split_plan(request: PlanRequest, offload: tuple[str, ...] | None = None) -> Plan:
    """The plan of a split at `request.fraction`: of the piece kinds in `offload`, or by default of those whose share
    shortens the predicted prefill (the fastest of `kind_subsets`, the one that offloads more on ties; every kind
    when the profile cannot predict a time, and across hosts). What `hetero plan --ane-fraction F`, `hetero convert
    --coreml` and the runtime's split all offload (`request.offload` is set here).

    A plan that leaves kinds out says so in its assumptions, with what offloading every kind would predict."""
    if offload is not None or not request.fraction or (request.hosts or 1) > 1:
        return make_plan(replace(request, offload=offload or OFFLOADABLE))
    every = best = None
    for kinds in kind_subsets(request.config):  # every kind first
        try:
            plan = make_plan(replace(request, offload=kinds))
        except HeteroError:  # this mix's memory leaves no room for KV
            continue
        t = plan.predicted["split_prefill_s"]
        if t is None:  # no time to compare: every kind, as asked
            return make_plan(replace(request, offload=OFFLOADABLE))
        every = plan if kinds == OFFLOADABLE else every
        if best is None or t < best.predicted["split_prefill_s"] - 1e-12:
            best = plan
    if best is None or best is every:  # none fits: every kind's plan raises the memory error
        return every or make_plan(replace(request, offload=OFFLOADABLE))
    instead = "no room for the KV cache"
    if every is not None:
        window = f", a {every.memory.context_window}-token window" if every.memory is not None else ""
        instead = f"{every.predicted['split_prefill_s']:.1f} s{window}"
    short = {v: k for k, v in PIECE_ALIASES.items()}
    best.assumptions.append(
        f"offloads only {', '.join(best.offload)} (--pieces {','.join(short.get(k, k) for k in best.offload)}): "
        f"the piece kinds whose share shortens the predicted prefill at this fraction "
        f"({best.predicted['split_prefill_s']:.1f} s; every kind: {instead}; --pieces all offloads every kind)")
    return best


def recommend(request: PlanRequest) -> tuple[float, Plan]:
    """The F in [0, 1] (steps of 0.01), and the piece kinds that take it, with the shortest predicted split
    prefill: where both lanes balance (`request.fraction` and `request.offload` are what it chooses). A kind the
    profile's ANE lane runs too slowly stays whole on the GPU (the plan's `offload`, with that cap). With
    `memory_gb` (one host), a split whose memory leaves a context window below the context is not a candidate; the
    plan's assumptions say when that passed over a faster one. Across hosts only the best plan is planned so."""
    across = request.hosts is not None and request.hosts > 1
    one_host = replace(request, hosts=None, link_gbps=None, link_latency_ms=None,
                       memory_gb=None if across else request.memory_gb)  # --memory-gb is then each host's
    best, short = _search(one_host)
    if request.hosts is not None or request.link_gbps is not None or request.link_latency_ms is not None:
        return best[0], make_plan(replace(request, fraction=best[0], offload=best[3]))
    if short is not None and short[1] < best[1]:
        best[2].assumptions.append(
            f"memory: a faster split (F {short[0]:.2f}, {short[1]:.1f} s) would leave a {short[2]}-token context "
            f"window at {request.memory_gb:g} GB, below the {request.context}-token context; recommended the fastest "
            "that leaves room")
    return best[0], best[2]


def _search(request: PlanRequest):
    """(the best (F, time, plan, kinds), the fastest split passed over for memory (F, time, window) or None) over
    every F in steps of 0.01 and every subset of kinds (`kind_subsets`: all kinds first, so on ties the plan that
    offloads more wins)."""
    best = short = None
    seen = set()
    for offload in kind_subsets(request.config):
        for i in range(101):
            f = i / 100
            try:
                plan = make_plan(replace(request, fraction=f, offload=offload))
            except HeteroError:
                if f == 0 or request.memory_gb is None:
                    raise
                continue  # this split's fixed memory leaves no room for KV at all
            key = tuple(p.ane_units for p in plan.pieces)
            if key in seen:  # same aligned slices as a smaller F or another subset: same plan
                continue
            seen.add(key)
            t = plan.predicted["split_prefill_s"]
            if t is None:
                raise HeteroError(f"cannot recommend a fraction for {request.profile.chip}: "
                                  f"{'; '.join(plan.unknown) or 'throughput unknown'}")
            window = plan.memory.context_window if plan.memory is not None else None
            if f and window is not None and window < request.context:  # the prompt it is planned for would not fit
                if short is None or t < short[1]:
                    short = (f, t, window)
                continue
            if best is None or t < best[1] - 1e-12:
                best = (f, t, plan, offload)
    return best, short
