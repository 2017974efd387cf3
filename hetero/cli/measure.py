"""`hetero tune --devices`: measure this machine's two lanes and save them as the `this-machine` profile.

GPU lane: MLX matmul throughput at prefill shapes (in the dtype the engine loads models in) and bandwidth of a
large reduction (MLX's or numpy's, the faster); a decoder MLP's matmuls at one token (a plain decode step) and at k+1 tokens (an MTP verify
pass). ANE lane: the same backend the pipeline uses (Core ML on macOS, the reference executor elsewhere)
running an exported MLP program; its fixed cost per call from a tiny program. Each figure is the median of
several timed runs after a warm-up; the timer and the sizes are parameters, so tests can script the times.
"""

from __future__ import annotations

import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hetero.checkpoint.dtypes import default_dtype
from hetero.host.environment import environment
from hetero.host.settings import DEFAULT_DRAFT_DEPTH
from hetero.models.cache import GDNCache
from hetero.models.cache import KVCache
from hetero.models.qwen3_5 import Attention
from hetero.models.qwen3_5 import GatedDeltaNet
from hetero.models.qwen3_5 import MLP
from hetero.models.qwen3_5 import ModelArgs
from hetero.pipeline import ane_backend
from hetero.planner import model_shape
from hetero.planner import physical_memory_bytes
from hetero.planner import pieces
from hetero.profiles import THIS_MACHINE

# (what is timed, the call, repeats) -> seconds one call takes; `what` names the measurement
Timer = Callable[[str, Callable[[], object], int], float]
GDN_SHAPE = dict(hidden=1024, key_heads=4, value_heads=8, key_dim=64, value_dim=64)
ATTENTION_SHAPE = dict(hidden=1024, heads=8, kv_heads=2, head_dim=128, chunk=512, context=4096)


