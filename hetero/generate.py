"""Chunked prefill and the plain decode loop, as free functions over a model and its cache list."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx

from hetero.cache import LayerCache, cache_arrays
from hetero.models.qwen3_5 import Model
from hetero.sampling import Sampler

ProgressFn = Callable[[int, int], None]  # (tokens done, tokens total)


def prefill(
    model: Model,
    tokens: list[int],
    cache: list[LayerCache],
    chunk: int = 512,
    progress: ProgressFn | None = None,
    all_logits: bool = False,
    mtp: bool = False,
) -> tuple[mx.array, mx.array]:
    """Run `tokens` through the model in chunks, filling `cache`.

    Returns (logits, post-norm hidden): for the last position only ([1, V], [1, hidden]), or for every
    position when `all_logits` ([S, V], [S, hidden]). Only the rows that are read go through lm_head.
    With `mtp`, the MTP head's KV is filled too: position p gets (t_{p+1}, h_p) for p < len(tokens) - 1;
    the last hidden waits for the token that will follow the prompt.
    """
    if not tokens:
        raise ValueError("prefill needs at least one token")
    logits, hidden = [], []
    carry: mx.array | None = None  # [1, H] the previous chunk's last hidden, waiting for its next token
    for start in range(0, len(tokens), chunk):
        piece = mx.array(tokens[start : start + chunk])[None]  # [1, S]
        h = model.model(piece, cache[: len(model.layers)])  # [1, S, hidden]
        last = start + chunk >= len(tokens)
        if mtp:
            pairs_h = h[0, :-1] if carry is None else mx.concatenate([carry, h[0, :-1]])  # [m, H]
            pairs_t = piece[0, 1:] if carry is None else piece[0]  # [m]
            if pairs_t.size:
                model.mtp_hidden(pairs_t[None], pairs_h[None], cache)
            carry = h[0, -1:]
        if all_logits:
            logits.append(model.logits(h)[0])
            hidden.append(h[0])
            mx.eval(logits[-1], hidden[-1], *cache_arrays(cache))
        elif last:
            logits.append(model.logits(h[:, -1:])[0])
            hidden.append(h[0, -1:])
            mx.eval(logits[-1], hidden[-1], *cache_arrays(cache))
        else:
            mx.eval(*cache_arrays(cache))  # bound the graph: one chunk at a time
        if progress is not None:
            progress(min(start + chunk, len(tokens)), len(tokens))
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
) -> Iterator[int]:
    """Yield generated token ids (EOS excluded) until EOS or `max_tokens`.

    The next step is queued with `mx.async_eval` before the current token is handed out, so the
    model computes while the caller detokenizes and prints.
    """
    times = times if times is not None else DecodeTimes()
    times.start, times.prompt_tokens = time.perf_counter(), len(prompt)
    cache = cache if cache is not None else model.make_cache()
    if max_tokens <= 0:
        times.first_token = times.end = time.perf_counter()
        return
    logits, _ = prefill(model, prompt, cache, chunk, progress)
    token = sampler(logits[-1])

    def step(tok: mx.array) -> mx.array:
        out, _ = model(tok.reshape(1, 1), cache)
        return sampler(out[0, -1])

    mx.async_eval(token)
    for n in range(max_tokens):
        nxt = step(token) if n + 1 < max_tokens else None
        if nxt is not None:
            mx.async_eval(nxt)
        tid = token.item()
        if n == 0:
            times.first_token = time.perf_counter()
        if tid in eos_ids:
            times.finish_reason = "stop"
            break
        times.generated += 1
        times.end = time.perf_counter()
        yield tid
        if nxt is None:
            break
        token = nxt
    times.end = time.perf_counter()
