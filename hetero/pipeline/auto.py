"""`--ane-fraction auto`: the split this machine's measured profile recommends, kept only where it is measured to win.

1. The planner prices GPU-only as it runs here (the CPU wavefront on its lanes, `hetero.planner.predict`) and the
   split the same way; where no split is predicted faster, auto means GPU-only.
2. The recommended fraction is verified on a calibration prompt (`verify`), halved until it passes.
3. The verified split's TTFT is timed against GPU-only's on a calibration prompt of a few chunks, in alternated
   pairs, until the 95% interval of their ratio (`hetero.host.confidence`) lies below or above 1, or
   `TIMING_SECONDS` pass. The split is kept only when the whole interval lies below 1: a win beyond the noise.
   Otherwise auto means GPU-only. The decision is said once, on one line, and saved with its interval for this
   model, split, profile and code (`saved_timing`), so the next start does not time it again.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable

import mlx.core as mx

from hetero.coreml.export import DEFAULT_WEIGHT_FORM
from hetero.decode.prefill import prefill
from hetero.errors import HeteroError
from hetero.host.confidence import Estimate, repeat
from hetero.host.settings import measured_with, save_tuning, tuning
from hetero.planner import OFFLOADABLE, physical_memory_bytes, recommend
from hetero.planner.plan import PlanRequest
from hetero.pipeline.run import CALIBRATION, DEFAULT_CHUNK, DEFAULT_VERIFY_TOL, PipelineRun, configure
from hetero.pipeline.verification import FP32Reference, verify
from hetero.profiles import THIS_MACHINE, load_profile
from hetero.validate import AneSplit

TIMING_SECONDS = 30.0  # the TTFT check's time cap: past it, a split not yet beyond the noise is not kept
TIMING_TARGET_S = 1.0  # the calibration prompt is sized so that its predicted GPU-only prefill takes about this
TIMING_CHUNKS = (4, 8)  # ... within these many chunks (fewer could not overlap the lanes; more take too long)

# (the split, the calibration prompt) -> the split's TTFT over GPU-only's, pair by pair
TimeFn = Callable[[PipelineRun, list[int]], Estimate]


def split_for(engine, ane: AneSplit | float | str, chunk: int = DEFAULT_CHUNK,
              weights: str = DEFAULT_WEIGHT_FORM) -> PipelineRun:
    """The split of `--ane-fraction F|auto` for `engine`: an `AneSplit` (a bare fraction or "auto" is parsed by
    `AneSplit.parse`, the one parser), its quantized weights exported in the form `weights` (`--ane-weights`)."""
    ane = AneSplit.parse(ane)
    if ane.auto:
        return auto_fraction(engine, chunk, weights=weights)
    return configure(engine, ane.fraction, chunk, weights=weights)


def auto_fraction(engine, chunk: int = DEFAULT_CHUNK, report: Callable[[str], None] | None = None,
                  tol: float | None = DEFAULT_VERIFY_TOL, weights: str = DEFAULT_WEIGHT_FORM,
                  time_ttft: TimeFn | None = None) -> PipelineRun:
    """`--ane-fraction auto` (module docstring). `time_ttft` times the split against GPU-only (default:
    `ttft_ratio`, the real prefills on the clock). The fp32 reference the checks share goes once the fraction is
    chosen: a server keeps none of it."""
    return _auto_fraction(engine, chunk, report or (lambda line: print(line, file=sys.stderr)), tol, weights,
                          time_ttft or ttft_ratio, FP32Reference(engine))


def _auto_fraction(engine, chunk: int, report: Callable[[str], None], tol: float | None, weights: str,
                   time_ttft: TimeFn, fp32: FP32Reference) -> PipelineRun:
    if chunk <= 0 or chunk % 64:
        raise HeteroError(f"--prefill-chunk {chunk}: the split prefill needs a positive multiple of 64")
    profile = load_profile(THIS_MACHINE)
    args = engine.model.args
    memory_gb = getattr(engine, "memory_gb", None) or physical_memory_bytes() / 1e9  # the split's copy costs memory
    context = min(8192, args.max_position_embeddings)
    fraction, best = recommend(PlanRequest(engine.config, profile, 0.0, context, chunk, memory_gb=memory_gb))
    gpu_only = lambda: configure(engine, 0.0, chunk, profile=profile)  # noqa: E731
    predicted = best.predicted
    if not fraction or predicted["split_prefill_s"] >= predicted["gpu_only_prefill_s"]:
        report(f"--ane-fraction auto: GPU-only: no split is predicted faster on this machine at {context} tokens "
               f"(GPU-only {predicted['gpu_only_prefill_s']:.2f} s as it runs here, {_lanes(profile)})")
        return gpu_only()
    run = verified(engine, fraction, best.offload, chunk, profile, weights, tol, report, fp32)
    if run is None:
        return gpu_only()
    return timed(engine, run, chunk, report, time_ttft) or gpu_only()


def _lanes(profile) -> str:
    if profile.prefill_lanes > 1:
        return f"on {profile.prefill_lanes} CPU lanes, which an ANE lane on the CPU would share"
    return "on one lane"


def verified(engine, fraction: float, offload: tuple[str, ...], chunk: int, profile, weights: str, tol: float | None,
             report: Callable[[str], None], fp32: FP32Reference) -> PipelineRun | None:
    """The split at `fraction`, halved until it passes verification on the calibration prompt (each lowering
    reported); None when none passes or the lane's worker is lost."""
    ids = engine.tokenizer.encode(CALIBRATION)[: 2 * chunk]
    while fraction > 0:
        run = configure(engine, fraction, chunk, offload=offload, profile=profile, weights=weights)
        check = verify(run, ids, tol=tol, n_tokens=8, fp32=fp32)
        if "lane_lost" in check:  # the worker, not the split, failed: no fraction can be judged now
            report("--ane-fraction auto: the ANE lane's worker was lost during calibration; prefill runs GPU-only")
            return None
        if check["match"]:
            return run
        lower = round(fraction / 2, 2) if fraction > 0.05 else 0.0
        report(f"--ane-fraction auto: {fraction:.2f} failed verification on a calibration prompt "
               f"(distance {check['distance']}, tolerance {check['tolerance']}, greedy "
               f"{check['greedy_match_tokens']}/8); "
               f"lowering to {lower:.2f}")
        fraction = lower
    report("--ane-fraction auto: no split passed verification; prefill runs GPU-only")
    return None


