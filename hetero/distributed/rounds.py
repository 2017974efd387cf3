"""One request through the pipeline: every rank runs its side of it (SPMD), the last rank leads.

Prefill is pipelined by chunk: each rank runs chunk c of its layers and hands the hidden states on, then goes on
to chunk c+1 while the next rank runs chunk c; the chunk edges are those of the single-process `prefill`.
Decoding is led by the last rank, which holds the head: it samples, drafts with the MTP head, accepts and rolls
back with the engine's own stepper (`hetero.decode.solo.decode_tokens` over its `Stage`). Before every backbone pass
it broadcasts the pass's tokens (VERIFY, recording GDN states, or STEP for plain decoding); after every commit it
broadcasts the committed tokens (COMMIT), from which every other rank rolls its own caches back exactly as the
last rank did (accepted = len(tokens) - 1 of the pass) and rank 0 emits the text; DONE ends the request.
A JSON constraint and logprobs run on the last rank too, with the single-process decoders' own code; the logprobs
of each COMMIT's tokens follow it to rank 0 (`outputs`). In a `stoppable` request (a server's), rank 0 answers
every COMMIT with GO_ON or STOP (its output ended: a stop string, a client gone) once it has handled the tokens, and
the last rank ends the request there (DONE), so a request nobody reads does not keep the pipeline busy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import mlx.core as mx

from hetero.caches.prefix import PrefixCache
from hetero.decode.logprobs import TokenLogprob
from hetero.decode.prefill import ChunkFn, ProgressFn, chunk_edges, prefill
from hetero.decode.parts import RowParts
from hetero.decode.records import MTPStats
from hetero.decode.solo import decode_tokens
from hetero.distributed.outputs import last_rank_options, recv_logprobs, send_logprobs
from hetero.distributed.request import Request
from hetero.distributed.stage import COMMIT, DONE, STEP, VERIFY, Stage, message_length
from hetero.models.cache import GDNCache, KVCache, LayerCache, cache_arrays, expect_positions


GO_ON, STOP = 1, 0  # rank 0's answer to a COMMIT in a stoppable request


PREFIX_KEY = "pipeline"  # one model per pipeline: each rank's prefix cache holds only its own layers' states


def restore(stage: Stage, request: Request) -> tuple[list[LayerCache], int, mx.array | None]:
    """Every rank: (cache, tokens already in it, post-norm hidden of the last one) for this request.

    With the request's prefix cache on, each rank keeps a `PrefixCache` of its own layers' states, captured at the
    same points on every rank (prefill chunk edges, the end of an MTP turn). The ranks restore only a prefix that
    all of them hold a checkpoint for, exactly there; otherwise they all start cold."""
    if not request.prefix_cache:
        return stage.make_cache(), 0, None
    if stage.prefix is None:
        stage.prefix = PrefixCache(request.prefix_cache)
    pc, ids, link = stage.prefix, request.prompt, stage.link
    node = pc.lookup(PREFIX_KEY, ids, limit=len(ids) - 1)  # the last prompt token must run: its logits
    target = min(link.gather_ints(node.end if node is not None else 0))
    held = pc.lookup(PREFIX_KEY, ids, limit=target) if target else None
    if not all(link.gather_ints(int(held is not None and held.end == target))):
        return stage.make_cache(), 0, None
    restored = pc.restore(stage, PREFIX_KEY, ids, limit=target)
    return restored.cache, restored.n, restored.hidden


def capture(stage: Stage, tokens: list[int], cache: list[LayerCache], hidden: mx.array) -> None:
    """Checkpoint this rank's caches after `tokens` (`hidden` [m, H]: what the MTP head has not consumed, on the
    last rank; elsewhere the stage's own last output, which no restore reads)."""
    if stage.prefix is None or any(isinstance(c, KVCache) and c.keys is None for c in cache):
        return  # (an MTP layer with no pair yet, after a 1-token prompt: nothing worth a checkpoint)
    stage.prefix.capture(stage, PREFIX_KEY, tokens, cache, hidden)


def lead(stage: Stage, request: Request, cache: list[LayerCache], skip: int = 0, carry: mx.array | None = None) -> dict:
    """The last rank's side of a generation (prefill, then decoding) over `cache`, which holds prompt[:skip]
    (`carry`: its last hidden); returns its stats for rank 0."""
    link, ids, eos, depth = stage.link, request.prompt, set(request.eos), request.depth
    pc = request.prefix_cache
    constraint, recorder = last_rank_options(stage, request)

    def on_chunk(n: int, at: list[LayerCache], hidden: mx.array) -> None:
        link.watchdog.pet()  # a chunk done is progress
        if pc:
            capture(stage, ids[:n], at, hidden)

    def announce(kind: int, tokens: list[int]) -> None:
        link.from_last([kind, len(tokens), *tokens], message_length())
        link.watchdog.pet()

    stopped = []  # rank 0 answered STOP

    def commit(tokens: list[int]) -> None:
        """The committed tokens to every rank, then (when asked for) their logprobs to rank 0; in a stoppable
        request, rank 0's answer."""
        announce(COMMIT, tokens)
        if recorder is not None:  # the recorder holds one item per committed token: these are its newest
            send_logprobs(stage, recorder.items[len(recorder.items) - len(tokens):], recorder.top)
        if request.stoppable and link.recv((1,), mx.int32, 0).item() == STOP:
            stopped.append(True)

    stats = MTPStats(depth) if depth else None
    committed, state = list(ids), []

    def on_commit(decoder, new: list[int]) -> None:
        commit(new)
        committed.extend(new)
        state[:] = [decoder]
        stage.announce = VERIFY if depth else STEP  # every later backbone pass is a verify pass, or a plain step

    parts = RowParts(cache=cache, skip=skip, carry=carry, on_chunk=on_chunk, marks=request.marks,
                     mtp_prefill=bool(pc) and stage.has_mtp, max_context=request.max_context, on_commit=on_commit,
                     constraint=constraint, logprobs=recorder, stats=stats)
    stream = decode_tokens(stage, ids, request.options, eos, depth, parts)
    try:
        for _ in stream:
            if stopped:  # (at the first token of the round rank 0 stopped at: nothing after it runs)
                break
    finally:
        stream.close()
        stage.announce = None
    if pc and state and depth:  # the committed end state of an MTP turn (x is committed but not yet run)
        decoder = state[0]
        capture(stage, committed[: decoder.length], decoder.cache, decoder.pending_hidden)
    announce(DONE, [])
    return {"mtp": stats.to_dict() if stats is not None else None}


