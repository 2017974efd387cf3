"""Pipeline parallelism on this machine: one rank on one core against two ranks on one core each (issue 15).

    python bench/distributed.py                      # 16K-token prompt, bundled model; writes bench/results/distributed.json
    python bench/distributed.py --tokens 4096 --repeats 1 --out /tmp/d.json   # a quicker look

Contenders, alternated (A B A B ...), each in fresh processes with one BLAS thread, pinned to its core
(os.sched_setaffinity before MLX starts):
  1 rank    `hetero.load` + `Engine.generate` in one process on core 0;
  2 ranks   `mlx.launch -n 2 --backend ring` on the loopback address, rank r on core r, `PipelineEngine.generate`
            (layers split by hetero.planner.hosts.split_layers).
  direct    the same two ranks started by hand with the environment mlx.launch gives them (MLX_RANK, MLX_HOSTFILE):
            mlx.launch's I/O loop selects on each child's always-writable stdin and so spins a whole core, which
            on a 2-core machine is one of the ranks' cores.
Each process first runs a short warm-up request (compiles the decode steps), then the timed one: a prompt of
--tokens tokens cut from held-out standard-library source, greedy, MTP at depth 3, --decode new tokens. Reported:
prefill time (TTFT) and its ratio 2 ranks / 1 rank (target <= 0.6), prefill and decode tok/s, peak MLX memory per
rank (weights included; reset at the request's start) and its ratio to the single process's peak (target: each
rank <= 0.6), the weight bytes each rank holds, and whether the greedy tokens are identical (they must be).
Medians over --repeats; every run is kept in the JSON with the environment (BLAS, threads, versions) and the
machine's load average before and after it (the two ranks need both cores to themselves).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_PREFILL_RATIO = 0.6
TARGET_MEMORY_RATIO = 0.6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="prompt tokens (default: 16384)")
    p.add_argument("--decode", type=int, default=32, help="new tokens per timed request (default: 32)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per contender, alternated (default: 2)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (default: 512)")
    p.add_argument("--model", default=None,
                   help="checkpoint directory, or a bench checkpoint's name (large, moe: bench/checkpoints.py "
                   "writes it once under the temp folder) (default: the bundled model)")
    p.add_argument("--timeout", type=float, default=900, help="seconds a contender's run may take (default: 900)")
    p.add_argument("--wait-idle", type=float, default=120,
                   help="before each run, wait up to this many seconds for the 1-minute load average to fall below "
                   "0.5 (a shared machine's other work skews the two-core comparison; the loads are recorded)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "distributed.json"), help="JSON to write")
    p.add_argument("--worker", choices=["single", "pipeline"], help=argparse.SUPPRESS)  # internal: one contender
    p.add_argument("--prompt-file", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------
# One contender (in its own process)


def worker(args: argparse.Namespace) -> None:
    """Pin to this rank's core, warm up, run the timed request; rank 0 writes the result JSON."""
    os.sched_setaffinity(0, {int(os.environ.get("MLX_RANK", "0")) % os.cpu_count()})
    sys.path.insert(0, str(ROOT))
    import hetero  # first: the fast BLAS goes under MLX before anything imports mlx.core
    from hetero.host.environment import environment

    ids = json.loads(Path(args.prompt_file).read_text())
    warm = ids[: min(len(ids), 2 * args.chunk + 37)]
    params = dict(max_tokens=args.decode, prefill_chunk=args.chunk, mtp=True, draft_depth=3)
    if args.worker == "single":
        engine, close, rank = hetero.load(args.model), None, 0
        engine.generate(warm, max_tokens=4, prefill_chunk=args.chunk, mtp=True, draft_depth=3)
        result = engine.generate(ids, use_prefix_cache=False, **params)
        per_rank = [{"layers": [0, engine.model.args.num_hidden_layers - 1],
                     "peak_memory_bytes": result.stats["peak_memory_bytes"], "weight_bytes": _weight_bytes(engine)}]
    else:
        from hetero.distributed.group import connect
        from hetero.distributed.runtime import PipelineEngine, load_stage, serve

        link = connect(120)
        stage, path, config = load_stage(link, args.model)
        rank = link.rank
        if rank:
            serve(stage)
            link.close()
            return
        engine = PipelineEngine(stage, path, config, str(args.model))
        engine.generate(warm, max_tokens=4, prefill_chunk=args.chunk, mtp=True, draft_depth=3)
        result = engine.generate(ids, **params)
        per_rank = result.stats["pipeline"]["per_rank"]
        engine.close()
        link.close()
    s = result.stats
    Path(args.result_file).write_text(json.dumps({
        "ttft_s": s["ttft_s"], "prefill_tps": s["prefill_tps"], "decode_tps": s["decode_tps"], "tokens": result.tokens,
        "prompt_tokens": s["prompt_tokens"], "per_rank": per_rank, "mtp": s.get("mtp"), "environment": environment(),
    }))


