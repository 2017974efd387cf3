"""Chunked prefill and the plain decode loop, as free functions over a model and its cache list."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from hetero.cache import LayerCache, cache_arrays, expect_positions
from hetero.constrained import Constraint
from hetero.logprobs import LogprobRecorder
from hetero.models.qwen3_5 import Model
from hetero.sampling import Sampler

ProgressFn = Callable[[int, int], None]  # (tokens done, tokens total)
ChunkFn = Callable[[int, mx.array], None]  # (tokens in the cache, post-norm hidden [1, H] of the last one)


def chunk_edges(offset: int, n: int, chunk: int, marks: Sequence[int] = ()) -> list[int]:
    """Where `prefill` cuts n tokens after `offset` cached ones: at multiples of `chunk` counted from position 0, and
    at `marks` (absolute positions); [0, ..., n], strictly increasing."""
    first = chunk - offset % chunk  # tokens up to the next absolute chunk edge
    cuts = set(range(first, n, chunk)) | {m - offset for m in marks if offset < m < offset + n}
    return [0] + sorted(cuts) + [n]


def mtp_pairs(model: Model, piece: mx.array, h: mx.array, carry: mx.array | None, cache: list[LayerCache]) -> mx.array:
    """Fill the MTP head's KV for one prefill chunk: position p gets (t_{p+1}, h_p). piece [1, S] tokens, h [1, S, H]
    their post-norm hiddens, `carry` [1, H] the previous chunk's last hidden (None at the prompt's start); returns
    this chunk's last hidden [1, H], which waits for the next chunk's first token."""
    pairs_h = h[0, :-1] if carry is None else mx.concatenate([carry, h[0, :-1]])  # [m, H]
    pairs_t = piece[0, 1:] if carry is None else piece[0]  # [m]
    if pairs_t.size:
        model.mtp_hidden(pairs_t[None], pairs_h[None], cache)
    return h[0, -1:]


def prefill(
    model: Model,
    tokens: list[int],
    cache: list[LayerCache],
    chunk: int = 512,
    progress: ProgressFn | None = None,
    all_logits: bool = False,
    mtp: bool = False,
    carry: mx.array | None = None,
    on_chunk: ChunkFn | None = None,
    marks: Sequence[int] = (),
) -> tuple[mx.array, mx.array]:
    """Run `tokens` through the model in chunks, filling `cache` (which may already hold a prefix).

    Returns (logits, post-norm hidden): for the last position only ([1, V], [1, hidden]), or for every
    position when `all_logits` ([S, V], [S, hidden]). Only the rows that are read go through lm_head.
    With `mtp`, the MTP head's KV is filled too: position p gets (t_{p+1}, h_p) for p < len(tokens) - 1;
    the last hidden waits for the token that will follow the prompt.

    When `cache` already holds n tokens (a restored prefix), chunk edges stay at multiples of `chunk` counted
    from position 0, so the work after a restore at a chunk edge is exactly the cold run's; `carry` [1, H] is
    then h_{n-1}, which the MTP head pairs with tokens[0]. `on_chunk` sees the cache after every chunk.
    `marks` (absolute positions) end a chunk too: the chunk holding a mark is cut in two there, so `on_chunk`
    sees the state exactly at it (a chat transcript's end, before its generation prompt).
    """
    if not tokens:
        raise ValueError("prefill needs at least one token")
    logits, hidden = [], []
    offset = cache[0].offset if cache else 0
    expect_positions(cache, offset + len(tokens))
    edges = chunk_edges(offset, len(tokens), chunk, marks)
    for start, stop in zip(edges, edges[1:]):
        piece = mx.array(tokens[start:stop])[None]  # [1, S]
        h = model.model(piece, cache[: len(model.layers)])  # [1, S, hidden]
        last = stop >= len(tokens)
        if mtp:
            carry = mtp_pairs(model, piece, h, carry, cache)
        if all_logits:
            logits.append(model.logits(h)[0])
            hidden.append(h[0])
            mx.eval(logits[-1], hidden[-1], *cache_arrays(cache))
        elif last:
            logits.append(model.logits(h[:, -1:])[0])
            hidden.append(h[0, -1:])
            mx.eval(logits[-1], hidden[-1], *cache_arrays(cache))
        else:
            mx.eval(h[0, -1:], *cache_arrays(cache))  # bound the graph: one chunk at a time
        if on_chunk is not None:
            on_chunk(offset + stop, h[0, -1:])
        if progress is not None:
            progress(stop, len(tokens))
    return mx.concatenate(logits), mx.concatenate(hidden)


@dataclass
class DecodeTimes:
    """Wall-clock marks of one generation, filled in as it runs."""

    start: float = 0.0
    first_token: float = 0.0
    end: float = 0.0
    prompt_tokens: int = 0
    generated: int = 0
    finish_reason: str = "length"

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.start

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        span = self.end - self.first_token
        return (self.generated - 1) / span if self.generated > 1 and span > 0 else 0.0


@dataclass
class Trace:
    """What the backbone ran for one generation, for a checkpoint of its end state.

    `hidden` holds post-norm hiddens [1, H]: the prompt's last position, then one per decode step;
    `tokens` the ids each decode step ran (scalar arrays, evaluated lazily).
    """

    hidden: list[mx.array] = field(default_factory=list)
    tokens: list[mx.array] = field(default_factory=list)


def generate_tokens(
    model: Model,
    prompt: list[int],
    sampler: Sampler,
    max_tokens: int,
    eos_ids: set[int],
    chunk: int = 512,
    progress: ProgressFn | None = None,
    times: DecodeTimes | None = None,
    cache: list[LayerCache] | None = None,
    skip: int = 0,
    carry: mx.array | None = None,
    on_chunk: ChunkFn | None = None,
    mtp_prefill: bool = False,
    trace: Trace | None = None,
    constraint: Constraint | None = None,
    logprobs: LogprobRecorder | None = None,
    marks: Sequence[int] = (),
) -> Iterator[int]:
    """Yield generated token ids (EOS excluded) until EOS or `max_tokens`.

    The next step is queued with `mx.async_eval` before the current token is handed out, so the
    model computes while the caller detokenizes and prints. With `skip` > 0, `cache` already holds
    prompt[:skip] (a restored prefix, `carry` its last hidden) and only the rest is prefilled;
    `mtp_prefill` fills the MTP head's KV during prefill too (so checkpoints serve MTP requests).
    `constraint` masks every position's logits before sampling (its mask is computed on the CPU while the
    next step runs); `logprobs` records each yielded token's raw logprobs before the token is yielded.
    """
    times = times if times is not None else DecodeTimes()
    times.start, times.prompt_tokens = times.start or time.perf_counter(), len(prompt)  # a caller may start earlier
    cache = cache if cache is not None else model.make_cache()
    if max_tokens <= 0:
        times.first_token = times.end = time.perf_counter()
        return
    logits, last_hidden = prefill(model, prompt[skip:], cache, chunk, progress, mtp=mtp_prefill, carry=carry,
                                  on_chunk=on_chunk, marks=marks)
    row = logits[-1]  # [V] the logits the current token is drawn from
    token = sampler(row if constraint is None else constraint.apply(row))
    if trace is not None:
        trace.hidden.append(last_hidden)

    def step(tok: mx.array) -> mx.array:
        out, h = model(tok.reshape(1, 1), cache)
        if trace is not None:
            trace.tokens.append(tok)
            trace.hidden.append(h[0])
        return out[0, -1]  # [V]

    mx.async_eval(token)
    for n in range(max_tokens):
        nxt_row = step(token) if n + 1 < max_tokens else None
        nxt = None
        if nxt_row is not None:  # unconstrained, the sample joins the queued step; constrained, it waits for the mask
            nxt = sampler(nxt_row) if constraint is None else None
            mx.async_eval(nxt if nxt is not None else nxt_row)
        tid = token.item()
        if n == 0:
            times.first_token = time.perf_counter()
        if tid in eos_ids:
            times.finish_reason = "stop"
            break
        if constraint is not None:
            constraint.advance(tid)
            if nxt_row is not None:
                nxt = sampler(constraint.apply(nxt_row))
                mx.async_eval(nxt)
        if logprobs is not None:
            logprobs.add(row[None], [tid])
        times.generated += 1
        times.end = time.perf_counter()
        yield tid
        if nxt is None:
            break
        token, row = nxt, nxt_row
    times.end = time.perf_counter()