def follow(stage: Stage, request: Request, cache: list[LayerCache], skip: int = 0,
           progress: ProgressFn | None = None, logprobs: list[TokenLogprob] | None = None,
           go_on: Callable[[], bool] | None = None) -> Iterator[int]:
    """Any other rank's side of a generation: prefill its chunks after `skip` cached tokens, then run the passes
    the last rank announces and roll back as it commits. Yields the committed tokens in order (rank 0 emits them);
    on rank 0, a request with logprobs appends each committed token's to `logprobs` before yielding it, and a
    stoppable one answers each COMMIT, once its tokens are handled, with `go_on()` (GO_ON or STOP)."""
    link, ids = stage.link, request.prompt
    pc, top = request.prefix_cache, request.options.logprobs
    on_chunk = (lambda n, at, h: capture(stage, ids[:n], at, h)) if pc else None
    prefill_stage(stage, ids, cache, request.options.prefill_chunk, progress, skip, on_chunk, request.marks)
    committed = list(ids)
    passed = 0  # tokens of the latest recorded (verify) pass, waiting for its commit
    last = None  # this stage's output of the latest pass [1, H]
    while True:
        kind, n, *rest = link.from_last(None, message_length())
        tokens = rest[:n]
        link.watchdog.pet()
        if kind == DONE:
            break
        if kind in (VERIFY, STEP):
            if kind == VERIFY:
                for c in cache:
                    if isinstance(c, GDNCache):
                        c.start_recording()
            out = stage.model(mx.array([tokens]), cache)
            link.eval(out, *cache_arrays(cache))
            passed = n if kind == VERIFY else 0
            last = out[0, -1:]
        elif kind == COMMIT:
            if passed:
                commit_pass(cache, passed, accepted=n - 1)
                passed = 0
            if link.first and top is not None:
                rows = recv_logprobs(stage, tokens, top)
                if logprobs is not None:
                    logprobs.extend(rows)
            committed += tokens
            yield from tokens
            if link.first and request.stoppable:
                link.send(mx.array([GO_ON if go_on is None or go_on() else STOP], dtype=mx.int32), link.size - 1)
        else:
            raise RuntimeError(f"unknown pipeline message kind {kind}")
    if pc and request.depth and last is not None:  # the end of an MTP turn, as the last rank captures it
        capture(stage, committed[: cache[0].offset], cache, last)


def commit_pass(cache: list[LayerCache], passed: int, accepted: int) -> None:
    """Keep the pass's first `accepted` + 1 tokens in this rank's caches (`Decoder.commit`, backbone part)."""
    for c in cache:
        if isinstance(c, GDNCache):
            c.commit(accepted + 1)
        else:
            c.trim_to(c.offset - passed + accepted + 1)
    mx.eval(*cache_arrays(cache))


def prefill_stage(stage: Stage, ids: list[int], cache: list[LayerCache], chunk: int,
                  progress: ProgressFn | None = None, skip: int = 0, on_chunk: ChunkFn | None = None,
                  marks: list[int] = ()) -> None:
    """This (non-last) rank's layers over ids[skip:] (the cache holds ids[:skip]), chunk by chunk at the edges of
    `decode.prefill.prefill` (`marks` too), each chunk handed on as soon as it is done; `on_chunk(n, cache, last output
    [1, H])`
    after each."""
    edges = chunk_edges(skip, len(ids) - skip, chunk, marks)
    expect_positions(cache, len(ids))
    for start, stop in zip(edges, edges[1:]):
        out = stage.model(mx.array(ids[skip + start : skip + stop])[None], cache)  # [1, S] -> the send of [1, S, H]
        stage.link.eval(out, *cache_arrays(cache))
        if on_chunk is not None:
            on_chunk(skip + stop, cache, out[0, -1:])
        if progress is not None:
            progress(stop, len(ids) - skip)


def logits_lead(stage: Stage, request: Request) -> None:
    """Last rank: every position's logits of the prompt, sent to rank 0 (`Engine.logits` across ranks)."""
    logits, _ = prefill(stage, request.prompt, stage.make_cache(), request.options.prefill_chunk, all_logits=True,
                        on_chunk=lambda n, at, h: stage.link.watchdog.pet())  # [S, V]
    stage.link.send(logits.astype(mx.float32), 0)


def logits_follow(stage: Stage, request: Request) -> mx.array | None:
    """Other ranks: their layers over the prompt; rank 0 then receives the logits [S, V] fp32."""
    prefill_stage(stage, request.prompt, stage.make_cache(), request.options.prefill_chunk)
    if stage.link.first:
        return stage.link.recv((len(request.prompt), stage.args.vocab_size), mx.float32, stage.link.size - 1)
    return None
