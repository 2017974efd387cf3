"""The engine's side of the ANE lane's worker process (`hetero.coreml.backends.ane_worker`, whose docstring has the
protocol): it starts the worker (a fresh interpreter, never a fork of this one), loads programs into it and runs
them, with the arrays in two shared-memory arenas this side owns.

A job costs one copy in (the inputs packed into the input arena) and none out (the outputs are views of the output
arena). While the worker computes, the ANE lane's thread here waits on a socket, which releases the GIL, so the GPU
lane's Python runs meanwhile. A worker that dies, answers nothing within its timeout or returns non-finite values is
killed and `AneLaneLost` raised; the engine then prefills that request GPU-only and the next one gets a new worker.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np

from hetero.coreml.backends.arena import pack, packed_bytes, views
from hetero.errors import AneLaneLost, AneNonFinite
from hetero.pipeline.lanes import Trace

JOB_TIMEOUT_S = 120.0  # one program call; the slowest seen here is well under a second
LOAD_TIMEOUT_S = 900.0  # loading (on a Mac: compiling) one program
START_TIMEOUT_S = 120.0  # the interpreter, numpy and coremltools
ARENA_STEP = 1 << 20  # arenas grow in whole MiB, by at least a quarter, so a few jobs settle their size


@dataclass
class LaneStats:
    """Totals over a worker's jobs: `ipc_s` is what crossing the process boundary cost (packing the inputs, then
    the round trip less the worker's compute)."""

    calls: int = 0
    copy_in_s: float = 0.0
    round_trip_s: float = 0.0
    compute_s: float = 0.0

    @property
    def ipc_s(self) -> float:
        return self.copy_in_s + self.round_trip_s - self.compute_s

    def since(self, before: "LaneStats") -> "LaneStats":
        return LaneStats(self.calls - before.calls, self.copy_in_s - before.copy_in_s,
                         self.round_trip_s - before.round_trip_s, self.compute_s - before.compute_s)


