"""How `hetero serve` stops on SIGTERM or SIGINT (launchd, systemd, `docker stop`, Ctrl-C).

The first signal stops at once what the server takes in: the listening socket closes, a new generation request is
a 503, and every job generating or waiting ends at its next token or prefill chunk (`Runner.stop`): a stream ends
with an error event in its API's shape, a plain request gets a 503, and the turn's prefix checkpoint is written as
usual (the session cache writes each file under a temporary name and renames it into place, so nothing half-written
is ever read). Whatever still runs `STOP_GRACE_S` seconds after the first signal (a checkpoint still being written,
a prefill step still on the GPU) is cut off by exiting the process then; a second signal exits at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType

import uvicorn

log = logging.getLogger("hetero.server")

STOP_GRACE_S = 4.0  # after the first signal, the most the process lives on (the target is an exit within 5 s)


class StoppingServer(uvicorn.Server):
    """uvicorn's server, stopping as the module says: `stop` is called on the first SIGTERM or SIGINT (the runner's
    `stop`), then uvicorn closes the socket and waits for the responses to end, at most `grace_s` seconds."""

    def __init__(self, config: uvicorn.Config, stop, grace_s: float = STOP_GRACE_S):
        super().__init__(config)
        self._stop, self.grace_s = stop, grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:  # the second signal: nothing more is waited for
            _say(f"hetero: {name} again: exiting now\n")
            os._exit(128 + sig)
        log.info("%s: stopping (no new requests; generations end now; exit within %g s, a second signal exits "
                 "at once)", name, self.grace_s)
        self._stop()
        threading.Thread(target=_exit_after, args=(self.grace_s,), name="hetero-stop", daemon=True).start()
        self.should_exit = True  # uvicorn closes the socket and waits for the open responses to end
        # (uvicorn's own handler would also raise the signal again once served: the process ends with status 0)


def _exit_after(seconds: float) -> None:
    """Exit the process `seconds` from now, whatever still runs then (a worker thread keeps it alive otherwise)."""
    time.sleep(seconds)
    _say(f"hetero: still busy {seconds:g} s after the stop signal: exiting now\n")
    os._exit(1)


def _say(line: str) -> None:
    """Write `line` to stderr if it is still there (a launcher that died may have taken the pipe with it)."""
    try:
        os.write(2, line.encode())
    except OSError:
        pass
