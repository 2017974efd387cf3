"""What the engine hands a row beside its `DecodeOptions`: one object, `RowParts`, that `solo.decode_tokens`,
`Batch.join` and `DecodeLoop.generate_tokens` take whole and the row keeps (`Row.parts`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from hetero.decode.logprobs import LogprobRecorder
from hetero.decode.prefill import ChunkFn, ProgressFn
from hetero.decode.records import DecodeTimes, MTPStats, Trace
from hetero.models.cache import ModelCache
from hetero.tools.constrained import Constraint
from hetero.vision.prompt import ImagePrompt

if TYPE_CHECKING:
    from hetero.decode.state import Decoder

CommitFn = Callable[["Decoder", list[int]], None]  # (the committed state, the tokens it newly committed; last = x)


@dataclass(frozen=True)
class RowParts:
    """A row's parts; every one is off by default.

    Prefill: `cache` already holding prompt[:skip] (a restored prefix, `carry` [1, H] its last hidden),
    `progress(done, total)` after every chunk (with `lambda *_: batch.step()` the rows already decoding get a round
    after every chunk of a new prompt), `on_chunk(n, cache_at_n, hidden)` at every chunk edge and at `marks`
    (absolute positions that also end a chunk), `mtp_prefill` to fill the MTP head's KV at depth 0 too, `images`
    (the prompt's `hetero.vision.prompt.ImagePrompt`) for a prompt with images.
    Decoding: `max_context` bounds the drafts (default the model's window), `on_commit(decoder, tokens)` sees the
    committed state after the first token and after every round, `constraint` (a fresh grammar's `Constraint`, or a
    `hetero.tools.thinking_budget.ThinkingBudget`) masks every token the row samples, `logprobs` records each
    committed token's raw logprobs, `trace` (depth 0) records what the backbone ran, and `times` (a caller may have
    started it) and `stats` are filled in as the row decodes.
    """

    cache: ModelCache | None = None
    skip: int = 0
    carry: mx.array | None = None
    progress: ProgressFn | None = None
    on_chunk: ChunkFn | None = None
    marks: Sequence[int] = ()
    mtp_prefill: bool = False
    images: ImagePrompt | None = None
    max_context: int | None = None
    on_commit: CommitFn | None = None
    constraint: Constraint | None = None
    logprobs: LogprobRecorder | None = None
    trace: Trace | None = None
    times: DecodeTimes | None = None
    stats: MTPStats | None = None
