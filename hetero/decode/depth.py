"""The draft depth: its bounds, its one check, and the depth policy (given, tuned or calibrated, else the default)."""

from __future__ import annotations

from hetero.host.settings import DEFAULT_DRAFT_DEPTH, PLAIN
from hetero.models.gated_delta import RECURRENT_MAX_TOKENS
from hetero.validate import Bound

MAX_DEPTH = RECURRENT_MAX_TOKENS - 1  # a verify pass (k+1 tokens) must take the recorded recurrent path
DEPTH = Bound(1, MAX_DEPTH, integer=True)  # a draft depth: `--draft-depth`'s argparse type and `check_depth`


def check_depth(depth, name: str = "--draft-depth") -> int:
    """`depth` when it is a draft depth (an integer in 1..MAX_DEPTH), else a one-line HeteroError naming `name`:
    the one check of a depth, made where one enters (`decode_depth`, a row joining the stepper)."""
    return DEPTH.check(depth, name)


def decode_depth(has_mtp: bool, mtp: bool | None, given: int | None, tuned: int | str | None = None) -> int:
    """The depth policy: the draft depth a generation decodes at, 0 for plain decoding.

    `given` (the caller's `--draft-depth`, checked here) wins; else `tuned` (what `hetero tune` or the first-use
    calibration saved: a depth, or PLAIN); else DEFAULT_DRAFT_DEPTH. `mtp` False decodes plainly, True with MTP,
    None as the model can: MTP when it has a head, unless `tuned` is PLAIN and no depth is given. A saved depth
    outside 1..MAX_DEPTH (a hand-edited settings file) is ignored, never trusted."""
    if given is not None:
        check_depth(given)
    use_mtp = (has_mtp and (given is not None or tuned != PLAIN)) if mtp is None else mtp
    if not use_mtp:
        return 0
    if given is not None:
        return given
    return tuned if isinstance(tuned, int) and DEPTH.problem(tuned) is None else DEFAULT_DRAFT_DEPTH
