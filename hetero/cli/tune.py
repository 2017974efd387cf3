"""`hetero tune`: measure plain decoding against MTP draft depths on this machine and keep the fastest."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from hetero.decode.depth_calibration import CODE_PROMPT, accepted_any
from hetero.engine import Engine
from hetero.host.settings import PLAIN, save_tuning

PROMPTS = (
    CODE_PROMPT,
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
    depth, or PLAIN ("off") when plain decoding beat them all, so that `hetero run` then decodes plainly. A depth
    whose drafts were never accepted is never the winner (`accepted_any`), whatever the clock said.

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
    paying = [d for d in table if accepted_any(table[d]["mean_accepted_length"])]
    best = max(paying or table, key=lambda d: table[d]["decode_tps"])
    # compare what is saved: the file explains the choice
    mtp_wins = bool(paying) and table[best]["decode_tps"] > round(plain, 2)
    result = {"plain_tps": round(plain, 2), "depths": table, "draft_depth": best if mtp_wins else PLAIN}
    path = save_tuning(engine.identity, result)
    if mtp_wins:
        report(f"saved draft depth {best} for {engine.name} to {path}")
    else:
        report(f"plain decoding was fastest on this machine: saved 'off' for {engine.name} to {path} "
               "(hetero run decodes plainly; --draft-depth still turns MTP on)")
    return result
