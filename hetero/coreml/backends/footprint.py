"""A process's memory as the OS accounts it now, never a peak.

macOS: `proc_pid_rusage(pid, RUSAGE_INFO_V6, &info)` (libproc) fills a `rusage_info_v6`, whose `ri_phys_footprint`
is the memory the OS charges the process now (what Activity Monitor's "Memory" column shows and what the kernel's
memory limits act on), and `ri_neural_footprint` the memory the Neural Engine wires down on its behalf (macOS 14+).
`getrusage`'s `ru_maxrss` is the lifetime *peak*: useless for what a process holds after it loaded a program.
Before v6 (an older kernel refuses the flavor) v4 gives the footprint alone.

Linux: the resident set from /proc/self/statm (the reference executor expands every program's weights there).

The bytes come from a call (`RusageCall`: flavor -> the struct's bytes) so that the parsing, all of the logic, is
tested anywhere; only `proc_pid_rusage` itself needs a Mac.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

RUSAGE_INFO_V4, RUSAGE_INFO_V6 = 4, 6
UUID_BYTES = 16  # rusage_info_v*: uint8_t ri_uuid[16], then uint64_t fields
PHYS_FOOTPRINT_FIELD = 7  # ri_user_time, ri_system_time, ri_pkg_idle_wkups, ri_interrupt_wkups, ri_pageins,
# ri_wired_size, ri_resident_size, ri_phys_footprint (v0 on)
NEURAL_FOOTPRINT_FIELD = 44  # v6: after ri_secure_ptime_in_system (xnu bsd/sys/resource.h)
BUFFER_BYTES = 1024  # larger than any rusage_info_v* (v6: 16 + 56 x 8 = 464): a newer kernel never overruns it

RusageCall = Callable[[int], bytes | None]  # flavor -> the rusage_info struct's bytes, None when refused


@dataclass(frozen=True)
class Footprint:
    """Bytes a process holds now: `bytes` as the OS charges it (macOS: phys footprint; Linux: resident), and on
    macOS 14+ `neural_bytes`, what the Neural Engine wired down for it (None: this OS does not say)."""

    bytes: int
    neural_bytes: int | None
    source: str  # "phys_footprint" (proc_pid_rusage) or "resident" (/proc)

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "neural_bytes": self.neural_bytes, "source": self.source}


def _field(buf: bytes, index: int) -> int:
    return struct.unpack_from("<Q", buf, UUID_BYTES + 8 * index)[0]


def parse_rusage(buf: bytes, flavor: int) -> Footprint:
    """The footprint in a `rusage_info_v<flavor>` struct's bytes (the neural footprint from v6 on)."""
    neural = _field(buf, NEURAL_FOOTPRINT_FIELD) if flavor >= RUSAGE_INFO_V6 else None
    return Footprint(_field(buf, PHYS_FOOTPRINT_FIELD), neural, "phys_footprint")


def mac_footprint(rusage: RusageCall) -> Footprint | None:
    """This process's footprint from `rusage` (`proc_pid_rusage` for this pid): v6, else v4; None when both fail."""
    for flavor in (RUSAGE_INFO_V6, RUSAGE_INFO_V4):
        buf = rusage(flavor)
        if buf is not None:
            return parse_rusage(buf, flavor)
    return None


def proc_pid_rusage(flavor: int) -> bytes | None:
    """libproc's `proc_pid_rusage(getpid(), flavor, buffer)`: the struct's bytes, None when the kernel refuses the
    flavor. Only a Mac has it."""
    lib = ctypes.CDLL(ctypes.util.find_library("proc") or "/usr/lib/libSystem.B.dylib", use_errno=True)
    buf = ctypes.create_string_buffer(BUFFER_BYTES)
    if lib.proc_pid_rusage(ctypes.c_int(os.getpid()), ctypes.c_int(flavor), buf) != 0:
        return None
    return buf.raw


def linux_resident() -> Footprint | None:
    """This process's resident memory from /proc; None off Linux."""
    try:
        with open("/proc/self/statm") as f:
            return Footprint(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"), None, "resident")
    except OSError:
        return None
