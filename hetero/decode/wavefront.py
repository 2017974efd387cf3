"""CPU prefill as a two-lane wavefront: chunk c on one thread and chunk c+1 on the other, one layer apart.

On MLX's CPU backend a prefill chunk's matmuls spread over the cores (the BLAS's own threads), but everything else
does not: MLX's elementwise kernels and the numpy parts of a chunk (the activations' exp, the attention softmax, the
experts' routing) run on one core. Two chunks in flight fill the second core with that work. Chunk c+1 at layer l
needs chunk c's layer-l state (GDN state and conv window, PLE token context and conv window, the attention's KV and
index keys) and its own layer l-1 output, so each lane runs a layer once the other lane's previous chunk has
finished it: a wavefront, lane b one layer behind lane a.

The lanes are threads, each with its own MLX stream (MLX's default stream is per thread) and one BLAS thread (the
cores are now the lanes'). After every layer a lane evaluates the layer's output and its cache, then signals; the
other lane builds its chunk's same layer on those evaluated arrays. Host syncs inside a layer (numpy's exp, the
softmax, the routing buckets) stay: a lane waits on its own work only. Each chunk runs the same ops in the same
order as the one-lane `prefill`, so the caches and logits are those of the sequential run up to the BLAS's
summation order (one thread against two; on the bench model they are equal bit for bit), and greedy tokens are
identical.

The second lane is one thread for the process's life (MLX never ends a stream's scheduler thread, so a stream per
prefill would leave one behind each time); the calling thread runs the other lane, the last chunk (its logits take a
compiled step, compiled once per thread) and any chunk of at most 16 tokens, and it alone runs the reports
(`progress`, the prefix cache's `on_chunk` checkpoints), in chunk order; a report may stop the prefill (a cancelled
request) but never waits on other work. A checkpoint at chunk k's edge reads `frozen` views of each layer's cache,
taken as chunk k left the layer, since the other lane has chunk k+1 in the first layers by then.

Between requests, the prefill gives the model away only where neither lane holds its work: once another job wants
the model, the lanes finish the chunks they began, begin no other, and the job's turn passes (`pause`); the next
segment begins after. The second lane is one thread for every prefill of the process, so a turn passed from inside
a lane's job would leave that thread waiting on a job that waits for the turn: a circle (docs/server.md).

Not used (the sequential `prefill` runs instead) with images, on a GPU, on one core, or for fewer than two chunks of
17 tokens or more. `HETERO_PREFILL_WAVEFRONT=0` turns it off.

Why threads and not one lazy graph on two MLX streams: MLX's CPU streams do run concurrently (a toy of two
elementwise chains: 1.8 s on two streams against 3.1 s on one), but a chunk's host syncs (numpy's exp, the attention
softmax, the routing buckets), each several times faster than MLX's CPU forms, would all have had to go lazy.

Measured (`bench/prefill_wavefront.py`, quiet 2-core machine, the one lane and the wavefront in the same run, 4K
tokens in 512-token chunks): the scaled-down Flash-Next at 1,073.5 against 765.5 tok/s (1.40x; 6.74 against 10.47 CPU
s, the one lane's second MKL thread spinning between products; the lanes waited on each other 1% of the wall time),
the bundled Qwen3.5 model at 3,082 against 2,296 tok/s (1.34x); logits equal bit for bit, greedy the same.
"""

from __future__ import annotations

import copy
import os
import queue
import threading
from collections import deque
from collections.abc import Callable

import mlx.core as mx

from hetero.decode.turns import Pause, lane_job
from hetero.host import blas
from hetero.host.switches import switched_on
from hetero.models.cache import KVCache, LayerCache, ModelCache

MIN_TOKENS = 17  # chunks of at most 16 tokens run compiled steps (`RECURRENT_MAX_TOKENS`): the calling thread's lane
ENV = "HETERO_PREFILL_WAVEFRONT"
LANE_THREAD = "hetero-prefill-lane"


