"""The ANE lane's worker process: it loads exported programs with the platform's backend and runs jobs whose arrays
travel through shared memory.

Why a process: Core ML's Python binding (`CompiledMLModel.predict`, apple/coremltools `CoreMLPython.mm`) keeps the
GIL for the whole prediction, so in the engine's process the GPU lane's Python would wait for every ANE call. Here
the engine's ANE lane thread only waits on a socket (which releases the GIL) while this process computes.

Protocol (`multiprocessing.connection` messages over a socket inherited as a file descriptor; every reply is a
tuple whose first item says what it is):
    ("load", path, function)          -> ("loaded", program id, seconds)
    ("arena", "in" | "out", name)     -> ("ok",)             attach a shared-memory arena the engine created
    ("run", id, layout)               -> ("done", layout, compute seconds, copy seconds)  outputs in the out arena
                                      or ("garbage", output name) when an output holds NaN or inf
                                      or ("grow", bytes) when they do not fit: the engine sends a larger "out"
                                         arena, then this process copies the held outputs and answers "done"
    ("check", id, layout, timed)      -> ("checked", findings)  the doctor's checks of a program on these inputs
                                         (`hetero.coreml.backends.diagnose`; `timed`: CPU_AND_NE against CPU_ONLY)
    ("stat",)                         -> ("stat", {"bytes", "neural_bytes", "source"} now, or None where the OS does
                                         not say: `coreml_macos.memory_now`, the footprint on macOS)
    ("stop",)                         -> (no reply; the process exits)
A failure answers ("error", one line). A layout is a list of (name, dtype, shape, byte offset) into an arena.

Both arenas belong to the engine: it creates, grows and unlinks them, so a worker that dies leaks nothing, and the
input arrays Core ML reads stay mapped for this process's whole life however late Core ML releases them.

Run as `python -m hetero.coreml.backends.ane_worker FD [MODULE:LOADER]`; the optional loader (a callable
`(path, function) -> program`) replaces the platform's, which is how tests stand in for Core ML's `predict`;
without it, $HETERO_ANE_LOADER (same form) does, so a test can fault the worker of a `hetero run` subprocess.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
import time
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np

from hetero.coreml.backends import platform_backend
from hetero.coreml.backends.coreml_macos import memory_now
from hetero.coreml.backends.arena import attach, pack, packed_bytes, views

# Packages coremltools imports for converters this process never runs (torch alone is ~300 MB and 2 s to import).
UNUSED_BY_THE_WORKER = ("torch", "torchvision", "tensorflow", "transformers", "sklearn", "xgboost", "libsvm")


def _call(loader, path: Path, function: str | None):
    """A loader that names no function takes the path alone (single-function packages)."""
    return loader(path) if function is None else loader(path, function)


def _replace(arenas: dict[str, SharedMemory], retired: list[SharedMemory], role: str, name: str) -> None:
    """Attach the new arena for `role`; the old one is closed, or kept mapped while views of it live (a backend
    that holds its inputs past the call: Core ML may release them late)."""
    old, arenas[role] = arenas.get(role), attach(name)
    if old is not None:
        retired.append(old)
    for shm in list(retired):
        try:
            shm.close()
            retired.remove(shm)
        except BufferError:  # exported views remain
            pass


def serve(conn: Connection, loader) -> None:
    """Answer the engine's messages until it says stop or goes away."""
    programs: list = []
    sources: list[tuple[Path, str | None]] = []  # each program's (package, function)
    arenas: dict[str, SharedMemory] = {}
    retired: list[SharedMemory] = []  # replaced arenas a program may still hold views of
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the engine is gone
            return
        kind = msg[0]
        if kind == "stop":
            return
        try:
            if kind == "load":
                start = time.perf_counter()
                programs.append(_call(loader, Path(msg[1]), msg[2]))
                sources.append((Path(msg[1]), msg[2]))
                conn.send(("loaded", len(programs) - 1, time.perf_counter() - start))
            elif kind == "arena":
                _replace(arenas, retired, msg[1], msg[2])
                conn.send(("ok",))
            elif kind == "run":
                start = time.perf_counter()
                out = programs[msg[1]](views(msg[2], arenas["in"].buf))
                computed = time.perf_counter()
                bad = next((k for k, a in out.items() if a.dtype.kind == "f" and not np.isfinite(a).all()), None)
                if bad is not None:  # checked here, on the lane's own core: the engine's process never scans them
                    conn.send(("garbage", bad))
                    continue
                need = packed_bytes(out)
                if "out" not in arenas or arenas["out"].size < need:
                    conn.send(("grow", need))
                    _, role, name = conn.recv()  # ("arena", "out", name)
                    _replace(arenas, retired, role, name)
                layout = pack(out, arenas["out"].buf)
                del out  # the job's arrays go when it returns, not at the next job
                conn.send(("done", layout, computed - start, time.perf_counter() - computed))
            elif kind == "check":  # the doctor's: imported only when a doctor asks
                from hetero.coreml.backends.diagnose import diagnose

                found = diagnose(programs[msg[1]], *sources[msg[1]], views(msg[2], arenas["in"].buf), *msg[3:])
                conn.send(("checked", found))
            elif kind == "stat":
                found = memory_now()
                conn.send(("stat", None if found is None else found.to_dict()))
            else:
                conn.send(("error", f"unknown message {kind!r}"))
        except (EOFError, OSError):
            return
        except Exception as e:  # noqa: BLE001  (the engine decides what a failed job means; this process goes on)
            text = str(e).strip().splitlines()
            conn.send(("error", f"{type(e).__name__}: {text[0] if text else ''}"))


# glibc's mallopt parameters (malloc.h): keep freed memory for the next job instead of returning it to the kernel
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep the memory a job frees for the next job (False where there is no glibc).

    The reference executor allocates every op's output afresh. A fresh process's malloc maps each temporary above
    128 KB anew and returns it when freed, so every job touched fresh pages again: 3,552 minor page faults per call
    of bench/ttft.py's MLP program, 71 ms against 58 ms without them (bench/lane_job.py). The engine's own process
    had long since raised glibc's adaptive thresholds, which is why the in-thread lane did not pay this. Up to
    32 MB a temporary now comes from the heap, and the heap keeps what is freed (the worker's resident memory then
    holds its largest job's temporaries, which its reported memory counts)."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # macOS has no mallopt: Core ML allocates its own buffers there
        return False
    trim = 2**31 - 1  # mallopt takes a C int: 2 GB, never reached
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, trim))


def main(argv: list[str]) -> None:
    keep_freed_memory()
    for name in UNUSED_BY_THE_WORKER:
        sys.modules.setdefault(name, None)  # an import of these fails fast: coremltools then skips its converters
    conn = Connection(int(argv[0]))
    spec = argv[1] if len(argv) > 1 else os.environ.get("HETERO_ANE_LOADER")
    if spec:
        module, _, attr = spec.partition(":")
        loader = getattr(importlib.import_module(module), attr)
    else:
        loader = platform_backend()[1]
    conn.send(("ready", os.getpid()))
    serve(conn, loader)


if __name__ == "__main__":
    main(sys.argv[1:])
