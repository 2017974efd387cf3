"""`hetero serve` when `mlx.launch` started it on more than one rank: rank 0 serves HTTP (OpenAI and Anthropic
APIs, `hetero.server`) on a `PipelineEngine`, the other ranks serve rank 0.

The pipeline takes one request at a time: the server runs with one worker (requests wait in line). A request whose
client leaves, or that a stop string ends, ends on every rank at the next commit (`PipelineEngine.generate`'s
`should_stop`), with the ranks in step for the next one. What has no pipelined form is refused at startup: the ANE
split, batched decoding and the disk session cache (each rank's prefix cache lives in RAM).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from hetero.distributed.command import pipelined
from hetero.distributed.runtime import PipelineEngine
from hetero.errors import HeteroError


def serve_pipelined(args: argparse.Namespace) -> int | None:
    """Serve `hetero serve`'s arguments across the ranks until rank 0 is interrupted; None when the group has one
    rank (the caller serves in-process)."""
    refused = [flag for flag, on in (("--ane-fraction", args.ane_fraction is not None),
                                     ("--max-batch above 1", args.max_batch > 1),
                                     ("--session-cache", args.session_cache is not None)) if on]
    if refused:
        raise HeteroError(f"{', '.join(refused)}: not available when serving across ranks (mlx.launch); leave "
                          f"{'it' if len(refused) == 1 else 'them'} out (each rank keeps its prefix cache in RAM)")
    if os.environ.get("MLX_RANK", "0") != "0":  # Ctrl-C in the launching terminal: rank 0 stops, then tells us
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return pipelined(args, lambda engine: _serve(engine, args))


def _serve(engine: PipelineEngine, args: argparse.Namespace) -> int:
    """Rank 0: the HTTP server on the pipelined engine, one request at a time."""
    from hetero.prefix_cache import PrefixCache
    from hetero.server.app import create_app, listen, run_app

    sock = listen(args.host, args.port, args.api_key)
    try:
        engine.prefix_cache = PrefixCache(int(args.prefix_cache_max_gb * 1024**3))
        names = {engine.name} | ({args.served_model_name} if args.served_model_name else set())
        app = create_app(engine, args.api_key, names, None, 1, args.prefill_chunk, args.default_max_tokens,
                         args.max_body_mb, args.decode_share, 1)
    except BaseException:
        sock.close()
        raise
    share = engine.stage.share.layers
    print(f"[hetero rank 0/{engine.stage.link.size} pid {os.getpid()}: layers {share.start}..{share.stop - 1}, "
          "serving HTTP]", file=sys.stderr, flush=True)
    run_app(app, sock, f"serving {sorted(names)} on http://{args.host}:{args.port} (pipelined across "
                       f"{engine.stage.link.size} ranks, one request at a time; no session cache)")
    return 0
