"""The CPU prefill wavefront (hetero.decode.wavefront) against the one-lane prefill, same model, same run.

    python bench/prefill_wavefront.py                       # the random scaled-down Flash-Next (bench/checkpoints.py
                                                            # QWEN4), a 4K-token prompt, 512-token chunks
    python bench/prefill_wavefront.py --models qwen4 moe --lengths 4096 --repeats 3

Each run prefills the prompt into a fresh cache (as `hetero run` does: the last position's logits, the MTP head's
pairs when the checkpoint has a head), alternating one lane / wavefront. Besides tok/s it reports the process's
CPU seconds and the cores it kept busy (CPU time / wall time): on a loaded machine the wall times say little, while
the CPU seconds move less, and the wavefront's wall time on a quiet machine is at least half of its CPU seconds.
`lanes_waiting`: the share of the wall time a lane spent waiting on the other (their mean), the overlap lost.
JSON under bench/results/prefill_wavefront.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hetero.host.blas import reexec_with_fast_blas  # noqa: E402
from hetero.host.environment import environment
from bench.checkpoints import checkpoint  # noqa: E402
from hetero.checkpoint.loader import load_model  # noqa: E402
from hetero.decode import wavefront  # noqa: E402
from hetero.decode.prefill import prefill  # noqa: E402


WAITED: dict[str, float] = {}  # seconds each lane's thread spent waiting on the other lane, this run


def _timed_wait(wait):
    def timed(self, k: int, layer: int, caller: bool) -> None:
        start = time.perf_counter()
        try:
            wait(self, k, layer, caller)
        finally:
            name = threading.current_thread().name
            WAITED[name] = WAITED.get(name, 0.0) + time.perf_counter() - start
    return timed


wavefront._Front.wait = _timed_wait(wavefront._Front.wait)


def run(model, prompt: list[int], chunk: int, on: bool) -> tuple[float, float, np.ndarray, float, float]:
    """(tok/s, cores busy, the last logits, CPU seconds, the share of the wall time the lanes waited on each other
    (mean of the two)) of one prefill into a fresh cache."""
    os.environ[wavefront.ENV] = "1" if on else "0"
    cache = model.make_cache()
    WAITED.clear()
    cpu, start = time.process_time(), time.perf_counter()
    logits, _ = prefill(model, prompt, cache, chunk, mtp=model.has_mtp)
    mx.eval(logits)
    wall, busy = time.perf_counter() - start, time.process_time() - cpu
    waited = sum(WAITED.values()) / 2 / wall if on else 0.0
    return len(prompt) / wall, busy / wall, np.array(logits), busy, waited


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen4"], help="bench/checkpoints.py names (default: qwen4)")
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096])
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (hetero's default: 512)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "hetero-bench"))
    ap.add_argument("--out", default="bench/results/prefill_wavefront.json")
    args = ap.parse_args()
    reexec_with_fast_blas()

    rng = np.random.default_rng(0)
    rows = []
    for name in args.models:
        model = load_model(checkpoint(name, Path(args.workdir)), dtype=mx.float32)[0]
        run(model, rng.integers(3, model.args.vocab_size, 2 * args.chunk).tolist(), args.chunk, True)  # warm-up
        for length in args.lengths:
            prompt = rng.integers(3, model.args.vocab_size, length).tolist()
            got = {"one_lane": [], "wavefront": []}
            for _ in range(args.repeats):  # alternate A B A B
                for who, on in (("one_lane", False), ("wavefront", True)):
                    got[who].append(run(model, prompt, args.chunk, on))
            ref = got["one_lane"][0][2]
            row = {"model": name, "prompt_tokens": length, "chunk": args.chunk,
                   "max_logit_diff": max(float(np.abs(r[2] - ref).max()) for r in got["wavefront"]),
                   "same_greedy": all(int(r[2].argmax()) == int(ref.argmax()) for r in got["wavefront"])}
            for who, runs in got.items():
                row[who] = {"prefill_tps": statistics.median(r[0] for r in runs), "prefill_tps_runs": [r[0] for r in runs],
                            "cores_busy": statistics.median(r[1] for r in runs),
                            "cpu_s": statistics.median(r[3] for r in runs),
                            "lanes_waiting": statistics.median(r[4] for r in runs)}
            row["ratio"] = row["wavefront"]["prefill_tps"] / row["one_lane"]["prefill_tps"]
            rows.append(row)
            one, wave = row["one_lane"], row["wavefront"]
            print(f"{name:8s} {length:6d} tok | one lane {one['prefill_tps']:8.1f} tok/s ({one['cores_busy']:.2f} cores "
                  f"busy, {one['cpu_s']:.2f} CPU s), wavefront {wave['prefill_tps']:8.1f} tok/s ({wave['cores_busy']:.2f}, "
                  f"{wave['cpu_s']:.2f} CPU s, lanes waiting {wave['lanes_waiting']:.0%}) -> {row['ratio']:.2f}x | max logit diff "
                  f"{row['max_logit_diff']:.2e}, greedy {'same' if row['same_greedy'] else 'DIFFERS'}", flush=True)
        del model
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": environment(), "rows": rows, "args": vars(args)}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
