"""The job runner: up to `max_concurrent` generations at once, each on its own worker thread, taking round-robin
turns on the model (`hetero.decode.turns`): one prefill chunk or one decode token per turn, so a new request starts
while others decode and none starves. With `max_batch` > 1 (`hetero serve --max-batch N`), the requests decoding at
one moment share every decode pass instead (`hetero.decode.loop`): each prefills in its turns, then hands its decoding
to one loop that runs a batched round per turn (JSON-constrained requests too, each masked as alone). With a split
(`hetero serve --ane-fraction F`), one prompt at a time prefills through the ANE + GPU pipeline, whose GPU lane
lends its turn to the other requests while the ANE computes its share (prompts arriving meanwhile prefill
GPU-only). A client that disconnects cancels its job.

A job yields, in order: `Started` (when its prefill begins), text pieces (stop strings already cut), then its
`Outcome`; a job that asked for logprobs also yields each token's `TokenLogprobs` just before that token's text.
The API modules turn these into responses; they never touch the model.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import mlx.core as mx

from starlette.requests import Request

from hetero.decode.logprobs import LogprobRecorder, TokenLogprob
from hetero.decode.options import DecodeOptions
from hetero.decode.loop import DecodeLoop, Seat
from hetero.decode.prefill import Progress
from hetero.decode.turns import DECODE_SHARE, Turn, Turns
from hetero.engine import Engine
from hetero.errors import HeteroError
from hetero.pipeline.lanes import LentTurn
from hetero.server.requests import Job
from hetero.server.refusals import RequestError
from hetero.server.stops import StopMatcher


log = logging.getLogger("hetero.server")


class Cancelled(Exception):
    """The client went away; the generation stops where it is."""


def shutting_down() -> RequestError:
    """What a request cut short (or refused) by the server's stop gets: a 503 in its API's error shape."""
    return RequestError(503, "the server is shutting down (SIGTERM or SIGINT); send the request again once it is back",
                        None, "server_shutting_down")


@dataclass
class TokenLogprobs:
    """One token's raw bytes and logprob, and its top alternatives (bytes, logprob), most likely first (an echoed
    prompt's first token has neither: None)."""

    token: bytes
    logprob: float | None
    top: list[tuple[bytes, float]] | None


@dataclass
class Echo:
    """A completion's prompt sent back before its reply (`echo`): its text, and its tokens' logprobs when asked."""

    text: str
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class Started:
    """Streamed once, when the prefill begins: how many prompt tokens came from the prefix cache, and the echoed
    prompt of a completion that asked for it."""

    cached_tokens: int
    echo: Echo | None = None


@dataclass
class Timing:
    """A finished job's times (perf_counter seconds): queued, taken by a worker, first text sent, ended."""

    submitted: float
    started: float
    first_text: float | None = None
    end: float | None = None


@dataclass
class Outcome:
    """What a finished job reports to its API's output shaper."""

    text: str
    stats: dict
    stop: str | None  # the stop string that ended it
    finish: str  # "stop" (EOS or a stop string) or "length"
    logprobs: list[TokenLogprobs] | None = None  # every generated token's, when the job asked for them
    echo: Echo | None = None  # the prompt, when a completion asked for it back

    @property
    def usage(self) -> tuple[int, int, int]:
        """(prompt tokens, cached prompt tokens, completion tokens)."""
        s = self.stats
        return s["prompt_tokens"], s["cached_tokens"], s["generated_tokens"]


