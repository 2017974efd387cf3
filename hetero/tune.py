"""`hetero tune`: measure plain decoding against MTP draft depths on this machine and keep the fastest; and the
short first-use calibration that decides MTP on or off for a model never tuned here."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from typing import TYPE_CHECKING

from hetero.settings import PLAIN, save_tuning

if TYPE_CHECKING:  # the engine calls `calibrate` on itself: no import of it at run time
    from hetero.engine import Engine

CALIBRATION_TOKENS = 48  # per contender: long enough for MTP's rounds to average out, short on a 27B (~10 s in all)

PROMPTS = (
    "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the command line and run.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def read_config(path):\n    with open(path) as f:\n        for line in f:\n            line = line.strip()\n",
)


def tune(
    engine: Engine,
    depths: tuple[int, ...] = (1, 2, 3, 4),
    tokens: int = 256,
    report: Callable[[str], None] = print,
) -> dict:
    """Decode the same prompts plainly and at each depth (greedy, after a warm-up) and save the winner: the fastest
    depth, or PLAIN ("off") when plain decoding beat them all, so that `hetero run` then decodes plainly.

    Returns {"plain_tps", "depths": {depth: {"decode_tps", "mean_accepted_length"}}, "draft_depth"}.
    """
    def measure(**kw) -> tuple[float, float | None]:
        tps, accepted = [], []
        for prompt in PROMPTS:
            stats = engine.generate(prompt, max_tokens=tokens, temperature=0.0, **kw).stats
            tps.append(stats["decode_tps"])
            if "mtp" in stats:
                accepted.append(stats["mtp"]["mean_accepted_length"])
        return statistics.median(tps), (statistics.mean(accepted) if accepted else None)

    engine.generate(PROMPTS[0], max_tokens=32, mtp=False)  # warm-up: first calls compile and allocate
    engine.generate(PROMPTS[0], max_tokens=32, mtp=True, draft_depth=max(depths))
    plain, _ = measure(mtp=False)
    report(f"{'plain':>8}  {plain:8.1f} tok/s")
    table = {}
    for depth in depths:
        tps, accepted = measure(mtp=True, draft_depth=depth)
        table[depth] = {"decode_tps": round(tps, 2), "mean_accepted_length": accepted}
        report(f"{'depth ' + str(depth):>8}  {tps:8.1f} tok/s  {tps / plain:5.2f}x  accepted length {accepted:.2f}")
    best = max(table, key=lambda d: table[d]["decode_tps"])
    mtp_wins = table[best]["decode_tps"] > round(plain, 2)  # compare what is saved: the file explains the choice
    result = {"plain_tps": round(plain, 2), "depths": table, "draft_depth": best if mtp_wins else PLAIN}
    path = save_tuning(engine.identity, result)
    if mtp_wins:
        report(f"saved draft depth {best} for {engine.name} to {path}")
    else:
        report(f"plain decoding was fastest on this machine: saved 'off' for {engine.name} to {path} "
               "(hetero run decodes plainly; --draft-depth still turns MTP on)")
    return result


def calibrate(engine: Engine, depth: int, report: Callable[[str], None] = print) -> int | str:
    """First use of a model with an MTP head on this machine: decode one code prompt plainly and at draft `depth`
    (greedy, after a warm-up of each), save the faster as if `hetero tune` had, and return it (`depth`, or PLAIN).
    `hetero tune` measures every depth on more prompts and replaces this decision.
    """
    report(f"hetero: first run of {engine.name} on this machine: measuring MTP against plain decoding "
           f"({CALIBRATION_TOKENS} tokens each, once; `hetero tune` measures more)")
    prompt = PROMPTS[0]
    engine.generate(prompt, max_tokens=8, mtp=False)  # warm-up: first calls compile and allocate
    engine.generate(prompt, max_tokens=8, mtp=True, draft_depth=depth)
    plain = engine.generate(prompt, max_tokens=CALIBRATION_TOKENS, mtp=False).stats["decode_tps"]
    drafted = engine.generate(prompt, max_tokens=CALIBRATION_TOKENS, mtp=True, draft_depth=depth).stats
    choice = depth if drafted["decode_tps"] > plain else PLAIN
    result = {
        "plain_tps": round(plain, 2),
        "depths": {depth: {"decode_tps": round(drafted["decode_tps"], 2),
                                         "mean_accepted_length": drafted["mtp"]["mean_accepted_length"]}},
        "draft_depth": choice,
        "calibrated": "first use",
    }
    path = save_tuning(engine.identity, result)
    verdict = f"MTP at depth {choice}" if choice != PLAIN else "plain decoding"
    report(f"hetero: plain {plain:.1f} tok/s, MTP depth {depth} {drafted['decode_tps']:.1f} tok/s: "
           f"{verdict} from now on (saved to {path})")
    return choice