def enabled() -> bool:
    """Whether this process may prefill by wavefront: a CPU default device, two cores or more that it may run on, and
    not turned off."""
    if not switched_on(ENV):
        return False
    return mx.default_device() == mx.cpu and blas.usable_cores() >= 2


def chunks_in_flight() -> int:
    """Prefill chunks whose transient buffers live at once in this process: two when `enabled` (one per lane),
    else one. The memory governor counts this many."""
    return 2 if enabled() else 1


def applies(model, edges: list[int]) -> bool:
    """Whether a prefill cut at `edges` goes by wavefront: `enabled`, a backbone that runs layer by layer
    (`begin` / `run_layer` / `end`), and at least two chunks long enough for the second lane."""
    backbone = getattr(model, "model", None)
    if not enabled() or not all(hasattr(backbone, f) for f in ("begin", "run_layer", "end")):
        return False
    return sum(b - a >= MIN_TOKENS for a, b in zip(edges, edges[1:])) >= 2


class _Lane:
    """The second lane: one thread for the process's life with its own MLX stream, running one job at a time. (A
    stream made per prefill would leave a scheduler thread behind each time: MLX never ends a stream's thread.)"""

    def __init__(self) -> None:
        self.pid = os.getpid()  # a forked child has no such thread: it makes its own
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=LANE_THREAD, daemon=True).start()

    def _serve(self) -> None:
        with mx.stream(mx.new_stream(mx.cpu)):  # MLX's streams belong to the thread that made them
            while True:
                job, done = self.jobs.get()
                try:
                    with lane_job(LANE_THREAD):
                        job()
                finally:
                    done.set()

    def submit(self, job: Callable[[], None]) -> threading.Event:
        """Queue `job`; the event is set once it ran."""
        done = threading.Event()
        self.jobs.put((job, done))
        return done


_lane: list[_Lane] = []
_lane_lock = threading.Lock()


def _second_lane() -> _Lane:
    with _lane_lock:
        if not _lane or _lane[0].pid != os.getpid():
            _lane[:] = [_Lane()]
        return _lane[0]


def on_second_lane(job: Callable[[], None]) -> threading.Event:
    """Run `job` on the second lane (its own thread and MLX stream); the event is set once it ran (`hetero tune
    --devices` times two lanes at once with it). What `job` reads must be evaluated already."""
    return _second_lane().submit(job)


class _Aborted(Exception):
    """The other lane failed: this one stops (the other lane's error is raised)."""