class Runner:
    """Runs up to `max_concurrent` jobs at once, each on a worker thread, taking turns on the model; while senior
    jobs wait (decoding, or sent earlier), a prefilling job gets `1 - decode_share` of the model's time
    (`hetero.decode.turns`). A job waits on the ring only between its units of work (docs/server.md, "One scheduler
    owns every lane"). MTP jobs draft at
    `draft_depth` (`hetero serve --draft-depth`; None: the engine's tuned or calibrated depth)."""

    def __init__(self, engine: Engine, split=None, max_concurrent: int = 4, prefill_chunk: int = 512,
                 decode_share: float = DECODE_SHARE, max_batch: int = 1, draft_depth: int | None = None):
        if max_concurrent < 1:
            raise HeteroError(f"--max-concurrent must be at least 1, got {max_concurrent}")
        if max_batch < 1:
            raise HeteroError(f"--max-batch must be at least 1, got {max_batch}")
        self.engine, self.split = engine, split  # split: a configured `hetero.pipeline.PipelineRun` or None
        self.prefill_chunk = prefill_chunk
        self.draft_depth = draft_depth
        workers = max(max_concurrent, max_batch)  # a batch of N needs N jobs generating at once
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hetero-gen")
        self.turns = Turns(decode_share)
        self.loop = DecodeLoop(engine.model, self.turns, max_batch) if max_batch > 1 else None
        self._split_free = threading.Lock()  # one prompt at a time goes through the ANE + GPU split
        self.finished = 0
        self.cancelled = 0  # jobs stopped because their client went away
        self.split_prefills = 0
        self.stopping = threading.Event()  # set by `stop`: every job ends at its next token or prefill chunk
        self.running = 0  # jobs on a worker thread (generating, or waiting for their turn on the model)
        self.waiting = 0  # jobs submitted that no worker has taken yet
        self.ane_busy_s = 0.0  # the ANE lane's busy time over the split prefills
        self._count = threading.Lock()
        # called on the worker thread with each finished job's Outcome and its Timing (the server's /metrics)
        self.on_outcome: Callable[[Outcome, Timing], None] | None = None

    def stop(self) -> None:
        """The server is stopping: jobs waiting for a worker are refused, generating ones end at their next token
        or prefill chunk (their turn's checkpoint is still written) and fail with `shutting_down()`."""
        self.stopping.set()

    def close(self) -> None:
        """The server has stopped: end the worker threads (and the batch loop's) now, while the interpreter is
        whole. A worker that ran compiled steps drops MLX's per-thread compile cache as it ends, which needs the
        GIL; left to end at interpreter exit (daemon workers, as when uvicorn runs in a background thread), that
        aborts the process (`hetero.models.compiled`)."""
        self.stop()
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.loop is not None:
            self.loop.close()

    def refuse_if_stopping(self) -> None:
        """Raise the shutting-down error once the server's stop has begun (long work checks it between steps)."""
        if self.stopping.is_set():
            raise shutting_down()

    def submit(self, job: Job, emit: Callable[[str | Started | TokenLogprobs], None],
               cancelled: threading.Event):
        """Queue `run(job, ...)` for a worker thread; its concurrent Future."""
        with self._count:
            self.waiting += 1
        return self.pool.submit(self.run, job, emit, cancelled, time.perf_counter())

    def run(self, job: Job, emit: Callable[[str | Started | TokenLogprobs], None],
            cancelled: threading.Event, submitted: float | None = None) -> Outcome:
        """In a worker thread: wait for a turn, generate, pass text through the stop matcher to `emit`.
        `submitted`: when `submit` queued it (its perf_counter), else now."""
        timing = Timing(submitted if submitted is not None else time.perf_counter(), time.perf_counter())
        with self._count:
            self.waiting -= submitted is not None
            self.running += 1

        def timed(piece: str | Started | TokenLogprobs) -> None:
            if timing.first_text is None and isinstance(piece, str):
                timing.first_text = time.perf_counter()
            emit(piece)

        ticket = object()
        self.turns.enter(ticket)
        try:
            outcome = self._run(job, timed, cancelled, ticket)
        except Cancelled:
            with self._count:  # (jobs end on several threads at once: /health's counts must add up)
                self.cancelled += 1
            raise
        finally:
            self.turns.leave(ticket)
            with self._count:
                self.running -= 1
        with self._count:
            self.finished += 1
        timing.end = time.perf_counter()
        if self.on_outcome is not None:
            try:
                self.on_outcome(outcome, timing)
            except Exception:  # a bug in the metrics must not fail the request that finished
                log.exception("recording a finished request's metrics failed")
        return outcome

    def _split(self, job: Job, ticket: object) -> JobSplit | None:
        """The split prefill for this job when the server has one and the job did not opt out."""
        if self.split is None or job.ane_fraction == 0.0:
            return None
        return JobSplit(self, ticket)

    def _run(self, job: Job, emit: Callable[[str | Started | TokenLogprobs], None], cancelled: threading.Event,
             ticket: object) -> Outcome:
        if cancelled.is_set():
            raise Cancelled()
        if self.stopping.is_set():
            raise shutting_down()
        echo = self._echo(job) if job.echo else None
        matcher = StopMatcher(job.stops)
        parts: list[str] = []
        started = []
        # parallel_tool_calls false: the reply is parsed here too, and the generation ends with its first call
        one_call = job.reply.parser() if job.reply is not None and not job.reply.parallel else None

        def on_text(piece: str) -> None:
            out = matcher.feed(piece)
            if out:
                parts.append(out)
                emit(out)
                if one_call is not None:
                    one_call.feed(out)

        turn = Turn(self.turns, ticket)

        def report(done: int, total: int) -> None:  # after every prefill chunk; the turn passes between them
            if not started:  # the prefill covers only what the prefix cache did not restore
                started.append(True)
                emit(Started(len(job.ids) - total, echo))
            if cancelled.is_set():
                raise Cancelled()
            if self.stopping.is_set():
                raise shutting_down()

        halted = []  # set when the server's stop ended the generation

        def should_stop() -> bool:
            turn()  # after every token
            if self.stopping.is_set():
                halted.append(True)
            return (matcher.stopped is not None or cancelled.is_set() or bool(halted)
                    or (one_call is not None and one_call.calls > 0))

        logprobs: list[TokenLogprobs] | None = [] if job.options.logprobs is not None else None
        # the loop takes the job's place in the ring while it decodes for it, then gives it back
        seat = Seat(self.loop, ticket) if self.loop is not None else None
        result = self.engine.generate(
            job.ids, options=self._options(job), draft_depth=self.draft_depth, prefill_chunk=self.prefill_chunk,
            on_text=on_text, on_logprob=self._on_logprob(emit, logprobs), progress=Progress(report, turn),
            should_stop=should_stop, split=self._split(job, ticket),
            mark=job.reply.mark if job.reply is not None else None, batch=seat, images=_images(job),
        )
        if cancelled.is_set():
            raise Cancelled()  # cut short by the client, not finished
        if halted and matcher.stopped is None:
            raise shutting_down()  # cut short by the server's stop (its turn is checkpointed), not finished
        tail = matcher.flush()
        if tail:
            parts.append(tail)
            emit(tail)
        finish = "stop" if matcher.stopped is not None else result.stats["finish_reason"]
        stats = {k: v for k, v in result.stats.items() if k != "model"}
        return Outcome("".join(parts), stats, matcher.stopped, finish, logprobs, echo)

    def _echo(self, job: Job) -> Echo:
        """The prompt of an `echo` completion: its text and, with logprobs asked, each prompt token's logprob under
        the raw model given the tokens before it (one prefill of every position; the first token has none)."""
        ids, engine = job.ids, self.engine
        if job.options.logprobs is None:
            return Echo(engine.tokenizer.decode(ids))
        recorder = LogprobRecorder(job.options.logprobs)  # what generated tokens report, for rows 0..S-2 of the prompt
        recorder.add(mx.array(engine.logits(ids)[:-1]), ids[1:])  # [S-1, V]: token i+1 given tokens 0..i
        first = TokenLogprobs(engine.token_bytes(ids[0]), None, None)
        return Echo(engine.tokenizer.decode(ids), [first] + [self._bytes(x) for x in recorder.items])

    def _bytes(self, x: TokenLogprob) -> TokenLogprobs:
        """A token's logprobs with its id and its alternatives' as the raw bytes the APIs report."""
        token_bytes = self.engine.token_bytes
        return TokenLogprobs(token_bytes(x.token), x.logprob, [(token_bytes(t), lp) for t, lp in x.top])

    @staticmethod
    def _options(job: Job) -> DecodeOptions:
        """The job's decode options as the engine takes them: a forced tool call is decoded under its call's grammar
        (response_format shapes text replies, not calls)."""
        forced = job.reply.grammar if job.reply is not None else None
        return replace(job.options, grammar=forced, json_schema=None, json_object=False) if forced else job.options

    def _on_logprob(self, emit: Callable[[TokenLogprobs], None],
                    into: list[TokenLogprobs] | None) -> Callable[[TokenLogprob], None] | None:
        """With logprobs asked for (`into` a list): each token's logprobs, as the APIs report them, go to `emit`
        (ahead of its text) and into `into`."""
        if into is None:
            return None

        def on_logprob(x: TokenLogprob) -> None:
            item = self._bytes(x)
            into.append(item)
            emit(item)

        return on_logprob

    async def complete(self, job: Job, request: Request) -> Outcome:
        """Run to the end; a client that disconnects meanwhile cancels the job."""
        cancelled = threading.Event()
        fut = asyncio.wrap_future(self.submit(job, lambda _: None, cancelled))
        while not fut.done():
            await asyncio.wait([fut], timeout=0.25)
            if not fut.done() and await request.is_disconnected():
                cancelled.set()
        return fut.result()

    async def stream(self, job: Job) -> AsyncIterator[list[str | Started | TokenLogprobs | Outcome]]:
        """Started, text pieces as they come, then the Outcome, in lists: each list holds every item the job
        emitted since the event loop last took some (one wake-up of the event loop per list, not per token, so the
        decoding thread is not slowed by a hand-off per token). Closing the iterator (client gone) cancels the job."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        pending: list = []  # emitted on the worker thread, not taken by the event loop yet
        lock = threading.Lock()
        cancelled = threading.Event()

        def emit(piece) -> None:
            with lock:
                pending.append(piece)
                first = len(pending) == 1
            if first:  # the event loop takes everything up to here when it wakes: one wake-up for all of it
                loop.call_soon_threadsafe(ready.set)

        fut = self.submit(job, emit, cancelled)
        fut.add_done_callback(emit)  # the Future last: its Outcome (or its exception)
        try:
            while True:
                await ready.wait()
                with lock:
                    items, pending[:] = list(pending), []
                    ready.clear()  # a piece emitted after this sets it again
                if not items:
                    continue
                if not isinstance(items[-1], Future):
                    yield items
                    continue
                end = items.pop()
                if end.cancelled() or end.exception() is not None:
                    if items:  # what it streamed before it failed goes out first, as it came
                        yield items
                    end.result()  # raises the job's exception
                yield items + [end.result()]
                return
        finally:
            cancelled.set()

    async def stream_started(self, job: Job, request: Request
                             ) -> AsyncIterator[list[str | Started | TokenLogprobs | Outcome]] | None:
        """`stream(job)` once its first items are in, so that a job failing before it generates anything fails
        before the response's first byte (a 4xx/5xx, not a 200 that breaks off). None: the client went away."""
        items = self.stream(job)
        first = asyncio.ensure_future(items.__anext__())
        while not first.done():
            await asyncio.wait([first], timeout=0.25)
            if not first.done() and await request.is_disconnected():
                first.cancel()  # closes the stream, which cancels the job
                await asyncio.wait([first])
                return None
        head = first.result()  # the job's own exception, when it failed first

        async def chained() -> AsyncIterator[list[str | Started | TokenLogprobs | Outcome]]:
            try:
                yield head
                async for batch in items:
                    yield batch
            finally:
                await items.aclose()  # now, not at garbage collection: closing the stream is what cancels the job

        return chained()


