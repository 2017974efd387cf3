"""Per-token log-probabilities, as OpenAI-compatible servers report them.

They come from the raw model distribution: log_softmax of the target logits at that position, before the
temperature / top-k / top-p / min-p warps and before a constraint's mask (vLLM's default, `raw_logprobs`). Under
MTP the rows are the verify pass's target logits at each accepted position and at the corrected / bonus one,
so plain and speculative decoding report the same numbers up to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from hetero.errors import HeteroError

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its id, its logprob, and the `top` most likely ids with theirs (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_top(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS:
        raise HeteroError(f"logprobs (top alternatives) must be an integer in [0, {MAX_TOP_LOGPROBS}], got {n!r}")


class LogprobRecorder:
    """Collects a TokenLogprob per decoded token; decoders call `add` with the logits rows the tokens came from."""

    def __init__(self, top: int):
        check_top(top)
        self.top = top
        self.items: list[TokenLogprob] = []

    def add(self, logits: mx.array, tokens: list[int]) -> None:
        """logits [n, V] (raw target rows), tokens [n]: the token at row i was decoded from row i."""
        lp = logits.astype(mx.float32)
        lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)  # [n, V]
        chosen = lp[mx.arange(len(tokens)), mx.array(tokens)]  # [n]
        if self.top:
            ids = mx.argpartition(-lp, self.top - 1, axis=-1)[:, : self.top]  # [n, top] unordered
            vals = mx.take_along_axis(lp, ids, axis=-1)  # [n, top]
            mx.eval(chosen, ids, vals)
            ids_np, vals_np = np.array(ids), np.array(vals)
        else:
            mx.eval(chosen)
        chosen_np = np.array(chosen)
        for i, t in enumerate(tokens):
            top: tuple[tuple[int, float], ...] = ()
            if self.top:
                order = np.lexsort((ids_np[i], -vals_np[i]))  # most likely first, ties by id
                top = tuple((int(ids_np[i, j]), float(vals_np[i, j])) for j in order)
            self.items.append(TokenLogprob(int(t), float(chosen_np[i]), top))
