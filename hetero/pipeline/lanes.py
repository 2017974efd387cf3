"""Device lanes on anyio, the job-graph scheduler (each lane runs its ready jobs, oldest chunk first), decode
interleaving, and the Chrome trace with one track per lane."""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time
import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import mlx.core as mx
import numpy as np

from hetero.decode.turns import Turn, lane_job
from hetero.errors import HeteroError


@dataclass
class Trace:
    """Chrome trace events (Perfetto opens the file): one track (tid) per lane, complete ("X") events in us."""

    t0: float = field(default_factory=time.perf_counter)
    events: list[dict] = field(default_factory=list)
    tracks: dict[int, str] = field(default_factory=dict)  # tid -> lane name

    def add(self, lane: str, tid: int, name: str, start: float, end: float, args: dict | None = None) -> None:
        self.events.append({"name": name, "cat": lane, "ph": "X", "pid": 1, "tid": tid,
                            "ts": round((start - self.t0) * 1e6, 3), "dur": round((end - start) * 1e6, 3),
                            "args": args or {}})

    def to_json(self) -> dict:
        meta = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "hetero prefill"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": t, "args": {"name": n}} for t, n in sorted(self.tracks.items())]
        return {"traceEvents": meta + self.events, "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike) -> None:
        try:
            Path(path).write_text(json.dumps(self.to_json()))
        except OSError as e:
            raise HeteroError(f"cannot write the trace to {path}: {e.strerror}") from None


class Lane:
    """One device: jobs run one at a time off the event loop, with busy time and trace events.

    A `dedicated` lane (the MLX one) runs every job on one thread of its own: MLX streams belong to a thread, and
    a lazy array left by one job must never be evaluated on another thread. Call `close` when done.
    """

    def __init__(self, name: str, tid: int, trace: Trace | None = None, dedicated: bool = False):
        self.name, self.tid, self.trace = name, tid, trace
        self.busy_s = 0.0
        self.limiter = anyio.CapacityLimiter(1)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"hetero-{name}") if dedicated else None
        if trace is not None:
            trace.tracks[tid] = name

    def _timed(self, fn: Callable[[], object], label: str) -> object:
        _own_stream()
        start = time.perf_counter()
        try:
            with lane_job(self.name):
                return fn()
        finally:
            end = time.perf_counter()
            self.busy_s += end - start
            if self.trace is not None:
                self.trace.add(self.name, self.tid, label, start, end)

    async def run(self, fn: Callable[[], object], label: str) -> object:
        """Run `fn` off the event loop, one job of this lane at a time."""
        if self.pool is None:
            return await anyio.to_thread.run_sync(self._timed, fn, label, limiter=self.limiter)
        future = self.pool.submit(self._timed, fn, label)
        return await anyio.to_thread.run_sync(future.result, limiter=self.limiter)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


_THREAD = threading.local()


def _own_stream() -> None:
    """Per worker thread, once: its own MLX stream (MLX streams are per thread) and one numpy BLAS thread
    (each lane is one core's worth of work; a 2-thread BLAS call thrashes against the other lane)."""
    if not getattr(_THREAD, "stream", None):
        _THREAD.stream = mx.new_stream(mx.default_device())
        mx.set_default_stream(_THREAD.stream)
        _one_numpy_blas_thread()


def _one_numpy_blas_thread() -> None:
    """numpy's bundled OpenBLAS: one thread for the calling thread only (a no-op where there is none)."""
    import ctypes
    import glob

    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*"))
    try:
        ctypes.CDLL(libs[0]).openblas_set_num_threads_local(1) if libs else None
    except (OSError, AttributeError):  # another BLAS (Accelerate on macOS) or an older OpenBLAS: leave it
        pass


class DecodeQueue:
    """Decode rounds of requests already generating, which the GPU lane interleaves with another prefill.

    Each stream is a callable that runs one decode round (e.g. one MTP draft + verify + commit) and returns False
    once its request is done. Policy: round-robin over streams (no request starves another); the GPU lane runs
    rounds whenever it has no prefill job ready (it would otherwise wait for the ANE), and at least one round
    every `every` prefill jobs even when it has (so decoding never stalls behind a long prefill). Its rounds are
    the GPU lane's jobs (`on_lane`).
    """

    on_lane = True  # each round runs as a job of the GPU lane

    def __init__(self, streams: list[Callable[[], bool]] | None = None, every: int = 4):
        self.streams: list[Callable[[], bool]] = list(streams or [])
        self.every = every
        self.rounds = 0
        self.since = 0  # GPU prefill jobs since the last round
        self._next = 0

    def add(self, stream: Callable[[], bool]) -> None:
        self.streams.append(stream)

    @property
    def pending(self) -> bool:
        return bool(self.streams)

    def run_one(self) -> None:
        """One round of the next stream in turn; a finished stream leaves the queue."""
        i = self._next % len(self.streams)
        if not self.streams[i]():
            self.streams.pop(i)
        else:
            self._next = i + 1
        self.rounds += 1
        self.since = 0


