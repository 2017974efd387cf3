"""Plain decode (and prefill) with each layer's input projections fused at load (the default; the routed experts'
gate|up too) against the same checkout loading them unfused (`hetero.load(..., fuse_projections=False)`), alternated
in one run.

    python bench/fused_projections.py                  # JSON under bench/results/fused_projections.json
    python bench/fused_projections.py --models qwen4 --prompt 4096 --tokens 32 --rounds 4 --repeats 1 \
        --out bench/results/fused_projections_qwen4.json   # the qwen4 MoE model's 4K prefill and decode

Each of `--repeats` fresh processes loads the model twice in fp32, unfused and fused, warms both up, then runs
`--rounds` rounds; a round decodes `--tokens` greedy tokens after a `--prompt`-token prompt (128) with each engine
through `bench/prefill_decode.py`'s `run_hetero` (plain greedy decoding, no prefix cache, no MTP; a checkpoint
needs no tokenizer), the order swapped every round (unfused first, then fused first, ...), so both see the same
load on a shared machine. Reported per model: the median decode tokens/s over all
rounds of each setting, ms per step (one token per step), their ratio (fused / unfused), the same for the prompt's
prefill tokens/s, each process's medians, the load average around each process, and whether both settings decoded
the same tokens.
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
import hetero  # before MLX: the fast BLAS under it
import mlx.core as mx
import numpy as np
from bench.prefill_decode import run_hetero
from hetero.checkpoint.loader import load_model
models = {{k: load_model({path!r}, dtype=mx.float32, fuse_projections=k == "fused")[0] for k in ("unfused", "fused")}}
ids = np.random.default_rng(0).integers(3, models["fused"].args.vocab_size, {prompt}).tolist()
for m in models.values():
    run_hetero(m, ids, 16)
tps, prefill, tokens = {{k: [] for k in models}}, {{k: [] for k in models}}, {{}}
for r in range({rounds}):
    for k in (("unfused", "fused") if r % 2 == 0 else ("fused", "unfused")):
        prefill_tps, decode_tps, out = run_hetero(models[k], ids, {tokens})
        tps[k].append(decode_tps)
        prefill[k].append(prefill_tps)
        tokens.setdefault(k, out)
print(json.dumps([tps, prefill, tokens["unfused"] == tokens["fused"]]))
"""

def measure(path: str | None, tokens: int, rounds: int, prompt: int) -> dict:
    """One fresh process: each setting's decode and prefill tokens/s per round, whether they decoded the same
    tokens, the load average before and after."""
    code = MEASURE.format(path=path, tokens=tokens, rounds=rounds, prompt=prompt)
    before = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    tps, prefill, same = json.loads(out.stdout.strip().splitlines()[-1])
    return {"tps": tps, "prefill_tps": prefill, "same_tokens": same, "load": [before, os.getloadavg()[0]]}


def compare(name: str, path: str | None, args: argparse.Namespace) -> dict:
    """`args.repeats` processes of alternated rounds: the row for one model."""
    procs = [measure(path, args.tokens, args.rounds, args.prompt) for _ in range(args.repeats)]
    tps = {s: [t for p in procs for t in p["tps"][s]] for s in ("unfused", "fused")}
    prefill = {s: [t for p in procs for t in p["prefill_tps"][s]] for s in ("unfused", "fused")}
    u, f = statistics.median(tps["unfused"]), statistics.median(tps["fused"])
    pu, pf = statistics.median(prefill["unfused"]), statistics.median(prefill["fused"])
    same = all(p["same_tokens"] for p in procs)
    loads = [x for p in procs for x in p["load"]]
    per_process = [statistics.median(p["tps"]["fused"]) / statistics.median(p["tps"]["unfused"]) for p in procs]
    print(f"{name:8s} unfused {u:7.1f} tok/s ({1000 / u:6.2f} ms/step)  fused {f:7.1f} tok/s ({1000 / f:6.2f} ms/step)  "
          f"ratio {f / u:.3f}  (per process {', '.join(f'{r:.3f}' for r in per_process)}; "
          f"load {min(loads):.1f}-{max(loads):.1f}; same tokens: {same})", flush=True)
    print(f"{name:8s} prefill of {args.prompt} tokens: unfused {pu:7.1f} tok/s, fused {pf:7.1f} tok/s, ratio {pf / pu:.3f}",
          flush=True)
    return {"model": name, "unfused_tps": u, "fused_tps": f, "unfused_ms_per_step": 1000 / u,
            "fused_ms_per_step": 1000 / f, "ratio": f / u, "ratio_per_process": per_process, "same_tokens": same,
            "tps": tps, "prompt_tokens": args.prompt, "unfused_prefill_tps": pu, "fused_prefill_tps": pf,
            "prefill_ratio": pf / pu, "prefill_tps": prefill, "load_average": [p["load"] for p in procs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=["bundled", "large", "moe", "qwen4"], default=["bundled", "large"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens (random ids) before each decode")
    ap.add_argument("--rounds", type=int, default=6, help="alternated rounds per process (one generation per setting)")
    ap.add_argument("--repeats", type=int, default=3, help="processes per model")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "hetero-bench"))
    ap.add_argument("--out", default="bench/results/fused_projections.json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import hetero  # noqa: F401  (before MLX: the fast BLAS under it, for writing the large checkpoint)
    from bench.checkpoints import checkpoint
    from hetero.host.environment import environment

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
