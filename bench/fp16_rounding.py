"""The reference executor's fp16 rounding (`hetero.coreml.fp16.fp16_values`) against the version before it and numpy's
casts, alternated in one run.

    python bench/fp16_rounding.py                  # JSON under bench/results/fp16_rounding.json

Every op result of the reference executor is rounded to fp16 values (held in fp32). The version before rounded fp16
subnormals by picking them out with a boolean index (`a[small]`), which costs most where most values are tiny: a
softmax's probabilities over thousands of keys. The 27B doctor's 4,096-patch vision block spent 24 of its 39 s
there. Contenders, each on the same arrays, alternated round by round:
- `gather`: the version before (kept here as the baseline);
- `hetero`: `fp16_values` as it is (many subnormals: an add of 1/2 and a masked copy, no gather; a few: picked out);
- `numpy`: `a.astype(float16).astype(float32)`.
Arrays: `probabilities` (a softmax over 4,096 keys for 4,096 queries: 16.8M values, most below 2^-14) and
`activations` (16.8M N(0, 1) values: few subnormals). Reported: median seconds per array and each contender's ratio to
`gather` (median and min-max over rounds), all checked equal bit for bit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np  # noqa: E402

from hetero.coreml.fp16 import fp16_values  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "fp16_rounding.json"


def gather(a: np.ndarray) -> np.ndarray:
    """The rounding before: subnormals picked out by a boolean index (the baseline)."""
    bits = np.ascontiguousarray(a).view(np.uint32)
    out = (bits >> 13) & 1
    out += 0x0FFF
    out += bits
    out &= np.uint32(0xFFFFE000)
    out = out.view(np.float32)
    mag = np.abs(a)
    small = mag < 2.0**-14
    if small.any():
        out[small] = np.rint(a[small] * np.float32(2.0**24)) * np.float32(2.0**-24)
    large = ~(mag < 65520.0)
    if large.any():
        out[large] = np.where(np.isnan(a[large]), a[large], np.copysign(np.float32(np.inf), a[large]))
    return out


CONTENDERS = {"gather": gather, "hetero": fp16_values, "numpy": lambda a: a.astype(np.float16).astype(np.float32)}


def arrays(n: int = 4096) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((n, n), dtype=np.float32) * 3
    scores -= scores.max(axis=0, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=0, keepdims=True)
    return {"probabilities": probs, "activations": rng.standard_normal((n, n), dtype=np.float32)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    data, result = arrays(), {}
    for name, a in data.items():
        want = CONTENDERS["numpy"](a).view(np.uint32)
        assert all(np.array_equal(f(a).view(np.uint32), want) for f in CONTENDERS.values()), name
        times = {k: [] for k in CONTENDERS}
        for f in CONTENDERS.values():
            f(a)  # warm-up
        for _ in range(args.rounds):  # alternated: every round runs each contender once
            for k, f in CONTENDERS.items():
                t = time.perf_counter()
                f(a)
                times[k].append(time.perf_counter() - t)
        ratios = {k: [x / g for x, g in zip(v, times["gather"])] for k, v in times.items()}
        result[name] = {
            "values": int(a.size), "below_fp16_normal": round(float((np.abs(a) < 2.0**-14).mean()), 4),
            "median_s": {k: round(statistics.median(v), 4) for k, v in times.items()},
            "ratio_to_gather": {k: {"median": round(statistics.median(v), 3), "min": round(min(v), 3),
                                    "max": round(max(v), 3)} for k, v in ratios.items()},
        }
        print(name, json.dumps(result[name]))
    from hetero.host.blas import environment

    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"rounds": args.rounds, "results": result, "environment": environment(),
                               "note": "2-core dev machine shared with other engineers' jobs (load average ~7)"},
                              indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
