"""What compiling the whole decode step would buy on MLX's CPU backend: the bound of a fixed-shape whole-step compile.

    python bench/whole_step.py                        # bundled model, 512 tokens of context, JSON to bench/results/
    MKL_NUM_THREADS=1 python bench/whole_step.py --out bench/results/whole_step_1thread.json

The engine compiles each layer's decode step (`DecoderLayer`, `hetero/models/compiled.py`) and runs the attention
over the cache between the compiled pieces. This script compiles the whole backbone step, attention and KV writes
included, as one `mx.compile`d function of (token, every cache array) at a fixed position, which is the most a
whole-step compile over a fixed-capacity cache could fuse, and times it against the engine's step at the same
position, alternated in one process (each timed step decodes the same position, as bench/step_profile.py does).
It checks that both give the same logits, counts the primitives each evaluates, and writes the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hetero.host.blas import reexec_with_fast_blas  # noqa: E402  (before MLX)
from hetero.host.environment import environment

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from bench.step_profile import graph_primitives  # noqa: E402
from hetero.decode.prefill import prefill  # noqa: E402
from hetero.engine import load  # noqa: E402
from hetero.models.cache import GDNCache, ModelCache, cache_arrays  # noqa: E402


def layer_arrays(cache: ModelCache) -> list[mx.array]:
    """Every backbone cache's two arrays, in layer order: (conv, state) for GDN, (keys, values) for attention."""
    return [a for c in cache.backbone for a in ((c.conv, c.recurrent) if isinstance(c, GDNCache) else (c.keys, c.values))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens before the timed step")
    ap.add_argument("--rounds", type=int, default=7, help="alternated rounds of --steps steps each")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", default="bench/results/whole_step.json")
    args = ap.parse_args()
    if min(args.context, args.rounds, args.steps) < 1:
        ap.error("--context, --rounds and --steps take positive numbers")
    reexec_with_fast_blas()
    model = load(None, dtype=mx.float32).model
    rng = np.random.default_rng(0)
    cache = model.make_cache()
    prefill(model, rng.integers(3, model.args.vocab_size, args.context).tolist(), cache)
    mx.eval(cache_arrays(cache))
    kinds, offset, token = [type(c) for c in cache.backbone], args.context, mx.array([[7]])
    arrays = layer_arrays(cache)

    def rebuild(states: list[mx.array]) -> ModelCache:
        """Caches at `offset` holding `states` (`layer_arrays`' order)."""
        layers = []
        for i, kind in enumerate(kinds):
            c = kind()
            if kind is GDNCache:
                c.conv, c.recurrent = states[2 * i], states[2 * i + 1]
            else:
                c.keys, c.values = states[2 * i], states[2 * i + 1]
            c.offset = offset
            layers.append(c)
        return ModelCache(layers, [])

    def whole(token: mx.array, *states: mx.array) -> list[mx.array]:
        c = rebuild(list(states))
        logits, _ = model(token, c)
        return [logits, *layer_arrays(c)]

    compiled = mx.compile(whole)

    def engine_step() -> list[mx.array]:
        c = rebuild(arrays)
        logits, _ = model(token, c)
        return [logits, *cache_arrays(c)]

    logits, primitives = {}, {}
    for name, step in (("per_layer", engine_step), ("whole_step", lambda: compiled(token, *arrays))):
        outs = step()  # evaluated before the next is built: the engine's step writes into `arrays` in place
        primitives[name] = sum(graph_primitives(outs).values())
        mx.eval(outs)
        logits[name] = outs[0]
    diff = float(mx.abs(logits["per_layer"] - logits["whole_step"]).max())
    runs = {"per_layer": lambda: mx.eval(engine_step()), "whole_step": lambda: mx.eval(compiled(token, *arrays))}
    ms: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            run()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                run()
            ms[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    med = {k: statistics.median(v) for k, v in ms.items()}
    result = {"environment": environment(), "args": vars(args), "primitives": primitives, "max_logit_difference": diff,
              "step_ms": med, "step_ms_runs": ms, "speedup": med["per_layer"] / med["whole_step"]}
    print(f"bundled decode step at {args.context} tokens: per-layer compiled (the engine) {med['per_layer']:.3f} ms, "
          f"{primitives['per_layer']} primitives; whole step compiled {med['whole_step']:.3f} ms, "
          f"{primitives['whole_step']} primitives: {result['speedup']:.2f}x; max |logit difference| {diff:g}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
