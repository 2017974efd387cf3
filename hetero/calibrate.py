"""The short calibration on first use: a model with an MTP head never measured on this machine decodes one code
prompt plainly and speculatively, and the faster way is saved for it (`hetero tune` measures more and replaces it).
So an untuned default is a measured decision, never a guess that may be slower than plain decoding."""

from __future__ import annotations

from collections.abc import Callable

from hetero.settings import PLAIN, save_tuning

CALIBRATION_TOKENS = 48  # per contender: long enough for MTP's rounds to average out, short on a 27B (~10 s in all)
CODE_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the command line and run.\"\"\"\n"


def calibrate(engine, depth: int, report: Callable[[str], None] = print) -> int | str:
    """First use of a model with an MTP head on this machine (`engine` a `hetero.engine.Engine`, which calls this): decode one code prompt plainly and at draft `depth`
    (greedy, after a warm-up of each), save the faster as if `hetero tune` had, and return it (`depth`, or PLAIN).
    `hetero tune` measures every depth on more prompts and replaces this decision.
    """
    report(f"hetero: first run of {engine.name} on this machine: measuring MTP against plain decoding "
           f"({CALIBRATION_TOKENS} tokens each, once; `hetero tune` measures more)")
    prompt = CODE_PROMPT
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
