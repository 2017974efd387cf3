"""How busy the rest of the machine was while a benchmark measured: the load average, and the cores other processes
used over a window (the machine's busy time from /proc/stat less this process's own and its waited-for children's).
A timing taken while others kept a core busy is a shared machine's, and the JSON says so."""

from __future__ import annotations

import os
import time


def _busy_jiffies() -> int | None:
    try:
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(cpu) - cpu[3] - (cpu[4] if len(cpu) > 4 else 0)  # all but idle and iowait


class LoadWindow:
    """`with LoadWindow() as w: ...`; then `w.result`: {"load_1min": [start, end], "others_cores": mean cores the
    other processes kept busy (None where /proc/stat is missing)}."""

    def __enter__(self) -> "LoadWindow":
        self.t0, self.load0, self.busy0, self.own0 = time.perf_counter(), os.getloadavg()[0], _busy_jiffies(), _own()
        return self

    def __exit__(self, *exc) -> None:
        wall, busy, own = time.perf_counter() - self.t0, _busy_jiffies(), _own()
        others = None
        if busy is not None and self.busy0 is not None and wall > 0:
            tick = os.sysconf("SC_CLK_TCK")
            others = max(0.0, ((busy - self.busy0) / tick - (own - self.own0)) / wall)
        self.result = {"load_1min": [round(self.load0, 2), round(os.getloadavg()[0], 2)],
                       "others_cores": None if others is None else round(others, 3)}


def others_now(window_s: float = 1.0) -> float | None:
    """The cores other processes keep busy, over the next `window_s` seconds (this process idle meanwhile)."""
    with LoadWindow() as w:
        time.sleep(window_s)
    return w.result["others_cores"]


def wait_quiet(most: float = 0.25, timeout_s: float = 300.0, window_s: float = 1.0) -> float:
    """Wait (up to `timeout_s`) until other processes keep at most `most` of a core busy; the seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        others = others_now(window_s)
        if others is None or others <= most:
            break
    return time.perf_counter() - start


def _own() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def shared(windows: list[dict]) -> bool:
    """Whether others kept more than a fifth of a core busy on average over these windows."""
    seen = [w["others_cores"] for w in windows if w.get("others_cores") is not None]
    return bool(seen) and sum(seen) / len(seen) > 0.2
