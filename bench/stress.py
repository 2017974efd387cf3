"""Concurrent requests never stall: the long stress run against `hetero serve` (the short one is tests/test_stress.py;
the harness is tests/stress.py, its checks tests/stress_checks.py; docs/server.md, "One scheduler owns every lane").

    python bench/stress.py --clients 16 --requests 200                       # the bundled model, 512-token chunks
    python bench/stress.py --layout two-chunk                                # every prompt two chunks or more
    python bench/stress.py --wavefront off --max-batch 1 --ane-fraction 0.5  # any setting
    python bench/stress.py --opencode 50                                     # OpenCode's pattern, 50 times in a row
    python bench/stress.py --plot                                            # bench/results/stress.png from the JSON

A storm: every call of the drawn workload is sent alone first (to a fresh server of the same setting: its answer
and its own work W), then all at once to another fresh server while /health and /metrics are read; every call is
judged (no 5xx, its solo answer, its bound; docs/server.md) and the run's summary (stalls, 5xx, answers unlike solo,
the worst wait against its bound, p50/p99 latency per request kind) goes to bench/results/stress.json under the
run's name, beside the others. The OpenCode pattern: a streamed chat of ~1,300 tokens (max_tokens 8), then 0.33 s
later a streamed chat of ~16K tokens, N times in a row against one default server; the target is every title
request answering in under 2 s plus the work queued ahead of it (none: each turn starts on an idle server).
The machine is shared: the JSON records the load average before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from stress import Call, Server, Setting, draw, send, solo, storm  # noqa: E402
from stress_checks import Monitor, agree, judge, scrape  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "stress.json"
LAYOUTS = {  # layout -> (prefill chunk, shortest prompt in tokens)
    "bundled": (512, 1),
    "two-chunk": (256, 2 * 256 + 32),  # every prompt two chunks or more (chat template included): every prefill by wavefront
}


def environment() -> dict:
    import hetero  # (before mlx: the fast BLAS under it)
    import mlx.core as mx
    from hetero.host import blas

    return {"commit": commit(), "machine": platform.machine(), "cores": os.cpu_count(), "mlx": mx.__version__,
            "hetero": getattr(hetero, "__version__", None), "blas": blas.describe(),
            "python": platform.python_version(), "shared_machine": True}


def commit() -> str | None:
    """The code's commit: git's, or the COMMIT file of a copy made with `git archive`."""
    import subprocess

    if (ROOT / "COMMIT").exists():
        return (ROOT / "COMMIT").read_text().strip()
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None


def run_storm(args, log_dir: Path) -> dict:
    chunk, shortest = LAYOUTS[args.layout]
    setting = Setting(f"{args.layout}, wavefront {args.wavefront}, batch {args.max_batch}"
                      + (f", split {args.ane_fraction}" if args.ane_fraction else ""),
                      max_batch=args.max_batch, wavefront=args.wavefront == "on", ane_fraction=args.ane_fraction,
                      prefill_chunk=args.prefill_chunk or chunk, max_concurrent=args.max_concurrent)
    calls = draw(args.seed, args.requests, args.clients, args.max_prompt, max_gap=args.max_gap, max_new=args.max_new)
    for c in calls:
        c.tokens = max(c.tokens, shortest)
    load = os.getloadavg()
    t0 = time.perf_counter()
    with Server(setting, log_dir / "solo.log", args.model) as server:
        alone = solo(server, calls)
    t1 = time.perf_counter()
    with Server(setting, log_dir / "storm.log", args.model) as server:
        before = scrape(server.url)
        monitor = Monitor(server, setting)
        results = storm(server, calls, timeout=args.timeout)
        monitor.stop()
        mismatch = agree(server, calls, results, alone, before)
        health = scrape(server.url)[0]
    report = judge(setting, calls, results, alone)
    report.update(
        layout=args.layout, wavefront=args.wavefront, max_batch=args.max_batch, ane_fraction=args.ane_fraction,
        prefill_chunk=setting.prefill_chunk, clients=args.clients, seed=args.seed, max_prompt=args.max_prompt,
        solo_s=round(t1 - t0, 1), storm_s=round(time.perf_counter() - t1, 1),
        monitor={"reads": monitor.reads, "slowest_s": round(monitor.slowest, 3), "problems": monitor.problems},
        reconciled=mismatch, health_after=health["requests"], load_before=load, load_after=os.getloadavg(),
        prompt_tokens_total=sum(r.prompt_tokens or 0 for r in results.values()))
    return report


def run_opencode(args, log_dir: Path) -> dict:
    """The OpenCode pattern `args.opencode` times in a row against one default server."""
    setting = Setting(f"opencode, wavefront {args.wavefront}", wavefront=args.wavefront == "on")
    load = os.getloadavg()
    turns = []
    with Server(setting, log_dir / "opencode.log", args.model) as server:
        solo_title = [send(server.url, server.model, Call(0, 0, "chat", True, 1300, 8, "answer", 0, 900 + i), 120)
                      .latency for i in range(3)]
        for i in range(args.opencode):
            out = {}

            def go(call: Call) -> None:
                out[call.index] = send(server.url, server.model, call, args.timeout)

            title = threading.Thread(target=go, args=(Call(0, 0, "chat", True, 1300, 8, "answer", 0, 1000 + i),))
            title.start()
            time.sleep(0.33)
            go(Call(1, 1, "chat", True, 16000, 32, "answer", 0, 2000 + i))
            title.join()
            t, m = out[0], out[1]
            turns.append({"title_s": _r(t.latency), "main_s": _r(m.latency), "title_status": t.status,
                          "main_status": m.status, "title_prompt_tokens": t.prompt_tokens,
                          "main_prompt_tokens": m.prompt_tokens, "error": t.error or m.error})
            print(f"turn {i + 1}: title {turns[-1]['title_s']} s, main {turns[-1]['main_s']} s", file=sys.stderr)
    titles = [x["title_s"] for x in turns if x["title_s"] is not None]
    return {"setting": setting.name, "turns": len(turns), "solo_title_s": [_r(x) for x in solo_title],
            "title_max_s": max(titles, default=None), "title_median_s": _r(sorted(titles)[len(titles) // 2]) if titles
            else None, "under_2s": sum(x < 2.0 for x in titles), "stalls": sum(x["title_s"] is None or
                                                                                 x["main_s"] is None for x in turns),
            "status_5xx": sum((x[k] or 0) >= 500 for x in turns for k in ("title_status", "main_status")),
            "queue_ahead_s": 0.0, "load_before": load, "load_after": os.getloadavg(), "per_turn": turns}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def save(name: str, report: dict) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data["environment"] = environment()
    data.setdefault("runs", {})[name] = report | {"commit": commit()}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")


def plot() -> Path:
    """bench/results/stress.png: each storm's calls, latency against bound (log-log), one panel per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {k: v for k, v in json.loads(RESULTS.read_text())["runs"].items() if "rows" in v}
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 4.2), squeeze=False)
    for ax, (name, run) in zip(axes[0], runs.items()):
        rows = [r for r in run["rows"] if r["latency_s"] is not None]
        for action, color in (("answer", "tab:blue"), ("cancel", "tab:orange"), ("garbage", "tab:gray")):
            mine = [r for r in rows if r["action"] == action]
            ax.scatter([r["bound_s"] for r in mine], [r["latency_s"] for r in mine], s=9, c=color, label=action)
        top = max([r["bound_s"] for r in rows] + [r["latency_s"] for r in rows])
        ax.plot([0.01, top], [0.01, top], "k--", lw=0.8, label="the bound")
        ax.set(xscale="log", yscale="log", xlabel="bound (s)", ylabel="latency (s)",
               title=f"{name}\n{run['summary']['stalls']} past the bound, {run['summary']['status_5xx']} 5xx")
        ax.title.set_fontsize(8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = RESULTS.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="bundled")
    p.add_argument("--wavefront", choices=["on", "off"], default="on", help="HETERO_PREFILL_WAVEFRONT")
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--max-concurrent", type=int, default=4)
    p.add_argument("--ane-fraction", type=float, default=None)
    p.add_argument("--prefill-chunk", type=int, default=None, help="default: the layout's")
    p.add_argument("--max-prompt", type=int, default=60_000, help="longest prompt drawn, in tokens")
    p.add_argument("--max-gap", type=float, default=1.0)
    p.add_argument("--max-new", type=int, default=16)
    p.add_argument("--seed", type=int, default=47)
    p.add_argument("--timeout", type=float, default=1800.0, help="a call with no answer by then is a stall")
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    p.add_argument("--opencode", type=int, default=0, help="run the OpenCode pattern N times instead of a storm")
    p.add_argument("--name", default=None, help="the run's key in the JSON (default: from the setting)")
    p.add_argument("--plot", action="store_true", help="only draw bench/results/stress.png from the JSON")
    args = p.parse_args()
    if args.plot:
        print(plot().relative_to(ROOT), file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory(prefix="hetero-stress-") as tmp:
        if args.opencode:
            report = run_opencode(args, Path(tmp))
            ok = report["stalls"] == 0 and report["status_5xx"] == 0 and report["under_2s"] == report["turns"]
        else:
            report = run_storm(args, Path(tmp))
            s = report["summary"]
            ok = not report["failures"] and not report["monitor"]["problems"] and not report["reconciled"]
            print(json.dumps(s, indent=1), file=sys.stderr)
            for f in report["failures"][:20]:
                print("FAIL", f, file=sys.stderr)
    name = args.name or report["setting"]
    save(name, report)
    print(f"{name}: {'ok' if ok else 'FAILED'} -> {RESULTS.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
