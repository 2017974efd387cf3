"""Batched decoding for requests that live on their own threads (the server's jobs): one decode loop for all.

A job prefills its prompt on its own thread, taking turns on the model as before (`hetero.decode.turns`), emits its
first token, then hands its decoder to the `DecodeLoop` and reads the rest of its tokens from a queue. The loop's
thread runs one `Batch` round for every request handed over, one turn on the model per round, so the prefill
chunks of prompts that arrive meanwhile still interleave with decoding. Rows join and leave between rounds;
a job that stops reading (its client went away, a stop string matched) closes its stream, and its request leaves
before the next round without disturbing the others.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx

from hetero.decode.options import RowOptions
from hetero.decode.records import DecodeTimes
from hetero.decode.rows import Row
from hetero.decode.sampling import Sampler
from hetero.decode.stepper import MAX_BATCH, Batch
from hetero.decode.turns import Turns
from hetero.errors import HeteroError
from hetero.host.settings import DEFAULT_DRAFT_DEPTH
from hetero.models.cache import cache_arrays
from hetero.models.interface import CausalLM


class _Stream:
    """One handed-over request and the queue its job reads: token lists, then None (done) or an exception."""

    def __init__(self, request: Row) -> None:
        self.request = request
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False
        self.left = threading.Event()  # set by the loop once the request is out of the batch (its state committed)


class DecodeLoop:
    """Decodes every handed-over request in one `Batch` on its own thread, one turn of `turns` per round."""

    def __init__(self, model: CausalLM, turns: Turns | None = None, max_batch: int = MAX_BATCH, history: int = 512):
        self.model = model
        self.turns = turns if turns is not None else Turns()
        self.batch = Batch(model, max_batch)
        self.rounds = 0
        self.rows_total = 0  # requests over all rounds (rows_total / rounds: the mean batch size since start)
        self.sizes: deque[tuple[float, int]] = deque(maxlen=history)  # (wall time, requests) of the latest rounds
        self._cv = threading.Condition()
        self._arrivals: deque[_Stream] = deque()
        self._streams: dict[Row, _Stream] = {}
        self._ticket = object()  # the loop's place in the turn ring
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def max_batch(self) -> int:
        return self.batch.max_batch

    def health(self) -> dict:
        """Batch size now and over the latest rounds (for /health)."""
        recent = [n for _, n in self.sizes]
        return {"batch_size": len(self.batch.rows), "max_batch": self.max_batch, "rounds": self.rounds,
                "waiting": len(self._arrivals), "recent_batch_sizes": recent[-32:],
                "mean_batch_size": round(sum(recent) / len(recent), 3) if recent else 0.0}

    def generate_tokens(self, model: CausalLM, prompt: list[int], sampler: Sampler, max_tokens: int, eos_ids: set[int],
                        *, depth: int = DEFAULT_DRAFT_DEPTH, copy: bool = True,
                        on_handover: Callable[[], None] | None = None, on_handback: Callable[[], None] | None = None,
                        **options) -> Iterator[int]:
        """`solo.decode_tokens` (the same `RowOptions`), the same tokens, with the decoding done in the shared batch.
        The prefill runs on the caller's thread, then the first token is yielded; `on_handover()` runs once the rest
        is the loop's (the caller gives up its turn on the model there) and `on_handback()` once the stream ends or
        is closed (the caller takes a turn again: the loop has finished its round, and the request's state is its
        committed one). `on_commit`, `stats` and `logprobs` are updated on the loop's thread; `times` on the
        caller's, as tokens are yielded; a `constraint` is the loop thread's after the handover."""
        times = options.pop("times", None) or DecodeTimes()
        times.start, times.prompt_tokens = times.start or time.perf_counter(), len(prompt)
        if max_tokens <= 0:
            times.first_token = times.end = time.perf_counter()
            return
        request = self.batch.prefilled(prompt, sampler, max_tokens, eos_ids, depth, copy,
                                       RowOptions(**options))  # its own times: this thread's are `times`
        decoder = request.decoder

        def emit(tokens: list[int]) -> Iterator[int]:
            for t in tokens:
                if times.generated == 0:
                    times.first_token = time.perf_counter()
                times.generated += 1
                times.end = time.perf_counter()
                yield t

        yield from emit(list(request.tokens))
        if request.done:
            times.finish_reason = request.finish_reason
            return
        # the loop's thread has its own stream: nothing of the request may stay lazy (the sampler's key included)
        mx.eval(decoder.pending_hidden, *cache_arrays(decoder.cache), sampler.key)
        stream = _Stream(request)
        with self._cv:
            if self._closed:
                raise HeteroError("the batched decode loop is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hetero-batch", daemon=True)
                self._thread.start()
                atexit.register(self.close)  # a daemon thread, ended before the interpreter finalizes
            self._arrivals.append(stream)
            self._cv.notify_all()
        if on_handover is not None:
            on_handover()
        try:
            while True:
                item = stream.queue.get()
                if item is None:
                    times.finish_reason = request.finish_reason
                    return
                if isinstance(item, BaseException):
                    raise item
                yield from emit(item)
        finally:
            stream.cancelled = True  # read by the loop before its next round
            with self._cv:
                self._cv.notify_all()
            # a closed stream's request may still be in the batch with its next pass queued (its caches a token ahead):
            # the caller reads its state (an end-of-turn checkpoint) only once the loop has dropped it
            while not stream.left.wait(0.1):
                if self._thread is None or not self._thread.is_alive():
                    break
            if on_handback is not None:
                on_handback()

    def close(self) -> None:
        """Stop the loop's thread (requests still in the batch get no more tokens)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        holding = False  # whether the loop is in the turn ring
        try:
            while True:
                if holding and not self._streams:  # nothing to decode: the other jobs have the model
                    self.turns.leave(self._ticket)
                    holding = False
                with self._cv:
                    self._cv.wait_for(lambda: self._closed or self._arrivals or self._streams)
                    if self._closed:
                        return
                    while self._arrivals and not self.batch.full:
                        s = self._arrivals.popleft()
                        if s.cancelled:
                            s.left.set()
                        else:
                            self._streams[self.batch.admit(s.request)] = s
                for r, s in list(self._streams.items()):
                    if s.cancelled:
                        self.batch.leave(r)
                        del self._streams[r]
                        s.left.set()
                if not self._streams:
                    continue
                if not holding:
                    self.turns.enter(self._ticket)
                    holding = True
                self._round()
                self.turns.pass_turn(self._ticket)
        finally:  # closed, or a failure outside a round: no job waits for tokens that will not come
            if holding:
                self.turns.leave(self._ticket)
            with self._cv:
                self._closed = True
                orphans = list(self._streams.values()) + list(self._arrivals)
                self._streams.clear()
                self._arrivals.clear()
            for s in orphans:
                s.queue.put(HeteroError("the batched decode loop stopped"))
                s.left.set()

    def _round(self) -> None:
        """One batch round; its tokens to each request's stream. A failure ends every request of the batch."""
        try:
            emitted = self.batch.step()
        except Exception as e:  # the rows' states are unknown now: each job gets the error
            for r, s in self._streams.items():
                self.batch.leave(r)
                s.queue.put(e)
                s.left.set()
            self._streams.clear()
            return
        self.rounds += 1
        self.rows_total += len(emitted)
        self.sizes.append((time.time(), len(emitted)))
        for r, tokens in emitted.items():
            s = self._streams[r]
            if tokens:
                s.queue.put(tokens)
            if r.done:  # out of the batch already (`Batch.step`), its state committed
                s.left.set()
                s.queue.put(None)
                del self._streams[r]


@dataclass(frozen=True)
class Seat:
    """A job's place in a shared `DecodeLoop`, named by its `GenerationRequest.batch`: the job leaves its turn on
    the model when the loop takes its request over (`on_handover`) and takes one again when it ends (`on_handback`)."""

    loop: DecodeLoop
    on_handover: Callable[[], None] | None = None
    on_handback: Callable[[], None] | None = None

    def decode_tokens(self, model: CausalLM, prompt: list[int], sampler: Sampler, max_tokens: int, eos_ids: set[int],
                      **options) -> Iterator[int]:
        """`solo.decode_tokens`'s arguments and tokens, decoded in the loop's batch."""
        return self.loop.generate_tokens(model, prompt, sampler, max_tokens, eos_ids, on_handover=self.on_handover,
                                         on_handback=self.on_handback, **options)
