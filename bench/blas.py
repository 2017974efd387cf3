"""MLX fp32 matmuls on the BLAS a fresh venv brings against mlx[cpu]'s bundled reference BLAS.

    python bench/blas.py                  # ~1 minute on 2 cores; JSON to bench/results/blas.json

x @ W.T (a Linear layer's layout) over ~400 MB of fp32 weights (8 matrices of 3072 x 4096) at M = 1 (a decode
step) and M = 4 (an MTP verify pass over 4 tokens); M = 1024 (a prefill chunk) over one 512 x 4096 slice, which
the reference BLAS already needs seconds for. Each variant runs in its own interpreter, the variants alternate
round by round, and each figure is the median over rounds of a per-process median; the JSON records the load
average, since threaded BLAS suffers first when other jobs share the cores. Variants:
- reference: MLX alone (the bundled netlib BLAS of the mlx[cpu] wheel);
- wheel: `import hetero` first, as the `hetero` command does (threads as a user gets them: all cores);
- wheel_1thread: the same with OMP_NUM_THREADS=1 (what benchmarks give each lane).
Every child also checks a matmul against numpy's float64 result.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
K, N, MATRICES, PREFILL_N = 4096, 3072, 8, 512
VARIANTS = {"reference": {}, "wheel": {}, "wheel_1thread": {"OMP_NUM_THREADS": "1"}}
CLEAN = ("LD_PRELOAD", "HETERO_BLAS_REEXEC", "MKL_THREADING_LAYER", "MKL_NUM_THREADS", "OMP_NUM_THREADS",
         "OPENBLAS_NUM_THREADS", "KMP_BLOCKTIME")


def child(variant: str, reps: int) -> dict:
    if variant == "reference":  # hetero/host/blas.py on its own, to describe without applying anything
        import importlib.util

        spec = importlib.util.spec_from_file_location("blas_alone", ROOT / "hetero" / "blas.py")
        blas = sys.modules["blas_alone"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(blas)
    else:
        sys.path.insert(0, str(ROOT))
        import hetero.host.blas as blas
    import mlx.core as mx
    import numpy as np

    mx.set_default_device(mx.cpu)
    mx.random.seed(0)
    weights = [mx.random.normal((N, K)) for _ in range(MATRICES)]
    mx.eval(weights)
    prefill_w = [weights[0][:PREFILL_N]]  # M = 1024 costs 4.3 GFLOP

    def timed(m: int, ws: list, reps: int) -> float:
        x = mx.random.normal((m, K))
        mx.eval(x, [x[:64] @ w.T for w in ws])  # warm-up: loads MKL's layer, touches the weights
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            mx.eval([x @ w.T for w in ws])
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    out = {}
    slow = 1 if variant == "reference" else reps  # the reference BLAS takes seconds at M = 1024
    for m, ws, r in ((1, weights, reps), (4, weights, reps), (1024, prefill_w, slow)):
        s = timed(m, ws, r)
        flops = 2 * m * K * sum(w.shape[0] for w in ws)
        out[f"M={m}"] = {"ms": round(s * 1e3, 2), "gflops": round(flops / s / 1e9, 2)}
    rng = np.random.default_rng(0)
    a, w = rng.standard_normal((300, 1024)).astype(np.float32), rng.standard_normal((700, 1024)).astype(np.float32)
    got = np.array(mx.array(a) @ mx.array(w).T)
    ref = a.astype(np.float64) @ w.T.astype(np.float64)
    out["max_abs_err_vs_float64"] = float(np.abs(got - ref).max())
    out["blas"] = blas.describe()
    out["blas_library"] = blas.mlx_blas_library()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per shape in each process")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "blas.json")
    ap.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.reps)))
        return

    t0, load_start = time.perf_counter(), os.getloadavg()
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for v in order:
            env = {k: val for k, val in os.environ.items() if k not in CLEAN} | VARIANTS[v]
            proc = subprocess.run([sys.executable, __file__, "--child", v, "--reps", str(args.reps)], env=env,
                                  capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                sys.exit(f"{v} failed:\n{proc.stderr}")
            runs[v].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {v}: " + ", ".join(f"{k} {runs[v][-1][k]['ms']} ms" for k in ("M=1", "M=4", "M=1024")),
                  flush=True)

    result = {}
    for v, rs in runs.items():
        row = {"blas": rs[-1]["blas"], "blas_library": rs[-1]["blas_library"], "env": VARIANTS[v]}
        for shape in ("M=1", "M=4", "M=1024"):
            ms = statistics.median(x[shape]["ms"] for x in rs)
            row[shape] = {"ms": ms, "gflops": statistics.median(x[shape]["gflops"] for x in rs)}
        row["M=4 / M=1"] = round(row["M=4"]["ms"] / row["M=1"]["ms"], 2)
        row["max_abs_err_vs_float64"] = max(x["max_abs_err_vs_float64"] for x in rs)
        result[v] = row
    ref = result["reference"]
    speedup = {v: {s: round(ref[s]["ms"] / result[v][s]["ms"], 1) for s in ("M=1", "M=4", "M=1024")}
               for v in result if v != "reference"}

    sys.path.insert(0, str(ROOT))
    from hetero.host.environment import environment

    report = {
        "command": "python bench/blas.py" + (f" --rounds {args.rounds}" if args.rounds != 3 else ""),
        "what": f"x @ W.T, fp32; M=1 and M=4 over {MATRICES} x ({N} x {K}) = {MATRICES * N * K * 4 / 1e6:.0f} MB, "
                f"M=1024 over {PREFILL_N} x {K}",
        "rounds": args.rounds,
        "reps": args.reps,
        "variants": result,
        "speedup_vs_reference": speedup,
        "wall_s": round(time.perf_counter() - t0, 1),
        "load_average_1min": {"start": round(load_start[0], 2), "end": round(os.getloadavg()[0], 2)},  # others' jobs
        "environment": environment(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for v, row in result.items():
        print(f"{v:14s} {row['blas']}\n{'':14s} " + "  ".join(
            f"{s}: {row[s]['ms']:.1f} ms {row[s]['gflops']:.1f} GFLOP/s" for s in ("M=1", "M=4", "M=1024")))
    print(f"speedup vs reference: {speedup}\nwrote {args.out} in {report['wall_s']} s")


if __name__ == "__main__":
    main()
