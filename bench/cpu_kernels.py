"""hetero's own CPU kernels (hetero.host.kernels) against MLX's ops, on whole decode rounds.

    python bench/cpu_kernels.py                               # the large model, 1 / 2 / 4 / 8 rows, 3 rounds
    python bench/cpu_kernels.py --models bundled large --rows 1 4 --rounds 2 --tokens 24
    python bench/cpu_kernels.py --part ops                    # each kernel alone against MLX's op, one process

A decode round multiplies 1 to 8 rows (a request alone, or a batch of them) by every weight, and steps every GDN
layer's recurrent state; on two cores MLX's sgemm reads the weights about twice for 4 rows and its delta rule makes
five passes over the state, the kernels one each. Here the batch stepper (hetero.decode.stepper.Batch, what `hetero
serve` batches with, and a lone row's solo round, what `Engine.stream` runs) decodes --tokens greedy plain tokens
for N rows (short distinct prompts, EOS ignored), in a fresh child process per (model, path, round), the paths
alternated round by round (a process decides its kernels once):
  kernels    both kernels (the default)
  few_rows   the few-row product only (HETERO_DELTA_KERNEL=0): what the delta step adds
  mlx        neither (HETERO_FEW_ROW_KERNEL=0 HETERO_DELTA_KERNEL=0): MLX's own ops
Reported per model, path and row count: the median steady round in ms (the first two rounds left out: they compile
and fill the queue) and tok/s; per path the aggregate at N rows against its own one row (issue 36's "4 concurrent
requests at least 2.5x one" on the large model); the kernels' round against each other path's at the same rows.
Identity: every row's tokens in a batch equal the same prompt decoded alone on the same path (exit status 1
otherwise); each path's tokens against the kernels' are reported (equal, or the first position where float rounding
parts them). Writes bench/results/cpu_kernels.json (the environment, the kernels' status in each child included).

`--part ops` times each kernel alone in one process, alternated with MLX's own op on the same inputs, medians of
--repeats: the few-row product over every weight matrix of the model in turn (what a round reads) at each row count,
against MLX's product as `linear.project` runs it without the kernel (`(W @ x.T).T` from 4 rows); the delta step over every GDN layer's state at each row count, against MLX's five ops
(`gated_delta._recurrent_step`'s own form). Writes bench/results/cpu_kernels_ops.json.
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
sys.path.insert(0, str(ROOT))

from bench.peers import first_difference  # noqa: E402

DEFAULT_OUT = "bench/results/cpu_kernels.json"
PATHS = {  # path -> its switches
    "kernels": {"HETERO_FEW_ROW_KERNEL": "1", "HETERO_DELTA_KERNEL": "1"},
    "few_rows": {"HETERO_FEW_ROW_KERNEL": "1", "HETERO_DELTA_KERNEL": "0"},
    "mlx": {"HETERO_FEW_ROW_KERNEL": "0", "HETERO_DELTA_KERNEL": "0"},
}


def child(model: str, rows: list[int], tokens: int, workdir: str) -> dict:
    """One process, one path (HETERO_FEW_ROW_KERNEL as set by the parent): every row count's rounds and tokens."""
    from hetero.host.environment import environment  # noqa: F401  (hetero first: the fast BLAS under MLX)

    import mlx.core as mx

    from bench.checkpoints import checkpoint
    from hetero.decode.sampling import Sampler, SamplingParams
    from hetero.decode.stepper import Batch
    from hetero.engine import load
    import time

    path = checkpoint(model, Path(workdir)) if model != "bundled" else None
    engine = load(str(path) if path else None, dtype=mx.float32)
    prompts = [list(range(10 + 7 * i, 74 + 7 * i)) for i in range(max(rows))]  # 64 tokens each, distinct

    def decode(group: list[list[int]]) -> tuple[float, list[list[int]]]:
        batch = Batch(engine.model, max_batch=len(group))
        order = [batch.join(p, Sampler(SamplingParams()), tokens, set(), 0) for p in group]
        times, t = [], time.perf_counter()
        while batch.rows:
            batch.step()
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
        return statistics.median(times[2:]), [r.tokens for r in order]

    out = {"environment": environment(), "rows": {}}
    for n in rows:
        seconds, toks = decode(prompts[:n])
        out["rows"][str(n)] = {"round_ms": seconds * 1e3, "tokens": toks}
    alone = [out["rows"]["1"]["tokens"][0]] + [decode([p])[1][0] for p in prompts[1:]]  # each prompt alone
    out["alone"] = alone
    return out