class LentTurn(DecodeQueue):
    """What the split prefill's GPU lane does while the ANE computes its share: it lends its job's turn on the model
    (`hetero.decode.turns.Turn`) to the other jobs (their decode rounds, or their own prefill chunks) instead of
    idling; nothing to do while the job is alone. Lending waits on the turn ring, so it runs between the GPU lane's
    jobs, never as one (`on_lane` False): the lane holds nothing while other jobs use the model. The GPU time the
    split spent since it last lent the turn counts as prefill time (`Turns.pass_turn`)."""

    on_lane = False

    def __init__(self, turn: Turn, every: int = 4):
        super().__init__(every=every)
        self.turn = turn

    @property
    def pending(self) -> bool:
        return self.turn.wanted()

    def run_one(self) -> None:
        self.turn(prefilling=True)
        self.rounds += 1
        self.since = 0


@dataclass(eq=False)
class Job:
    """One unit of prefill work for one lane ("gpu" or "ane"), runnable once every job in `after` has run.

    Among a lane's ready jobs the lowest `rank` runs first: (chunk, layer, step), so the oldest chunk in flight
    moves on and the other lane gets its next job as early as possible.
    """

    label: str
    lane: str
    fn: Callable[[], object]
    after: tuple["Job", ...] = ()
    rank: tuple = ()


async def run_jobs(jobs: Iterable[Job], gpu: Lane, ane: Lane, decode: DecodeQueue | None = None) -> None:
    """Run a job graph on two lanes: each lane takes its ready jobs one at a time, lowest rank first, while the
    other lane runs its own (a wavefront, not lock-step stages). The GPU lane fills its idle time with decode
    rounds from `decode`. The first exception of any job stops both lanes and is raised here."""
    jobs = list(jobs)
    waiting = {job: len(job.after) for job in jobs}
    dependents: dict[Job, list[Job]] = {job: [] for job in jobs}
    for job in jobs:
        for dep in job.after:
            dependents[dep].append(job)
    left = {"gpu": sum(j.lane == "gpu" for j in jobs), "ane": sum(j.lane == "ane" for j in jobs)}
    ready: dict[str, list] = {"gpu": [], "ane": []}  # heaps of (rank, sequence, job)
    seq = iter(range(len(jobs)))
    for job in jobs:
        if not job.after:
            heapq.heappush(ready[job.lane], (job.rank, next(seq), job))
    state = {"changed": anyio.Event(), "error": None, "running": 0}

    def notify() -> None:
        state["changed"].set()
        state["changed"] = anyio.Event()

    def done(job: Job) -> None:
        left[job.lane] -= 1
        for nxt in dependents.pop(job):
            waiting[nxt] -= 1
            if not waiting[nxt]:
                heapq.heappush(ready[nxt.lane], (nxt.rank, next(seq), nxt))
        notify()

    async def drive(name: str, lane: Lane) -> None:
        fill = decode if name == "gpu" else None
        while left[name] and state["error"] is None:
            if fill is not None and fill.pending and (fill.since >= fill.every or not ready[name]):
                if fill.on_lane:
                    await lane.run(fill.run_one, "decode round")
                else:  # it waits on the turn ring: between the lane's jobs, on a thread that holds no lane
                    await anyio.to_thread.run_sync(fill.run_one)
                continue
            if not ready[name]:
                if not state["running"] and not any(ready.values()):  # nothing can ever become ready
                    state["error"] = RuntimeError("the prefill job graph has a cycle")
                    notify()
                    return
                await state["changed"].wait()
                continue
            job = heapq.heappop(ready[name])[2]
            state["running"] += 1
            try:
                await lane.run(job.fn, job.label)
            except BaseException as e:  # noqa: BLE001  (re-raised by run_jobs once both lanes have stopped)
                state["error"] = state["error"] or e
                notify()
                return
            finally:
                state["running"] -= 1
            if fill is not None:
                fill.since += 1
            done(job)

    async with anyio.create_task_group() as tg:
        tg.start_soon(drive, "gpu", gpu)
        tg.start_soon(drive, "ane", ane)
    if state["error"] is not None:
        raise state["error"]
