"""Time predictions: the two lanes' rates from a profile, the split prefill as the runtime's wavefront runs it,
and the decode rates (bandwidth roofline, plain, MTP)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetero.models.interface import Args
from hetero.planner.cost import ane_pairs, ane_piece_flops, chunk_spans, piece_flops, visible_pairs
from hetero.planner.shape import MoE, Storage, gdn_state_bytes, kv_bytes_per_token
from hetero.planner.slices import ANE_WEIGHT_BYTES, Piece, moe_params, pieces
from hetero.profiles import Profile


@dataclass(frozen=True)
class Lanes:
    """Effective device rates (FLOP/s, bytes/s; None = unknown) and the ANE's fixed cost per call."""

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
        )

    def gpu_rate(self, kind: str) -> float | None:
        special = {"gdn_recurrence": self.gpu_recurrence_flops, "attention": self.gpu_attention_flops}
        return special.get(kind) or self.gpu_flops

    def ane_rate(self, kind: str) -> float | None:
        return (self.ane_attention_flops if kind == "attention" else None) or self.ane_flops


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
    """The runtime's wavefront: each lane runs its own jobs back to back while the other runs its own, so the wall
    time is the busier lane's total plus the fill and drain of the pipeline: the other lane's work on the last
    chunk, which nothing can overlap (its jobs alternate with the busier lane's along that chunk's layers).

    GPU lane: every piece's GPU share (all of it when not split) and, per split piece and chunk, the merge (the
    ANE's output into MLX and a sum over the chunk's activations). ANE lane: its shares at the static shapes it
    runs (attention over each chunk's context bucket) plus a fixed cost per program call.
    """
    starts, sizes = chunk_spans(tokens, chunk)
    gpu = np.zeros_like(sizes)  # seconds per chunk on each lane
    ane = np.zeros_like(sizes)
    merge_bytes = sizes * hidden * MERGE_BYTES_PER_ACTIVATION  # [chunks]
    for p in ps:
        share = p.ane_share if split else 0.0
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