def ops_part(model: str, rows: list[int], repeats: int, workdir: str) -> dict:
    """Each kernel against MLX's own op in this process (the kernels built or loaded first)."""
    import time

    import mlx.core as mx

    from bench.checkpoints import checkpoint
    from hetero.engine import load
    from hetero.host import kernels
    from hetero.host.environment import environment
    from hetero.models.gated_delta import mlx_step
    from hetero.models.linear import TRANSPOSED_ROWS
    from mlx.utils import tree_flatten

    few_rows, delta_step = kernels.few_rows(), kernels.delta_step()
    if few_rows is None or delta_step is None:
        sys.exit(f"the kernels are not in use here: {kernels.status()}")
    path = checkpoint(model, Path(workdir)) if model != "bundled" else None
    engine = load(str(path) if path else None, dtype=mx.float32)
    weights = [w for name, w in tree_flatten(engine.model.parameters())
               if w.ndim == 2 and name.endswith("weight") and "embed" not in name and "mtp" not in name]
    if engine.model.args.tie_word_embeddings:
        weights.append(engine.model.model.embed_tokens.weight)  # the lm_head
    weights = [mx.contiguous(w) for w in weights]  # each part of a fused product its own buffer, for both paths
    mx.eval(weights)
    gdn = [layer.linear_attn for layer in engine.model.model.layers if layer.is_linear]

    def timed(run) -> float:
        t = time.perf_counter()
        mx.eval(run())
        return (time.perf_counter() - t) * 1e3

    def mlx_product(x, w):  # `linear.project` without the kernel: transposed for 4-48 rows
        return (w @ x.T).T if x.shape[0] in TRANSPOSED_ROWS else x @ w.T

    out: dict = {"environment": environment(), "weights_mb": sum(w.nbytes for w in weights) / 1e6,
                 "gdn_layers": len(gdn), "few_rows": {}, "delta_step": {}}
    for n in rows:
        xs = {w.shape[1]: mx.random.normal((n, w.shape[1])) for w in weights}
        states = [mx.random.normal((n * g.nv, g.dk, g.dv)) * 0.1 for g in gdn]
        q, k = (mx.random.normal((n * gdn[0].nv, gdn[0].dk)) * 0.1 for _ in range(2))
        v = mx.random.normal((n * gdn[0].nv, gdn[0].dv))
        g, beta = mx.full((n * gdn[0].nv,), -0.1), mx.full((n * gdn[0].nv,), 0.5)
        mx.eval(xs, states, q, k, v, g, beta)
        runs = {
            ("few_rows", "kernel"): lambda: [few_rows(xs[w.shape[1]], w) for w in weights],
            ("few_rows", "mlx"): lambda: [mlx_product(xs[w.shape[1]], w) for w in weights],
            ("delta_step", "kernel"): lambda: [delta_step(q, k, v, g, beta, s) for s in states],
            ("delta_step", "mlx"): lambda: [mlx_step(q, k, v, g, beta, s) for s in states],
        }
        times: dict = {key: [] for key in runs}
        for key, run in runs.items():  # warm-up
            timed(run)
        for _ in range(repeats):
            for key, run in runs.items():
                times[key].append(timed(run))
        for op in ("few_rows", "delta_step"):
            kern, ref = statistics.median(times[(op, "kernel")]), statistics.median(times[(op, "mlx")])
            out[op][str(n)] = {"kernel_ms": kern, "mlx_ms": ref, "kernel_vs_mlx": ref / kern}
    for op in ("few_rows", "delta_step"):
        one = out[op][str(rows[0])]["kernel_ms"]
        for n in rows:
            out[op][str(n)]["kernel_vs_its_first_row_count"] = out[op][str(n)]["kernel_ms"] / one
            print(f"{model} {op} {n} rows: kernel {out[op][str(n)]['kernel_ms']:.2f} ms "
                  f"({out[op][str(n)]['kernel_vs_its_first_row_count']:.2f}x its {rows[0]} row), MLX "
                  f"{out[op][str(n)]['mlx_ms']:.2f} ms; kernel {out[op][str(n)]['kernel_vs_mlx']:.2f}x MLX's speed",
                  flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=["bundled", "large"], default=["large"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per row")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds, one child process per path each")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "hetero-bench"))
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--part", choices=["rounds", "ops"], default="rounds")
    ap.add_argument("--repeats", type=int, default=20, help="--part ops: alternated timings per op and row count")
    ap.add_argument("--child", nargs=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = sorted(set(args.rows) | {1})
    if args.part == "ops":
        import hetero  # noqa: F401  first: the fast BLAS under MLX

        result = {"args": vars(args), "models": {m: ops_part(m, rows, args.repeats, args.workdir) for m in args.models}}
        out = Path(args.out if args.out != DEFAULT_OUT else "bench/results/cpu_kernels_ops.json")
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
        return
    if args.child:
        print(json.dumps(child(args.child[0], rows, args.tokens, args.workdir)))
        return

    results: dict = {"args": vars(args), "models": {}}
    ok = True
    for model in args.models:
        runs: dict[str, list[dict]] = {p: [] for p in PATHS}
        for r in range(args.rounds):
            for path, switches in (PATHS.items() if r % 2 == 0 else reversed(PATHS.items())):
                cmd = [sys.executable, __file__, "--child", model, "--rows", *map(str, rows), "--tokens",
                       str(args.tokens), "--workdir", args.workdir]
                env = {**os.environ, **switches}
                done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if done.returncode != 0:
                    sys.exit(f"the {path} child failed:\n{done.stderr[-3000:]}")
                runs[path].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"{model} round {r + 1} {path}: " + ", ".join(
                    f"{n} rows {v['round_ms']:.1f} ms" for n, v in runs[path][-1]["rows"].items()), flush=True)
        entry: dict = {"environment": {p: runs[p][0]["environment"] for p in PATHS}}
        for path in PATHS:
            med = {n: statistics.median(run["rows"][str(n)]["round_ms"] for run in runs[path]) for n in rows}
            first = runs[path][0]
            identical = all(first["rows"][str(n)]["tokens"][i] == first["alone"][i] for n in rows for i in range(n))
            ok &= identical
            entry[path] = {str(n): {"round_ms": med[n], "tok_s": n * 1e3 / med[n],
                                    "aggregate_vs_own_one_row": n * med[1] / med[n]} for n in rows}
            entry[path]["batched_equals_alone"] = identical
        base = entry["kernels"]
        for other in ("few_rows", "mlx"):
            entry[f"kernels_vs_{other}_round"] = {str(n): entry[other][str(n)]["round_ms"] / base[str(n)]["round_ms"]
                                                 for n in rows}
            entry[f"tokens_{other}_vs_kernels_first_difference"] = [
                first_difference(a, b) for a, b in zip(runs["kernels"][0]["alone"], runs[other][0]["alone"])]
        entry["kernels_vs_mlx_one_row_aggregate"] = {
            str(n): n * entry["mlx"]["1"]["round_ms"] / base[str(n)]["round_ms"] for n in rows}
        results["models"][model] = entry
        for n in rows:
            print(f"{model} {n} rows: " + ", ".join(
                f"{p} {entry[p][str(n)]['round_ms']:.1f} ms ({entry[p][str(n)]['aggregate_vs_own_one_row']:.2f}x "
                f"its one row)" for p in PATHS) + f"; kernels {entry['kernels_vs_mlx_round'][str(n)]:.2f}x MLX's "
                f"round, {entry['kernels_vs_few_rows_round'][str(n)]:.2f}x few_rows'", flush=True)
        print(f"{model}: batched equals alone: " + ", ".join(f"{p} {entry[p]['batched_equals_alone']}" for p in PATHS)
              + "; tokens against the kernels', first difference per prompt: " + ", ".join(
                  f"{p} {entry[f'tokens_{p}_vs_kernels_first_difference']}" for p in ("few_rows", "mlx")), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
