"""Solo decode speed of this checkout against a baseline checkout (an earlier commit), alternated in one run.

    git worktree add /tmp/hetero-before <commit>
    python bench/decode_path.py --baseline /tmp/hetero-before      # JSON under bench/results/decode_path.json

Each measurement is a fresh process that imports hetero from one tree (PYTHONPATH), loads the model in fp32,
warms up once, then decodes `--tokens` greedy tokens after a 128-token prompt, `--runs` times, through
`Engine.generate` (the public API both trees have; the prefix cache off): the median decode tokens/s. The trees
alternate (baseline, this, baseline, this, ...) `--repeats` times per (model, mode); reported: the medians and
their ratio (this / baseline), for plain decoding and MTP at `--depth`. Both trees run with the same BLAS, threads
and environment (recorded in the JSON).
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
import sys, json, statistics
import hetero
import numpy as np
engine = hetero.load({path!r})
rng = np.random.default_rng(0)
ids = rng.integers(3, engine.model.args.vocab_size, 128).tolist()
options = dict(mtp=False) if {depth} == 0 else dict(mtp=True, draft_depth={depth})
engine.generate(ids, max_tokens=16, use_prefix_cache=False, **options)
tps = [engine.generate(ids, max_tokens={tokens}, use_prefix_cache=False, **options).stats["decode_tps"]
       for _ in range({runs})]
print(json.dumps([hetero.__file__, statistics.median(tps)]))
"""


def measure(tree: Path, path: str | None, depth: int, tokens: int, runs: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    code = MEASURE.format(path=path, depth=depth, tokens=tokens, runs=runs)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, check=True)
    where, tps = json.loads(out.stdout.strip().splitlines()[-1])
    if not Path(where).resolve().is_relative_to(tree):  # PYTHONPATH must win over an installed hetero
        raise SystemExit(f"measured {where}, not the tree {tree}")
    return float(tps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="a checkout of the commit to compare against")
    ap.add_argument("--models", nargs="+", choices=["bundled", "large"], default=["bundled", "large"])
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3, help="generations per process (median)")
    ap.add_argument("--repeats", type=int, default=3, help="alternated processes per tree")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "hetero-bench"))
    ap.add_argument("--out", default="bench/results/decode_path.json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import hetero  # noqa: F401  (before MLX: the fast BLAS under it, for writing the large checkpoint)
    from bench.checkpoints import checkpoint
    from hetero.host.environment import environment

    baseline = Path(args.baseline).resolve()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=baseline, capture_output=True, text=True).stdout.strip()
    result = {"baseline": str(baseline), "baseline_commit": head, "environment": environment(), "rows": []}
    for name in args.models:
        path = None if name == "bundled" else str(checkpoint(name, Path(args.workdir)))
        for depth in (0, args.depth):
            runs = {"baseline": [], "this": []}
            for _ in range(args.repeats):
                runs["baseline"].append(measure(baseline, path, depth, args.tokens, args.runs))
                runs["this"].append(measure(ROOT, path, depth, args.tokens, args.runs))
            b, t = statistics.median(runs["baseline"]), statistics.median(runs["this"])
            mode = "plain" if depth == 0 else f"mtp depth {depth}"
            row = {"model": name, "mode": mode, "baseline_tps": b, "this_tps": t, "ratio": t / b, "runs": runs}
            result["rows"].append(row)
            print(f"{name:8s} {mode:12s} baseline {b:7.1f} tok/s  this {t:7.1f} tok/s  ratio {t / b:.3f}  "
                  f"(spread {min(runs['this']):.1f}-{max(runs['this']):.1f} / "
                  f"{min(runs['baseline']):.1f}-{max(runs['baseline']):.1f})", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
