"""The lone plain row's round against an older stepper's, in one process: the bare step loop, an old tree's
`Batch` (its stepper.py loaded from --baseline), this tree's `decode_tokens` and `Engine.stream`.

    python bench/solo_round.py --baseline /tmp/base --threads 2     # /tmp/base: `git archive 479eedd | tar -x`

Bundled model, greedy, EOS ignored, 128 tokens after each of `bench/overhead.py`'s first three prompts. Each
round runs, per prompt, the loop, the old stepper, decode_tokens, stream and the loop again; each layer's tok/s is
divided by the mean of the two loops around it (a machine shared with other jobs drifts less within a prompt
than across a run), and the medians of those paired ratios are reported. Every layer's tokens must equal the
loop's. JSON under bench/results/solo_round.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="a checkout of the older tree (its hetero/decode/stepper.py)")
    ap.add_argument("--threads", type=int, choices=[1, 2], default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/solo_round.json")
    args = ap.parse_args()
    for var in ("MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import hetero  # noqa: F401  first: the fast BLAS under MLX
    from hetero.host.blas import reexec_with_fast_blas
    from hetero.host.environment import environment

    reexec_with_fast_blas()
    import mlx.core as mx

    from bench.overhead import SETTLE_S, Layers, tps
    from hetero.decode.sampling import Sampler
    from hetero.engine import load

    spec = importlib.util.spec_from_file_location("baseline_stepper", Path(args.baseline) / "hetero/decode/stepper.py")
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)  # its imports resolve to this tree's modules (rows, cache, ...)
    engine = load(None, dtype=mx.float32)
    engine.eos_ids = set()
    L = Layers(engine, 0, 128, None)

    def baseline(i: int):
        batch = old.Batch(engine.model, max_batch=1)
        row = batch.join(L.ids[i], Sampler(L.greedy), L.n, set(), 0, True)
        out, times = list(row.tokens), [time.perf_counter()]
        while not row.done:
            for t in batch.step().get(row, []):
                out.append(t)
                times.append(time.perf_counter())
        batch.leave(row)
        return out, tps(times)

    layers = {"baseline_stepper": baseline, "decode_tokens": L.decode_tokens, "stream": L.stream}
    for fn in [L.step_loop, *layers.values()]:  # warm-up
        fn(0)
    ratios: dict[str, list[float]] = {k: [] for k in layers}
    identical = True
    for _ in range(args.rounds):
        for i in range(3):
            time.sleep(SETTLE_S)
            ref, before = L.step_loop(i)
            rates = {}
            for k, fn in layers.items():
                time.sleep(SETTLE_S)
                out, rates[k] = fn(i)
                identical &= out == ref
            time.sleep(SETTLE_S)
            _, after = L.step_loop(i)
            for k, rate in rates.items():
                ratios[k].append(rate / ((before + after) / 2))
    result = {"environment": environment(), "args": vars(args), "greedy_identical": identical,
              "median_ratio_to_step_loop": {k: statistics.median(v) for k, v in ratios.items()}, "ratios": ratios}
    print(f"{args.threads} threads: " + ", ".join(f"{k}/loop {v:.3f}" for k, v in
                                                  result["median_ratio_to_step_loop"].items()) + f"; identical {identical}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if not identical:
        sys.exit("FAILED: a layer's greedy output differs from the step loop's")


if __name__ == "__main__":
    main()