class _Front:
    """What the lanes share: the (chunk, layer) pairs done, the reports queued for the calling thread, a failure, and
    the segment's bounds: chunks begin in order, each once its predecessor finished layer 0 (`begin`), and none at or
    past `limit` begins in this segment."""

    def __init__(self, chunks: int) -> None:
        self.cond = threading.Condition()
        self.done: set[tuple[int, int]] = set()
        self.reports: deque[Callable[[], None]] = deque()
        self.failed: list[BaseException] = []
        self.chunks = self.limit = chunks
        self.begun = -1  # the last chunk that began (they begin in order)
        self.out = 0  # segments of the second lane not returned yet

    def mark(self, k: int, layer: int) -> None:
        with self.cond:
            self.done.add((k, layer))
            self.cond.notify_all()

    def report(self, fn: Callable[[], None]) -> None:
        with self.cond:
            self.reports.append(fn)
            self.cond.notify_all()

    def fail(self, e: BaseException) -> None:
        with self.cond:
            self.failed.append(e)
            self.cond.notify_all()

    def begin(self, k: int, caller: bool) -> bool:
        """Whether chunk k begins in this segment: once chunk k-1 finished its first layer, unless the segment ended
        before k (`stop`). The calling thread (`caller`) runs the queued reports meanwhile."""
        while True:
            with self.cond:
                self.cond.wait_for(lambda: (k - 1, 0) in self.done or k == 0 or k >= self.limit or self.failed
                                   or (caller and self.reports))
                if self.failed:
                    raise _Aborted
                go = k < self.limit and ((k - 1, 0) in self.done or k == 0)
                if go:
                    self.begun = k
                ended = k >= self.limit
            if caller:
                self.drain()
            if go or ended:
                return go

    def stop(self) -> None:
        """End the segment after the chunks that began: their lanes finish them, no other begins."""
        with self.cond:
            self.limit = self.begun + 1
            self.cond.notify_all()

    def wait(self, k: int, layer: int, caller: bool) -> None:
        """Until chunk k finished `layer`; the calling thread (`caller`) runs the queued reports meanwhile."""
        while True:
            with self.cond:
                self.cond.wait_for(lambda: (k, layer) in self.done or self.failed or (caller and self.reports))
                if self.failed:
                    raise _Aborted
                ready = (k, layer) in self.done
            if caller:
                self.drain()
            if ready:
                return

    def settle(self) -> None:
        """On the calling thread, once its own lane is done: until the second lane's segment returned, running the
        queued reports meanwhile (none after a failure)."""
        while True:
            with self.cond:
                self.cond.wait_for(lambda: not self.out or (self.reports and not self.failed))
                idle = not self.out
            if not self.failed:
                try:
                    self.drain()
                except BaseException as e:  # noqa: BLE001 (a report stopped the prefill: the lanes stop too)
                    self.fail(e)
            if idle:
                return

    def drain(self) -> None:
        """Run the queued reports, in order (on the calling thread)."""
        while True:
            with self.cond:
                if not self.reports:
                    return
                fn = self.reports.popleft()
            fn()


def frozen(c: LayerCache) -> LayerCache:
    """Layer cache `c` as it stands, unaffected by the next chunk's writes (the prefix cache's checkpoint reads it
    while the other lane writes on): a shallow copy, since a chunk rebinds the recurrent states (GDN state and conv
    window, PLE context and conv window, QSA index keys), with the attention buffers cut at the offset, since a
    chunk writes those in place (rows past the offset only, but on the array objects themselves)."""
    at = copy.copy(c)
    if isinstance(c, KVCache) and c.keys is not None:
        buffers = c.state if getattr(c, "index_keys", None) is None else c.state[:-1]  # K/V (quantized: 6 arrays)
        at._set_buffers([a[:, :, : c.offset] for a in buffers])
        mx.eval(*at.state)  # views, evaluated on this lane (a stream is its thread's): the caller reads them
    ple = getattr(c, "ple", None)
    if ple is not None:
        at.ple = copy.copy(ple)
    return at


def run(model, tokens: list[int], cache: ModelCache, edges: list[int],
        after: Callable[[int, mx.array], Callable[[ModelCache | None], None] | None], views: bool = False,
        pause: Pause | None = None) -> None:
    """Prefill tokens[edges[0]:edges[-1]] chunk by chunk (chunk k = tokens[edges[k]:edges[k+1]]) into `cache` on two
    lanes. `after(k, h)` runs on chunk k's lane once its backbone is done (h: `model.model`'s output [1, S, H]), in
    chunk order (chunk k's after chunk k-1's returned): it may write caches past the backbone's (the MTP head's) and
    must evaluate what it keeps. What it returns, `report(view)` (progress, a checkpoint), runs on the calling
    thread, in chunk order; it must not wait on other work (it runs while the other lane computes), and an exception
    there stops both lanes and reaches the caller. `view` is, with `views`, the cache as it stood at chunk k's edge
    (`frozen` layers, the MTP head's as `after` left them), else None.

    `pause` (the job's `Turn` on the model): once another job wants the model (`pause.wanted()`), the lanes end the
    chunks they began and no other, and `pause(prefilling=True)` runs when neither lane holds work of this prefill;
    the rest continues as a new segment afterwards. So the prefill gives the model away between its jobs, never
    inside one, and the second lane is idle while other jobs run (they may use it). Alone, it runs as one segment.
    What the lanes read must be evaluated before (`cache`'s arrays, anything `after` reads): a lazy array built on
    the calling thread's stream cannot be evaluated on the other lane's thread."""
    _Wavefront(model, tokens, cache, edges, after, views, pause).run()


