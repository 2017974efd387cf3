"""The short calibration on first use: a model with an MTP head never measured on this machine decodes one code
prompt plainly and speculatively, and the faster way is saved for it (`hetero tune` measures more and replaces it).
So an untuned default is a measured decision, never a guess that may be slower than plain decoding."""

from __future__ import annotations

from collections.abc import Callable

from hetero.decode.options import DecodeOptions
from hetero.decode.parts import RowParts
from hetero.decode.records import DecodeTimes, MTPStats
from hetero.decode.solo import decode_tokens
from hetero.host.settings import PLAIN, save_tuning

CALIBRATION_TOKENS = 48  # per contender: long enough for MTP's rounds to average out, short on a 27B (~10 s in all)
CODE_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the command line and run.\"\"\"\n"


DecodeFn = Callable[[int, int], tuple[float, float | None]]  # (depth, tokens) -> (decode tok/s, mean accepted length)


def accepted_any(mean_accepted_length: float | None) -> bool:
    """Whether speculative decoding kept any draft (a mean accepted length above 1). One that kept none cannot pay:
    each of its rounds costs a plain step's pass, over more tokens, plus the drafts, for the one token plain decoding
    gets. So it never wins a measurement, whatever the clock said on a busy machine (a random head, e.g.)."""
    return mean_accepted_length is not None and mean_accepted_length > 1.0


def stepper_decode(engine) -> DecodeFn:
    """Greedy decoding of the code prompt straight through the stepper (never through `Engine.generate`, which is
    what asks for this calibration): (depth 0 is plain, tokens) -> (decode tokens/s, mean accepted length)."""
    prompt = engine.tokenizer.encode(CODE_PROMPT)

    def decode(depth: int, n: int) -> tuple[float, float | None]:
        times, stats = DecodeTimes(), MTPStats(depth) if depth else None
        for _ in decode_tokens(engine.model, prompt, DecodeOptions(n), engine.eos_ids, depth,
                               RowParts(times=times, stats=stats)):
            pass
        return times.decode_tps, stats.to_dict()["mean_accepted_length"] if stats is not None else None

    return decode


def calibrate(engine, depth: int, report: Callable[[str], None] = print, decode: DecodeFn | None = None) -> int | str:
    """First use of a model with an MTP head on this machine (`engine` a `hetero.engine.Engine`, which calls this):
    decode one code prompt plainly and at draft `depth` (greedy, after a warm-up of each; `decode` defaults to the
    stepper, `stepper_decode`), save the faster as if `hetero tune` had, and return it (`depth`, or PLAIN; PLAIN too
    when no draft was accepted, `accepted_any`).
    `hetero tune` measures every depth on more prompts and replaces this decision.
    """
    report(f"hetero: first run of {engine.name} on this machine: measuring MTP against plain decoding "
           f"({CALIBRATION_TOKENS} tokens each, once; `hetero tune` measures more)")
    decode = decode if decode is not None else stepper_decode(engine)
    decode(0, 8)  # warm-up: first calls compile and allocate
    decode(depth, 8)
    plain, _ = decode(0, CALIBRATION_TOKENS)
    drafted, accepted_length = decode(depth, CALIBRATION_TOKENS)
    choice = depth if drafted > plain and accepted_any(accepted_length) else PLAIN
    result = {
        "plain_tps": round(plain, 2),
        "depths": {depth: {"decode_tps": round(drafted, 2), "mean_accepted_length": accepted_length}},
        "draft_depth": choice,
        "calibrated": "first use",
    }
    path = save_tuning(engine.identity, result)
    verdict = f"MTP at depth {choice}" if choice != PLAIN else "plain decoding"
    report(f"hetero: plain {plain:.1f} tok/s, MTP depth {depth} {drafted:.1f} tok/s: "
           f"{verdict} from now on (saved to {path})")
    return choice
