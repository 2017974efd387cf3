"""Time predictions: the two lanes' rates from a profile, the split prefill as the runtime's wavefront runs it,
and the decode rates (bandwidth roofline, plain, MTP)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from hetero.models.interface import Args
from hetero.planner.cost import ane_pairs, ane_piece_flops, chunk_spans, piece_flops, visible_pairs
from hetero.planner.shape import MoE, Storage, gdn_state_bytes, kv_bytes_per_token
from hetero.planner.slices import ANE_WEIGHT_BYTES, Piece, moe_params, pieces
from hetero.profiles import Profile


@dataclass(frozen=True)
class Lanes:
    """Effective device rates (FLOP/s, bytes/s; None = unknown) and the ANE's fixed cost per call, and how the
    machine's lanes run: GPU-only prefill on `prefill_lanes` CPU lanes at once (the two-lane wavefront,
    `hetero.decode.wavefront`; one on a GPU), each CPU lane at `contention` of its rate while another computes on
    another core, and an ANE lane that computes on the CPU cores (`ane_on_cpu`: the reference executor) leaves the
    split's GPU lane `split_gpu_scale` of GPU-only's lane rate (one BLAS thread of the lane's, where it takes a core
    the GPU path would use)."""

    gpu_flops: float | None
    gpu_bw: float | None
    ane_flops: float | None
    ane_bw: float | None
    ane_call_s: float
    gpu_recurrence_flops: float | None = None  # the GDN recurrence runs many small ops: its own rate
    gpu_attention_flops: float | None = None  # attention (matmul FLOPs counted) at its measured rate
    ane_attention_flops: float | None = None
    gpu_score_s: float = 0.0  # the GPU's softmax cost per attention score, beyond the matmuls
    ane_score_s: float = 0.0  # the ANE's, over its static programs' scores
    prefill_lanes: int = 1
    contention: float = 1.0
    ane_on_cpu: bool = False
    split_gpu_scale: float = 1.0

    @classmethod
    def of(cls, profile: Profile, ane_instances: int = 1) -> "Lanes":
        """The lanes of `profile` with the ANE lane driving `ane_instances` of the chip's ANEs at once.

        A profile's `ane_fp16_tflops` is the chip's figure, summed over its `ane_count` ANEs (an Ultra's two dies
        each carry one), and one program runs on one ANE: the driver does not stripe it across both. The runtime's
        ANE lane runs one program at a time, so it gets one ANE's rate (the default); a runtime that pins one
        program per ANE and runs them together (oMLX's dual-ANE path) gets `ane_instances` of them.
        """
        mul = lambda v, k: None if v is None else v * k  # noqa: E731
        ane_count = max(1, profile.ane_count)
        if not 1 <= ane_instances <= ane_count:
            raise ValueError(f"ane_instances {ane_instances}: {profile.chip} has {ane_count} ANE(s)")
        ane = mul(profile.ane_fp16_tflops, ane_instances / ane_count)  # TFLOPS the lane's programs run at, peak
        return cls(
            mul(profile.gpu_fp32_tflops, 1e12 * profile.gpu_efficiency), mul(profile.memory_bandwidth_gbs, 1e9),
            mul(ane, 1e12 * profile.ane_efficiency), mul(profile.ane_bandwidth_gbs, ane_instances * 1e9),
            profile.ane_dispatch_s or 0.0,
            mul(profile.gpu_fp32_tflops, 1e12 * profile.gpu_efficiency * profile.gpu_recurrence_efficiency),
            mul(profile.gpu_fp32_tflops, 1e12 * profile.gpu_efficiency * profile.gpu_attention_efficiency),
            mul(ane, 1e12 * profile.ane_efficiency * profile.ane_attention_efficiency),
            profile.gpu_attention_score_s,
            profile.ane_attention_score_s,
            max(1, profile.prefill_lanes),
            profile.lane_contention,
            profile.ane_on_cpu,
            split_gpu_scale(profile),
        )

    def gpu_rate(self, kind: str) -> float | None:
        special = {"gdn_recurrence": self.gpu_recurrence_flops, "attention": self.gpu_attention_flops}
        return special.get(kind) or self.gpu_flops

    def ane_rate(self, kind: str) -> float | None:
        return (self.ane_attention_flops if kind == "attention" else None) or self.ane_flops

    def scaled(self, gpu: float = 1.0, ane: float = 1.0) -> "Lanes":
        """These lanes with every GPU rate (compute and bandwidth) times `gpu`, every ANE rate times `ane`."""
        mul = lambda v, k: None if v is None else v * k  # noqa: E731
        return replace(self, gpu_flops=mul(self.gpu_flops, gpu), gpu_bw=mul(self.gpu_bw, gpu),
                       gpu_recurrence_flops=mul(self.gpu_recurrence_flops, gpu),
                       gpu_attention_flops=mul(self.gpu_attention_flops, gpu), gpu_score_s=self.gpu_score_s / gpu,
                       ane_flops=mul(self.ane_flops, ane), ane_bw=mul(self.ane_bw, ane),
                       ane_attention_flops=mul(self.ane_attention_flops, ane), ane_score_s=self.ane_score_s / ane)

    def gpu_only(self) -> "Lanes":
        """The rates GPU-only prefill's lanes run at: under contention when it runs on several CPU lanes."""
        return self.scaled(self.contention) if self.prefill_lanes > 1 else self

    def split(self) -> "Lanes":
        """The rates of the split's two lanes running at once: both CPU lanes under contention where the ANE lane
        computes on the CPU, the GPU lane at `split_gpu_scale` of its rate where that lane takes one of its cores."""
        if not self.ane_on_cpu:
            return self
        return self.scaled(self.contention * self.split_gpu_scale, self.contention)


def split_gpu_scale(profile: Profile) -> float:
    """The split's GPU-lane rate over GPU-only's lane rate: where an ANE lane on the CPU takes a core that GPU-only
    prefill's lanes and BLAS threads would use (`prefill_lanes` x `lane_threads` + 1 > `cpu_cores`), the runtime
    gives the split's GPU lane one BLAS thread (`hetero.pipeline.split`), 1 / `lane_threads` of a lane's threads;
    else 1."""
    threads = max(1, profile.lane_threads or 1)
    if not profile.ane_on_cpu or profile.cpu_cores is None:
        return 1.0
    return 1.0 / threads if max(1, profile.prefill_lanes) * threads + 1 > profile.cpu_cores else 1.0


def _seconds(flops: np.ndarray, nbytes: float, rate: float | None, bw: float | None) -> np.ndarray | None:
    """Roofline time per chunk: compute or weight reads, whichever is slower; None when the rate is unknown.

    A chunk reads a piece's weights only when it computes with them (lm_head: the last chunk).
    """
    if rate is None:
        return None
    t = flops / rate
    return np.maximum(t, np.where(flops > 0, nbytes, 0.0) / bw) if bw else t


@dataclass
class PrefillTime:
    """Predicted prefill seconds: wall time and each lane's busy time (None = unknown)."""

    wall_s: float | None
    gpu_busy_s: float | None
    ane_busy_s: float | None


MERGE_BYTES_PER_ACTIVATION = 12  # a merge brings an fp32 activation into MLX, then reads and writes it in the sum


def predict_prefill(ps: list[Piece], storage: Storage, lanes: Lanes, tokens: int, chunk: int, split: bool,
                    hidden: int) -> PrefillTime:
    """The prefill as this machine runs it. GPU-only: on `lanes.prefill_lanes` lanes (`wavefront_wall`; one lane:
    the chunks one after another). Split: the runtime's wavefront of two lanes, each running its own jobs back to back
    while the other runs its own, so the wall time is the busier lane's total plus the fill and drain of the
    pipeline: the other lane's work on the last chunk, which nothing can overlap (its jobs alternate with the busier
    lane's along that chunk's layers).

    GPU lane: every piece's GPU share (all of it when not split) and, per split piece and chunk, the merge (the
    ANE's output into MLX and a sum over the chunk's activations). ANE lane: its shares at the static shapes it
    runs (attention over each chunk's context bucket) plus a fixed cost per program call. Lanes on the CPU run at
    the rates `Lanes.gpu_only` and `Lanes.split` give them.
    """
    starts, sizes = chunk_spans(tokens, chunk)
    if not split:
        per_chunk = gpu_chunk_seconds(ps, storage, lanes.gpu_only(), tokens, chunk)
        if per_chunk is None:
            return PrefillTime(None, None, None)
        layers = max((p.layers for p in ps), default=1)
        busy = float(per_chunk.sum())
        return PrefillTime(wavefront_wall(per_chunk, lanes.prefill_lanes, layers), busy, 0.0)
    if not any(p.ane_share for p in ps):  # nothing for the ANE lane: the GPU-only prefill
        return predict_prefill(ps, storage, lanes, tokens, chunk, False, hidden)
    lanes = lanes.split()
    gpu = np.zeros_like(sizes)  # seconds per chunk on each lane
    ane = np.zeros_like(sizes)
    merge_bytes = sizes * hidden * MERGE_BYTES_PER_ACTIVATION  # [chunks]
    for p in ps:
        share = p.ane_share
        g = _seconds(piece_flops(p, starts, sizes) * (1 - share), storage.nbytes(p.params * (1 - share)),
                     lanes.gpu_rate(p.kind), lanes.gpu_bw)
        if g is None:
            return PrefillTime(None, None, None)
        g = g + (1 - share) * p.pair_scores * visible_pairs(starts, sizes) * lanes.gpu_score_s  # the softmax
        gpu += p.layers * g
        if share:
            a = _seconds(ane_piece_flops(p, starts, sizes, chunk) * share, p.params * share * ANE_WEIGHT_BYTES,
                         lanes.ane_rate(p.kind), lanes.ane_bw)
            if a is None:
                return PrefillTime(None, None, None)
            a = a + share * p.pair_scores * ane_pairs(starts, chunk) * lanes.ane_score_s if p.pair_scores else a
            ane += p.layers * (a + lanes.ane_call_s)
            if lanes.gpu_bw:
                gpu += p.layers * merge_bytes / lanes.gpu_bw
    gpu_busy, ane_busy = float(gpu.sum()), float(ane.sum())
    if not ane_busy:
        return PrefillTime(gpu_busy, gpu_busy, 0.0)
    return PrefillTime(max(gpu_busy, ane_busy) + min(float(gpu[-1]), float(ane[-1])), gpu_busy, ane_busy)


def wavefront_wall(chunk_s: np.ndarray, lanes: int, layers: int) -> float:
    """Wall seconds of chunks prefilled on `lanes` CPU lanes as `hetero.decode.wavefront` runs them: chunk k on lane
    (n - 1 - k) % lanes, its layers in order, each taking `chunk_s[k] / layers`; layer i of chunk k starts once its
    lane is free, its layer i - 1 is done and chunk k - 1 has done layer i. One lane: the sum.

    The layer-by-layer recurrence end_i = max(end_{i-1}, prev_i) + step unrolls to
    end_i = (i + 1) step + max(free, max_{j <= i} (prev_j - j step)), one running maximum per chunk."""
    n = len(chunk_s)
    if lanes <= 1 or n < 2:
        return float(np.sum(chunk_s))
    free, prev = np.zeros(lanes), np.zeros(layers)  # when each lane is free; chunk k-1's end of each layer
    steps = np.arange(layers, dtype=np.float64)
    for k in range(n):
        lane, step = (n - 1 - k) % lanes, float(chunk_s[k]) / layers
        prev = (steps + 1) * step + np.maximum(free[lane], np.maximum.accumulate(prev - steps * step))
        free[lane] = prev[-1]
    return float(prev[-1])


def decode_bytes_per_token(args: Args, moe: MoE | None, storage: Storage, context: int, kv_bytes: float) -> float:
    """Bytes one decode step reads: every weight used per token (MoE: the router, the top-k experts and the shared
    expert, not the others), the KV cache, GDN state."""
    return decode_weight_bytes(args, moe, storage) + kv_bytes_per_token(args, kv_bytes, with_mtp=False) * context + 2 * gdn_state_bytes(args)


def decode_weight_bytes(args: Args, moe: MoE | None, storage: Storage) -> float:
    """Weight bytes one decode step of the backbone reads (no KV, no state, no MTP head): the embedding one row."""
    weights = 0.0
    for p in pieces(args, moe, 0.0):
        if p.kind == "mtp":
            continue
        params = p.token_params
        if p.kind == "lm_head" and not args.tie_word_embeddings:  # the embedding: one row, not its matrix
            params -= args.vocab_size * args.hidden_size
        weights += p.layers * storage.nbytes(params)
    return weights


@dataclass(frozen=True)
class DecodeRate:
    """Predicted decode tokens per second (None = unknown): the bandwidth roofline, plain decode (the roofline
    times the profile's decode efficiency) and MTP decode (one verify pass plus k draft steps per round)."""

    roofline_tps: float | None
    plain_tps: float | None
    mtp_tps: float | None


def distinct_experts(moe: MoE, tokens: int) -> float:
    """Experts `tokens` tokens pick between them per layer, expected under uniform routing: each token takes
    `per_token` of `experts`."""
    return moe.experts * (1.0 - (1.0 - moe.per_token / moe.experts) ** tokens)


def verify_cost(ratio: float, measured_tokens: int, tokens: int) -> float:
    """A verify pass over `tokens` tokens in plain decode steps, from the profile's `ratio` measured at
    `measured_tokens`: linear in the tokens between one (one plain step) and the measured point."""
    if measured_tokens <= 1:
        return ratio
    return 1.0 + (ratio - 1.0) * (tokens - 1) / (measured_tokens - 1)


def predict_decode(args: Args, moe: MoE | None, storage: Storage, bw: float | None, context: int, kv_bytes: float,
                   accepted_length: float, depth: int, efficiency: float = 1.0, verify_ratio: float | None = None,
                   verify_tokens: int = 4) -> DecodeRate:
    """Decode rates at `context` tokens: a plain step reads every weight once (bandwidth roofline x efficiency);
    an MTP round is one verify pass over depth + 1 tokens (`verify_ratio` plain steps at `verify_tokens`) plus
    `depth` draft steps, and yields `accepted_length` tokens. MTP is None without a head or a verify ratio.

    MoE: the verify pass's tokens pick different experts, so it also reads the experts they pick beyond one
    token's top-k (`distinct_experts`, uniform routing); the profile's verify ratio, measured on a dense model,
    prices the rest."""
    if bw is None:
        return DecodeRate(None, None, None)
    step = decode_bytes_per_token(args, moe, storage, context, kv_bytes)
    rate = bw * efficiency  # bytes per second a decode step really reads at
    if not args.mtp_num_hidden_layers or verify_ratio is None:
        return DecodeRate(bw / step, rate / step, None)
    mtp = next(p for p in pieces(args, moe, 0.0) if p.kind == "mtp")
    draft = storage.nbytes(mtp.token_params + args.vocab_size * args.hidden_size) + kv_bytes_per_token(args, kv_bytes, True, only_mtp=True) * context
    extra = 0.0
    if moe is not None:
        expert = storage.nbytes(3 * args.hidden_size * moe.intermediate)
        extra = len(args.moe_layers) * (distinct_experts(moe, depth + 1) - moe.per_token) * expert
    round_s = (verify_cost(verify_ratio, verify_tokens, depth + 1) * step + extra + depth * draft) / rate
    return DecodeRate(bw / step, rate / step, accepted_length / round_s)


@dataclass(frozen=True)
class DenseExperts:
    """The obvious static-shape ANE formulation of the routed experts, costed: every token through every expert
    (a fixed-shape program per layer; the router's weights, zero for unpicked experts, applied on the GPU)."""

    gpu_s: float  # the routed experts on the GPU as they run now (top-k only), the whole prompt
    ane_s: float  # all experts dense on the ANE, the whole prompt
    best_saving_s: float  # the most a token split between both lanes could save: gpu_s - the balanced time
    ane_weight_bytes: int  # fp16 weights the ANE would hold for it (every layer's every expert)


def dense_experts_on_ane(args: Args, moe: MoE, lanes: Lanes, tokens: int) -> DenseExperts | None:
    """What the dense static formulation would cost for a `tokens`-long prefill (compute roofline on both lanes;
    None when a lane's rate is unknown). Balanced split: a share s of the tokens on the ANE with
    s x ane_s = (1 - s) x gpu_s."""
    gpu_rate, ane_rate = lanes.gpu_rate("moe"), lanes.ane_rate("moe")
    if gpu_rate is None or ane_rate is None:
        return None
    h, n = args.hidden_size, len(args.moe_layers)
    gpu = n * tokens * 2.0 * moe_params(h, moe)[1] / gpu_rate
    ane = n * tokens * 6.0 * h * moe.intermediate * moe.experts / ane_rate
    balanced = gpu * ane / (gpu + ane)
    return DenseExperts(gpu, ane, gpu - balanced, n * 3 * h * moe.intermediate * moe.experts * ANE_WEIGHT_BYTES)


def gpu_chunk_seconds(ps: list[Piece], storage: Storage, lanes: Lanes, tokens: int, chunk: int) -> np.ndarray | None:
    """Seconds the GPU spends on each chunk of a `tokens`-long prefill running all of `ps` (no ANE share): the
    roofline per piece, the softmax per score; the same figure `predict_prefill` sums when not split."""
    starts, sizes = chunk_spans(tokens, chunk)
    out = np.zeros_like(sizes)
    for p in ps:
        g = _seconds(piece_flops(p, starts, sizes), storage.nbytes(p.params), lanes.gpu_rate(p.kind), lanes.gpu_bw)
        if g is None:
            return None
        out += p.layers * (g + p.pair_scores * visible_pairs(starts, sizes) * lanes.gpu_score_s)
    return out
