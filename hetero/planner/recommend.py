"""`hetero plan --recommend` and `--ane-fraction auto`: the fraction, and the piece kinds that take it, with the
shortest predicted split prefill."""

from __future__ import annotations

from itertools import combinations

from hetero.errors import HeteroError
from hetero.planner.plan import Plan, make_plan
from hetero.planner.shape import model_shape
from hetero.planner.slices import OFFLOADABLE, pieces
from hetero.profiles import Profile


def recommend(config: dict, profile: Profile, context: int, chunk: int = 512, **kw) -> tuple[float, Plan]:
    """The F in [0, 1] (steps of 0.01), and the piece kinds that take it, with the shortest predicted split
    prefill: where both lanes balance. A kind the profile's ANE lane runs too slowly stays whole on the GPU
    (the plan's `offload`, with that cap)."""
    across = {k: kw.pop(k) for k in ("hosts", "link_gbps", "link_latency_ms") if k in kw}  # the best plan's only
    if (across.get("hosts") or 1) > 1:  # --memory-gb is then each host's: the one-host budget plays no part
        across["memory_gb"] = kw.pop("memory_gb", None)
    best: tuple[float, float, Plan, tuple[str, ...]] | None = None
    seen = set()
    present = {p.kind for p in pieces(*model_shape(config), 0.0)}
    kinds = tuple(k for k in OFFLOADABLE if k in present)  # a dense model has no shared expert to try
    subsets = [OFFLOADABLE] + [c for n in range(len(kinds) - 1, 0, -1) for c in combinations(kinds, n)]
    for offload in subsets:  # all kinds first: on ties the plan that offloads more wins
        for i in range(101):
            f = i / 100
            plan = make_plan(config, profile, f, context, chunk, offload=offload, **kw)
            key = tuple(p.ane_units for p in plan.pieces)
            if key in seen:  # same aligned slices as a smaller F or another subset: same plan
                continue
            seen.add(key)
            t = plan.predicted["split_prefill_s"]
            if t is None:
                raise HeteroError(f"cannot recommend a fraction for {profile.chip}: {'; '.join(plan.unknown) or 'throughput unknown'}")
            if best is None or t < best[1] - 1e-12:
                best = (f, t, plan, offload)
    if any(v is not None for v in across.values()):
        return best[0], make_plan(config, profile, best[0], context, chunk, offload=best[3], **kw, **across)
    return best[0], best[2]
