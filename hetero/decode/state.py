"""A request's decoding state between rounds (`Decoder`), its copy lane, and `start`: prefill and the first token.

The backbone has run every committed token but the latest, `x`; the MTP head has run every pair but the pending
ones. The stepper (`hetero.decode.stepper`) moves a set of these states forward one round at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from hetero.decode.logprobs import LogprobRecorder
from hetero.decode.penalties import Penalizer
from hetero.decode.prefill import ChunkFn, ProgressFn, prefill
from hetero.decode.records import Trace
from hetero.decode.sampling import Sampler
from hetero.models.cache import KVCache, LayerCache, ModelCache
from hetero.models.interface import CausalLM
from hetero.tools.constrained import Constraint
from hetero.vision.prompt import ImagePrompt

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


def start(
    model: CausalLM,
    prompt: list[int],
    sampler: Sampler,
    depth: int,
    cache: ModelCache | None = None,
    chunk: int = 512,
    progress: ProgressFn | None = None,
    copy: bool = False,
    skip: int = 0,
    carry: mx.array | None = None,
    on_chunk: ChunkFn | None = None,
    constraint: Constraint | None = None,
    logprobs: LogprobRecorder | None = None,
    marks: Sequence[int] = (),
    trace: Trace | None = None,
    mtp_prefill: bool = False,
    penalizer: Penalizer | None = None,
    images: ImagePrompt | None = None,
) -> Decoder:
    """Prefill `prompt` (after `skip` tokens that `cache` already holds, `carry` [1, H] their last hidden) and sample
    the first token, which becomes the decoder's x (not emitted yet).

    The MTP head's KV is filled too at `depth` > 0, or with `mtp_prefill` (so checkpoints serve MTP requests);
    `copy` (depth > 0) starts a copy lane over the prompt. `on_chunk` sees the cache after every prefill chunk and
    at `marks` (`prefill`). A `constraint` masks the first token and consumes it; `logprobs` records its raw row;
    `trace` (depth 0) gets the prompt's last hidden, the first entry of what the backbone ran. A `penalizer`
    (`hetero.decode.penalties`) penalizes the first token's logits before the constraint's mask, and counts it.
    `images` (the prompt's `ImagePrompt`) puts its images in place and sets its 3-D positions (`prefill`).
    """
    cache = cache if cache is not None else model.make_cache()
    logits, hidden = prefill(model, prompt[skip:], cache, chunk, progress, mtp=bool(depth) or mtp_prefill,
                             carry=carry, on_chunk=on_chunk, marks=marks, images=images)  # [1, V], [1, H]
    last = logits[-1] if penalizer is None else penalizer(logits[-1:])[0]  # [V]
    x = sampler(last if constraint is None else constraint.apply(last)).item()
    if constraint is not None:
        constraint.advance(x)
    if penalizer is not None:
        penalizer.add([x])
    if logprobs is not None:
        logprobs.add(logits[-1:], [x])
    if trace is not None and not depth:
        trace.hidden.append(hidden)
    lane = CopyLane(prompt + [x]) if copy and depth else None
    return Decoder(model, cache, x, hidden, lane=lane)