class _Wavefront:
    """One prefill on the two lanes (`run`): the chunks' work (`chunk`), each lane's loop (`lane`), the segments."""

    def __init__(self, model, tokens: list[int], cache: ModelCache, edges: list[int], after, views: bool,
                 pause: Pause | None) -> None:
        self.backbone, self.layers = model.model, len(model.model.layers)
        self.tokens, self.cache, self.after, self.views, self.pause = tokens, cache, after, views, pause
        self.chunks = list(zip(edges, edges[1:]))
        self.front = _Front(len(self.chunks))
        self.caller = threading.current_thread()
        self.at_edge: dict[int, list] = {}  # chunk -> its frozen layer caches (with `views`)

    def run(self) -> None:
        # Chunks alternate between the lanes, the last one on the calling thread's; so does a short chunk: both run
        # compiled steps (the last one's logits), which compile once per thread and stay with the caller's. Each
        # lane takes its chunks in order, so neither waits on work queued behind its own.
        front, n = self.front, len(self.chunks)
        ks = [[], []]
        for k, (a, b) in enumerate(self.chunks):
            ks[(n - 1 - k) % 2 if b - a >= MIN_TOKENS else 0].append(k)
        while True:
            first = front.begun + 1
            with blas.one_thread():  # each lane's matmuls on its own core
                rest = [k for k in ks[1] if k >= first]
                if rest:
                    with front.cond:
                        front.out += 1
                    done = _second_lane().submit(lambda: self.lane(rest))
                self.lane([k for k in ks[0] if k >= first])
                front.settle()
                if rest:
                    done.wait()
            if front.failed:
                raise front.failed[0]
            if front.begun + 1 >= n:
                return
            front.limit = n
            self.pause(prefilling=True)  # neither lane holds work of this prefill: the model may go to other jobs

    def lane(self, ks: list[int]) -> None:
        """One lane's chunks of this segment, in order (on the calling thread, or as the second lane's job)."""
        front, mine = self.front, threading.current_thread() is self.caller
        try:
            with lane_job(LANE_THREAD if not mine else "prefill wavefront"):
                for k in ks:
                    if not front.begin(k, mine):
                        break
                    self.chunk(k, mine)
        except _Aborted:
            pass
        except BaseException as e:  # noqa: BLE001 (raised again on the calling thread)
            front.fail(e)
        finally:
            if not mine:
                with front.cond:
                    front.out -= 1
                    front.cond.notify_all()

    def chunk(self, k: int, mine: bool) -> None:
        """Chunk k's layers, each once the previous chunk left it; then `after`, its report queued; on the calling
        thread, the reports run and, once another job wants the model, the segment ends after the chunks begun."""
        front, cache, backbone = self.front, self.cache, self.backbone
        start, stop = self.chunks[k]
        h, ctx = backbone.begin(mx.array(self.tokens[start:stop])[None])  # [1, S, H]
        for i in range(self.layers):
            if k:
                front.wait(k - 1, i, mine)
            c = cache.backbone[i]
            h = backbone.run_layer(i, h, ctx, c)
            mx.eval(h, *c.state)
            if self.views:
                self.at_edge.setdefault(k, []).append(frozen(c))
            front.mark(k, i)
        if k:
            front.wait(k - 1, self.layers, mine)
        report = self.after(k, backbone.end(h))  # the MTP head's pairs: its caches stand at chunk k's edge now
        held = self.at_edge.pop(k, [])
        if report is not None:
            view = ModelCache(held, [frozen(c) for c in cache.mtp]) if self.views else None
            front.report(lambda: report(view))
        front.mark(k, self.layers)
        if mine:
            front.drain()
            if self.pause is not None and self.pause.wanted():
                front.stop()
