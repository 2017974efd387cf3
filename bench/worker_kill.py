"""Kill the ANE lane's worker at given seconds into a long split run: `hetero run --ane-fraction 0.5` must still exit
0 with exactly the GPU-only tokens, one warning line and no traceback, whichever phase the kill lands in (the
programs' export or load, a job, between jobs).

    python bench/worker_kill.py                       # the bundled model, a ~4K-token prompt, kills at 1..10 s
    python bench/worker_kill.py --tokens 10000 --at 2,4,7,10,15

The worker is found as the child of the `hetero run` process whose command line runs `hetero.coreml.backends.ane_worker`
(Linux /proc) and SIGKILLed from outside. JSON to bench/results/worker_kill.json: per kill time, whether a worker
was there to kill, the exit status, whether the tokens equal the GPU-only run's, the warning lines and the phase
the warning names (a kill after the split's last job goes unnoticed: no warning, and the split's own tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n"


def worker_of(pid: int) -> int | None:
    """The pid of `pid`'s ANE worker child, if it has one now."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"hetero.coreml.backends.ane_worker" in cmd:
            return int(entry.name)
    return None


def hetero_run(prompt_file: str, split: bool, env: dict, kill_at: float | None = None) -> dict:
    cmd = [sys.executable, "-m", "hetero.cli.main", "run", "--prompt", "-", "--max-tokens", "16",
           "--no-mtp", "--json", *(["--ane-fraction", "0.5"] if split else [])]
    with open(prompt_file) as stdin:  # the prompt on stdin (`--prompt -`)
        proc = subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                cwd=ROOT)
    killed = None
    if kill_at is not None:
        deadline = time.monotonic() + kill_at
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        worker = worker_of(proc.pid) if proc.poll() is None else None
        if worker is not None:
            os.kill(worker, signal.SIGKILL)
            killed = worker
    out, err = proc.communicate(timeout=1800)
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    try:
        tokens = json.loads(out)["tokens"]
    except (ValueError, KeyError):
        tokens = None
    return {"rc": proc.returncode, "tokens": tokens, "killed_worker": killed, "warnings": warnings,
            "traceback": "Traceback" in err}


def _phase(warning: str) -> str:
    """What the worker was doing when it was lost, from the warning ("while loading x", "between jobs", ...)."""
    found = re.search(r"\(status [^)]*\) (.*?);", warning)
    return found[1] if found else warning


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length (about)")
    ap.add_argument("--at", default="1,2,3,4,5,6,7,8,10", help="seconds after start to kill the worker")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "worker_kill.json"))
    args = ap.parse_args()
    times = [float(t) for t in args.at.split(",")]
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "HETERO_HOME": home}  # a fresh export: the first kills land in it
        prompt = Path(home) / "prompt.txt"
        prompt.write_text(TEXT * (args.tokens // 24))
        gpu = hetero_run(str(prompt), False, env)
        assert gpu["rc"] == 0 and gpu["tokens"], gpu
        rows = []
        for t in times:
            r = hetero_run(str(prompt), True, env, kill_at=t)
            row = {"kill_at_s": t, "killed_worker": r["killed_worker"] is not None, "rc": r["rc"],
                   "gpu_only_tokens": r["tokens"] == gpu["tokens"], "warnings": len(r["warnings"]),
                   "phase": _phase(r["warnings"][0]) if r["warnings"] else None,
                   "traceback": r["traceback"]}
            # a kill after the split's last job goes unnoticed (no warning; the split's own tokens)
            row["ok"] = (row["rc"] == 0 and row["warnings"] <= 1 and not row["traceback"]
                         and (row["gpu_only_tokens"] or not row["warnings"]))
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"tokens": args.tokens, "runs": rows, "all_ok": all(r["ok"] for r in rows)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"all ok: {result['all_ok']} ({sum(r['killed_worker'] for r in rows)} of {len(rows)} kills landed)")


if __name__ == "__main__":
    main()
