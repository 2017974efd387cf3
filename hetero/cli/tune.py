"""`hetero tune`: plain decoding against every MTP draft depth on this machine, in alternated pairs until the
verdict is beyond the noise (`hetero.decode.depth_contest`); the verdict is saved with its interval and samples.
`hetero tune --show` prints what is saved for this machine (each verdict and why, the device profile's rates with
their intervals) and what would be measured again."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from hetero.decode.depth_calibration import PROMPTS, measure_depths, verdict_entry
from hetero.decode.depth_contest import DecodeFn, ExpectedFn, ratio_text
from hetero.host.settings import PLAIN, changed, machine_id, remeasure_reason, save_tuning, settings_path, tunings

TUNE_SECONDS = 120.0  # `hetero tune`'s time cap by default (`--seconds`)


def tune(engine, depths: tuple[int, ...] = (1, 2, 3, 4), tokens: int = 256, report: Callable[[str], None] = print,
         cap_s: float = TUNE_SECONDS, decode: DecodeFn | None = None, expected: ExpectedFn | None = None,
         clock: Callable[[], float] = time.perf_counter) -> dict:
    """Decode the same prompts plainly and at each depth, in alternated pairs (greedy, after a warm-up), until the
    best depth's ratio to plain is beyond the noise or `cap_s` pass; save and return the verdict's entry
    (`depth_calibration.verdict_entry`: "draft_depth" is the depth, or PLAIN when plain decoding wins or no depth
    had drafts accepted; "depths" each depth's median tokens/s, accepted length and ratio with its interval)."""
    report(f"measuring plain decoding against MTP at depth {', '.join(map(str, depths))}: {len(PROMPTS)} prompts x "
           f"{tokens} tokens per pair, until the verdict is beyond the noise (at most {cap_s:.0f} s)")
    contest, verdict = measure_depths(engine, depths, tokens, cap_s, decode, expected, clock=clock)
    report(f"{'plain':>8}  {statistics.median(contest.plain):8.1f} tok/s")
    for d in depths:
        length = contest.accepted_length(d)
        report(f"{'depth ' + str(d):>8}  {statistics.median(contest.rates[d]):8.1f} tok/s  "
               f"{ratio_text(contest.estimate(d))}  accepted length {length:.2f}")
    entry = verdict_entry(contest, verdict, tokens, "hetero tune")
    path = save_tuning(engine.identity, entry)
    report(f"verdict: {verdict.why}")
    if verdict.depth == PLAIN:
        report(f"saved 'off' for {engine.name} to {path} (hetero run decodes plainly; --draft-depth still turns MTP on)")
    else:
        report(f"saved draft depth {verdict.depth} for {engine.name} to {path}")
    if not verdict.settled:
        report("the verdict is inside the noise: `hetero run` and idle time in `hetero serve` measure again")
    return entry


def show(report: Callable[[str], None] = print) -> None:
    """What this machine's settings hold: each model's draft-depth verdict and why, the device profile's measured
    rates with their intervals, and which of them would be measured again (and why)."""
    entries = tunings()
    report(f"settings for this machine ({machine_id()}) in {settings_path()}")
    if not entries:
        report("  nothing measured yet: `hetero run` measures a model's draft depth on first use; `hetero tune` "
               "measures every depth, `hetero tune --devices` the lanes")
    for model_id, entry in sorted(entries.items()):
        if model_id == "device_profile":
            _show_devices(entry, report)
            continue
        depth = entry.get("draft_depth")
        verdict = entry.get("verdict") if isinstance(entry.get("verdict"), dict) else {}
        report(f"  {model_id}: {'plain decoding' if depth == PLAIN else f'MTP at depth {depth}'} "
               f"({entry.get('calibrated', 'saved')})")
        if verdict.get("why"):
            report(f"    why: {verdict['why']}")
        again = remeasure_reason(model_id)
        report(f"    {'measured again at the next run: ' + again if again else 'stands'}; "
               "`hetero tune --model M` measures it again")


def _show_devices(profile: dict, report: Callable[[str], None]) -> None:
    report("  device profile (`hetero tune --devices`):")
    for what, e in sorted((profile.get("confidence") or {}).items()):
        spread = f"+-{e['spread']:.1%}" if e.get("spread") is not None else "no interval"
        report(f"    {what}: {e['median'] * 1e3:.3f} ms per call ({spread}, {e['samples']} samples)")
    moved = changed(profile.get("measured_with"))
    report(f"    {'measured with other code: ' + moved + '; run it again' if moved else 'stands'}")