def timing_tokens(run: PipelineRun) -> int:
    """The TTFT check's prompt length: whole chunks, `TIMING_CHUNKS`, as many as the planner predicts GPU-only to
    prefill in about `TIMING_TARGET_S` (the most where it cannot predict)."""
    lo, hi = TIMING_CHUNKS
    per_chunk = run.plan.predicted["gpu_only_prefill_s"] and run.plan.predicted["gpu_only_prefill_s"] / max(
        1, -(-run.plan.context // run.chunk))
    n = hi if not per_chunk else int(TIMING_TARGET_S / per_chunk)
    room = (run.engine.model.args.max_position_embeddings - 1) // run.chunk  # whole chunks the model can hold
    return run.chunk * max(1, min(room, max(lo, min(hi, n))))


def timing_prompt(engine, n: int) -> list[int]:
    """`n` tokens of the calibration text, repeated (the same code sample the verification reads)."""
    ids = engine.tokenizer.encode(CALIBRATION)
    return (ids * (n // max(len(ids), 1) + 1))[:n]


def timed(engine, run: PipelineRun, chunk: int, report: Callable[[str], None], time_ttft: TimeFn
          ) -> PipelineRun | None:
    """`run` when its TTFT beats GPU-only's beyond the noise on the calibration prompt, else None; said once, and
    the decision saved (a saved one for the same split and code is reused)."""
    n = timing_tokens(run)
    key = f"{engine.identity}#auto-split"
    profile = hashlib.sha256(json.dumps(run.plan.profile.to_dict(), sort_keys=True).encode()).hexdigest()[:12]
    split = {"fraction": run.requested_fraction, "offload": list(run.offload), "chunk": chunk, "tokens": n,
             "profile": profile}  # a profile measured again times the split again
    saved = saved_timing(key, split)
    ratio = saved if saved is not None else time_ttft(run, timing_prompt(engine, n))
    if saved is None:
        save_tuning(key, {**split, "ratio": ratio.to_dict(), "measured_with": measured_with()})
    kinds = "" if run.offload == OFFLOADABLE else f" of {', '.join(run.offload)} only"
    measured = (f"its TTFT measured {_ratio(ratio)} GPU-only's on a {n}-token calibration prompt"
                + (" (saved earlier)" if saved is not None else ""))
    if ratio.below(1.0):
        report(f"--ane-fraction auto: {run.requested_fraction:.2f}{kinds} (recommended for this machine, verified; "
               f"{measured}; {run.effective_fraction:.2f} of the prefill's FLOPs)")
        return run
    report(f"--ane-fraction auto: GPU-only: the split at {run.requested_fraction:.2f}{kinds} passed verification, "
           f"but {measured}: not a win beyond the noise")
    return None


def _ratio(e: Estimate) -> str:
    if not e.known:
        return f"{e.median:.2f}x ({e.n} pairs, too few for an interval)"
    return f"{e.median:.2f}x (95% interval {e.low:.2f}-{e.high:.2f}x, {e.n} pairs)"


def saved_timing(key: str, split: dict) -> Estimate | None:
    """The TTFT ratio saved for this very split (fraction, kinds, chunk, prompt) with this code; None otherwise."""
    entry = tuning(key) or {}
    if any(entry.get(k) != v for k, v in split.items()) or entry.get("measured_with") != measured_with():
        return None
    try:
        r = entry["ratio"]
        return Estimate(float(r["median"]), r["low"], r["high"], int(r["samples"]))
    except (KeyError, TypeError, ValueError):
        return None


def ttft_ratio(run: PipelineRun, ids: list[int], cap_s: float = TIMING_SECONDS,
               clock: Callable[[], float] = time.perf_counter) -> Estimate:
    """The split's TTFT over GPU-only's on `ids` (both the whole prompt and its last logits; GPU-only as it runs
    here, the CPU wavefront included), in pairs on fresh caches, the order alternating, after a warm-up of each;
    until the interval lies below or above 1, 40 pairs or `cap_s`."""
    model = run.engine.model
    split = run.splitter(len(ids))

    def gpu() -> None:
        mx.eval(prefill(model, ids, model.make_cache(), run.chunk)[0])

    def ane() -> None:
        split.run(ids, model.make_cache(), logits=True)

    return ratio_of(gpu, ane, cap_s, clock)


def ratio_of(base: Callable[[], None], other: Callable[[], None], cap_s: float,
             clock: Callable[[], float] = time.perf_counter) -> Estimate:
    """other's time over base's, in pairs (the order alternating) after one warm-up call of each, until the 95%
    interval of the median ratio lies below or above 1, 40 pairs or `cap_s` seconds."""
    base(), other()
    pairs = [0]

    def pair() -> float:
        order = (base, other) if pairs[0] % 2 == 0 else (other, base)
        took = {}
        for fn in order:
            t = clock()
            fn()
            took[fn] = clock() - t
        pairs[0] += 1
        return took[other] / took[base]

    beyond = lambda e: e.above(1.0) or e.below(1.0)  # noqa: E731
    return repeat(pair, beyond, most=40, cap_s=cap_s, clock=clock)[0]
