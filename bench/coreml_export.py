"""Core ML export: export time and package sizes, reference-executor accuracy against MLX, and throughput.

    python bench/coreml_export.py                     # bundled model (if present) + real Qwen3.5-27B pieces
    python bench/coreml_export.py --skip-27b --repeats 3

1. The bundled model exported at ANE fraction 1.0 (chunk 64, context 512): time, programs, bytes on disk; then
   a 300-token prefill with every attention layer through the reference executor against MLX-only (logits).
2. One Qwen3.5-27B attention layer (24 heads, 4 KV heads, head_dim 256, hidden 5120) and one MLP (17408
   channels), random weights: build + save time, package size, executor vs MLX accuracy (cosine, max abs error,
   PSNR) for a chunk at position `context - chunk`, and seconds per chunk for the executor and for MLX (fp32) on
   the same piece, warmed up and alternated A B A B; median and spread.
JSON goes to bench/results/coreml_export.json with the environment (BLAS, threads, versions).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hetero.host.blas import reexec_with_fast_blas  # noqa: E402
from hetero.host.environment import environment

ROOT = Path(__file__).resolve().parents[1]
CONFIG_27B = Path("/work/shared/reference/configs/qwen3.5-27b.json")


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def alternate(contenders: dict, repeats: int) -> dict:
    """Warm each up once, then run them A B A B ...; median and spread (min, max) of seconds per call."""
    for fn in contenders.values():
        fn()
    times = {k: [] for k in contenders}
    for _ in range(repeats):
        for k, fn in contenders.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "runs": len(v)} for k, v in times.items()}


def bench_bundled(work: Path, chunk: int, context: int) -> dict:
    from hetero.checkpoint.loader import load_model
    from hetero.checkpoint.source import BUNDLED_MODEL
    from hetero.coreml.backends.accuracy import compare
    from hetero.coreml.backends.reference_prefill import prefill_with_attention_programs
    from hetero.coreml.export import export_coreml
    from hetero.decode.prefill import prefill

    if not (BUNDLED_MODEL / "config.json").is_file():
        return {"skipped": "hetero/bundled/ is not present"}
    out = work / "bundled"
    t = time.perf_counter()
    manifest = export_coreml(None, out, 1.0, chunk=chunk, contexts=[context])
    export_s = time.perf_counter() - t
    t = time.perf_counter()
    again = export_coreml(None, out, 1.0, chunk=chunk, contexts=[context])
    reuse_s = time.perf_counter() - t
    model, _, _ = load_model(None, dtype=mx.float32)
    tokens = np.random.default_rng(0).integers(0, model.args.vocab_size, min(300, context)).tolist()
    ref, _ = prefill(model, tokens, model.make_cache(), chunk=chunk)
    ours, _, _ = prefill_with_attention_programs(model, tokens, out)
    ref_l, our_l = np.array(ref[-1]), np.array(ours[-1])
    return {
        "ane_fraction": 1.0, "chunk": chunk, "context": context,
        "export_s": export_s, "reexport_reusing_s": reuse_s, "all_reused": all(p["reused"] for p in again["programs"]),
        "programs": len(manifest["programs"]),
        "package_bytes": {p["file"]: dir_bytes(out / p["file"]) for p in manifest["programs"]},
        "total_bytes": dir_bytes(out),
        "prefill_tokens": len(tokens),
        "prefill_logits_vs_mlx": {**compare(our_l, ref_l), "argmax_equal": int(our_l.argmax()) == int(ref_l.argmax())},
    }


def bench_27b_attention(work: Path, chunk: int, context: int, repeats: int) -> dict:
    from hetero.coreml.backends.accuracy import compare
    from hetero.coreml.backends.reference_executor import ReferenceExecutor
    from hetero.coreml.export import attention_weights
    from hetero.coreml.graphs.attention import AttentionShape, attention_masks, build_attention, cache_inputs, rope_tables
    from hetero.coreml.graphs.package import save_program
    from hetero.models.cache import KVCache
    from hetero.models.qwen3_5 import DecoderLayer, ModelArgs

    args = ModelArgs.from_config(json.loads(CONFIG_27B.read_text()))
    layer = random_layer(DecoderLayer(args, "full_attention"), seed=0, keep_mlp=False)
    start = context - chunk
    shape = AttentionShape(hidden=args.hidden_size, heads=args.num_attention_heads, kv_heads=args.num_key_value_heads,
                           head_dim=args.head_dim, rotary_dims=args.rotary_dims, chunk=chunk, cache_slots=start,
                           eps=args.rms_norm_eps)
    t = time.perf_counter()
    prog = build_attention(shape, attention_weights(args, layer, range(args.num_key_value_heads)))
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    path = save_program(prog, work / "qwen3.5-27b_attention.mlpackage")
    save_s = time.perf_counter() - t
    del prog

    rng = np.random.default_rng(1)
    fp16 = lambda a: np.asarray(a, np.float32).astype(np.float16).astype(np.float32)  # noqa: E731
    prior = mx.array(fp16(rng.standard_normal((1, start, args.hidden_size))))
    x = mx.array(fp16(rng.standard_normal((1, chunk, args.hidden_size))))
    cache = KVCache()
    layer.self_attn(layer.input_layernorm(prior), cache)
    mx.eval(cache.keys, cache.values)
    prior_k, prior_v = np.array(cache.keys[:, :, :start]), np.array(cache.values[:, :, :start])

    def mlx_piece():
        c = KVCache()
        c.keys, c.values, c.offset = cache.keys, cache.values, start
        y = layer.self_attn(layer.input_layernorm(x), c)
        mx.eval(y)
        return y

    ref = np.array(mlx_piece()[0])
    executor = ReferenceExecutor(path)
    normed = np.array(layer.input_layernorm(x)[0])  # the programs read the GPU lane's normed input
    inputs = {"x": normed.T[None, :, None, :].astype(np.float16), **rope_tables(start, shape, args.rope_theta),
              **attention_masks(start, shape), **cache_inputs(prior_k, prior_v, shape)}
    ours = executor(inputs)["out"][0, :, 0, :].T
    timing = alternate({"reference_executor": lambda: executor(inputs), "mlx_fp32": mlx_piece}, repeats)
    return {
        "piece": "attention layer (24 heads, 4 KV heads, head_dim 256)", "chunk": chunk, "cache_slots": start,
        "build_s": build_s, "save_s": save_s, "package_bytes": dir_bytes(path),
        "accuracy": compare(ours, ref), "seconds_per_chunk": timing,
        "tokens_per_s": {k: chunk / v["median_s"] for k, v in timing.items()},
    }


def bench_27b_mlp(work: Path, chunk: int, repeats: int) -> dict:
    from hetero.coreml.backends.accuracy import compare
    from hetero.coreml.backends.reference_executor import ReferenceExecutor
    from hetero.coreml.export import mlp_weights
    from hetero.coreml.graphs.mlp import MLPShape, build_mlp
    from hetero.coreml.graphs.package import save_program
    from hetero.models.qwen3_5 import MLP, ModelArgs, RMSNorm

    args = ModelArgs.from_config(json.loads(CONFIG_27B.read_text()))
    holder = type("Layer", (), {})()
    holder.mlp = random_layer(MLP(args.hidden_size, args.intermediate_size), seed=2, keep_mlp=True)
    holder.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
    holder.post_attention_layernorm.weight = mx.array(1 + 0.3 * np.random.default_rng(3).standard_normal(args.hidden_size), dtype=mx.float32)
    shape = MLPShape(args.hidden_size, args.intermediate_size, chunk)
    t = time.perf_counter()
    prog = build_mlp(shape, mlp_weights(holder.mlp, np.arange(args.intermediate_size)))
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    path = save_program(prog, work / "qwen3.5-27b_mlp.mlpackage")
    save_s = time.perf_counter() - t
    del prog
    x = mx.array(np.random.default_rng(4).standard_normal((1, chunk, args.hidden_size)).astype(np.float16).astype(np.float32))

    def mlx_piece():
        y = holder.mlp(holder.post_attention_layernorm(x))
        mx.eval(y)
        return y

    ref = np.array(mlx_piece()[0])
    executor = ReferenceExecutor(path)
    normed = np.array(holder.post_attention_layernorm(x)[0])  # the programs read the GPU lane's normed input
    inputs = {"x": normed.T[None, :, None, :].astype(np.float16)}
    ours = executor(inputs)["out"][0, :, 0, :].T
    timing = alternate({"reference_executor": lambda: executor(inputs), "mlx_fp32": mlx_piece}, repeats)
    return {
        "piece": "MLP (17408 channels in 2 blocks of 8704)", "chunk": chunk,
        "build_s": build_s, "save_s": save_s, "package_bytes": dir_bytes(path),
        "accuracy": compare(ours, ref), "seconds_per_chunk": timing,
        "tokens_per_s": {k: chunk / v["median_s"] for k, v in timing.items()},
    }


def random_layer(module, seed: int, keep_mlp: bool):
    """Projections N(0, 1/fan_in), norm scales 1 + 0.3 N(0, 1), fp32; a decoder layer's MLP dropped unless kept."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    if not keep_mlp and hasattr(module, "mlp"):
        module.mlp = nn.Identity()
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    new = []
    for k, v in tree_flatten(module.parameters()):
        if k.endswith("norm.weight"):
            new.append((k, mx.array(1 + 0.3 * rng.standard_normal(v.shape), dtype=mx.float32)))
        else:
            new.append((k, mx.random.normal(v.shape) / np.sqrt(v.shape[-1])))
    module.load_weights(new)
    mx.eval(module.parameters())
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024, help="27B pieces: the chunk sits at context - chunk")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-27b", action="store_true")
    ap.add_argument("--skip-bundled", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "coreml_export.json"))
    opts = ap.parse_args()
    reexec_with_fast_blas()

    import coremltools as ct

    work = Path(tempfile.mkdtemp(prefix="hetero-coreml-bench-"))
    result = {"environment": {**environment(), "coremltools": ct.__version__}, "settings": vars(opts)}
    try:
        if not opts.skip_bundled:
            result["bundled"] = bench_bundled(work, 64, 512)
            print(json.dumps(result["bundled"], indent=1), flush=True)
        if not opts.skip_27b:
            result["qwen3.5-27b_attention"] = bench_27b_attention(work, opts.chunk, opts.context, opts.repeats)
            print(json.dumps(result["qwen3.5-27b_attention"], indent=1), flush=True)
            result["qwen3.5-27b_mlp"] = bench_27b_mlp(work, opts.chunk, opts.repeats)
            print(json.dumps(result["qwen3.5-27b_mlp"], indent=1), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
