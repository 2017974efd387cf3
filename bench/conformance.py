"""The conformance sweep: every architecture's config space against transformers, more draws than the suite runs.

    python bench/conformance.py --draws 300                      # 300 draws per architecture, the first 100 split
    python bench/conformance.py --draws 20 --arch qwen4_exp      # one architecture
    python bench/conformance.py --split-draws 0                  # numerics only
    python bench/conformance.py --replay '<a draw's JSON>'       # one draw again (a failing test's message has it)
    python bench/conformance.py --qsa-budgets 8,64,512,2048      # the QSA case at budgets up to the released 2048
    python bench/conformance.py --merge a.json b.json --out all.json   # sweeps run in parts, summarised as one

Each draw (tests/conformance_space.py, sized FULL) is written by transformers and checked on the whole path
(tests/conformance_checks.py): logits at every position against transformers in float64, greedy tokens, chunked
prefill, cached decode, MTP against plain, a repeated pass. The first `--split-draws` draws of each architecture
also run the split at fraction 0.5 in fp32, bf16 and fp16 (real-LLM massive activations drawn in two of three;
fp16 takes their mild form) and must pass `--verify`, stay engaged and decode the GPU-only tokens.

Writes bench/results/conformance.json as it goes (every draw's config, worst error per check, failures), then a
summary: per architecture the failures and the worst error of each check, and per config field and value the worst
error and the failures seen (`by_field`). `--merge` joins sweeps run in parts: the summary in `--out`, every draw
in `<out>_records.json.gz`. Heavy: run it under `flock /tmp/hetero-heavy.lock nice -n 5`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HETERO_KERNEL_CACHE", str(Path.home() / ".cache" / "hetero" / "kernels"))
import hetero  # noqa: E402,F401  (first: the fast BLAS under MLX)
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402

import conformance_checks as cc  # noqa: E402
from conformance_space import ARCHITECTURES, DTYPE_NAMES, FULL, Draw, milder, split_draw  # noqa: E402
from hetero.host.environment import environment  # noqa: E402

CHECKS = ("logits", "greedy", "chunked", "decode", "mtp", "repeat", "split_distance", "split_engaged")


def draws_of(arch: str, n: int, seed: int) -> list[Draw]:
    """n distinct draws of `arch` (the split's strategy: the numerics and the split share them) from `seed`."""
    out: dict[str, Draw] = {}

    @hypothesis_seed(seed)
    @settings(max_examples=4 * n, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(split_draw(arch, FULL))
    def grab(draw):
        if len(out) < n:
            out.setdefault(json.dumps(draw.to_json(), sort_keys=True), draw)

    grab()
    return list(out.values())


def run_one(draw: Draw, root: Path, split: bool, lane: str) -> dict:
    """The draw's numerics, and with `split` the split in each dtype (fp16 on the mild form of strong outliers,
    whose GPU-only path overflows fp16 itself)."""
    started = time.time()
    record = {"arch": draw.arch, "source": draw.source, "draw": draw.to_json()}
    try:
        mild = milder(draw)
        dtypes = DTYPE_NAMES if mild is draw else tuple(d for d in DTYPE_NAMES if d != "float16")
        result = cc.run_draw(draw, root, dtypes if split else (), lane)
        if split and mild is not draw and not result.refused:
            more = cc.run_draw(mild, root, ("float16",), lane, numerics=False)
            for part in ("errors", "failures", "refused"):
                getattr(result, part).update(getattr(more, part))
            result.split = {**(result.split or {}), **(more.split or {})}
        record.update(result.to_json(), expected_refusal=bool(result.refused) and result.refused_as_expected(draw))
    except Exception:  # a crash is a failure of the draw, recorded, and the sweep goes on
        record["crash"] = traceback.format_exc()[-2000:]
    record["seconds"] = round(time.time() - started, 2)
    return record


def failed(record: dict) -> list[str]:
    """The checks a record failed (numerics, split per dtype, a crash)."""
    unexpected = record.get("refused") and not record.get("expected_refusal")
    return list(record.get("failures") or {}) + (["crash"] if "crash" in record else []) + (
        ["refused"] if unexpected else [])


def _fields(draw: dict) -> dict[str, str]:
    """A draw's fields as (name -> value) strings for the per-field summary."""
    out = {}
    for key, value in draw["config"].items():
        if key == "layer_types":
            out[key] = "".join("L" if t == "linear_attention" else "A" for t in value)
        elif isinstance(value, dict):
            out.update({f"{key}.{k}": json.dumps(v) for k, v in value.items()})
        else:
            out[key] = json.dumps(value)
    out["prompt"] = str(draw["prompt"])
    out["mtp"] = str(draw["mtp"])
    out["outliers"] = (draw.get("outliers") or {}).get("level", "none")
    out.update({f"weights.{k}": str(v) for k, v in draw["weights"].items()})
    return out


def _worst(record: dict) -> dict[str, float]:
    """Each check's worst error in a record (a split's checks per dtype: `float16 split_distance`)."""
    return {k: v for k, v in (record.get("errors") or {}).items() if k.split(" ")[-1] in CHECKS}


def summary(records: list[dict]) -> dict:
    """Per architecture: draws, failures (by check), refusals, the worst error of each check; per field and value:
    draws, failures and the worst error of each check."""
    arches, fields = {}, {}
    for r in records:
        a = arches.setdefault(r["arch"], {"draws": 0, "split_draws": 0, "failed_draws": 0, "failures": {},
                                          "refused": {}, "worst": {}, "seconds": 0.0})
        a["draws"] += 1
        a["split_draws"] += bool(r.get("split"))
        a["seconds"] = round(a["seconds"] + r["seconds"], 1)
        bad = failed(r)
        a["failed_draws"] += bool(bad)
        for b in bad:
            a["failures"][b] = a["failures"].get(b, 0) + 1
        for what, why in (r.get("refused") or {}).items():
            a["refused"][why] = a["refused"].get(why, 0) + 1
        worst = _worst(r)
        for k, v in worst.items():
            a["worst"][k] = max(v, a["worst"].get(k, 0.0))
        for name, value in _fields(r["draw"]).items():
            f = fields.setdefault(name, {}).setdefault(value, {"draws": 0, "failed": 0})
            f["draws"] += 1
            f["failed"] += bool(bad)
            for k, v in worst.items():
                f[k] = max(v, f.get(k, 0.0))
    return {"architectures": arches, "by_field": fields}


def replay(text: str, lane: str) -> None:
    """Run one draw (its JSON) again, the split in every dtype, and print what it found."""
    draw = Draw.from_json(json.loads(text))
    record = run_one(draw, Path(tempfile.mkdtemp()), split=True, lane=lane)
    print(json.dumps(record, indent=1))


def qsa_budgets(budgets: list[int], out: Path) -> None:
    """The issue's QSA layout (tests/test_conformance_regressions.py) at each budget, a prompt of 3 budgets: the
    worst relative error against transformers (ties in index order, near-ties pinned to hetero's choice:
    tests/conformance_oracle.py) over every position, and without the near-ties pinned."""
    import mlx.core as mx
    import numpy as np

    import qwen4_checkpoint as qc
    from conformance_oracle import Choices, pinned
    from hetero.checkpoint.loader import load_model
    from test_conformance_regressions import _issue_layout

    rows = []
    for budget in budgets:
        path = Path(tempfile.mkdtemp()) / f"qsa-{budget}"
        started = time.time()
        hf = qc.build(path, ple_layer_ids=(1,), seed=budget, **_issue_layout(budget, 4, 2))
        tokens = np.random.default_rng(budget).integers(2, qc.VOCAB, 3 * budget).tolist()
        model = load_model(path, mx.float32)[0]
        choices = Choices()
        with choices.recording(model):
            ours = np.array(model(mx.array([tokens]))[0][0])
        free = cc.relative(ours, cc.hf_logits(hf, tokens))
        with pinned(hf, choices):
            error = cc.relative(ours, cc.hf_logits(hf, tokens))
        rows.append({"budget": budget, "tokens": len(tokens), "relative_error": error,
                     "within_1e-4": error <= cc.TOL, "near_ties_pinned": choices.ties,
                     "relative_error_unpinned": free, "seconds": round(time.time() - started, 1)})
        print(json.dumps(rows[-1]), flush=True)
    out.write_text(json.dumps({"qsa_budgets": rows, "environment": environment()}, indent=1))
    print(f"wrote {out}")


SPLIT_FIELDS = ("match", "distance", "gpu_distance", "tolerance", "worst", "choice_flips", "effective_fraction",
                "unranged_fraction", "lane_failures", "greedy_match_tokens", "greedy_tie_at")


def compact(record: dict) -> dict:
    """A record as the committed results keep it: the draw, each check's worst error, the failures and refusals,
    and of each split its verdict (`SPLIT_FIELDS`)."""
    split = {d: {k: r.get(k) for k in SPLIT_FIELDS if k in r} for d, r in (record.get("split") or {}).items()}
    keep = ("arch", "source", "draw", "errors", "failures", "refused", "expected_refusal", "crash", "seconds")
    return {**{k: record[k] for k in keep if k in record}, **({"split": split} if split else {})}


def merge(files: list[str], out: Path) -> None:
    """Several sweeps' records (runs of a few architectures each, under the heavy-job lock in turns) as one result:
    duplicate draws counted once, the summary over all of them in `out`, every draw (`compact`) in
    `<out>_records.json.gz`."""
    records, seen, meta = [], set(), {}
    for name in files:
        data = json.loads(Path(name).read_text())
        meta.setdefault("environment", data.get("environment"))
        meta.setdefault("seeds", []).append(data.get("seed"))
        for r in data["records"]:
            key = json.dumps([r["draw"], bool(r.get("split"))], sort_keys=True)
            if key not in seen:
                seen.add(key)
                records.append(r)
    records_file = out.with_name(out.stem + "_records.json.gz")
    result = {"merged_from": [Path(f).name for f in files], "summary": summary(records), "records": records_file.name,
              "machine_shared": True, **meta}
    out.write_text(json.dumps(result, indent=1))
    with gzip.open(records_file, "wt") as f:
        json.dump([compact(r) for r in records], f, separators=(",", ":"))
    print(json.dumps(result["summary"]["architectures"], indent=1))
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--draws", type=int, default=20, help="draws per architecture")
    p.add_argument("--split-draws", type=int, default=None, help="of them, how many also run the split (default: "
                   "min(draws, 100))")
    p.add_argument("--arch", action="append", choices=ARCHITECTURES, help="architectures (default: all)")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed of the draws")
    p.add_argument("--lane", default="thread", choices=("thread", "process"), help="the split's ANE lane")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "conformance.json"))
    p.add_argument("--replay", help="one draw's JSON: run it again and print the result")
    p.add_argument("--qsa-budgets", help="comma-separated QSA budgets: the issue's QSA layout at each")
    p.add_argument("--merge", nargs="+", help="result files of several sweeps: one result of them all in --out")
    args = p.parse_args()
    if args.merge:
        return merge(args.merge, Path(args.out))
    if args.replay:
        return replay(args.replay, args.lane)
    if args.qsa_budgets:
        return qsa_budgets([int(b) for b in args.qsa_budgets.split(",")], Path(args.out))
    split_draws = min(args.draws, 100) if args.split_draws is None else args.split_draws
    root = Path(tempfile.mkdtemp(prefix="conformance-"))
    os.environ.setdefault("HETERO_HOME", str(root / "home"))  # the splits' exports: a throwaway home
    records: list[dict] = []
    out = Path(args.out)
    for arch in args.arch or ARCHITECTURES:
        for i, draw in enumerate(draws_of(arch, args.draws, args.seed)):
            records.append(run_one(draw, root, i < split_draws, args.lane))
            r = records[-1]
            print(f"{arch} {i + 1}/{args.draws} {r['source']} {r['seconds']}s {failed(r) or 'ok'}", flush=True)
            result = {"draws_per_arch": args.draws, "split_draws_per_arch": split_draws, "seed": args.seed,
                      "lane": args.lane, "summary": summary(records), "records": records,
                      "machine_shared": True, "environment": environment()}
            out.write_text(json.dumps(result, indent=1))
    print(json.dumps(summary(records)["architectures"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
