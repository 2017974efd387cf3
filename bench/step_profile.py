"""Where a decode step's and a prefill chunk's time goes: the weights' matmuls against everything else (host overhead).

    python bench/step_profile.py                     # bundled model and the ~540 MB random one
    python bench/step_profile.py --models bundled --context 512 --chunk 512

For one plain decode step (one token after a `--context`-token prompt) and one `--chunk`-token prefill chunk:
  - `matmul_ms`: every weight matrix the step reads, multiplied by a random [M, in] input in one graph (M = 1 for
    decode, the chunk for prefill): what the BLAS alone costs for the same products, the floor of this machine;
  - `step_ms`: the real step, compiled as the engine runs it, and `uncompiled_ms` with `mx.disable_compile()`;
  - `build_ms`: the Python time to build the step's lazy graph (part of `step_ms`);
  - `overhead_ms` = step_ms - matmul_ms: dispatch, elementwise ops, attention, the recurrence, Python;
  - `primitives`: how many primitives MLX evaluates for the decode step (its graph, after the compiled functions
    fused what they fuse; `by_kind` the most frequent, `views` those that only re-view their input), and
    `per_primitive_us` what one tiny primitive costs to evaluate here (chains of 2,000 elementwise ops, and of
    2,000 reshapes, on 256 floats): `dispatch_ms` = views x view cost + the others x elementwise cost, an estimate
    of the floor of a step made of that many primitives on MLX's CPU backend, whatever each computes.
Medians of `--repeats` timed runs after warm-ups. Writes bench/results/step_profile.json.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hetero.host.blas import reexec_with_fast_blas  # noqa: E402  (before MLX)
from hetero.host.environment import environment

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from bench.checkpoints import checkpoint  # noqa: E402
from hetero.checkpoint.loader import load_model  # noqa: E402
from hetero.decode.prefill import prefill  # noqa: E402
from hetero.models.cache import KVCache, cache_arrays  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    fn()
    fn()  # warm-ups: compile, allocate
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def backbone_matrices(model) -> list[mx.array]:
    """Every weight matrix a plain forward step multiplies by (backbone projections and the output head)."""
    mats = [w for name, w in tree_flatten(model.parameters())
            if w.ndim == 2 and not name.startswith("mtp.") and "embed_tokens" not in name]
    if model.args.tie_word_embeddings:
        mats.append(model.model.embed_tokens.weight)  # the output head reads it as a matrix
    return mats


def matmul_ms(mats: list[mx.array], rows: int, repeats: int) -> float:
    xs = [mx.random.normal((rows, w.shape[1])) for w in mats]  # [M, in] each
    mx.eval(xs)
    return median_ms(lambda: mx.eval([x @ w.T for x, w in zip(xs, mats)]), repeats)


VIEWS = {"Slice", "Squeeze", "ExpandDims", "Reshape", "Transpose", "Flatten", "Unflatten", "Broadcast", "AsStrided"}


def graph_primitives(outputs: list[mx.array]) -> Counter:
    """The primitives of the unevaluated graph behind `outputs`, by kind (from MLX's own DOT export)."""
    buf = io.StringIO()
    mx.export_to_dot(buf, *outputs)
    return Counter(re.findall(r'\[label ="([^"]+)", shape=rectangle\]', buf.getvalue()))


def per_primitive_us(n: int = 2000, repeats: int = 9) -> dict:
    """What one tiny primitive costs to evaluate on this backend, graph already built (uncompiled chains of n ops on
    256 floats): an elementwise multiply, and a reshape (a view, no arithmetic)."""
    x = mx.ones((1, 256))
    mx.eval(x)

    def eval_us(make) -> float:
        times = []
        for _ in range(repeats):
            y = make()
            t0 = time.perf_counter()
            mx.eval(y)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6 / n

    def multiplies() -> mx.array:
        y = x
        for _ in range(n):
            y = y * 1.0001
        return y

    def reshapes() -> mx.array:
        y = x
        for i in range(n):
            y = y.reshape((256, 1) if i % 2 == 0 else (1, 256))
        return y

    return {"elementwise": eval_us(multiplies), "view": eval_us(reshapes)}


def decode_step(model, context: list[int], repeats: int) -> dict:
    cache = model.make_cache()
    prefill(model, context, cache)
    token = mx.array([[int(context[-1])]])
    offset = len(context)

    def one() -> float:
        for c in cache:  # every timed step decodes the same position (GDN states just move on: same shapes)
            if isinstance(c, KVCache):
                c.trim_to(offset)
        t0 = time.perf_counter()
        logits, _ = model(token, cache)
        built = time.perf_counter() - t0
        mx.eval(logits, *cache_arrays(cache))
        return built

    for c in cache:
        if isinstance(c, KVCache):
            c.trim_to(offset)
    logits, _ = model(token, cache)
    kinds = graph_primitives([logits, *cache_arrays(cache)])
    mx.eval(logits, *cache_arrays(cache))
    builds = []
    step = median_ms(lambda: builds.append(one()), repeats)
    mx.disable_compile()
    try:
        uncompiled = median_ms(one, repeats)
    finally:
        mx.enable_compile()
    return {"step_ms": step, "uncompiled_ms": uncompiled, "build_ms": statistics.median(builds) * 1e3,
            "primitives": sum(kinds.values()), "views": sum(n for k, n in kinds.items() if k in VIEWS),
            "by_kind": dict(kinds.most_common(12))}


def prefill_chunk(model, tokens: list[int], repeats: int) -> dict:
    def one() -> None:
        prefill(model, tokens, model.make_cache(), chunk=len(tokens))

    return {"step_ms": median_ms(one, repeats)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["bundled", "large"], choices=["bundled", "large"])
    ap.add_argument("--context", type=int, default=512, help="prompt tokens before the timed decode step")
    ap.add_argument("--chunk", type=int, default=512, help="tokens in the timed prefill chunk")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "hetero-bench"))
    ap.add_argument("--out", default="bench/results/step_profile.json")
    args = ap.parse_args()
    reexec_with_fast_blas()
    rng = np.random.default_rng(0)
    rows = []
    for name in args.models:
        model, _, _ = load_model(checkpoint(name, Path(args.workdir)), dtype=mx.float32)
        mats = backbone_matrices(model)
        vocab = model.args.vocab_size
        decode = decode_step(model, rng.integers(3, vocab, args.context).tolist(), args.repeats)
        decode["matmul_ms"] = matmul_ms(mats, 1, args.repeats)
        chunk = prefill_chunk(model, rng.integers(3, vocab, args.chunk).tolist(), max(3, args.repeats // 10))
        chunk["matmul_ms"] = matmul_ms(mats, args.chunk, max(3, args.repeats // 10))
        for part in (decode, chunk):
            part["overhead_ms"] = part["step_ms"] - part["matmul_ms"]
        cost = decode["per_primitive_us"] = per_primitive_us()
        decode["dispatch_ms"] = (decode["views"] * cost["view"] +
                                 (decode["primitives"] - decode["views"]) * cost["elementwise"]) / 1e3
        weight_mb = sum(w.nbytes for w in mats) / 1e6
        rows.append({"model": name, "weights_mb": weight_mb, "context": args.context, "chunk": args.chunk,
                     "decode": decode, "prefill_chunk": chunk})
        print(f"{name:8s} decode step {decode['step_ms']:7.2f} ms (uncompiled {decode['uncompiled_ms']:.2f}, "
              f"graph build {decode['build_ms']:.2f}) | its matmuls alone {decode['matmul_ms']:.2f} ms "
              f"({weight_mb:.0f} MB) | overhead {decode['overhead_ms']:.2f} ms/token", flush=True)
        print(f"{name:8s} decode step: {decode['primitives']} primitives ({decode['views']} views at "
              f"{cost['view']:.1f} us, the others at {cost['elementwise']:.1f} us) = about {decode['dispatch_ms']:.2f} ms "
              f"of dispatch; most: {decode['by_kind']}", flush=True)
        print(f"{name:8s} prefill chunk of {args.chunk}: {chunk['step_ms']:8.1f} ms | its matmuls alone "
              f"{chunk['matmul_ms']:.1f} ms | overhead {chunk['overhead_ms']:.1f} ms "
              f"({chunk['overhead_ms'] / args.chunk:.3f} ms/token)", flush=True)
        del model
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": environment(), "rows": rows, "args": vars(args)}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
