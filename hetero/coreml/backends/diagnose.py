"""The doctor's checks of one loaded program, run where the program itself runs (the ANE lane's worker process, its
"check" message, or the doctor's own process for its probes): its outputs on the inputs given (a full chunk, then a
padded last one), whether they are finite, how far they lie from the reference executor's on the same inputs, Core
ML's placement of its ops where the backend can say, and on a Mac its time under CPU_AND_NE against CPU_ONLY: a
Neural Engine that is not clearly faster than the CPU alone ran it on the CPU (a silent fallback), or has no reason
to run it at all. Each finding has its own verdict, so a failure is named for what it is."""

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
CLEARLY_FASTER = 1.25  # CPU_ONLY's time over CPU_AND_NE's at least this, or the program is flagged as a fallback
TIMED_CALLS = 3  # per compute units, after a warm-up call


def median_call_s(program, inputs: dict, calls: int = TIMED_CALLS) -> float:
    """Median seconds of `calls` calls of `program` on `inputs`, after one warm-up, by the program's clock (Core ML's:
    `CoreML.clock`, the wall clock)."""
    clock = getattr(program, "clock", time.perf_counter)
    program(inputs)
    times = []
    for _ in range(calls):
        t = clock()
        program(inputs)
        times.append(clock() - t)
    return float(np.median(times))


def timing(program, inputs: dict, calls: int = TIMED_CALLS) -> dict:
    """CPU_AND_NE against CPU_ONLY for a Core ML program (`program.cpu_only()`: the same function loaded for the CPU
    alone): their median seconds, the Neural Engine's speed-up and whether it is `flagged` (below
    `CLEARLY_FASTER`); `status` unavailable for a backend without compute units (the reference executor)."""
    cpu_only = getattr(program, "cpu_only", None)
    if cpu_only is None:
        return {"status": "unavailable", "flagged": None,
                "line": "timing under CPU_ONLY and CPU_AND_NE needs Core ML on a Mac"}
    ane_s, cpu_s = median_call_s(program, inputs, calls), median_call_s(cpu_only(), inputs, calls)
    speedup = cpu_s / max(ane_s, 1e-12)
    flagged = speedup < CLEARLY_FASTER
    line = (f"CPU_AND_NE {ane_s * 1e3:.3f} ms, CPU_ONLY {cpu_s * 1e3:.3f} ms: the Neural Engine "
            + (f"is not clearly faster ({speedup:.2f}x, below {CLEARLY_FASTER}x): a CPU fallback, or no gain"
               if flagged else f"runs it {speedup:.2f}x faster"))
    return {"status": "timed", "cpu_and_ne_s": ane_s, "cpu_only_s": cpu_s, "ane_speedup": round(speedup, 4),
            "flagged": flagged, "line": line}


def diagnose(program, path: Path, function: str | None, inputs: dict[str, np.ndarray], timed: bool = True) -> dict:
    """One run of `program` (loaded from `path`, `function`) on `inputs`, checked: `finite`, `nonfinite` (the
    outputs holding NaN or inf), `max_rel_diff` and `cosine` against the reference executor, `numbers_ok`,
    `placement` (`PlacementStatus.to_dict`, or unavailable where the backend has no compute plan), `timing` (with
    `timed`: CPU_AND_NE against CPU_ONLY on a Mac) and `ok` (all of them that could be judged)."""
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
        "status": "unavailable", "ok": None, "line": "placement needs Core ML on a Mac (MLComputePlan)"}
    numbers_ok = not nonfinite and rel <= AGREEMENT
    timed_found = timing(program, inputs) if timed else {"status": "skipped", "flagged": None, "line": "not timed"}
    ok = numbers_ok and placement.get("ok") is not False and not timed_found["flagged"]
    return {"finite": not nonfinite, "nonfinite": nonfinite, "max_rel_diff": rel, "cosine": cosine,
            "compared_with": against, "numbers_ok": numbers_ok, "placement": placement, "timing": timed_found,
            "seconds": seconds, "ok": ok}


def failure_line(found: dict) -> str | None:
    """What a diagnosed run failed, named for what it is (None: it passed): non-finite outputs, numbers off the
    reference, a placement above its cost budget (or a failed query), a CPU fallback."""
    if found["nonfinite"]:
        return f"non-finite {', '.join(found['nonfinite'])}"
    if not found["numbers_ok"]:
        return f"numbers: max rel diff {found['max_rel_diff']:.3g} from {found['compared_with']}"
    if found["placement"].get("ok") is False:
        return f"placement: {found['placement']['line']}"
    if found["timing"].get("flagged"):
        return f"fallback: {found['timing']['line']}"
    return None
