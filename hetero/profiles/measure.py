"""`hetero tune --devices`: measure this machine's two lanes and save them as the `this-machine` profile.

GPU lane: MLX matmul throughput at prefill shapes (in the dtype the engine loads models in) and bandwidth of a
large reduction. ANE lane: the same backend the pipeline uses (Core ML on macOS, the reference executor
elsewhere) running an exported MLP program; its fixed cost per call from a tiny program. Each figure is the
median of several timed runs after a warm-up.
"""

from __future__ import annotations

import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hetero.profiles import THIS_MACHINE


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of fn() over `repeats` calls, after one warm-up call."""
    fn()  # warm-up: first calls compile and allocate
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def gpu_lane(chunk: int = 256, hidden: int = 1024, out: int = 4096, repeats: int = 5) -> tuple[float, float]:
    """(matmul FLOP/s, bandwidth bytes/s) of MLX on its default device, in the engine's load dtype."""
    import mlx.core as mx

    from hetero.loader import default_dtype

    dtype = default_dtype()
    x = mx.random.normal((chunk, hidden)).astype(dtype)  # [S, hidden]
    w = mx.random.normal((out, hidden)).astype(dtype)  # [out, hidden]
    big = mx.ones((64 * 2**20,), dtype=mx.float32)  # 256 MB
    mx.eval(x, w, big)
    mm = median_seconds(lambda: mx.eval(x @ w.T), repeats)
    rd = median_seconds(lambda: mx.eval(big.sum()), repeats)
    return 2.0 * chunk * hidden * out / mm, big.nbytes / rd


def gpu_recurrence(flops_rate: float, tokens: int = 512, heads: int = 8, dk: int = 64, dv: int = 64) -> float:
    """The chunked delta rule's achieved rate relative to `flops_rate` (many small ops: usually well below 1)."""
    import mlx.core as mx

    from hetero.models.gated_delta import chunked_gated_delta
    from hetero.planner import delta_rule_flops

    key = mx.random.key(0)
    q, k = mx.random.normal((2, 1, tokens, heads, dk), key=key)  # [B, S, Hv, Dk] each
    q, k = q / dk**0.5, k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((1, tokens, heads, dv))  # [B, S, Hv, Dv]
    g = -mx.abs(mx.random.normal((1, tokens, heads))) * 0.1  # [B, S, Hv] log decays
    beta = mx.sigmoid(mx.random.normal((1, tokens, heads)))
    state = mx.zeros((1, heads, dk, dv))
    mx.eval(q, k, v, g, beta, state)
    s = median_seconds(lambda: mx.eval(*chunked_gated_delta(q, k, v, g, beta, state)), 3)
    return min(1.0, tokens * delta_rule_flops(heads, dk, dv) / s / flops_rate)


ATTENTION_SHAPE = dict(hidden=1024, heads=8, kv_heads=2, head_dim=128, chunk=256, context=2048)


def _attention_piece():
    """The planner's attention piece for ATTENTION_SHAPE (its FLOP count is the one the rates are relative to)."""
    from hetero.models.qwen3_5 import ModelArgs
    from hetero.planner import pieces

    a = ATTENTION_SHAPE
    args = ModelArgs.from_config(dict(
        model_type="qwen3_5_text", hidden_size=a["hidden"], num_attention_heads=a["heads"],
        num_key_value_heads=a["kv_heads"], head_dim=a["head_dim"], num_hidden_layers=1, intermediate_size=64,
        vocab_size=64, linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=64,
        linear_value_head_dim=64, full_attention_interval=1))
    return args, next(p for p in pieces(args, None, 0.0) if p.kind == "attention")


def gpu_attention(flops_rate: float, repeats: int = 3) -> float:
    """An attention layer's achieved rate on a chunk after a filled cache, relative to `flops_rate`."""
    import mlx.core as mx

    from hetero.cache import KVCache
    from hetero.models.qwen3_5 import Attention

    a = ATTENTION_SHAPE
    args, piece = _attention_piece()
    layer = Attention(args)
    before = a["context"] - a["chunk"]
    x = mx.random.normal((1, a["chunk"], a["hidden"]))
    past = mx.random.normal((1, a["kv_heads"], before, a["head_dim"]))
    mx.eval(layer.parameters(), x, past)

    def step() -> None:
        cache = KVCache()
        cache.update_and_fetch(past, past)
        mx.eval(layer(x, cache))

    cache_only = median_seconds(lambda: mx.eval(KVCache().update_and_fetch(past, past)), repeats)
    s = max(median_seconds(step, repeats) - cache_only, 1e-9)
    pairs = a["chunk"] * before + a["chunk"] * (a["chunk"] + 1) / 2  # causal: what the GPU lane computes
    return (piece.token_flops * a["chunk"] + piece.pair_flops * pairs) / s / flops_rate