class AneProcess:
    """One worker process and its arenas. Thread-safe; jobs run one at a time.

    `loader` ("module:callable", taking (path, function)) replaces the platform's backend in the worker: tests use
    it to stand in for Core ML. `timeout_s` bounds every job.
    """

    def __init__(self, loader: str | None = None, timeout_s: float = JOB_TIMEOUT_S):
        self.timeout_s = timeout_s
        self.lost: str | None = None
        self.unreported = False  # lost by a background load: the next `check_alive` reports it
        self.stats = LaneStats()
        self.trace: Trace | None = None  # set for a traced prefill: one event per job on its own track
        self._lock = threading.Lock()
        self._ids: dict[tuple[str, str | None], int] = {}
        self._arenas: dict[str, SharedMemory] = {}
        self._retired: list[SharedMemory] = []  # replaced output arenas whose views are still held
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])  # the worker imports this checkout's hetero
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # one lane is one core's worth of work
        cmd = [sys.executable, "-m", "hetero.coreml.backends.ane_worker", str(theirs.fileno()), *([loader] if loader else [])]
        # its stdout is a pipe of its own (Core ML's compiler may print there: never into the user's `--json`),
        # relayed line by line to this process's stderr
        self.proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, env=env)
        threading.Thread(target=_relay, args=(self.proc.stdout,), daemon=True, name="ANE worker stdout").start()
        theirs.close()
        self._conn = Connection(ours.detach())
        self.pid = self._reply(START_TIMEOUT_S, "starting")[1]
        _LIVE.add(self)

    # -- programs and jobs --------------------------------------------------------------------------------------

    def load(self, path: str | os.PathLike, function: str | None = None) -> "Program":
        """A program loaded in the worker (once per path and function), called like an in-process one."""
        key = (str(Path(path).resolve()), function)
        with self._lock:
            self._check()
            if key not in self._ids:
                self._send(("load", *key), f"loading {Path(path).name}")
                self._ids[key] = self._reply(LOAD_TIMEOUT_S, f"loading {Path(path).name}")[1]
        return Program(self, key)

    def run(self, key: tuple[str, str | None], inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One job: the outputs as read-only views of the output arena, valid until the worker's next job."""
        name = Path(key[0]).name
        with self._lock:
            self._check()
            start = time.perf_counter()
            self._ensure("in", packed_bytes(inputs))
            layout = pack(inputs, self._arenas["in"].buf)
            sent = time.perf_counter()
            self._send(("run", self._ids[key], layout), f"a job of {name}")
            msg = self._reply(self.timeout_s, f"a job of {name}")
            if msg[0] == "grow":  # the worker holds the outputs until it has a large enough arena
                self._ensure("out", msg[1], tell=False)
                self._send(("arena", "out", self._arenas["out"].name), f"a job of {name}")
                msg = self._reply(self.timeout_s, f"a job of {name}")
            if msg[0] == "garbage":
                self._lose(f"returned non-finite values in {msg[1]!r} of {name}", AneNonFinite)
            _, out_layout, compute_s, copy_s = msg
            outputs = views(out_layout, self._arenas["out"].buf)
            done = time.perf_counter()
            s = self.stats
            s.calls, s.copy_in_s = s.calls + 1, s.copy_in_s + (sent - start)
            s.round_trip_s, s.compute_s = s.round_trip_s + (done - sent), s.compute_s + compute_s
            if self.trace is not None:
                self.trace.tracks.setdefault(TRACK, f"ANE worker (pid {self.pid})")
                ipc = (sent - start) + (done - sent) - compute_s
                self.trace.add("ANE worker", TRACK, name, sent, done,
                               {"compute_ms": round(compute_s * 1e3, 3), "ipc_ms": round(ipc * 1e3, 3),
                                "copy_in_ms": round((sent - start) * 1e3, 3), "copy_out_ms": round(copy_s * 1e3, 3)})
            return outputs

    def diagnose(self, key: tuple[str, str | None], inputs: dict[str, np.ndarray], timed: bool = True) -> dict:
        """The doctor's checks of a loaded program, run in the worker on `inputs` (`hetero.coreml.backends.diagnose`;
        `timed`: also CPU_AND_NE against CPU_ONLY, where Core ML runs it)."""
        name = Path(key[0]).name
        with self._lock:
            self._check()
            self._ensure("in", packed_bytes(inputs))
            layout = pack(inputs, self._arenas["in"].buf)
            self._send(("check", self._ids[key], layout, timed), f"checking {name}")
            return self._reply(LOAD_TIMEOUT_S, f"checking {name}")[1]

    def memory(self) -> dict | None:
        """The worker's memory now (`coreml_macos.memory_now`): `bytes` as the OS charges it (macOS: its footprint
        from proc_pid_rusage; Linux: resident), `neural_bytes` (macOS 14+: what the Neural Engine wired for it) and
        `source`; None where the OS says nothing."""
        with self._lock:
            self._check()
            self._send(("stat",), "a memory query")
            return self._reply(self.timeout_s, "a memory query")[1]

    def resident_bytes(self) -> int | None:
        """What the worker holds now: its footprint (or resident set) plus what the Neural Engine wired for it."""
        found = self.memory()
        return None if found is None else int(found["bytes"] + (found["neural_bytes"] or 0))

    # -- arenas, replies, failure -------------------------------------------------------------------------------

    def _ensure(self, role: str, need: int, tell: bool = True) -> None:
        """An arena for `role` of at least `need` bytes; a new one replaces (and unlinks) the old."""
        old = self._arenas.get(role)
        if old is not None and old.size >= need:
            return
        size = max(need + need // 4, ARENA_STEP)
        self._arenas[role] = SharedMemory(create=True, size=-(-size // ARENA_STEP) * ARENA_STEP)
        if tell:
            self._send(("arena", role, self._arenas[role].name), "attaching an arena")
            self._reply(self.timeout_s, "attaching an arena")
        if old is not None:
            self._retire(old)

    def _retire(self, shm: SharedMemory) -> None:
        shm.unlink()  # the name goes now; the pages once nothing maps them
        self._retired.append(shm)
        for s in list(self._retired):
            try:
                s.close()
                self._retired.remove(s)
            except BufferError:  # a caller still holds views of an old output arena
                pass

    def _send(self, msg: tuple, what: str) -> None:
        """Send to the worker; a worker gone meanwhile (a broken pipe or reset socket) is a lost worker, never an
        OSError for the caller (the CLI would take a BrokenPipeError for its own stdout's reader going away)."""
        try:
            self._conn.send(msg)
        except OSError:
            self.proc.wait()
            self._lose(f"exited (status {self.proc.returncode}) while {what}")

    def _reply(self, timeout: float, what: str) -> tuple:
        try:
            if not self._conn.poll(timeout):
                self._lose(f"answered nothing within {timeout:g} s while {what}")
            msg = self._conn.recv()
        except (EOFError, OSError):
            self.proc.wait()
            self._lose(f"exited (status {self.proc.returncode}) while {what}")
        if msg[0] == "error":
            self._lose(f"failed while {what}: {msg[1]}")
        return msg

    def _check(self) -> None:
        if self.lost is not None:
            self.unreported = False  # the caller meets the loss now, and reports it
            raise AneLaneLost(f"the ANE lane's worker (pid {self.pid}) {self.lost}")
        if self.proc.poll() is not None:  # died while idle: found before anything is sent to it
            self._lose(f"exited (status {self.proc.returncode}) between jobs")

    def check_alive(self) -> None:
        """Raise `AneLaneLost` if the worker died since its last job (once: then it counts as lost), or if a
        background load (a context bucket warming) lost it and nobody has reported that yet."""
        with self._lock:
            if self.unreported:
                self.unreported = False
                raise AneLaneLost(f"the ANE lane's worker (pid {self.pid}) was lost between jobs: it {self.lost} "
                                  "(a background load found it)")
            if self.lost is None:
                self._check()

    def lost_in_background(self) -> None:
        """Mark this worker's loss, met by a background load that cannot report it, for `check_alive` to report."""
        self.unreported = self.lost is not None

    def _lose(self, reason: str, kind: type[AneLaneLost] = AneLaneLost) -> None:
        self.lost = reason
        self._shut(kill=True)
        lost = kind(f"the ANE lane's worker (pid {getattr(self, 'pid', self.proc.pid)}) {reason}")
        lost.lane = self  # whoever meets it in the background hands it back (`lost_in_background`)
        raise lost

    def _shut(self, kill: bool) -> None:
        _LIVE.discard(self)
        if self.proc.poll() is None:
            if not kill:
                try:
                    self._conn.send(("stop",))
                    self.proc.wait(timeout=5)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._conn.close()
        for shm in list(self._arenas.values()):
            self._retire(shm)
        self._arenas.clear()

    def close(self) -> None:
        """Stop the worker and free the arenas (views still held keep their pages until they go)."""
        with self._lock:
            if self.lost is None:
                self.lost = "was closed"
                self._shut(kill=False)

    @property
    def alive(self) -> bool:
        return self.lost is None and self.proc.poll() is None


class Program:
    """A program in the worker: `program(inputs)` -> outputs (read-only views valid until the worker's next job:
    copy what is kept)."""

    def __init__(self, lane: AneProcess, key: tuple[str, str | None]):
        self.lane, self.key = lane, key

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.lane.run(self.key, inputs)


def _relay(stream) -> None:
    """Copy a worker's stdout to this process's stderr, each line marked as the worker's, until it closes."""
    with stream:
        for line in stream:
            text = line.decode(errors="replace").rstrip()
            if text:
                print(f"ANE worker: {text}", file=sys.stderr, flush=True)


TRACK = 3  # the worker's track in a trace, beside the GPU (1) and ANE (2) lanes
_LIVE: set[AneProcess] = set()
_SHARED: dict[str | None, AneProcess] = {}
_SHARED_LOCK = threading.Lock()


def shared_worker(loader: str | None = None, timeout_s: float = JOB_TIMEOUT_S) -> AneProcess:
    """This process's worker for `loader` (None: the platform's backend), started anew when there is none or the
    last one was lost; engines share it, and a program loaded once serves them all. Its jobs time out after
    `timeout_s` from now on."""
    with _SHARED_LOCK:
        current = _SHARED.get(loader)
        if current is None or not current.alive:
            _SHARED[loader] = current = AneProcess(loader, timeout_s)
        current.timeout_s = timeout_s
        return current


@atexit.register
def stop_workers() -> None:
    """Stop every worker this process started (at exit; an embedding application may call it sooner)."""
    for lane in list(_LIVE):
        lane.close()
