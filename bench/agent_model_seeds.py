"""Does the agent models' training recipe hold on any machine? Each CLI's model trained at several seeds (a seed
stands in for another machine's roundings), each verified on held-out conversations after 0-30K characters of text
(tests/agent_model.py `verify_agent_model`) and then run in the real CLI's tool loop (tests/agent_clis.py), as
tests/test_agent_clis.py runs the shipped one.

    python bench/agent_model_seeds.py                          # claude, codex, opencode at seeds 1-3
    python bench/agent_model_seeds.py --clis claude --seeds 3 4

Writes bench/results/agent_model_seeds.json: per CLI and seed, the steps and margin the fit reached, whether the
verification and the CLI's tool loop passed (and what the CLI showed when it did not). The shipped models
(tests/models/agent-CLI) are seed 0. The former recipe (150 steps, no margin) failed at 2 of 5 seeds tried: opencode
seed 0 (margin -0.57: it answered before calling the tool) and claude seed 3 (it called the tool again after every
result until the context was full). Needs npm and `unshare -n`, as the tests do.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HETERO_HOME", tempfile.mkdtemp(prefix="hetero-bench-home-"))  # settings never in ~/.config

import agent_clis  # noqa: E402
import agent_model  # noqa: E402

from hetero.host import blas  # noqa: E402


def one(cli: str, seed: int, root: Path) -> dict:
    model = root / f"{cli}-{seed}"
    t0 = time.perf_counter()
    fit = agent_model.write_agent_model(model, cli, seed=seed)
    row = {"cli": cli, "seed": seed, **fit, "train_s": round(time.perf_counter() - t0)}
    try:
        row["verified"] = agent_model.verify_agent_model(model, cli)["replies"]
    except RuntimeError as e:
        row["verified"], row["verify_error"] = False, str(e)[:300]
    tools = [agent_model.CALLS[cli][0]] if cli == "claude" else None
    result = agent_clis.session(cli, str(model), [agent_model.PROMPTS[cli]], root / f"{cli}-{seed}-run",
                                agent_clis.install(), tools=tools, timeout=300)
    (turn,) = result["turns"]
    row["cli_passed"] = (agent_model.PROOF_FILE in result["files"]
                         and agent_model.FINAL_ANSWER in turn["reply"]["text"] and turn["reply"]["error"] is None)
    row["requests"] = len([r for r in turn["requests"] if "prompt" in r])
    if not row["cli_passed"]:
        row["cli_showed"] = (turn["reply"]["error"] or turn["reply"]["text"])[:300]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clis", nargs="+", choices=sorted(agent_model.CALLS), default=sorted(agent_model.CALLS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    why = agent_clis.namespaces_available()
    if why:
        raise SystemExit(f"cannot run the agent CLIs here: {why}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in a.seeds:
            for cli in a.clis:
                rows.append(one(cli, seed, Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
    out = Path(a.out or ROOT / "bench/results/agent_model_seeds.json")
    summary = {cli: f"{sum(r['cli_passed'] for r in rows if r['cli'] == cli)}/{len(a.seeds)}" for cli in a.clis}
    out.write_text(json.dumps({"cli_tool_loop_passed": summary, "runs": rows,
                               "environment": {"machine": platform.machine(), "blas": blas.describe(),
                                               "pins": agent_clis.PINS, "shared_machine": True}}, indent=2) + "\n")
    print(f"{out}: {summary}")


if __name__ == "__main__":
    main()