def ane_attention(flops_rate: float, call_s: float, repeats: int = 3) -> float:
    """One KV group's attention program (static cache) on the ANE backend, relative to the lane's MLP rate."""
    from coreml_graphs.attention import (AttentionShape, AttentionWeights, attention_masks, build_attention,
                                         cache_inputs, rope_tables)
    from coreml_graphs.package import save_program
    from hetero.pipeline import ane_backend

    _, loader = ane_backend()
    a = ATTENTION_SHAPE
    heads, D, h, S = a["heads"] // a["kv_heads"], a["head_dim"], a["hidden"], a["chunk"]
    shape = AttentionShape(h, heads, 1, D, D // 4, S, a["context"] - S, 1e-6)
    rng = np.random.default_rng(0)
    w = lambda *dims: (rng.standard_normal(dims) / np.sqrt(dims[-1])).astype(np.float32)  # noqa: E731
    weights = AttentionWeights(np.ones(h, np.float32), w(heads * D, h), w(heads * D, h), w(D, h), w(D, h),
                               np.ones(D, np.float32), np.ones(D, np.float32), w(h, heads * D))
    start = shape.cache_slots  # the last chunk of the bucket: a full cache
    past = rng.standard_normal((1, 1, start, D)).astype(np.float32)
    feed = {"x": rng.standard_normal((1, h, 1, S)).astype(np.float16), **rope_tables(start, shape, 1e4),
            **attention_masks(start, shape), **cache_inputs(past, past, shape)}
    with tempfile.TemporaryDirectory() as tmp:
        run = loader(save_program(build_attention(shape, weights), Path(tmp) / "attention.mlpackage"))
        s = max(median_seconds(lambda: run(feed), repeats) - call_s, 1e-9)
    _, piece = _attention_piece()  # one KV group of it, over the whole static bucket
    return (piece.token_flops * S + piece.pair_flops * S * a["context"]) / a["kv_heads"] / s / flops_rate


def ane_lane(chunk: int = 256, hidden: int = 1024, channels: int = 2048, repeats: int = 3) -> tuple[str, float, float]:
    """(backend, FLOP/s of an MLP program, seconds of fixed cost per call) on the pipeline's ANE backend."""
    from coreml_graphs.mlp import MLPShape, MLPWeights, build_mlp
    from coreml_graphs.package import save_program
    from hetero.pipeline import ane_backend

    name, loader = ane_backend()
    rng = np.random.default_rng(0)

    def program(h: int, c: int, s: int, folder: Path) -> tuple[Callable, dict]:
        w = MLPWeights(np.ones(h, np.float32), rng.standard_normal((c, h)).astype(np.float32) / np.sqrt(h),
                       rng.standard_normal((c, h)).astype(np.float32) / np.sqrt(h),
                       rng.standard_normal((h, c)).astype(np.float32) / np.sqrt(c))
        path = save_program(build_mlp(MLPShape(h, c, s, 1e-6), w), folder / f"mlp_{h}_{c}_{s}.mlpackage")
        return loader(path), {"x": rng.standard_normal((1, h, 1, s)).astype(np.float16)}

    with tempfile.TemporaryDirectory() as tmp:
        run, feed = program(hidden, channels, chunk, Path(tmp))
        big = median_seconds(lambda: run(feed), repeats)
        run_small, feed_small = program(64, 64, 64, Path(tmp))
        small = median_seconds(lambda: run_small(feed_small), repeats)
    flops = 6.0 * hidden * channels * chunk
    return name, flops / max(big - small, 1e-9), small


def measure(report: Callable[[str], None] = print) -> dict:
    """Measure both lanes; returns the `this-machine` profile (a dict `Profile.from_dict` reads)."""
    from hetero.blas import environment
    from hetero.planner import physical_memory_bytes

    gpu_flops, gpu_bw = gpu_lane()
    rec = gpu_recurrence(gpu_flops)
    report(f"GPU lane (MLX {environment()['device']}): {gpu_flops / 1e9:.1f} GFLOP/s, {gpu_bw / 1e9:.1f} GB/s, "
           f"GDN recurrence at {rec:.2f} of that rate")
    gpu_attn = gpu_attention(gpu_flops)
    report(f"GPU lane attention (chunk {ATTENTION_SHAPE['chunk']} over {ATTENTION_SHAPE['context']} tokens): "
           f"{gpu_attn:.2f} of the matmul rate")
    backend, ane_flops, call = ane_lane()
    ane_attn = ane_attention(ane_flops, call)
    report(f"ANE lane ({backend}): {ane_flops / 1e9:.1f} GFLOP/s, {call * 1e3:.2f} ms per call; attention at "
           f"{ane_attn:.2f} of that rate")
    on_ane = backend == "Core ML"
    return {
        "name": THIS_MACHINE,
        "chip": f"this machine ({platform.machine()}, {platform.system()})",
        "source": "measured by hetero tune --devices",
        "measured": True,
        "memory_bandwidth_gbs": round(gpu_bw / 1e9, 3),
        "gpu_fp32_tflops": round(gpu_flops / 1e12, 6),
        "ane_fp16_tflops": round(ane_flops / 1e12, 6),
        "ane_bandwidth_gbs": None,
        "ane_dispatch_s": round(call, 6),
        "ram_gb": round(physical_memory_bytes() / 1e9, 2),
        "gpu_efficiency": 1.0,
        "gpu_recurrence_efficiency": round(rec, 4),
        "gpu_attention_efficiency": round(gpu_attn, 4),
        "ane_attention_efficiency": round(ane_attn, 4),
        "ane_efficiency": 1.0,
        "ane_program_weight_limit_gb": 2.0 if on_ane else None,
        "ane_process_weight_limit_gb": 3.5 if on_ane else None,
        "gpu_wired_fraction": 0.75,
        "unknown": ["ane_bandwidth_gbs"],
        "notes": [
            f"GPU lane: MLX matmul throughput at prefill shapes and a 256 MB reduction's bandwidth ({environment()['blas']})",
            f"ANE lane: {backend} running an exported MLP program; its rate already includes its weight reads",
            "attention on each lane: one layer's chunk over a filled cache (the ANE's static cache bucket), its rate "
            "relative to the lane's matmul rate",
        ] + ([] if on_ane else ["no Neural Engine here: the ANE lane is the portable reference executor (no ANE memory limits)"]),
        "environment": environment(),
    }
