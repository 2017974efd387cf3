"""The doctor's checks of one loaded program, run in the ANE lane's worker process where the program itself runs
(`hetero.coreml.backends.ane_worker`'s "check" message): its outputs on the inputs the doctor sends (a full chunk, then a
padded last one), whether they are finite, how far they lie from the reference executor's on the same inputs, and,
where the backend can say, Core ML's placement of its ops."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from hetero.coreml.backends.accuracy import compare
from hetero.coreml.backends.reference_executor import ReferenceExecutor

# Core ML (fp16 on the ANE, its own accumulation order) against the reference executor (fp16 at op boundaries,
# fp32 accumulation): the largest |difference| / max |reference| over an output that still counts as agreement. Set
# from the fp16 step at the outputs' scale (2^-10) with room for accumulation order; a Mac's doctor confirms it.
AGREEMENT = 1e-2


def diagnose(program, path: Path, function: str | None, inputs: dict[str, np.ndarray]) -> dict:
    """One run of `program` (loaded from `path`, `function`) on `inputs`, checked: `finite`, `nonfinite` (the
    outputs holding NaN or inf), `max_rel_diff` and `cosine` against the reference executor, `placement`
    (`PlacementStatus.to_dict`, or unavailable where the backend has no compute plan) and `ok`."""
    start = time.perf_counter()
    ours = {k: np.array(v, np.float32) for k, v in program(inputs).items()}
    seconds = time.perf_counter() - start
    if isinstance(program, ReferenceExecutor):  # this machine's backend is the reference itself
        ref, against = ours, "itself (the reference executor is this machine's backend)"
    else:
        ref, against = ReferenceExecutor(path, function)(inputs), "the reference executor"
    nonfinite = sorted(k for k, a in ours.items() if not np.isfinite(a).all())
    rel, cosine = 0.0, 1.0
    for k, a in ours.items():
        if k in nonfinite:
            continue
        found = compare(a, ref[k])
        rel = max(rel, found["max_abs"] / max(float(np.abs(ref[k]).max()), 1e-30))
        cosine = min(cosine, found["cosine"])
    status = getattr(program, "placement_status", None)
    placement = status().to_dict() if status is not None else {
        "status": "unavailable", "line": "placement needs Core ML on a Mac (MLComputePlan)"}
    ok = not nonfinite and rel <= AGREEMENT and placement.get("ok") is not False
    return {"finite": not nonfinite, "nonfinite": nonfinite, "max_rel_diff": rel, "cosine": cosine,
            "compared_with": against, "placement": placement, "seconds": seconds, "ok": ok}
