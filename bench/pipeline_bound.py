"""The bound of a prefill pipelined across ranks: each rank's share of the prompt, timed alone in one process.

    python bench/pipeline_bound.py                      # bundled model, 16K tokens, 2 ranks
    python bench/pipeline_bound.py --model large --tokens 4096

The layers are split as `hetero run` under `mlx.launch` splits them (`hetero.planner.hosts.split_layers`). Chunk by
chunk (the prefill's edges, MTP head included, as a pipelined MTP request runs it), each rank's share runs and is
evaluated on its own: rank 0 the embedding and its layers, the last rank its layers, the final norm and the MTP head.
From the per-chunk times t[r][c]:
  - one process: the sum over every rank and chunk;
  - free-running pipeline: the busiest rank's total plus the others' share of one chunk (fill and drain);
  - lock step (each step waits for every rank: at step s rank r runs chunk s - r): the sum over steps of the
    slowest rank's time at that step.
The ratios to one process are what `bench/distributed.py` can at best measure with one core per rank; the
difference is the hand-offs' cost. Writes bench/results/pipeline_bound.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hetero.host.blas import reexec_with_fast_blas  # noqa: E402  (before MLX)
from hetero.host.environment import environment

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from bench.checkpoints import CHECKPOINTS, checkpoint  # noqa: E402
from hetero.checkpoint.loader import load_model  # noqa: E402
from hetero.decode.prefill import chunk_edges, mtp_pairs  # noqa: E402
from hetero.errors import HeteroError  # noqa: E402
from hetero.models.cache import cache_arrays, expect_positions  # noqa: E402
from hetero.planner.hosts import split_layers  # noqa: E402


def share_times(model, ids: list[int], ranks: list[range], chunk: int) -> list[list[float]]:
    """Seconds of each rank's share at each chunk: [rank][chunk]."""
    cache = model.make_cache()
    expect_positions(cache, len(ids))
    times = [[] for _ in ranks]
    carry = None  # [1, H] the previous chunk's last hidden, for the MTP head's first pair
    edges = chunk_edges(0, len(ids), chunk)
    for start, stop in zip(edges, edges[1:]):
        piece = mx.array(ids[start:stop])[None]  # [1, S]
        h = None
        for r, share in enumerate(ranks):
            t0 = time.perf_counter()
            if r == 0:
                h = model.model.embed_tokens(piece)  # [1, S, H]
            for i in share:
                h = model.model.layers[i](h, cache[i])
            outs = [h, *cache_arrays([cache[i] for i in share])]
            if r == len(ranks) - 1:
                h = model.model.norm(h)
                if model.mtp is not None:
                    carry = mtp_pairs(model, piece, h, carry, cache)
                    outs += cache_arrays(cache.mtp)
                outs[0] = h
            mx.eval(*outs)
            times[r].append(time.perf_counter() - t0)
    return times


def bounds(times: list[list[float]]) -> dict:
    t = np.array(times)  # [ranks, chunks]
    single = float(t.sum())
    totals = t.sum(axis=1)
    busiest = int(totals.argmax())
    fill = float(sum(t[r, 0] for r in range(busiest)) + sum(t[r, -1] for r in range(busiest + 1, len(t))))
    free = float(totals.max()) + fill
    ranks, chunks = t.shape
    lock = sum(max(t[r, step - r] for r in range(ranks) if 0 <= step - r < chunks)  # step s: rank r runs chunk s - r
               for step in range(chunks + ranks - 1))
    return {"one_process_s": round(single, 3), "rank_totals_s": [round(float(x), 3) for x in totals],
            "free_running_s": round(free, 3), "lock_step_s": round(float(lock), 3),
            "free_running_ratio": round(free / single, 4), "lock_step_ratio": round(lock / single, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory or bench checkpoint name (default: bundled)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--out", default="bench/results/pipeline_bound.json")
    args = ap.parse_args()
    for name in ("tokens", "ranks", "chunk"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    reexec_with_fast_blas()
    path = args.model
    if path in CHECKPOINTS:
        path = checkpoint(path, Path(tempfile.gettempdir()) / "hetero-bench")
    model, _, _ = load_model(path)
    ranks = split_layers(model.args, args.ranks, mtp=model.mtp is not None)
    ids = np.random.default_rng(0).integers(3, model.args.vocab_size, args.tokens).tolist()
    share_times(model, ids[: 2 * args.chunk], ranks, args.chunk)  # warm-up
    times = share_times(model, ids, ranks, args.chunk)
    out = {"model": args.model or "bundled", "tokens": args.tokens, "chunk": args.chunk,
           "split": [[r.start, r.stop - 1] for r in ranks], **bounds(times), "environment": environment()}
    print(f"{out['model']}, {args.tokens} tokens, split {out['split']}: one process {out['one_process_s']:.2f} s, "
          f"rank totals {out['rank_totals_s']} s; pipelined at best {out['free_running_ratio']:.2f}x free-running, "
          f"{out['lock_step_ratio']:.2f}x in lock step")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    try:
        main()
    except HeteroError as e:  # a bad --model: one line, no traceback
        sys.exit(f"error: {e}")
