"""What one ANE-lane job costs in the worker process against the same program run in this process (the in-thread
lane), idle and while MLX keeps a core busy as the GPU lane does: which part of a split's process-lane cost is the
job itself, and which is the split's scheduling of both lanes.

    python bench/lane_job.py                # bench/ttft.py's model, its recommended kinds at 0.98
    python bench/lane_job.py --calls 20

Each program (the first layer's MLP and GDN z programs) runs `--calls` times per mode, modes alternated in rounds.
JSON to bench/results/lane_job.json: per program and condition, the medians of the in-process call, the worker's
round trip and the worker's own compute time, and the ratio round trip / in-process.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one lane is one core's worth of work, as in bench/ttft.py
os.environ.setdefault("OMP_NUM_THREADS", "1")
from hetero.host.blas import reexec_with_fast_blas  # noqa: E402
from hetero.host.environment import environment

CHUNK = 512


class MlxLoad:
    """A thread that keeps MLX's CPU stream busy with 512 x 1536 x 1536 products until stopped (the GPU lane)."""

    def __init__(self):
        import mlx.core as mx

        self.stop = threading.Event()
        self.a, self.w = mx.random.normal((CHUNK, 1536)), mx.random.normal((1536, 1536))
        mx.eval(self.a, self.w)
        self.thread = threading.Thread(target=self._spin)

    def _spin(self):
        import mlx.core as mx

        mx.set_default_stream(mx.new_stream(mx.default_device()))  # MLX streams are per thread
        while not self.stop.is_set():
            mx.eval(self.a @ self.w)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def time_program(path: Path, calls: int) -> dict:
    """Medians in ms of `calls` in-process calls, worker round trips and worker compute times, alternated."""
    import numpy as np

    from hetero.coreml.backends.reference_executor import ReferenceExecutor
    from hetero.pipeline.ane_process import AneProcess

    local, lane = ReferenceExecutor(path), AneProcess()
    remote = lane.load(path)
    rng = np.random.default_rng(0)
    inputs = {k: rng.standard_normal(s).astype(np.float32) for k, s in local.input_shapes.items()}
    local(inputs), remote(inputs)  # warm-up: the arenas exist, the pages are touched
    here, trip, compute = [], [], []
    for _ in range(calls):
        t = time.perf_counter()
        local(inputs)
        here.append(time.perf_counter() - t)
        before = lane.stats.compute_s
        t = time.perf_counter()
        remote(inputs)
        trip.append(time.perf_counter() - t)
        compute.append(lane.stats.compute_s - before)
    lane.close()
    ms = lambda xs: round(statistics.median(xs) * 1e3, 3)  # noqa: E731
    return {"in_process_ms": ms(here), "worker_round_trip_ms": ms(trip), "worker_compute_ms": ms(compute),
            "round_trip_vs_in_process": round(statistics.median(trip) / statistics.median(here), 4)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=12)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = p.parse_args()
    reexec_with_fast_blas()
    os.environ["HETERO_HOME"] = tempfile.mkdtemp(prefix="hetero-lane-job-")

    from bench.ttft import build_engine
    from hetero.pipeline import configure

    engine = build_engine(Path(os.environ["HETERO_HOME"]))
    run = configure(engine, 0.98, CHUNK, offload=("mlp", "gdn_in_proj"), lane="thread")
    progs = run.splitter(8192).programs  # exports the programs of an 8K prompt
    paths = {"mlp": progs.mlp[0][0][0].path, "gdn z": progs.gdn_in_proj[0][0][0].path}
    results = {}
    for condition in ("idle", "under MLX load"):
        for name, path in paths.items():
            if condition == "idle":
                r = time_program(path, a.calls)
            else:
                with MlxLoad():
                    r = time_program(path, a.calls)
            results[f"{name}, {condition}"] = r
            print(f"{name:<6} {condition:<15} in-process {r['in_process_ms']:7.1f} ms  worker round trip "
                  f"{r['worker_round_trip_ms']:7.1f} ms (compute {r['worker_compute_ms']:.1f})  "
                  f"{r['round_trip_vs_in_process']:.3f}x", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lane_job.json").write_text(json.dumps({"environment": environment(), "calls": a.calls,
                                                   "results": results}, indent=1))


if __name__ == "__main__":
    main()
