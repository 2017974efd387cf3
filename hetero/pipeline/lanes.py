"""Device lanes on anyio, the stage driver (both lanes at once, merge on the GPU lane), decode interleaving,
and the Chrome trace with one track per lane."""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import mlx.core as mx
import numpy as np

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


@dataclass
class Stage:
    """One synchronisation step: prep (GPU lane), GPU share and ANE share at once, merge (GPU lane)."""

    label: str
    gpu: Callable[[], object] | None = None
    ane: Callable[[], object] | None = None
    merge: Callable[[object, object], None] | None = None
    prep: Callable[[], None] | None = None


class DecodeQueue:
    """Decode rounds of requests already generating, which the GPU lane interleaves with another prefill.

    Each stream is a callable that runs one decode round (e.g. one MTP draft + verify + commit) and returns False
    once its request is done. Policy: round-robin over streams (no request starves another); the GPU lane runs
    rounds while the ANE is still busy with its share of a stage, and at least one round every `every` stages
    even when it is not (so decoding never stalls behind a long prefill).
    """

    def __init__(self, streams: list[Callable[[], bool]] | None = None, every: int = 4):
        self.streams: list[Callable[[], bool]] = list(streams or [])
        self.every = every
        self.rounds = 0
        self.since = 0  # stages since the last round
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


async def run_stages(stages: Iterator[Stage], gpu: Lane, ane: Lane, decode: DecodeQueue | None = None) -> None:
    """Drive stages one after another; within a stage both lanes work at the same time, and the GPU lane fills
    its wait for the ANE with decode rounds from `decode`."""
    for st in stages:
        if decode is not None and decode.pending and decode.since >= decode.every:
            await gpu.run(decode.run_one, "decode round")
        if st.prep is not None:
            await gpu.run(st.prep, f"{st.label} prep")
        results: dict[str, object] = {}
        ane_done = anyio.Event()

        async def on_gpu() -> None:
            if st.gpu is not None:
                results["gpu"] = await gpu.run(st.gpu, st.label)
            while decode is not None and decode.pending and st.ane is not None and not ane_done.is_set():
                await gpu.run(decode.run_one, "decode round")

        async def on_ane() -> None:
            try:
                results["ane"] = await ane.run(st.ane, st.label)
            finally:
                ane_done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(on_gpu)
            if st.ane is not None:
                tg.start_soon(on_ane)
        if decode is not None:
            decode.since += 1
        if st.merge is not None:
            await gpu.run(lambda: st.merge(results.get("gpu"), results.get("ane")), f"{st.label} merge")
