"""Plain decode with each layer's input projections fused at load (the default) against the same checkout loading
them unfused (`hetero.load(..., fuse_projections=False)`), alternated in one run.

    python bench/fused_projections.py                  # JSON under bench/results/fused_projections.json

Each of `--repeats` fresh processes loads the model twice in fp32, unfused and fused, warms both up, then runs
`--rounds` rounds; a round decodes `--tokens` greedy tokens after a 128-token prompt with each engine through
`Engine.generate` (prefix cache and MTP off), the order swapped every round (unfused first, then fused first, ...),
so both see the same load on a shared machine. Reported per model: the median decode tokens/s over all rounds of
each setting, ms per step (one token per step), their ratio (fused / unfused), each process's medians, the load
average around each process, and whether both settings decoded the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASURE = """
import json
import hetero
import numpy as np
engines = {{"unfused": hetero.load({path!r}, fuse_projections=False), "fused": hetero.load({path!r})}}
ids = np.random.default_rng(0).integers(3, engines["fused"].model.args.vocab_size, 128).tolist()
for e in engines.values():
    e.generate(ids, max_tokens=16, use_prefix_cache=False, mtp=False)
tps, tokens = {{k: [] for k in engines}}, {{}}
for r in range({rounds}):
    for k in (("unfused", "fused") if r % 2 == 0 else ("fused", "unfused")):
        res = engines[k].generate(ids, max_tokens={tokens}, use_prefix_cache=False, mtp=False)
        tps[k].append(res.stats["decode_tps"])
        tokens.setdefault(k, res.tokens)
print(json.dumps([tps, tokens["unfused"] == tokens["fused"]]))
"""


def measure(path: str | None, tokens: int, rounds: int) -> dict:
    """One fresh process: each setting's tokens/s per round, whether they decoded the same tokens, the load
    average before and after."""
    code = MEASURE.format(path=path, tokens=tokens, rounds=rounds)
    before = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    tps, same = json.loads(out.stdout.strip().splitlines()[-1])
    return {"tps": tps, "same_tokens": same, "load": [before, os.getloadavg()[0]]}


def compare(name: str, path: str | None, args: argparse.Namespace) -> dict:
    """`args.repeats` processes of alternated rounds: the row for one model."""
    procs = [measure(path, args.tokens, args.rounds) for _ in range(args.repeats)]
    tps = {s: [t for p in procs for t in p["tps"][s]] for s in ("unfused", "fused")}
    u, f = statistics.median(tps["unfused"]), statistics.median(tps["fused"])
    same = all(p["same_tokens"] for p in procs)
    loads = [x for p in procs for x in p["load"]]
    per_process = [statistics.median(p["tps"]["fused"]) / statistics.median(p["tps"]["unfused"]) for p in procs]
    print(f"{name:8s} unfused {u:7.1f} tok/s ({1000 / u:6.2f} ms/step)  fused {f:7.1f} tok/s ({1000 / f:6.2f} ms/step)  "
          f"ratio {f / u:.3f}  (per process {', '.join(f'{r:.3f}' for r in per_process)}; "
          f"load {min(loads):.1f}-{max(loads):.1f}; same tokens: {same})", flush=True)
    return {"model": name, "unfused_tps": u, "fused_tps": f, "unfused_ms_per_step": 1000 / u,
            "fused_ms_per_step": 1000 / f, "ratio": f / u, "ratio_per_process": per_process, "same_tokens": same,
            "tps": tps, "load_average": [p["load"] for p in procs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=["bundled", "large"], default=["bundled", "large"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6, help="alternated rounds per process (one generation per setting)")
    ap.add_argument("--repeats", type=int, default=3, help="processes per model")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "hetero-bench"))
    ap.add_argument("--out", default="bench/results/fused_projections.json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import hetero  # noqa: F401  (before MLX: the fast BLAS under it, for writing the large checkpoint)
    from bench.checkpoints import checkpoint
    from hetero.blas import environment

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"commit": commit, "tokens": args.tokens, "rounds": args.rounds, "repeats": args.repeats,
              "environment": environment(), "rows": []}
    for name in args.models:
        path = None if name == "bundled" else str(checkpoint(name, Path(args.workdir)))
        result["rows"].append(compare(name, path, args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