def median_seconds(fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Median wall time of fn() over `repeats` calls, after one warm-up call."""
    fn()  # warm-up: first calls compile and allocate
    times = []
    for _ in range(repeats):
        t = clock()
        fn()
        times.append(clock() - t)
    return statistics.median(times)


def timed(what: str, fn: Callable[[], object], repeats: int) -> float:
    """The default `Timer`: median wall time of fn() (`what` is for timers that script or log the times)."""
    return median_seconds(fn, repeats)


@dataclass(frozen=True)
class Sizes:
    """What `measure` runs. Defaults: prefill-sized matmuls and programs, and for decode one MLP with the shape
    of Qwen3.5-9B's (shared/reference/configs): large enough that its weights stream from memory."""

    chunk: int = 256
    hidden: int = 1024
    out: int = 4096
    reduce_elements: int = 64 * 2**20  # fp32: 256 MB
    recurrence_tokens: int = 512
    gdn: dict = field(default_factory=lambda: dict(GDN_SHAPE))
    mlp_channels: int = 2048
    attention: dict = field(default_factory=lambda: dict(ATTENTION_SHAPE))
    decode_hidden: int = 4096
    decode_intermediate: int = 12288
    draft_depth: int = DEFAULT_DRAFT_DEPTH  # the verify pass covers draft_depth + 1 tokens

    @classmethod
    def for_model(cls, config: dict, chunk: int = 512) -> "Sizes":
        """Prefill measurements at a model's own shapes (its projections, GDN and attention layers, one chunk
        over a 4K context): rates depend on the sizes they are measured at."""

        args, _ = model_shape(config)
        return cls(
            chunk=chunk, hidden=args.hidden_size, out=args.intermediate_size or 4 * args.hidden_size,
            recurrence_tokens=chunk, mlp_channels=args.intermediate_size or 4 * args.hidden_size,
            gdn=dict(hidden=args.hidden_size, key_heads=args.linear_num_key_heads,
                     value_heads=args.linear_num_value_heads, key_dim=args.linear_key_head_dim,
                     value_dim=args.linear_value_head_dim),
            attention=dict(hidden=args.hidden_size, heads=args.num_attention_heads,
                           kv_heads=args.num_key_value_heads, head_dim=args.head_dim, chunk=chunk,
                           context=max(4096, 2 * chunk)),
        )


IN_FLOW_BYTES = 64 << 20  # a prefill streams its layers' weights: more than the caches of a CPU (or a GPU) hold
MAX_COPIES = 8


def _copies(nbytes: int) -> int:
    """How many distinct copies of a layer a measurement cycles through so that, as in a model's forward, its
    weights come from memory rather than a cache warmed by the previous call (a hot cache overstated the rates
    by 15-20% against the bench's prefill)."""
    return max(1, min(MAX_COPIES, -(-IN_FLOW_BYTES // max(nbytes, 1))))


def gpu_lane(chunk: int = 256, hidden: int = 1024, out: int = 4096, repeats: int = 5,
             reduce_elements: int = 64 * 2**20, timer: Timer = timed) -> tuple[float, float]:
    """(matmul FLOP/s, bandwidth bytes/s) of MLX on its default device, in the engine's load dtype. Bandwidth: the
    faster of an MLX reduction and a numpy one over the same bytes (MLX's CPU reduction is scalar: 4.8 GB/s where
    numpy's read 25 GB/s and a one-token matmul's weights 21 GB/s; on a Mac the GPU's reduction is the faster)."""
    import mlx.core as mx


    dtype = default_dtype()
    x = mx.random.normal((chunk, hidden)).astype(dtype)  # [S, hidden]
    ws = [mx.random.normal((out, hidden)).astype(dtype) for _ in range(_copies(out * hidden * dtype.size))]
    big = mx.ones((reduce_elements,), dtype=mx.float32)
    mx.eval(x, *ws, big)
    mm = timer("gpu matmul", lambda: mx.eval(*[x @ w.T for w in ws]), repeats)  # [S, out] each
    rd = timer("gpu bandwidth", lambda: mx.eval(big.sum()), repeats)
    host = np.ones(reduce_elements, np.float32)
    rd = min(rd, timer("host bandwidth", host.sum, repeats))
    return 2.0 * chunk * hidden * out * len(ws) / mm, big.nbytes / rd



def decode_verify(bandwidth: float, tokens: int, hidden: int = 4096, intermediate: int = 12288, repeats: int = 3,
                  timer: Timer = timed) -> tuple[float, float]:
    """(decode efficiency, MTP verify ratio) from a decoder MLP's matmuls in the engine's load dtype: at one token,
    as a plain decode step runs them, and at `tokens` (k + 1), as a verify pass does. Efficiency: its weight
    bytes per second at one token over `bandwidth`; ratio: the verify pass's time over the step's."""
    import mlx.core as mx
    from mlx.utils import tree_flatten


    mlp = MLP(hidden, intermediate)
    mlp.set_dtype(default_dtype())
    one = mx.random.normal((1, 1, hidden)).astype(default_dtype())  # [B, 1, hidden]
    many = mx.random.normal((1, tokens, hidden)).astype(default_dtype())  # [B, k+1, hidden]
    mx.eval(mlp.parameters(), one, many)
    step = timer("decode step", lambda: mx.eval(mlp(one)), repeats)
    verify = timer("verify pass", lambda: mx.eval(mlp(many)), repeats)
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(mlp.parameters()))
    return weight_bytes / step / bandwidth, verify / step


def _gdn_pieces(a: dict = GDN_SHAPE):
    """(model args, the planner's GDN pieces by kind) for the shape `a`: the FLOP counts the rate is relative to."""

    args = ModelArgs.from_config(dict(
        model_type="qwen3_5_text", hidden_size=a["hidden"], num_attention_heads=1, num_key_value_heads=1,
        head_dim=64, num_hidden_layers=2, intermediate_size=64, vocab_size=64, full_attention_interval=2,
        linear_num_key_heads=a["key_heads"], linear_num_value_heads=a["value_heads"],
        linear_key_head_dim=a["key_dim"], linear_value_head_dim=a["value_dim"]))
    return args, {p.kind: p for p in pieces(args, None, 0.0)}


def gpu_recurrence(flops_rate: float, tokens: int = 512, a: dict = GDN_SHAPE, timer: Timer = timed) -> float:
    """The GDN recurrence's achieved rate relative to `flops_rate`, as the planner charges it: a whole
    GatedDeltaNet layer on one chunk is timed and its projections' FLOPs at `flops_rate` are taken off; the rest
    (the chunked delta rule, and the conv, gates, norms and l2-norms around it) is the recurrence's time."""
    import mlx.core as mx


    args, by = _gdn_pieces(a)
    layers = [GatedDeltaNet(args) for _ in range(_copies(by["gdn_in_proj"].params * 4))]
    x = mx.random.normal((1, tokens, a["hidden"])) / a["hidden"] ** 0.5  # [1, S, hidden]
    mx.eval([m.parameters() for m in layers], x)
    s = timer("gpu recurrence", lambda: mx.eval(*[m(x, GDNCache()) for m in layers]), 3) / len(layers)
    projections = tokens * (by["gdn_in_proj"].token_flops + by["gdn_out_proj"].token_flops) / flops_rate
    return min(1.0, tokens * by["gdn_recurrence"].token_flops / flops_rate / max(s - projections, 1e-9))


def _attention_piece(a: dict = ATTENTION_SHAPE):
    """The planner's attention piece for the shape `a` (its FLOP count is the one the rates are relative to)."""

    args = ModelArgs.from_config(dict(
        model_type="qwen3_5_text", hidden_size=a["hidden"], num_attention_heads=a["heads"],
        num_key_value_heads=a["kv_heads"], head_dim=a["head_dim"], num_hidden_layers=1, intermediate_size=64,
        vocab_size=64, linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=64,
        linear_value_head_dim=64, full_attention_interval=1))
    return args, next(p for p in pieces(args, None, 0.0) if p.kind == "attention")


def gpu_attention(flops_rate: float, repeats: int = 3, a: dict = ATTENTION_SHAPE,
                  timer: Timer = timed) -> tuple[float, float]:
    """(matmul efficiency, seconds per score) of an attention layer on a chunk after a filled cache.

    Timed at two head sizes (`a`'s and half of it): the matmuls (QK^T, PV) scale with the head size, the softmax
    with the scores alone, so the two times separate the matmuls' rate (relative to `flops_rate`) from the
    softmax's cost per (query, key, head) score. Projections are charged at `flops_rate`."""
    import mlx.core as mx


    before = a["context"] - a["chunk"]
    pairs = a["chunk"] * before + a["chunk"] * (a["chunk"] + 1) / 2  # causal: what the GPU lane computes
    rest = {}  # head size -> (seconds past the projections, core matmul FLOPs)
    for D in (a["head_dim"] // 2, a["head_dim"]):
        shape = dict(a, head_dim=D)
        args, piece = _attention_piece(shape)
        n = _copies(piece.params * 4 + 2 * past_bytes(a, before, D))
        layers = [Attention(args) for _ in range(n)]
        x = mx.random.normal((1, a["chunk"], a["hidden"]))
        pasts = [mx.random.normal((1, a["kv_heads"], before, D)) for _ in range(n)]  # each layer its own cache
        mx.eval([m.parameters() for m in layers], x, *pasts)

        def fill(pasts=pasts) -> list:
            caches = [KVCache() for _ in pasts]
            for c, past in zip(caches, pasts):
                c.update_and_fetch(past, past)
            return caches

        def step(layers=layers, x=x, fill=fill) -> None:
            mx.eval(*[m(x, c) for m, c in zip(layers, fill())])

        filled = timer(f"gpu cache fill d{D}", lambda fill=fill: mx.eval(*[c.keys for c in fill()]), repeats)
        s = max(timer(f"gpu attention d{D}", step, repeats) - filled, 1e-9) / n
        rest[D] = (s - piece.token_flops * a["chunk"] / flops_rate, piece.pair_flops * pairs)
    return _split_attention_time(rest, a["head_dim"], flops_rate, pairs * a["heads"])


def ane_attention(flops_rate: float, call_s: float, repeats: int = 3, a: dict = ATTENTION_SHAPE,
                  timer: Timer = timed) -> tuple[float, float]:
    """(matmul efficiency, seconds per score) of one KV group's attention program (static cache) on the ANE
    backend, relative to the lane's MLP rate; timed at two head sizes as `gpu_attention` is."""
    from hetero.coreml.graphs.attention import (AttentionShape, AttentionWeights, attention_masks, build_attention,
                                         cache_inputs, rope_tables)
    from hetero.coreml.graphs.package import save_program

    _, loader = ane_backend()
    heads, h, S = a["heads"] // a["kv_heads"], a["hidden"], a["chunk"]
    rng = np.random.default_rng(0)
    w = lambda *dims: (rng.standard_normal(dims) / np.sqrt(dims[-1])).astype(np.float32)  # noqa: E731
    rest = {}  # head size -> (seconds past the projections, core matmul FLOPs)
    for D in (a["head_dim"] // 2, a["head_dim"]):
        shape = AttentionShape(h, heads, 1, D, D // 4, S, a["context"] - S, 1e-6)
        weights = AttentionWeights(w(heads * D, h), w(heads * D, h), w(D, h), w(D, h),
                                   np.ones(D, np.float32), np.ones(D, np.float32), w(h, heads * D))
        start = shape.cache_slots  # the last chunk of the bucket: a full cache
        past = rng.standard_normal((1, 1, start, D)).astype(np.float32)
        feed = {"x": rng.standard_normal((1, h, 1, S)).astype(np.float16), **rope_tables(start, shape, 1e4),
                **attention_masks(start, shape), **cache_inputs(past, past, shape)}
        with tempfile.TemporaryDirectory() as tmp:
            run = loader(save_program(build_attention(shape, weights), Path(tmp) / "attention.mlpackage"))
            s = max(timer(f"ane attention d{D}", lambda: run(feed), repeats) - call_s, 1e-9)
        _, piece = _attention_piece(dict(a, head_dim=D))  # one KV group of it, over the whole static bucket
        projections = piece.token_flops * S / a["kv_heads"] / flops_rate
        rest[D] = (s - projections, piece.pair_flops * S * a["context"] / a["kv_heads"])
    return _split_attention_time(rest, a["head_dim"], flops_rate, S * a["context"] * heads)


def past_bytes(a: dict, before: int, head_dim: int) -> int:
    """fp32 bytes of one layer's cached keys (or values) for `before` positions."""
    return 4 * a["kv_heads"] * before * head_dim


def _split_attention_time(rest: dict, head_dim: int, flops_rate: float, scores: float) -> tuple[float, float]:
    """(matmul efficiency, seconds per score) from attention's time past its projections at head sizes
    head_dim / 2 and head_dim ({D: (seconds, matmul FLOPs)}): the matmuls scale with D, the softmax does not."""
    (t_half, f_half), (t_full, f_full) = rest[head_dim // 2], rest[head_dim]
    if t_full > t_half > 0:
        efficiency = (f_full - f_half) / flops_rate / (t_full - t_half)
        per_score = (t_half - f_half / flops_rate / efficiency) / scores
        if per_score >= 0:
            return efficiency, per_score
    return f_full / flops_rate / max(t_full, 1e-9), 0.0  # noise hid the split: all of it as matmul rate


def ane_lane(chunk: int = 256, hidden: int = 1024, channels: int = 2048, repeats: int = 3,
             timer: Timer = timed, loader: Callable[[Path], Callable] | None = None) -> tuple[str, float, float]:
    """(backend, FLOP/s of an MLP program, seconds of fixed cost per call) on the pipeline's ANE backend, loaded
    by `loader` (default: the backend's own, in this process; `AneProcess.load`: through the lane's worker)."""
    from hetero.coreml.graphs.mlp import MLPShape, MLPWeights, build_mlp
    from hetero.coreml.graphs.package import save_program

    name, own = ane_backend()
    loader = loader or own
    rng = np.random.default_rng(0)

    def program(h: int, c: int, s: int, folder: Path) -> tuple[Callable, dict]:
        w = MLPWeights(rng.standard_normal((c, h)).astype(np.float32) / np.sqrt(h),
                       rng.standard_normal((c, h)).astype(np.float32) / np.sqrt(h),
                       rng.standard_normal((h, c)).astype(np.float32) / np.sqrt(c))
        folder.mkdir(parents=True, exist_ok=True)
        path = save_program(build_mlp(MLPShape(h, c, s), w), folder / f"mlp_{h}_{c}_{s}.mlpackage")
        return loader(path), {"x": rng.standard_normal((1, h, 1, s)).astype(np.float16)}

    with tempfile.TemporaryDirectory() as tmp:
        copies = [program(hidden, channels, chunk, Path(tmp) / str(i)) for i in range(_copies(6 * hidden * channels))]
        big = timer("ane mlp", lambda: [run(feed) for run, feed in copies], repeats) / len(copies)
        run_small, feed_small = program(64, 64, 64, Path(tmp))
        small = timer("ane call", lambda: run_small(feed_small), repeats)
    flops = 6.0 * hidden * channels * chunk
    return name, flops / max(big - small, 1e-9), small


def measure(report: Callable[[str], None] = print, timer: Timer = timed, sizes: Sizes = Sizes()) -> dict:
    """Measure both lanes; returns the `this-machine` profile (a dict `Profile.from_dict` reads), every figure
    exactly as measured."""

    z, a = sizes, sizes.attention
    gpu_flops, gpu_bw = gpu_lane(z.chunk, z.hidden, z.out, reduce_elements=z.reduce_elements, timer=timer)
    rec = gpu_recurrence(gpu_flops, z.recurrence_tokens, z.gdn, timer=timer)
    report(f"GPU lane (MLX {environment()['device']}): {gpu_flops / 1e9:.1f} GFLOP/s, {gpu_bw / 1e9:.1f} GB/s, "
           f"GDN recurrence at {rec:.2f} of that rate")
    gpu_attn, score_s = gpu_attention(gpu_flops, a=a, timer=timer)
    report(f"GPU lane attention (chunk {a['chunk']} over {a['context']} tokens): matmuls at {gpu_attn:.2f} of the "
           f"matmul rate, {score_s * 1e9:.2f} ns per score for the softmax")
    verify_tokens = z.draft_depth + 1
    decode_eff, verify = decode_verify(gpu_bw, verify_tokens, z.decode_hidden, z.decode_intermediate, timer=timer)
    report(f"GPU lane decode ({z.decode_hidden}x{z.decode_intermediate} MLP): one token reads weights at "
           f"{decode_eff:.2f} of that bandwidth; a verify pass over {verify_tokens} tokens costs {verify:.2f} steps")
    backend, ane_flops, call = ane_lane(z.chunk, z.hidden, z.mlp_channels, timer=timer)
    ane_attn = ane_attention(ane_flops, call, a=a, timer=timer)
    report(f"ANE lane ({backend}): {ane_flops / 1e9:.1f} GFLOP/s, {call * 1e3:.2f} ms per call; attention's "
           f"matmuls at {ane_attn[0]:.2f} of that rate, {ane_attn[1] * 1e9:.2f} ns per score")
    return profile_dict(backend, gpu_flops, gpu_bw, rec, (gpu_attn, score_s), decode_eff, verify, verify_tokens,
                        ane_flops, call, ane_attn, physical_memory_bytes(), environment())


def profile_dict(backend: str, gpu_flops: float, gpu_bw: float, rec: float, gpu_attn: tuple[float, float],
                 decode_eff: float, verify: float, verify_tokens: int, ane_flops: float, call: float,
                 ane_attn: tuple[float, float],
                 ram: int, env: dict) -> dict:
    """The `this-machine` profile from measured figures (unrounded: what was measured is what is saved);
    `gpu_attn` and `ane_attn` are (matmul efficiency, seconds per score)."""
    on_ane = backend == "Core ML"
    return {
        "name": THIS_MACHINE,
        "chip": f"this machine ({platform.machine()}, {platform.system()})",
        "source": "measured by hetero tune --devices",
        "measured": True,
        "memory_bandwidth_gbs": gpu_bw / 1e9,
        "gpu_fp32_tflops": gpu_flops / 1e12,
        "ane_fp16_tflops": ane_flops / 1e12,
        "ane_bandwidth_gbs": None,
        "ane_dispatch_s": call,
        "ram_gb": round(ram / 1e9, 2),
        "gpu_efficiency": 1.0,
        "gpu_recurrence_efficiency": rec,
        "gpu_attention_efficiency": gpu_attn[0],
        "gpu_attention_score_s": gpu_attn[1],
        "ane_attention_efficiency": ane_attn[0],
        "ane_attention_score_s": ane_attn[1],
        "ane_efficiency": 1.0,
        "decode_efficiency": decode_eff,
        "mtp_verify_ratio": verify,
        "mtp_verify_tokens": verify_tokens,
        "ane_program_weight_limit_gb": 2.0 if on_ane else None,
        "ane_process_weight_limit_gb": None,  # not documented, and not measured here
        "gpu_wired_fraction": 0.75,
        "unknown": ["ane_bandwidth_gbs", "ane_process_weight_limit_gb", "ane_instance_weight_window_gb"],
        "notes": [
            f"GPU lane: MLX matmul throughput at prefill shapes and a reduction's bandwidth, MLX's or numpy's, the faster ({env['blas']})",
            "decode: a decoder MLP's matmuls at one token (weight bytes per second over that bandwidth) and at k+1 "
            "tokens (the MTP verify pass, in plain steps)",
            f"ANE lane: {backend} running an exported MLP program; its rate already includes its weight reads",
            "attention on each lane: one layer's chunk over a filled cache (the ANE's static cache bucket), its rate "
            "relative to the lane's matmul rate; on the GPU timed at two head sizes, which separates the matmuls' "
            "rate from the softmax's cost per score",
        ] + ([] if on_ane else ["no Neural Engine here: the ANE lane is the portable reference executor (no ANE memory limits)"]),
        "environment": env,
    }
