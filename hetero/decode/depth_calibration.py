"""The draft depth measured on this machine: on first use of a model with an MTP head, and again whenever its verdict
is stale (measured with other code: `hetero.host.settings.remeasure_reason`) or was left inside the noise.

Plain decoding and MTP at the default depth are timed in alternated pairs on a few code prompts
(`hetero.decode.depth_contest`) until the 95% interval of their ratio excludes 1 or `CALIBRATION_SECONDS` pass; the
verdict is saved with its interval, sample count and samples. A verdict inside the noise keeps the better expected
rate (the planner's MTP model at the measured accepted length: `acceptance_model`) and is measured again at the next
chance, adding to the samples kept. `hetero tune` runs the same contest over every depth, for longer.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from hetero.decode.depth_contest import Contest, DecodeFn, ExpectedFn, Verdict, can_pay, decide, play
from hetero.decode.options import DecodeOptions
from hetero.decode.parts import RowParts
from hetero.decode.records import DecodeTimes, MTPStats
from hetero.decode.solo import decode_tokens
from hetero.errors import HeteroError
from hetero.host.settings import PLAIN, measured_with, save_tuning, tuning

__all__ = ["calibrate", "can_pay", "measure_depths"]

CALIBRATION_TOKENS = 64  # per sample: a few dozen MTP rounds, a fraction of a second on a small model
WARM_UP_TOKENS = 32  # each contender's first decode, untimed: enough MTP rounds to compile every shape a round takes
CALIBRATION_SECONDS = 20.0  # the first use's time cap (a verdict still inside the noise is measured again later)
# Code as a coding agent's prompts hold it, a few hundred tokens each: MTP's acceptance and the copy lane's drafts
# depend on the context (on the bundled model, 20-token prompts measured MTP at about 1.0x plain where 256-token ones
# of the same kind of code measured 2x, alternated on the same machine), so the prompts are not toy ones.
PROMPTS = (
    '''import os
import sys
from pathlib import Path


def find_files(root, suffix):
    """Every file under root whose name ends with suffix, sorted."""
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(suffix):
                found.append(Path(folder) / name)
    return sorted(found)


def count_lines(paths):
    """The number of lines in each file, by path."""
    counts = {}
    for path in paths:
        with open(path) as f:
            counts[path] = sum(1 for _ in f)
    return counts


def main(argv):
    """Print the line count of every Python file under the given folder."""
    root = argv[1] if len(argv) > 1 else "."
''',
    '''class Stack:
    """A last-in, first-out stack of items."""

    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        if not self.items:
            raise IndexError("peek at an empty stack")
        return self.items[-1]

    def __len__(self):
        return len(self.items)


class Queue:
    """A first-in, first-out queue of items."""

    def __init__(self):
        self.items = []

    def push(self, item):
''',
    '''import json


def read_config(path):
    """Read a key = value config file into a dict, skipping comments and blank lines."""
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            config[key.strip()] = value.strip()
    return config


def write_config(path, config):
    """Write a dict as a key = value config file, one line per key, sorted."""
    with open(path, "w") as f:
        for key in sorted(config):
            f.write(f"{key} = {config[key]}\\n")


def load_settings(path):
    """Read a JSON settings file; a missing file is an empty dict."""
    try:
        with open(path) as f:
''',
)
CODE_PROMPT = PROMPTS[0]


def stepper_decode(engine, prompts: tuple[str, ...] = PROMPTS) -> DecodeFn:
    """Greedy decoding of the prompts straight through the stepper, as `hetero run` decodes by default (the copy lane
    on), never through `Engine.generate`, which is what asks for this calibration: (depth, prompt index, tokens) ->
    (decode tokens/s, mean accepted length or None)."""
    encoded = [engine.tokenizer.encode(p) for p in prompts]

    def decode(depth: int, p: int, n: int) -> tuple[float, float | None]:
        times, stats = DecodeTimes(), MTPStats(depth) if depth else None
        for _ in decode_tokens(engine.model, encoded[p], DecodeOptions(n), engine.eos_ids, depth,
                               RowParts(times=times, stats=stats)):
            pass
        return times.decode_tps, stats.to_dict()["mean_accepted_length"] if stats is not None else None

    return decode


def acceptance_model(engine, context: int = 512) -> ExpectedFn:
    """MTP's rate over plain decoding's as the planner predicts it for this model on this machine's profile (measured
    by `hetero tune --devices`, else the default chip's), at a measured accepted length and depth; None where the
    profile cannot predict an MTP rate."""
    from hetero.planner import model_shape, predict_decode, storage_for
    from hetero.profiles import default_profile_name, load_profile

    def expected(depth: int, accepted_length: float) -> float | None:
        try:
            p = load_profile(default_profile_name())
            args, moe = model_shape(engine.config)
            rate = predict_decode(args, moe, storage_for(engine.config, None, None),
                                  None if p.memory_bandwidth_gbs is None else p.memory_bandwidth_gbs * 1e9, context, 2,
                                  accepted_length, depth, p.decode_efficiency, p.mtp_verify_ratio, p.mtp_verify_tokens)
        except (HeteroError, KeyError, TypeError, ValueError):
            return None
        return rate.mtp_tps / rate.plain_tps if rate.mtp_tps and rate.plain_tps else None

    return expected


def measure_depths(engine, depths: tuple[int, ...], tokens: int, cap_s: float, decode: DecodeFn | None = None,
                   expected: ExpectedFn | None = None, prior: Contest | None = None, prompts: int = len(PROMPTS),
                   stop: Callable[[], bool] = lambda: False, clock: Callable[[], float] = time.perf_counter,
                   least_rounds: int = 2) -> tuple[Contest, Verdict]:
    """Warm every contender up (one decode each), then play plain against `depths` (`depth_contest.play`), adding to
    `prior`'s samples; (the contest, its verdict)."""
    decode = decode if decode is not None else stepper_decode(engine)
    for d in (0, *depths):
        decode(d, 0, min(tokens, WARM_UP_TOKENS))
    contest = play(decode, prior or Contest(depths), prompts, tokens, cap_s, least_rounds, stop, clock)
    return contest, decide(contest, expected if expected is not None else acceptance_model(engine))


