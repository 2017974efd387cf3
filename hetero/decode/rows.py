"""A row of the stepper (one request's state, options, parts and tokens so far) and what a round decides for each."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from hetero.decode.options import DecodeOptions
from hetero.decode.parts import RowParts
from hetero.decode.penalties import Penalizer
from hetero.decode.sampling import Sampler
from hetero.decode.state import Decoder
from hetero.models.cache import GDNCache


@dataclass(eq=False)
class Row:
    """One request in the stepper: its decoder state (the solo `Decoder`), sampler, depth, options and parts (as
    `Batch.row` completed them: `times` and `max_context` always set, `stats` at depth > 0, `trace` at depth 0 only),
    and its tokens so far."""

    decoder: Decoder | None  # None: a request with nothing to decode (max_tokens <= 0), done at once
    sampler: Sampler
    depth: int  # MTP draft depth; 0 decodes plainly
    eos_ids: set[int]
    options: DecodeOptions
    parts: RowParts
    penalizer: Penalizer | None = None  # penalties / logit_bias: every draw, draft and verify row (None: none)
    tokens: list[int] = field(default_factory=list)  # emitted, EOS excluded
    finish_reason: str | None = None  # "stop" (EOS) or "length" once done

    @property
    def max_tokens(self) -> int:
        return self.options.max_tokens

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def take(self, new: list[int]) -> list[int]:
        """Emit the committed `new` tokens up to EOS or max_tokens, as solo decoding would; returns those emitted."""
        out, times = [], self.parts.times
        for t in new:
            if not self.tokens and not out:
                times.first_token = time.perf_counter()
            if t in self.eos_ids:
                self.finish_reason = times.finish_reason = "stop"
                break
            out.append(t)
            if len(self.tokens) + len(out) >= self.max_tokens:
                self.finish_reason = times.finish_reason = "length"
                break
        self.tokens += out
        times.generated, times.end = len(self.tokens), time.perf_counter()
        return out


@dataclass
class Round:
    """What one round proposes and decides for each row."""

    drafts: list[list[int]]
    draft_logprobs: list[mx.array | None]  # [k_i, V] proposal log-probs when sampled from the MTP head
    copied: list[bool]
    accepted: list[int] = field(default_factory=list)
    next: list[int] = field(default_factory=list)
    traced: list[mx.array | None] | None = None  # a plain round's hidden [1, H] per traced row, evaluated early

    def mtp_ran(self, i: int) -> bool:
        return bool(self.drafts[i]) and not self.copied[i]

    @classmethod
    def plain(cls, n: int) -> Round:
        """A round of n rows without drafts."""
        return cls([[] for _ in range(n)], [None] * n, [False] * n)


@dataclass
class Ahead:
    """A plain round's backbone pass queued over the tokens the previous round drew, before they were read.

    A batch's pass runs on fresh GDN caches (`gdn`), committed into the rows' own next round. A lone row's pass
    (`Batch._solo_pass`) runs on the row's own caches (`undo` holds each GDN cache's state before it) and draws
    the row's next token with it (`drawn`, `key` the sampler's key before that draw), as the bare step loop does."""

    rows: list[Row]
    target: mx.array  # [B, 1, V]
    hidden: mx.array  # [B, 1, H]
    gdn: dict[int, GDNCache] | None = None
    undo: list[tuple[GDNCache, mx.array, mx.array]] | None = None  # (cache, conv, recurrent) before the pass
    drawn: mx.array | None = None  # [1, 1] the token drawn from `target` (None: a penalizer draws it next round)
    key: mx.array | None = None  # the sampler's key before `drawn` was drawn
    traced: mx.array | None = None  # [1, H] the trace's hidden, made with the pass
