"""`hetero serve` when `mlx.launch` started it on more than one rank: rank 0 serves HTTP (OpenAI and Anthropic
APIs, `hetero.server`) on a `PipelineEngine`, the other ranks serve rank 0.

The pipeline takes one request at a time: the server runs with one worker (requests wait in line). A request whose
client leaves, or that a stop string ends, ends on every rank at the next commit (`PipelineEngine.stream`, stopped
by the runner), with the ranks in step for the next one. What has no pipelined form is refused at startup: the ANE
split, batched decoding and the disk session cache (each rank's prefix cache lives in RAM).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time

from hetero.caches.prefix import PrefixCache
from hetero.distributed.command import pipelined
from hetero.distributed.runtime import PipelineEngine
from hetero.errors import HeteroError
from hetero.server.app import ServerSettings, create_app, listen, run_app


def serve_pipelined(settings: ServerSettings) -> int | None:
    """Serve `hetero serve`'s settings across the ranks until rank 0 is interrupted; None when the group has one
    rank (the caller serves in-process)."""
    refused = [flag for flag, on in (("--ane-fraction", not settings.ane.gpu_only),
                                     ("--max-batch above 1", settings.max_batch > 1),
                                     ("--session-cache", settings.session_cache is not None),
                                     ("--kv-bits", settings.kv_bits is not None)) if on]
    if refused:
        raise HeteroError(f"{', '.join(refused)}: not available when serving across ranks (mlx.launch); leave "
                          f"{'it' if len(refused) == 1 else 'them'} out (each rank keeps its prefix cache in RAM)")
    if os.environ.get("MLX_RANK", "0") != "0":  # Ctrl-C in the terminal, or a service manager's SIGTERM to every
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # process: rank 0 stops, then tells us
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        stop_when_orphaned()
    return pipelined(settings.model, settings.dist_timeout, lambda engine: _serve(engine, settings))


def stop_when_orphaned(interval_s: float = 0.2) -> None:
    """Stop as on SIGTERM once the launcher is gone. `mlx.launch` dies of a SIGTERM without passing it on (`docker
    stop`, `kill PID`, a service manager that signals only its main process), which left every rank serving on."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGTERM)  # first: the launcher held our stderr, which may be gone with it

    threading.Thread(target=watch, name="hetero-launcher-watch", daemon=True).start()


def _serve(engine: PipelineEngine, settings: ServerSettings) -> int:
    """Rank 0: the HTTP server on the pipelined engine, one request at a time."""

    s = dataclasses.replace(settings, max_concurrent=1)  # the pipeline takes one request at a time
    engine.stage.link.watchdog.leave_terminate()  # an operator's SIGTERM stops the server as in one process
    sock = listen(s.host, s.port, s.api_key)
    try:
        engine.prefix_cache = PrefixCache(int(s.prefix_cache_max_gb * 1024**3))
        app = create_app(engine, s)
    except BaseException:
        sock.close()
        raise
    names = {engine.name} | s.model_names
    share = engine.stage.share.layers
    print(f"[hetero rank 0/{engine.stage.link.size} pid {os.getpid()}: layers {share.start}..{share.stop - 1}, "
          "serving HTTP]", file=sys.stderr, flush=True)
    run_app(app, sock, f"serving {sorted(names)} on http://{s.host}:{s.port} (pipelined across "
                       f"{engine.stage.link.size} ranks, one request at a time; no session cache)")
    return 0