def verdict_entry(contest: Contest, verdict: Verdict, tokens: int, calibrated: str) -> dict:
    """The settings entry of a verdict: the depth, each contender's median tokens/s, each depth's ratio to plain
    with its interval, the verdict, the samples (a later chance adds to them), and what it was measured with."""
    import statistics

    return {
        "draft_depth": verdict.depth,
        "plain_tps": round(statistics.median(contest.plain), 2) if contest.plain else None,
        "depths": {d: {"decode_tps": round(statistics.median(contest.rates[d]), 2) if contest.rates[d] else None,
                       "mean_accepted_length": contest.accepted_length(d),
                       "ratio": contest.estimate(d).to_dict() if contest.ratios[d] else None}
                   for d in contest.depths},
        "verdict": {"settled": verdict.settled, "why": verdict.why, "pairs": contest.pairs,
                    "seconds": round(contest.seconds, 2)},
        "calibrated": calibrated,
        "tokens": tokens,
        "samples": contest.to_dict(),
        "measured_with": measured_with(),
    }


def saved_contest(model_id: str, depths: tuple[int, ...], tokens: int) -> Contest | None:
    """The samples of a saved verdict left inside the noise, measured with the same code, depths and tokens (a
    next chance adds to them); None otherwise, or where the entry is damaged."""
    entry = tuning(model_id) or {}
    verdict = entry.get("verdict")
    if not isinstance(verdict, dict) or verdict.get("settled") is not False or entry.get("tokens") != tokens:
        return None
    if entry.get("measured_with") != measured_with():
        return None
    try:
        contest = Contest.from_dict(entry["samples"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return contest if contest.depths == depths else None


def calibrate(engine, depth: int, report: Callable[[str], None] = print, decode: DecodeFn | None = None,
              why: str = "never measured on this machine", cap_s: float = CALIBRATION_SECONDS,
              expected: ExpectedFn | None = None, stop: Callable[[], bool] = lambda: False,
              clock: Callable[[], float] = time.perf_counter) -> int | str:
    """Measure plain decoding against MTP at `depth` for `engine` (a `hetero.engine.Engine`, which calls this on first
    use and when its verdict should be measured again, `why`), save the verdict and return its depth (or PLAIN).
    `decode` defaults to the stepper (`stepper_decode`), `expected` to the planner's model (`acceptance_model`)."""
    prior = saved_contest(engine.identity, (depth,), CALIBRATION_TOKENS)
    report(f"hetero: {engine.name}: measuring MTP against plain decoding on this machine ({why}; at most "
           f"{cap_s:.0f} s{', adding to ' + str(prior.pairs) + ' pairs measured before' if prior else ''}; "
           f"`hetero tune` measures every depth)")
    contest, verdict = measure_depths(engine, (depth,), CALIBRATION_TOKENS, cap_s, decode, expected, prior,
                                      stop=stop, clock=clock)
    path = save_tuning(engine.identity, verdict_entry(contest, verdict, CALIBRATION_TOKENS,
                                                      "first use" if why.startswith("never") else f"again: {why}"))
    way = f"MTP at depth {verdict.depth}" if verdict.depth != PLAIN else "plain decoding"
    report(f"hetero: {way} {'from now on' if verdict.settled else 'for now'}: {verdict.why} (saved to {path})")
    return verdict.depth


def stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
