"""What `--verify` sees: each path's distance (hetero/pipeline/distance.py: the largest relative RMS difference of
any block) from the same prompt computed in fp32, per dtype, for honest splits and the documented defects, and the
fp32 split's own distance on long prompts (the `ANE_FLOOR` of hetero/pipeline/verification.py).

    python bench/verify_noise.py                 # bundled + real-shape models, 167-token code prompt; 8K and 16K floor
    python bench/verify_noise.py --long 8192     # a shorter floor measurement

Rows: for each checkpoint and dtype, d(gpu, fp32), d(split, fp32) of the honest split at 0.5 and of the split with an
MLP program losing half its output and a GDN z program returning zeros; the bound K x d(gpu) + ANE_FLOOR and whether
each passes, and the ratio d(split) / d(gpu) that K covers. JSON to bench/results/verify_noise.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import hetero  # noqa: E402  (first: it puts the fast BLAS under MLX)
from hetero.host.environment import environment  # noqa: E402

PROMPT = "def add(a, b):\n    return a + b\n" * 12


def defects(progs) -> dict:
    """name -> (programs of a piece kind, output factor) for the documented defects."""
    return {"mlp_half": (progs.mlp, 0.5), "z_zero": (progs.gdn_in_proj, 0.0)}


def checkpoint_rows(name: str, path) -> list[dict]:
    import mlx.core as mx

    from hetero.pipeline import configure, verify
    from hetero.pipeline.verification import FP32Reference

    rows = []
    for dtype_name, dtype in (("float32", mx.float32), ("bfloat16", mx.bfloat16), ("float16", mx.float16)):
        engine = hetero.load(path, dtype)
        ids = engine.encode_prompt(PROMPT, False)[:-1]
        run = configure(engine, 0.5, 64)
        progs = run.splitter(len(ids)).programs
        row = {"checkpoint": name, "dtype": dtype_name, "tokens": len(ids)}
        fp32 = FP32Reference(engine)  # one fp32 copy and reference prefill for the honest run and each defect
        honest = verify(run, ids, n_tokens=8, fp32=fp32)
        row.update(gpu_to_fp32=honest["gpu_distance"], bound=honest["tolerance"],
                   honest={"split_to_fp32": honest["distance"], "worst": honest["worst"], "match": honest["match"]})
        for defect, (programs, factor) in defects(progs).items():
            layer = sorted(programs)[0]
            program, units = programs[layer][0]
            programs[layer][0] = (lambda feed, p=program, f=factor: {k: v * f for k, v in p(feed).items()}, units)
            check = verify(run, ids, n_tokens=1, fp32=fp32)
            programs[layer][0] = (program, units)
            row[defect] = {"split_to_fp32": check["distance"], "match": check["match"]}
        if row["gpu_to_fp32"]:
            row["honest_ratio"] = round(row["honest"]["split_to_fp32"] / row["gpu_to_fp32"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def floor_rows(sizes: list[int]) -> list[dict]:
    """fp32 split (0.5, chunk 512) against fp32 GPU-only on bench/ttft.py's model at long prompts."""
    from bench.ttft import build_engine, prompt_ids
    from hetero.decode.prefill import prefill
    from hetero.pipeline import configure
    from hetero.pipeline.distance import distance
    from hetero.pipeline.verification import arrays_of

    engine = build_engine(Path(tempfile.mkdtemp()))
    rows = []
    for n in sizes:
        ids = prompt_ids(n)
        cache = engine.model.make_cache()
        logits, _ = prefill(engine.model, ids, cache, 512)
        truth = arrays_of(logits, cache.backbone)
        split_cache = engine.model.make_cache()
        res = configure(engine, 0.5, 512).splitter(len(ids)).run(ids, split_cache, logits=True)
        ours = arrays_of(res.logits, split_cache.backbone)
        d, where = distance(ours, truth)
        rows.append({"tokens": n, "split_to_fp32": round(d, 6), "worst": where})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--long", default="8192,16384", help="prompt sizes of the fp32 floor measurement ('' to skip)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "verify_noise.json"))
    args = p.parse_args()
    from hetero.pipeline.verification import ANE_FLOOR, K
    from tiny_checkpoint import write_real_shape_model

    real = write_real_shape_model(Path(tempfile.mkdtemp()) / "real")
    rows = checkpoint_rows("bundled", None) + checkpoint_rows("real-shape seed 0", real)
    floor = floor_rows([int(n) for n in args.long.split(",") if n])
    result = {"K": K, "ANE_FLOOR": ANE_FLOOR, "rows": rows, "fp32_split_floor": floor, "environment": environment()}
    Path(args.out).write_text(json.dumps(result, indent=1))
    honest = all(r["honest"]["match"] for r in rows)
    caught = all(not r[d]["match"] for r in rows for d in ("mlp_half", "z_zero"))
    ratios = [r["honest_ratio"] for r in rows if "honest_ratio" in r]
    print(f"honest splits pass: {honest}; every defect caught: {caught}; d(split)/d(gpu) "
          f"{min(ratios):.2f}-{max(ratios):.2f} (K {K}); fp32 floor "
          + ", ".join(f"{r['tokens']}: {r['split_to_fp32']:.2e}" for r in floor) + f" (ANE_FLOOR {ANE_FLOOR:g})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
