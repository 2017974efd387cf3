"""A deadline kept by a separate tiny process, so that a rank stuck inside MLX still ends with a clear message.

`mx.distributed.init` holds the GIL while it waits for its peers (a thread's timer never fires), and a recv from
a peer that hangs (stopped, not dead) blocks in C++. A dead peer's socket closes and MLX raises "[ring] connection
to a peer was lost" (after some retries), unless `mlx.launch`, which stops every rank when one fails, sends its
SIGTERM first. The watchdog covers all of it: armed with a timeout and a message, it expects a `pet()` at least
every timeout seconds, and when none comes it prints the message (one line, on the rank's stderr, which it shares)
and kills the rank with SIGKILL; a SIGTERM reaches it through Python's signal wakeup fd even while the rank waits
inside MLX, and it reports that the same way. It exits by itself when the rank does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

# Runs in the child: reads "arm <seconds> <message>", "pet", "off" lines from stdin; EOF means the rank is gone.
_CHILD = r"""
import os, select, signal, sys, time
parent, deadline, timeout, message, on_term = int(sys.argv[1]), None, 0.0, "", ""
buf = b""

def end(text):
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
    try:
        os.kill(parent, signal.SIGKILL)
    except ProcessLookupError:
        pass
    sys.exit(0)

while True:
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    ready, _, _ = select.select([0], [], [], wait)
    if not ready:
        end(message)
    data = os.read(0, 65536)
    if not data:
        sys.exit(0)
    if bytes([signal.SIGTERM]) in data and on_term:  # the rank's signal wakeup byte: it was told to stop
        end(on_term)
    buf += bytes(b for b in data if b >= 32 or b == 10)
    while b"\n" in buf:
        line, buf = buf.split(b"\n", 1)
        cmd, _, rest = line.decode().partition(" ")
        if cmd == "arm":
            seconds, _, message = rest.partition(" ")
            timeout = float(seconds)
            deadline = time.monotonic() + timeout
        elif cmd == "pet" and deadline is not None:
            deadline = time.monotonic() + timeout
        elif cmd == "off":
            deadline = None
        elif cmd == "term":
            on_term = rest
"""


class Watchdog:
    """Kills this process with a one-line message when an armed deadline passes without a `pet()`."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _CHILD, str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            close_fds=True,
        )
        self.armed = False
        self._relaying = False

    def _say(self, line: str) -> None:
        try:
            os.write(self._proc.stdin.fileno(), (line + "\n").encode())
        except (OSError, ValueError):  # the watchdog is gone (closed): nothing to guard with
            pass

    def on_terminate(self, message: str) -> None:
        """A SIGTERM (mlx.launch stops every rank when one fails) ends this process with `message`, even while it
        waits inside MLX: Python writes the signal's number to the wakeup fd, the watchdog's pipe, at once."""
        self._say(f"term {' '.join(message.split())}")
        os.set_blocking(self._proc.stdin.fileno(), False)  # set_wakeup_fd needs it; lines are small
        signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the watchdog ends the process, with the message
        signal.set_wakeup_fd(self._proc.stdin.fileno())
        self._relaying = True

    def leave_terminate(self) -> None:
        """SIGTERM is this process's own again: a server stops on it the graceful way, within its own grace
        (`hetero.server.stopping`), so its clients get a final event instead of a killed socket."""
        if self._relaying:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._relaying = False

    def arm(self, seconds: float, message: str) -> None:
        """From now on, `seconds` without a `pet()` end this process with `message` (one line)."""
        self._say(f"arm {seconds} {' '.join(message.split())}")
        self.armed = True

    def pet(self) -> None:
        """Progress: the deadline moves to `seconds` from now (no-op while disarmed)."""
        if self.armed:
            self._say("pet")

    def disarm(self) -> None:
        self._say("off")
        self.armed = False

    def close(self) -> None:
        """Stop guarding. A SIGTERM from here on is ignored, not fatal: the rank is finishing, and the one that
        closes on a failure must still print its error line (mlx.launch's SIGTERM raced it and killed it silently)."""
        if self._relaying:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self._relaying = False
        if self._proc.stdin and not self._proc.stdin.closed:
            self._proc.stdin.close()
        self._proc.wait()
