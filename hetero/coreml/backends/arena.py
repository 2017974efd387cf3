"""Shared-memory arenas of the ANE lane's worker protocol (`hetero.coreml.backends.ane_worker`): arrays packed side by
side into a segment, described by a layout of (name, dtype, shape, byte offset), and read back as views."""

from __future__ import annotations

from multiprocessing.shared_memory import SharedMemory

import numpy as np

ALIGN = 64  # bytes: every array in an arena starts on a cache line


def packed_bytes(arrays: dict[str, np.ndarray]) -> int:
    """Bytes an arena needs to hold `arrays` side by side, each aligned."""
    return sum(-(-a.nbytes // ALIGN) * ALIGN for a in arrays.values())


def pack(arrays: dict[str, np.ndarray], buf: memoryview) -> list[tuple]:
    """Copy `arrays` into `buf` (one copy each); returns their layout."""
    layout, offset = [], 0
    for name, a in arrays.items():
        a = np.asarray(a)
        np.copyto(np.ndarray(a.shape, a.dtype, buf, offset), a)
        layout.append((name, a.dtype.str, a.shape, offset))
        offset += -(-a.nbytes // ALIGN) * ALIGN
    return layout


def views(layout: list[tuple], buf: memoryview, writable: bool = False) -> dict[str, np.ndarray]:
    """The arrays a layout places in `buf`, as views (no copy)."""
    out = {}
    for name, dtype, shape, offset in layout:
        a = np.ndarray(tuple(shape), np.dtype(dtype), buf, offset)
        a.flags.writeable = writable
        out[name] = a
    return out


def attach(name: str) -> SharedMemory:
    """An engine-owned segment, attached without registering it with this process's resource tracker (which
    would unlink it, or warn of a leak, when this process exits: the engine unlinks its own)."""
    try:
        return SharedMemory(name, track=False)  # Python 3.13+
    except TypeError:
        from multiprocessing import resource_tracker

        shm = SharedMemory(name)
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001  (3.11/3.12 have no track=False)
        return shm

