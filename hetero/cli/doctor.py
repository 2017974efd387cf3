"""`hetero doctor`: what the split prefill runs on here and whether it works, each finding named for what it is.

It never crashes: every check runs guarded and ends with its own verdict, `pass`, `fail` or `unavailable` (with the
reason), the JSON report is printed whole whatever happened, and the exit code says which checks failed (one bit per
check, `EXIT_BITS`; 1 stays a user error, as for every command: a model that cannot be read):

- `backend`: the ANE lane's backend (Core ML, or the reference executor and why) and its worker process;
- `os`: this Mac's export target (`hetero.coreml.target`: fp16 single-function packages below macOS 15), the weight
  form that leaves, the compute plan's availability; a package whose specification the OS refused fails here;
- `placement`: Core ML's compute plan of every program checked, judged by cost (at most 2% of a program's estimated
  cost off the Neural Engine; unplaced functions counted apart; a failed query is a failure);
- `fallback`: each program timed under CPU_AND_NE against CPU_ONLY, flagged unless the Neural Engine is clearly
  faster (this catches silent fallbacks, and a macOS with no compute plan);
- `numbers`: every program's outputs finite and within the reference executor's on the same inputs;
- `weights`: the three exact weight forms of `--ane-weights` at the plan's MLP shape, with a recommendation;
- `split`: a real split prefill of the model (lane rates, overlap, its programs in the worker), verified against the
  GPU-only run; with a bare config (no weights) it is unavailable.

The programs checked are the plan's own (`hetero.cli.doctor_probes`: one per piece kind at the planned shapes, random
weights), then, with weights, every program the split loaded. On a Mac the doctor also times both attention layouts
and keeps the faster for later exports (`hetero.pipeline.programs.save_attention_layout`).
"""

from __future__ import annotations

import platform
import sys
import time
import traceback
from collections.abc import Callable

from hetero.cli.doctor_checks import (
    EXIT_BITS, check_backend, check_os, check_probes, check_split_lane, check_weights, read_model, verdicts,
)
from hetero.coreml.target import DEFAULT_WEIGHT_FORM, OS_REFUSED
from hetero.errors import HeteroError


def doctor(model: str | None = None, tokens: int = 1024, fraction: float = 0.5, chunk: int = 256,
           report: Callable[[str], None] = print, weights: str = DEFAULT_WEIGHT_FORM, dtype=None,
           engine=None) -> dict:
    """Run every check for `model` (a checkpoint, or a bare config.json: then the programs are probed at the planned
    shapes and the split is unavailable; `engine`: one already loaded). `report` gets one line per finding as it comes.
    Returns the findings: each check's verdict under `checks`, `exit_code` (the failed checks' bits) and `ok`."""
    start = time.perf_counter()
    out: dict = {"platform": _platform(), "checks": {}}
    state: dict = {"model": model, "dtype": dtype, "engine": engine, "tokens": tokens, "fraction": fraction,
                   "chunk": chunk, "weights": weights, "on_mac": False}
    steps = [("model", read_model, ()), ("backend", check_backend, ("model",)), ("os", check_os, ("backend",)),
             ("probes", check_probes, ("os",)), ("weights", check_weights, ("probes",)),
             ("split", check_split_lane, ("backend", "os"))]
    for name, step, needs in steps:
        failed = [n for n in needs if n in out.get("errors", {}) or n in out.get("skipped", {})]
        if failed:  # named, not run: its verdict says which step it waited for
            out.setdefault("skipped", {})[name] = f"not run: the {failed[0]} step failed"
            continue
        _guarded(name, step, state, out, report)
    judge(out)
    for name, found in out["checks"].items():
        report(f"check {name}: {found['verdict'].upper()}" + (f" ({found['reason']})" if found.get("reason") else ""))
    out["failed"] = [name for name, found in out["checks"].items() if found["verdict"] == "fail"]
    out["exit_code"] = sum(EXIT_BITS[name] for name in out["failed"])
    if "model" in out.get("errors", {}):  # nothing was checked: a user error, as every command exits with
        out["exit_code"] = 1
    out["ok"] = not out["failed"] and out["exit_code"] == 0
    out["not_checked"] = _not_checked(out)
    for line in out["not_checked"]:
        report(f"not checked: {line}")
    out["seconds"] = round(time.perf_counter() - start, 3)
    report(f"{'all checks passed' if out['ok'] else 'SOME CHECKS FAILED: ' + ', '.join(out['failed'])} "
           f"(exit code {out['exit_code']}; {out['seconds']} s)")
    return out


def _guarded(name: str, step, state: dict, out: dict, report) -> None:
    """Run one step; anything it raises becomes that step's failure (`errors[name]`), never the doctor's crash."""
    try:
        step(state, out, report)
    except Exception as e:  # noqa: BLE001  (the doctor reports every failure and goes on)
        text = str(e).strip().splitlines()
        line = f"{type(e).__name__}: {text[0] if text else ''}"
        out.setdefault("errors", {})[name] = line
        if not isinstance(e, HeteroError):
            out["errors"][name + "_traceback"] = traceback.format_exc(limit=6).splitlines()[-6:]
        report(f"{name}: FAILED: {line}")


def judge(out: dict) -> None:
    """Each check's verdict from what the steps found (`hetero.cli.doctor_checks.verdicts`), errors included: a
    refused specification anywhere is the OS's failure, whatever step met it."""
    out["checks"] = verdicts(out)
    if "model" in out.get("errors", {}):
        why = f"the model could not be read ({out['errors']['model']})"
        out["checks"] = {name: {"verdict": "unavailable", "reason": why} for name in EXIT_BITS}
        return
    refused = [line for line in _error_lines(out) if OS_REFUSED in line]
    if refused:
        out["checks"]["os"] = {"verdict": "fail", "reason": refused[0]}


def _error_lines(out: dict) -> list[str]:
    """Every failure line the report holds: step errors, and the program checks' failures."""
    lines = [v for k, v in out.get("errors", {}).items() if isinstance(v, str)]
    lines += out.get("programs", {}).get("failures", [])
    lines += [f.get("why", "") for f in out.get("weights", {}).get("forms", {}).values()]
    return lines + [e.get("error", "") for e in out.get("probes", {}).get("each", [])]


def _platform() -> dict:
    import mlx.core as mx

    return {"system": platform.platform(), "python": platform.python_version(), "mlx": mx.__version__,
            "mlx_device": str(mx.default_device())}


def _not_checked(out: dict) -> list[str]:
    """What this run could not check, with why."""
    lines = [f"{name}: {found['reason']}" for name, found in out["checks"].items() if found["verdict"] == "unavailable"]
    if out.get("os", {}).get("macos") is None:
        lines += ["the per-instance ANE weight window (a profile figure, unknown unless measured on a Mac)",
                  "on a Mac, run: hetero doctor --json (add --model DIR or a config.json for the model you run)"]
    else:
        lines.append("the per-instance ANE weight window (a profile figure; not measured by doctor yet)")
    return lines


def print_report(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

