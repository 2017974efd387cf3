"""The first run's MTP verdict in fresh settings homes against an alternated comparison: does the default decode
the faster way on this machine?

    python bench/mtp_verdict.py                 # 10 fresh HETERO_HOMEs on the bundled model
    python bench/mtp_verdict.py --homes 3

Each trial: a fresh HETERO_HOME (the CPU kernels' build cache shared, as a second clone on the machine would find
it), `hetero run` once as a new user's first run does (it measures and saves the draft-depth verdict), then in this
process an alternated comparison of plain decoding and MTP at the default depth as `hetero run` decodes (copy lane
on): 3 rounds x 3 prompts x 128 tokens, each pair on the same prompt back to back, the order alternating; the
median of the 9 pairs' ratios says which is faster. The trial agrees when the verdict is MTP exactly where the
comparison's median ratio is above 1. Target: at least 9 of 10 agree. JSON to bench/results/mtp_verdict.json, with
the load average and the cores other processes kept busy during each trial (this machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.machine_load import LoadWindow, shared  # noqa: E402
from hetero.host.blas import reexec_with_fast_blas  # noqa: E402
from hetero.host.environment import environment  # noqa: E402

TARGET = 9  # of 10 trials agree


def first_run(home: Path) -> tuple[dict, float, str]:
    """`hetero run` in a fresh home: (the verdict it saved, its wall seconds, its stderr)."""
    env = {**os.environ, "HETERO_HOME": str(home), "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "hetero", "run", "--prompt", "def parse(line):", "--max-tokens", "8"],
                         env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit(f"hetero run failed: {out.stderr[-2000:]}")
    data = json.loads((home / "settings.json").read_text())
    (entry,) = [v for machine in data.values() for k, v in machine.items() if k.startswith("bundled@")]
    return entry, time.perf_counter() - t, out.stderr


def comparison(engine, prompts: list[list[int]], depth: int, rounds: int, tokens: int) -> dict:
    """Plain against MTP at `depth` (copy lane on, as `hetero run` decodes), alternated pair by pair."""
    ratios, plain, mtp = [], [], []
    for r in range(rounds):
        for i, p in enumerate(prompts):
            order = (None, depth) if (r + i) % 2 == 0 else (depth, None)
            got = {}
            for d in order:
                stats = engine.generate(p, max_tokens=tokens, mtp=d is not None, draft_depth=d).stats
                got[d] = stats["decode_tps"]
            plain.append(got[None])
            mtp.append(got[depth])
            ratios.append(got[depth] / got[None])
    return {"ratio": statistics.median(ratios), "ratios": ratios, "plain_tps": statistics.median(plain),
            "mtp_tps": statistics.median(mtp)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--homes", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "mtp_verdict.json"))
    a = p.parse_args()
    reexec_with_fast_blas()
    os.environ.setdefault("HETERO_KERNEL_CACHE", str(Path.home() / ".cache" / "hetero" / "kernels"))
    os.environ["HETERO_HOME"] = tempfile.mkdtemp(prefix="hetero-verdict-bench-")

    import hetero
    from bench.mtp import code_prompts
    from hetero.host.settings import DEFAULT_DRAFT_DEPTH, PLAIN, pin_tuning

    engine = hetero.load(None)
    pin_tuning(engine.identity, DEFAULT_DRAFT_DEPTH, "bench: the comparison names its own settings")
    prompts = code_prompts(engine, 3, 256)
    comparison(engine, prompts[:1], DEFAULT_DRAFT_DEPTH, 1, 32)  # warm-up
    trials = []
    for k in range(a.homes):
        with LoadWindow() as w:
            home = Path(tempfile.mkdtemp(prefix=f"hetero-fresh-{k}-"))
            entry, wall, err = first_run(home)
            ref = comparison(engine, prompts, DEFAULT_DRAFT_DEPTH, a.rounds, a.tokens)
        mtp_verdict = entry["draft_depth"] != PLAIN
        trial = {"verdict": entry["draft_depth"], "settled": entry["verdict"]["settled"], "why": entry["verdict"]["why"],
                 "pairs": entry["verdict"]["pairs"], "calibration_s": entry["verdict"]["seconds"],
                 "first_run_wall_s": round(wall, 2), "interval": entry["depths"][str(DEFAULT_DRAFT_DEPTH)]["ratio"],
                 "comparison": ref, "mtp_faster": ref["ratio"] > 1, "agrees": mtp_verdict == (ref["ratio"] > 1),
                 "machine": w.result}
        trials.append(trial)
        print(f"home {k}: verdict {trial['verdict']} ({'settled' if trial['settled'] else 'inside the noise'}, "
              f"{trial['pairs']} pairs, {trial['calibration_s']:.1f} s): {trial['why']}\n"
              f"        comparison {ref['ratio']:.2f}x (plain {ref['plain_tps']:.0f}, MTP {ref['mtp_tps']:.0f} tok/s); "
              f"agrees: {trial['agrees']}; load {w.result}", flush=True)
    agree = sum(t["agrees"] for t in trials)
    doc = {"environment": environment(), "model": "bundled", "depth": DEFAULT_DRAFT_DEPTH,
           "comparison": {"rounds": a.rounds, "prompts": len(prompts), "tokens": a.tokens, "copy_lane": True},
           "trials": trials, "agree": agree, "of": len(trials),
           "target": {"at_least": TARGET * len(trials) / 10, "met": agree >= TARGET * len(trials) / 10},
           "shared_machine": shared([t["machine"] for t in trials])}
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"{agree} of {len(trials)} first-run verdicts agree with the comparison (target {TARGET} of 10): "
          f"{doc['target']['met']}; shared machine: {doc['shared_machine']}")


if __name__ == "__main__":
    main()
