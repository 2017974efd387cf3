"""Chunked prefill of a prompt into a model's caches (backbone, and the MTP head's pairs), as free functions."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from hetero.decode import wavefront
from hetero.models.cache import KVCache, ModelCache, cache_arrays, expect_positions
from hetero.models.interface import CausalLM
from hetero.vision.prompt import ImagePrompt

ProgressFn = Callable[[int, int], None]  # (tokens done, tokens total)
ChunkFn = Callable[[int, ModelCache, mx.array], None]  # (tokens in the cache n, the cache as it stands at n,
#                                                        post-norm hidden [1, H] of the last token)


def chunk_edges(offset: int, n: int, chunk: int, marks: Sequence[int] = ()) -> list[int]:
    """Where `prefill` cuts n tokens after `offset` cached ones: at multiples of `chunk` counted from position 0, and
    at `marks` (absolute positions); [0, ..., n], strictly increasing."""
    first = chunk - offset % chunk  # tokens up to the next absolute chunk edge
    cuts = set(range(first, n, chunk)) | {m - offset for m in marks if offset < m < offset + n}
    return [0] + sorted(cuts) + [n]


def mtp_pairs(model: CausalLM, piece: mx.array, h: mx.array, carry: mx.array | None, cache: ModelCache,
              positions: mx.array | None = None) -> mx.array:
    """Fill the MTP head's KV for one prefill chunk: position p gets (t_{p+1}, h_p). piece [1, S] tokens, h [1, S, H]
    their post-norm hiddens, `carry` [1, H] the previous chunk's last hidden (None at the prompt's start); returns
    this chunk's last hidden [1, H], which waits for the next chunk's first token. `positions` [3, m]: the 3-D
    rotary positions of the pairs' p (a prompt with images)."""
    pairs_h = h[0, :-1] if carry is None else mx.concatenate([carry, h[0, :-1]])  # [m, H]
    pairs_t = piece[0, 1:] if carry is None else piece[0]  # [m]
    if pairs_t.size:  # (a pipelined stage's head takes no positions: it never sees images)
        extra = () if positions is None else (positions,)
        model.mtp_hidden(pairs_t[None], pairs_h[None], cache.mtp, *extra, last=True)  # its keys are all that is kept
    return h[0, -1:]


def prefill(
    model: CausalLM,
    tokens: list[int],
    cache: ModelCache,
    chunk: int = 512,
    progress: ProgressFn | None = None,
    all_logits: bool = False,
    mtp: bool = False,
    carry: mx.array | None = None,
    on_chunk: ChunkFn | None = None,
    marks: Sequence[int] = (),
    images: ImagePrompt | None = None,
) -> tuple[mx.array, mx.array]:
    """Run `tokens` through the model in chunks, filling `cache` (which may already hold a prefix).

    Returns (logits, post-norm hidden): for the last position only ([1, V], [1, hidden]), or for every
    position when `all_logits` ([S, V], [S, hidden]). Only the rows that are read go through lm_head.
    With `mtp`, the MTP head's KV is filled too: position p gets (t_{p+1}, h_p) for p < len(tokens) - 1;
    the last hidden waits for the token that will follow the prompt.

    When `cache` already holds n tokens (a restored prefix), chunk edges stay at multiples of `chunk` counted
    from position 0, so the work after a restore at a chunk edge is exactly the cold run's; `carry` [1, H] is
    then h_{n-1}, which the MTP head pairs with tokens[0]. `on_chunk(n, cache_at_n, hidden)` sees the cache after
    every chunk (read it through `cache_at_n`: the wavefront may have the next chunk in its first layers already).
    `marks` (absolute positions) end a chunk too: the chunk holding a mark is cut in two there, so `on_chunk`
    sees the state exactly at it (a chat transcript's end, before its generation prompt).

    On the CPU with two cores or more, two chunks or more and no `images`, the chunks run as a two-lane wavefront
    (`hetero.decode.wavefront`): the same ops per chunk, the same result up to the BLAS's summation order; `progress`
    and `on_chunk` run on the calling thread, in chunk order, as they do otherwise.

    `images` (the prompt's `ImagePrompt`, its images encoded from the cache's offset on) puts the images'
    embeddings in place of their tokens and runs every chunk at its 3-D rotary positions; the attention caches
    then hold the prompt's position shift, so decoding continues at the positions after it.
    """
    if not tokens:
        raise ValueError("prefill needs at least one token")
    logits, hidden = [], []
    offset = cache[0].offset if cache else 0
    expect_positions(cache, offset + len(tokens))
    edges = chunk_edges(offset, len(tokens), chunk, marks)
    if images is None and wavefront.applies(model, edges):
        held = [carry]  # the MTP head's carry, handed from chunk to chunk in chunk order

        def after(k: int, h: mx.array):  # on chunk k's lane: h [1, S, hidden], its backbone's output
            start, stop = edges[k], edges[k + 1]
            if mtp:
                held[0] = mtp_pairs(model, mx.array(tokens[start:stop])[None], h, held[0], cache)
            if all_logits:
                logits.append(model.logits(h)[0])
                hidden.append(h[0])
            elif stop >= len(tokens):
                logits.append(model.logits(h[:, -1:])[0])
                hidden.append(h[0, -1:])
            last = h[0, -1:]
            mx.eval(last, *logits[-1:], *hidden[-1:], *([held[0], *cache_arrays(cache.mtp)] if mtp else []))

            def report(view: ModelCache | None) -> None:  # on the calling thread
                if on_chunk is not None:
                    on_chunk(offset + stop, view, last)
                if progress is not None:
                    progress(stop, len(tokens))

            return report

        # a restored prefix may still be lazy, on this thread's stream, which the other lane cannot evaluate
        mx.eval(*cache_arrays(cache), *([] if carry is None else [carry]))
        wavefront.run(model, tokens, cache, edges, after, views=on_chunk is not None)
        return mx.concatenate(logits), mx.concatenate(hidden)
    if images is not None:
        for c in cache:
            if isinstance(c, KVCache):
                c.shift = images.delta
    for start, stop in zip(edges, edges[1:]):
        piece = mx.array(tokens[start:stop])[None]  # [1, S]
        pairs = None
        if images is None:
            h = model.model(piece, cache.backbone)  # [1, S, hidden]
        else:
            embeds, positions = images.inputs(model.model.embed_tokens, offset + start, offset + stop)
            h = model.model(piece, cache.backbone, embeddings=embeds, positions=positions)  # [1, S, hidden]
            first = offset + start - (carry is not None)  # the p of the chunk's first MTP pair
            pairs = mx.array(images.positions[:, first : offset + stop - 1])  # [3, m]
        last = stop >= len(tokens)
        if mtp:
            carry = mtp_pairs(model, piece, h, carry, cache, pairs)
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
            on_chunk(offset + stop, cache, h[0, -1:])
        if progress is not None:
            progress(stop, len(tokens))
    return mx.concatenate(logits), mx.concatenate(hidden)
