"""A request's decoding state between rounds (`Decoder`), its copy lane, and `start`: prefill and the first token.

The backbone has run every committed token but the latest, `x`; the MTP head has run every pair but the pending
ones. The stepper (`hetero.decode.stepper`) moves a set of these states forward one round at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from hetero.decode.options import DecodeOptions
from hetero.decode.parts import RowParts
from hetero.decode.penalties import Penalizer
from hetero.decode.prefill import prefill
from hetero.decode.sampling import Sampler
from hetero.models.cache import KVCache, LayerCache, ModelCache
from hetero.models.interface import CausalLM

COPY_NGRAM = 3


class CopyLane:
    """Proposes the continuation of the latest earlier occurrence of the context's last n-gram."""

    def __init__(self, tokens: list[int], n: int = COPY_NGRAM):
        self.n = n
        self.tokens: list[int] = []
        self.last_seen: dict[tuple[int, ...], int] = {}  # n-gram -> position right after its latest occurrence
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            if end > self.n:  # index the n-gram ending one before the newest token: its successor is known
                self.last_seen[tuple(self.tokens[end - 1 - self.n : end - 1])] = end - 1

    def propose(self, k: int) -> list[int]:
        if len(self.tokens) < self.n:
            return []
        start = self.last_seen.get(tuple(self.tokens[-self.n :]))
        return [] if start is None else self.tokens[start : start + k]


@dataclass
class Decoder:
    """One request's decoding state between rounds.

    The backbone has run every committed token but `x`, the latest one; `pending_hidden` [m, H] holds the
    backbone hiddens the MTP head has not consumed yet, paired with `pending_tokens + [x]`.
    """

    model: CausalLM
    cache: ModelCache
    x: int
    pending_hidden: mx.array
    pending_tokens: list[int] = field(default_factory=list)
    lane: CopyLane | None = None

    @property
    def backbone(self) -> list[LayerCache]:
        return self.cache.backbone

    @property
    def mtp_cache(self) -> list[KVCache]:
        return self.cache.mtp

    @property
    def length(self) -> int:
        """Tokens the backbone has run (all committed tokens but x)."""
        return self.backbone[0].offset


def start(model: CausalLM, prompt: list[int], sampler: Sampler, depth: int, options: DecodeOptions,
          parts: RowParts = RowParts(), penalizer: Penalizer | None = None) -> Decoder:
    """Prefill `prompt` (after `parts.skip` tokens that `parts.cache` already holds, `parts.carry` [1, H] their last
    hidden) in chunks of `options.prefill_chunk` and sample the first token, which becomes the decoder's x (not
    emitted yet).

    The MTP head's KV is filled too at `depth` > 0, or with `parts.mtp_prefill` (so checkpoints serve MTP requests);
    `options.copy` (depth > 0) starts a copy lane over the prompt. `parts.on_chunk` sees the cache after every
    prefill chunk and at `parts.marks` (`prefill`). A `parts.constraint` masks the first token and consumes it;
    `parts.logprobs` records its raw row; `parts.trace` (depth 0) gets the prompt's last hidden, the first entry of
    what the backbone ran. A `penalizer` (`hetero.decode.penalties`) penalizes the first token's logits before the
    constraint's mask, and counts it. `parts.images` (the prompt's `ImagePrompt`) puts its images in place and sets
    its 3-D positions (`prefill`).
    """
    p = parts
    cache = p.cache if p.cache is not None else model.make_cache()
    logits, hidden = prefill(model, prompt[p.skip:], cache, options.prefill_chunk, p.progress,
                             mtp=bool(depth) or p.mtp_prefill, carry=p.carry, on_chunk=p.on_chunk, marks=p.marks,
                             images=p.images)  # [1, V], [1, H]
    last = logits[-1] if penalizer is None else penalizer(logits[-1:])[0]  # [V]
    x = sampler(last if p.constraint is None else p.constraint.apply(last)).item()
    if p.constraint is not None:
        p.constraint.advance(x)
    if penalizer is not None:
        penalizer.add([x])
    if p.logprobs is not None:
        p.logprobs.add(logits[-1:], [x])
    if p.trace is not None and not depth:
        p.trace.hidden.append(hidden)
    lane = CopyLane(prompt + [x]) if options.copy and depth else None
    return Decoder(model, cache, x, hidden, lane=lane)
