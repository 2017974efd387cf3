"""Decode speed over a long context on the CPU: the attention kernel for a few queries over a long cache
(`attention._numpy_few`) against MLX's `scaled_dot_product_attention`, alternated in one process.

    python bench/long_decode.py                 # JSON under bench/results/long_decode.json

One process loads the bundled model (fp32) with a prefix cache, so each context is prefilled once: for every
context length N (random prompt ids), the first call prefills and caches the prompt, then each measured call
resumes from it and decodes `--tokens` greedy tokens without MTP (`Engine.generate`, `stats["decode_tps"]`, which
counts decode time only; `--depth` N decodes with MTP drafts N deep instead). The kernels alternate (old, new,
old, new, ...) `--repeats` times per context: "old" sets `attention.MIN_KEYS` past any cache length, so every
decode step takes MLX's kernel as before; "new" keeps the threshold. Reported: the median tok/s of each, their
ratio (new / old), the spread, whether both kernels produced the same tokens, and the machine's load average
(other work on the two cores slows both alike).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def decode_tps(engine, ids: list[int], tokens: int, depth: int = 0) -> tuple[float, list[int]]:
    """One greedy decode of `tokens` tokens after `ids` (resumed from the prefix cache), plain or with MTP drafts
    `depth` deep: tok/s and tokens."""
    options = dict(mtp=True, draft_depth=depth) if depth else dict(mtp=False)
    result = engine.generate(ids, max_tokens=tokens, use_prefix_cache=True, **options)
    return float(result.stats["decode_tps"]), list(result.tokens)


def measure_context(engine, attention, n: int, tokens: int, repeats: int, depth: int = 0) -> dict:
    """Alternate the old and the new kernel over one prefilled context of n tokens."""
    import numpy as np

    ids = np.random.default_rng(n).integers(3, engine.model.args.vocab_size, max(n, 1)).tolist()
    new_threshold = attention.MIN_KEYS
    start = time.perf_counter()
    engine.generate(ids, max_tokens=4, use_prefix_cache=True, mtp=False)  # prefill, cached for the runs below
    prefill_s = time.perf_counter() - start
    runs: dict[str, list[float]] = {"old": [], "new": []}
    outputs: dict[str, list[int]] = {}
    try:
        for _ in range(repeats):
            for kernel in ("old", "new"):
                attention.MIN_KEYS = sys.maxsize if kernel == "old" else new_threshold
                tps, out = decode_tps(engine, ids, tokens, depth)
                runs[kernel].append(tps)
                outputs.setdefault(kernel, out)
    finally:
        attention.MIN_KEYS = new_threshold
    old, new = statistics.median(runs["old"]), statistics.median(runs["new"])
    return {"context": n, "old_tps": old, "new_tps": new, "ratio": new / old, "runs": runs,
            "same_tokens": outputs["old"] == outputs["new"], "prefill_s": prefill_s, "load": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[0, 4096, 8192, 16384, 30000])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="alternated runs per kernel and context (median)")
    ap.add_argument("--depth", type=int, default=0, help="MTP draft depth (0: plain decoding)")
    ap.add_argument("--out", default="bench/results/long_decode.json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import hetero  # before MLX: the fast BLAS under it
    from hetero.caches.prefix import PrefixCache
    from hetero.host.environment import environment
    from hetero.models import attention

    engine = hetero.load()
    engine.prefix_cache = PrefixCache()
    engine.generate([5, 6, 7], max_tokens=8, use_prefix_cache=False, mtp=False)  # warm-up
    result = {"model": "bundled", "tokens": args.tokens, "depth": args.depth, "min_keys": attention.MIN_KEYS,
              "environment": environment(), "rows": []}
    for n in args.contexts:
        row = measure_context(engine, attention, n, args.tokens, args.repeats, args.depth)
        result["rows"].append(row)
        engine.prefix_cache = PrefixCache()  # drop this context's snapshot before the next, longer one
        print(f"context {n:6d}  old {row['old_tps']:6.1f} tok/s  new {row['new_tps']:6.1f} tok/s  "
              f"ratio {row['ratio']:.2f}  (spread {min(row['runs']['new']):.1f}-{max(row['runs']['new']):.1f} / "
              f"{min(row['runs']['old']):.1f}-{max(row['runs']['old']):.1f})  same tokens {row['same_tokens']}  "
              f"load {row['load'][0]:.2f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