def _images(job: Job):
    """The job's images (an `ImagePrompt` over its ids), or () for a text prompt."""
    vision = getattr(job.reply, "vision", None)
    return vision if vision is not None else ()


class JobSplit:
    """One job's use of the server's ANE split (`GenerationRequest.split`): one prompt at a time goes through it
    (another finds it busy and prefills GPU-only), and the GPU lane lends the job's turns to other jobs' decoding
    while the ANE computes."""

    def __init__(self, runner: Runner, ticket: object) -> None:
        self.runner, self.ticket = runner, ticket

    def prefill(self, ids: list[int], on_chunk=None, images=None):
        """`PipelineRun.prefill` for this job (`images`: its `ImagePrompt`, or None), or an empty cache (0 tokens
        in it) when the split is busy."""
        runner = self.runner
        if not runner._split_free.acquire(blocking=False):  # another prompt is in the split: GPU-only
            return runner.engine.model.make_cache(), 0, None
        try:
            # a first-use export (text programs, the images' vision programs; minutes on a Mac) and the programs'
            # load into the ANE worker use no model lane: the job's turn goes to the other jobs meanwhile, and it
            # stops between programs when the server stops
            runner.turns.leave(self.ticket)
            try:
                runner.split.prepare(ids, check=runner.refuse_if_stopping, images=images)
            finally:
                runner.turns.enter(self.ticket)
            out = runner.split.prefill(ids, decode=LentTurn(Turn(runner.turns, self.ticket)), on_chunk=on_chunk,
                                       images=images)
            runner.split_prefills += bool(out[1])  # a lost ANE worker hands the prompt back to the GPU-only path
            last = runner.split.last
            runner.ane_busy_s += last.ane_busy_s if out[1] and last is not None else 0.0
            return out
        finally:
            runner._split_free.release()