def _weight_bytes(engine) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(engine.model.parameters()))


# ----------------------------------------------------------------------------------------------------------
# The driver


def _free_port(n: int) -> int:
    for _ in range(100):
        p = random.randrange(20000, 60000)
        socks = []
        try:
            for i in range(n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", p + i))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports on the loopback address")


def wait_idle(seconds: float) -> float:
    """Wait up to `seconds` for the 1-minute load average to fall below 0.5; returns it."""
    end = time.monotonic() + seconds
    while os.getloadavg()[0] >= 0.5 and time.monotonic() < end:
        time.sleep(2)
    return os.getloadavg()[0]


def run_contender(kind: str, args: argparse.Namespace, prompt_file: Path) -> dict:
    load_before = wait_idle(args.wait_idle)
    result_file = Path(tempfile.mkstemp(suffix=".json")[1])
    me = [sys.executable, str(Path(__file__).resolve()), "--prompt-file", str(prompt_file), "--result-file",
          str(result_file), "--chunk", str(args.chunk), "--decode", str(args.decode)]
    if args.model:
        me += ["--model", args.model]
    env = {**os.environ, "MKL_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    if kind == "single":
        processes = [([*me, "--worker", "single"], env)]
    elif kind == "direct":  # without the launcher: its I/O loop selects on each rank's always-writable stdin pipe,
        port = _free_port(2)  # so it spins a core; the ranks get the environment it would give them
        hostfile = Path(tempfile.mkstemp(suffix=".json")[1])
        hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
        processes = [([*me, "--worker", "pipeline"], {**env, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)})
                     for rank in (0, 1)]
    else:
        launch = str(Path(sys.executable).parent / "mlx.launch")
        processes = [([launch, "--backend", "ring", "-n", "2", "--starting-port", str(_free_port(2)), "--",
                       *me, "--worker", "pipeline"], env)]
    start = time.perf_counter()
    procs = [subprocess.Popen(command, cwd=ROOT, env=penv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for command, penv in processes]
    errors = []
    for proc in procs:
        try:
            errors.append(proc.communicate(timeout=args.timeout)[1])
        except subprocess.TimeoutExpired:
            proc.kill()
            errors.append(proc.communicate()[1])
    if kind == "direct":
        hostfile.unlink()
    text = result_file.read_text() if result_file.stat().st_size else ""
    result_file.unlink()
    if not text:
        raise SystemExit(f"{kind}: no result (exits {[p.returncode for p in procs]}); stderr:\n{errors[0][-3000:]}")
    result = json.loads(text)
    result["wall_s"] = round(time.perf_counter() - start, 3)
    result["load_average_1min"] = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    sys.path.insert(0, str(ROOT))
    from bench.checkpoints import CHECKPOINTS, checkpoint
    from hetero.checkpoint.source import resolve
    from hetero.checkpoint.tokenizer import Tokenizer
    from hetero.training.tokenizer_train import load_corpus

    if (os.cpu_count() or 1) < 2:
        print("warning: fewer than 2 cores: the two ranks share one", file=sys.stderr)
    if args.model in CHECKPOINTS:
        args.model = str(checkpoint(args.model, Path(tempfile.gettempdir()) / "hetero-bench"))
    ids = Tokenizer.from_dir(resolve(args.model)).encode(load_corpus()[1])
    if len(ids) < args.tokens:
        raise SystemExit(f"the held-out corpus has only {len(ids)} tokens; ask for fewer")
    prompt_file = Path(tempfile.mkstemp(suffix=".json")[1])
    prompt_file.write_text(json.dumps(ids[: args.tokens]))
    runs: dict[str, list[dict]] = {"single": [], "pipeline": [], "direct": []}
    for i in range(args.repeats):
        for kind in runs:  # A B C A B C
            r = run_contender(kind, args, prompt_file)
            runs[kind].append(r)
            print(f"[{i + 1}/{args.repeats}] {kind}: TTFT {r['ttft_s']:.2f}s, decode {r['decode_tps']:.1f} tok/s, peak "
                  + ", ".join(f"{p['peak_memory_bytes'] / 1e6:.0f} MB" for p in r["per_rank"]), flush=True)
    prompt_file.unlink()

    med = lambda kind, key: statistics.median(r[key] for r in runs[kind])  # noqa: E731
    spread = lambda kind, key: [min(r[key] for r in runs[kind]), max(r[key] for r in runs[kind])]  # noqa: E731
    single_peak = statistics.median(r["per_rank"][0]["peak_memory_bytes"] for r in runs["single"])
    n_ranks = len(runs["pipeline"][0]["per_rank"])
    rank_peaks = [statistics.median(r["per_rank"][k]["peak_memory_bytes"] for r in runs["pipeline"])
                  for k in range(n_ranks)]
    reference = runs["single"][0]["tokens"]
    identical = all(r["tokens"] == reference for rs in runs.values() for r in rs)
    prefill_ratio = med("pipeline", "ttft_s") / med("single", "ttft_s")
    memory_ratios = [p / single_peak for p in rank_peaks]
    summary = {
        "prompt_tokens": args.tokens,
        "decode_tokens": args.decode,
        "chunk": args.chunk,
        "model": args.model or "bundled",
        "repeats": args.repeats,
        "split": [r["layers"] for r in runs["pipeline"][0]["per_rank"]],
        "ttft_s": {k: {"median": med(k, "ttft_s"), "spread": spread(k, "ttft_s")} for k in runs},
        "prefill_tps": {k: med(k, "prefill_tps") for k in runs},
        "decode_tps": {k: {"median": med(k, "decode_tps"), "spread": spread(k, "decode_tps")} for k in runs},
        "prefill_time_ratio": round(prefill_ratio, 4),
        "prefill_time_ratio_direct": round(med("direct", "ttft_s") / med("single", "ttft_s"), 4),
        "prefill_target": TARGET_PREFILL_RATIO,
        "prefill_target_met": prefill_ratio <= TARGET_PREFILL_RATIO,
        "peak_memory_bytes": {"single": single_peak, "per_rank": rank_peaks},
        "weight_bytes": {"single": runs["single"][0]["per_rank"][0]["weight_bytes"],
                         "per_rank": [p["weight_bytes"] for p in runs["pipeline"][0]["per_rank"]]},
        "memory_ratio_per_rank": [round(m, 4) for m in memory_ratios],
        "memory_target": TARGET_MEMORY_RATIO,
        "memory_target_met": all(m <= TARGET_MEMORY_RATIO for m in memory_ratios),
        "greedy_identical": identical,
    }
    environment = runs["single"][0]["environment"]
    for rs in runs.values():
        for r in rs:
            r.pop("environment", None)
            r.pop("tokens", None)
    out = {"summary": summary, "runs": runs, "environment": environment,
           "pinning": "each process (each rank) pinned to one core with os.sched_setaffinity; MKL/OMP 1 thread"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if identical else 1


if __name__ == "__main__":
    from hetero.errors import HeteroError

    try:
        sys.exit(main())
    except HeteroError as e:  # a bad --model, a missing checkpoint: one line, no traceback
        sys.exit(f"error: {e}")
