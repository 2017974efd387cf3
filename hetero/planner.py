"""The offload planner and the memory governor (shared/DESIGN.md sections 4 and 7).

`make_plan` turns (model config, weight storage, context, chunk, hardware profile, requested fraction F) into a
per-layer plan of ANE slices: attention layers give F of their KV-head groups (whole groups, their query heads
along), MLPs F of their intermediate channels (multiples of 64), GDN input projections only their `z` rows
(capped at z / (qkv + z + b + a)); the recurrent path, embeddings, lm_head and the MTP head give nothing. It
reports each piece's requested and effective fraction with the reason for every cap, and a FLOPs / bytes cost
model predicts GPU-only and split prefill time, TTFT, the decode roofline and the MTP-adjusted decode rate.

`govern` is the memory governor: from weights, KV bytes per token, GDN state, prefill buffers, Core ML packages
and the GPU-wirable share of RAM it resolves the largest aligned context window that fits, line by line.
"""

from __future__ import annotations

import json
import math
import os
import weakref
from dataclasses import asdict, dataclass, field
from itertools import combinations
from pathlib import Path

import numpy as np

from hetero.errors import HeteroError
from hetero.models.qwen3_5 import ModelArgs
from hetero.profiles import Profile

ALIGN = 64  # channel and row slices come in multiples of 64 (the exporter's BC1S channel tile)
ANE_WEIGHT_BYTES = 2  # the exporter embeds fp16 weights
DELTA_BLOCK = 64  # the chunked delta rule's block size: its intra-block matmuls scale with it
RUNTIME_RESERVE = 1 << 30  # MLX runtime, allocator slack and decode activations: kept free by the governor
DEFAULT_ACCEPTED_LENGTH = 2.5  # tokens per MTP verify pass assumed when none is given (DESIGN: 2-3)
DEFAULT_DRAFT_DEPTH = 3
SPLIT_IN_FLIGHT = 4  # chunks a split prefill keeps in progress: enough for both lanes to find work
# Weights per exported ANE program: below the documented ~2 GB per program (a weights.bin past 2^31 bytes fails
# to load), with room for the package's own metadata. The exporter splits a larger share into several programs.
PROGRAM_WEIGHT_BUDGET = int(1.5 * 2**30)
KINDS = ("attention", "mlp", "moe", "gdn_in_proj", "gdn_recurrence", "gdn_out_proj", "lm_head", "mtp")
OFFLOADABLE = ("attention", "mlp", "gdn_in_proj")  # the kinds that may give the ANE a share
EXACT_PATH = {
    "gdn_recurrence": "conv and delta-rule recurrence carry state across the whole context: exact GPU path",
    "gdn_out_proj": "gated norm and out_proj follow the recurrence: exact GPU path",
    "lm_head": "embeddings, final norm and lm_head (last row only) stay on the GPU",
    "mtp": "the MTP head stays on the GPU: its KV feeds speculative decoding",
    "moe": "mixture-of-experts: experts are routed per token; static ANE programs cannot follow the routing",
}


# ----------------------------------------------------------------------------------------------------------
# What the plan is made of


@dataclass(frozen=True)
class PieceSlice:
    """One layer's ANE share of one piece: units [start, stop).

    Units: attention -> KV heads (their query-head groups come along), mlp -> intermediate channels,
    gdn_z -> rows of in_proj_z.
    """

    layer: int
    piece: str
    start: int
    stop: int


@dataclass(frozen=True)
class MoE:
    """The routed-expert MLP of a mixture-of-experts layer."""

    experts: int
    per_token: int
    intermediate: int
    shared_intermediate: int


@dataclass(frozen=True)
class Storage:
    """How the GPU's copy of the weights is stored: bf16 (bits 16) or MLX affine quantization."""

    bits: int = 16
    group_size: int = 64

    def nbytes(self, params: float) -> float:
        """Bytes of `params` weights: packed bits plus an fp16 scale and bias per group when quantized."""
        if self.bits >= 16:
            return 2.0 * params
        return params * self.bits / 8 + params / self.group_size * 4

    @property
    def label(self) -> str:
        return "bf16" if self.bits >= 16 else f"{self.bits}-bit, group size {self.group_size}"


@dataclass(frozen=True)
class Piece:
    """One kind of per-layer work with its cost and its ANE share (uniform over the layers of that kind).

    `token_flops` are FLOPs per token; `pair_flops` FLOPs per (query, visible key) pair (attention's core).
    """

    kind: str
    layers: int  # how many layers carry it (1 for model-level pieces)
    units: int  # what it splits into (0: it does not split)
    unit: str
    ane_units: int
    params: int  # weights per layer
    token_flops: float
    pair_flops: float = 0.0
    ane_unit_params: int = 0  # weights that travel with one ANE unit
    requested: float = 0.0
    cap_reason: str | None = None
    pair_scores: float = 0.0  # softmax scores per (query, visible key) pair: the attention heads

    @property
    def ane_share(self) -> float:
        return self.ane_units / self.units if self.units else 0.0


# ----------------------------------------------------------------------------------------------------------
# Reading a model config


def read_model_config(model: str | None) -> tuple[dict, str]:
    """(config dict, display name) from a bare config.json, a checkpoint directory or a hub id (small files only)."""
    from hetero.loader import read_config, resolve

    if model is not None and Path(model).is_file():
        try:
            return json.loads(Path(model).read_text()), str(model)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HeteroError(f"{model} is not valid JSON ({e})") from None
    return read_config(resolve(model, weights=False)), model or "bundled"


def model_shape(config: dict) -> tuple[ModelArgs, MoE | None]:
    """The network's shape from a config: `ModelArgs` plus the routed experts of MoE models (planning only)."""
    text = config.get("text_config") or config
    base = {"qwen3_5_moe": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_text"}.get(config.get("model_type"))
    moe = None
    if text.get("num_experts"):
        moe = MoE(int(text["num_experts"]), int(text.get("num_experts_per_tok", 1)),
                  int(text.get("moe_intermediate_size") or 0), int(text.get("shared_expert_intermediate_size") or 0))
    if base or text.get("intermediate_size") is None:
        patched_text = dict(text, intermediate_size=text.get("intermediate_size") or (moe.intermediate if moe else None))
        config = dict(config, model_type=base or config.get("model_type"))
        if "text_config" in config:
            config["text_config"] = dict(patched_text, model_type=base or text.get("model_type"))
        else:
            config.update(patched_text, model_type=base or config.get("model_type"))
    args = ModelArgs.from_config(config)
    return args, (moe if args.moe_layers else None)


def storage_for(config: dict, bits: int | None, group_size: int | None) -> Storage:
    """The checkpoint's own quantization when it has one, else `--bits` / `--group-size` (default bf16)."""
    q = config.get("quantization") or config.get("quantization_config") or {}
    if q.get("bits") and bits is None:
        return Storage(int(q["bits"]), int(q.get("group_size", 64)))
    b = 16 if bits is None else bits
    if b not in (2, 3, 4, 5, 6, 8, 16):
        raise HeteroError(f"--bits {b}: choose 2, 3, 4, 5, 6, 8 or 16")
    g = group_size or 64
    if g not in (32, 64, 128):
        raise HeteroError(f"--group-size {g}: choose 32, 64 or 128")
    return Storage(b, g)


# ----------------------------------------------------------------------------------------------------------
# Slicing: requested fraction -> aligned units per piece


def _aligned(x: float, step: int, total: int) -> int:
    """x rounded to the nearest multiple of `step` (half up), within [0, total]."""
    return max(0, min(total, int(math.floor(x / step + 0.5)) * step))


def pieces(args: ModelArgs, moe: MoE | None, fraction: float) -> list[Piece]:
    """The pieces of one prefill with their aligned ANE shares for a requested fraction (no memory cap)."""
    if not 0.0 <= fraction <= 1.0:
        raise HeteroError(f"--ane-fraction {fraction}: must be between 0 and 1")
    h, H, Hkv, D = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim
    n_attn = args.layer_types.count("full_attention")
    n_gdn = args.num_hidden_layers - n_attn
    group = H // Hkv
    out: list[Piece] = []

    attn_params = h * (2 * H * D + 2 * Hkv * D + H * D)  # q + gate, k, v, o
    kv = _aligned(fraction * Hkv, 1, Hkv)
    cap = None
    if kv != fraction * Hkv:
        cap = f"heads go in whole KV groups ({group} query heads each): {fraction:g} x {Hkv} groups rounds to {kv}"
    if n_attn:
        out.append(Piece("attention", n_attn, Hkv, "kv_groups", kv, attn_params, 2.0 * attn_params, 4.0 * H * D,
                         attn_params // Hkv, fraction, cap, pair_scores=H))

    dense_layers = args.num_hidden_layers - len(args.moe_layers)
    if dense_layers:
        I = args.intermediate_size
        c = _aligned(fraction * I, ALIGN, I)
        cap = None if c == fraction * I else f"channels in multiples of {ALIGN}: {fraction:g} x {I} rounds to {c}"
        out.append(Piece("mlp", dense_layers, I, "channels", c, 3 * h * I, 6.0 * h * I, 0.0, 3 * h, fraction, cap))
    if moe is not None:
        params = h * moe.experts + 3 * h * (moe.experts * moe.intermediate + moe.shared_intermediate)
        active = 2.0 * h * moe.experts + 6.0 * h * (moe.per_token * moe.intermediate + moe.shared_intermediate)
        out.append(Piece("moe", len(args.moe_layers), 0, "", 0, params, active, requested=fraction,
                         cap_reason=EXACT_PATH["moe"] if fraction else None))

    if n_gdn:
        nk, nv, dk, dv = args.linear_num_key_heads, args.linear_num_value_heads, args.linear_key_head_dim, args.linear_value_head_dim
        z = nv * dv
        qkv = 2 * nk * dk + nv * dv
        rows = qkv + z + 2 * nv
        want = fraction * rows
        zr = z if want >= z else _aligned(want, ALIGN, z)  # past z: all of z, whatever its alignment
        cap = None
        if want > z:
            cap = (f"only the z rows may leave: qkv, b, a feed the recurrence and stay on the exact GPU path "
                   f"(cap z / (qkv + z + b + a) = {z}/{rows} = {z / rows:.2f})")
        elif zr != want:
            cap = f"z rows in multiples of {ALIGN}: {fraction:g} x {rows} rows rounds to {zr}"
        out.append(Piece("gdn_in_proj", n_gdn, rows, "rows", zr, h * rows, 2.0 * h * rows, 0.0, h, fraction, cap))
        conv = qkv
        K = args.linear_conv_kernel_dim
        delta = delta_rule_flops(nv, dk, dv)
        out.append(Piece("gdn_recurrence", n_gdn, 0, "", 0, conv * K, 2.0 * conv * K + delta, requested=fraction,
                         cap_reason=EXACT_PATH["gdn_recurrence"] if fraction else None))
        out.append(Piece("gdn_out_proj", n_gdn, 0, "", 0, z * h, 2.0 * z * h + 8.0 * z, requested=fraction,
                         cap_reason=EXACT_PATH["gdn_out_proj"] if fraction else None))

    head_params = args.vocab_size * h * (1 if args.tie_word_embeddings else 2)
    out.append(Piece("lm_head", 1, 0, "", 0, head_params, 2.0 * h * args.vocab_size, requested=fraction,
                     cap_reason=EXACT_PATH["lm_head"] if fraction else None))
    if args.mtp_num_hidden_layers:
        I = args.intermediate_size or (moe.intermediate if moe else 0)
        mtp_params = args.mtp_num_hidden_layers * (attn_params + 3 * h * I) + 2 * h * h
        out.append(Piece("mtp", 1, 0, "", 0, mtp_params, 2.0 * mtp_params, 4.0 * H * D * args.mtp_num_hidden_layers,
                         requested=fraction, cap_reason=EXACT_PATH["mtp"] if fraction else None,
                         pair_scores=H * args.mtp_num_hidden_layers))
    return out


def delta_rule_flops(nv: int, dk: int, dv: int) -> float:
    """FLOPs per token of the chunked delta rule: intra-block matmuls (QK^T, KK^T, attn @ V) and the state's
    read, update and output."""
    return nv * 2.0 * (2 * DELTA_BLOCK * dk + DELTA_BLOCK * dv + 3 * dk * dv)


def ane_weight_bytes(ps: list[Piece]) -> int:
    """fp16 bytes of every weight the ANE's share carries (what Core ML keeps resident)."""
    return sum(p.layers * p.ane_units * p.ane_unit_params * ANE_WEIGHT_BYTES for p in ps)


def program_budget(profile: Profile) -> int:
    """Weight bytes per exported ANE program: the exporter's budget, or the profile's per-program limit if lower."""
    limit = profile.ane_program_weight_limit_gb
    return PROGRAM_WEIGHT_BUDGET if limit is None else min(PROGRAM_WEIGHT_BUDGET, int(limit * 1e9))


def program_spans(p: Piece, budget: int = PROGRAM_WEIGHT_BUDGET) -> list[tuple[int, int]]:
    """One layer's ANE share of `p` cut into programs of at most `budget` fp16 weight bytes: unit ranges
    [start, stop), channel and row parts in multiples of ALIGN (KV groups whole)."""
    if not p.ane_units:
        return []
    per_part = max(1, budget // (p.ane_unit_params * ANE_WEIGHT_BYTES))
    if p.kind != "attention" and per_part >= ALIGN:
        per_part -= per_part % ALIGN
    return [(a, min(a + per_part, p.ane_units)) for a in range(0, p.ane_units, per_part)]


def ane_programs(ps: list[Piece], budget: int = PROGRAM_WEIGHT_BUDGET) -> dict[str, int]:
    """How many ANE programs each piece kind is exported as, over all its layers."""
    return {p.kind: p.layers * len(program_spans(p, budget)) for p in ps if p.ane_units}


def fit_ane_memory(args: ModelArgs, moe: MoE | None, fraction: float, limit_bytes: float | None) -> tuple[list[Piece], float]:
    """Pieces for `fraction`, scaled down to the largest fraction whose ANE weights fit `limit_bytes` (a
    per-process limit a profile measured; None = none known).

    Returns (pieces, the fraction actually sliced); caps name the limit on every piece they shrink.
    """
    ps = pieces(args, moe, fraction)
    need = ane_weight_bytes(ps)
    if limit_bytes is None or need <= limit_bytes:
        return ps, fraction
    lo, hi = 0.0, fraction
    for _ in range(30):  # bisection: ANE bytes grow monotonically with the fraction
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ane_weight_bytes(pieces(args, moe, mid)) <= limit_bytes else (lo, mid)
    fitted = pieces(args, moe, lo)
    why = (f"ANE memory: at {fraction:g} the ANE share needs {need / 1e9:.1f} GB of fp16 weights, above the "
           f"{limit_bytes / 1e9:.1f} GB per process this profile measured on the ANE; sliced at {lo:.3f} instead")
    out = []
    for p, q in zip(ps, fitted):
        if q.ane_units < p.ane_units:
            q = Piece(**{**asdict(q), "requested": fraction, "cap_reason": why})
        else:
            q = Piece(**{**asdict(q), "requested": fraction})
        out.append(q)
    return out, lo


def ane_slices(args: ModelArgs, fraction: float, moe: MoE | None = None) -> list[PieceSlice]:
    """Per-layer ANE slices for a fraction (alignment only; the caller passes an already memory-capped one).

    This is what the Core ML exporter builds and what the pipeline runs.
    """
    return layer_slices(args, pieces(args, moe, fraction))


def layer_slices(args: ModelArgs, ps: list[Piece]) -> list[PieceSlice]:
    by_kind = {p.kind: p for p in ps}
    moe_layers = set(args.moe_layers)
    out = []
    for i, kind in enumerate(args.layer_types):
        if kind == "full_attention" and by_kind.get("attention") and by_kind["attention"].ane_units:
            out.append(PieceSlice(i, "attention", 0, by_kind["attention"].ane_units))
        if kind == "linear_attention" and by_kind.get("gdn_in_proj") and by_kind["gdn_in_proj"].ane_units:
            out.append(PieceSlice(i, "gdn_z", 0, by_kind["gdn_in_proj"].ane_units))
        if i not in moe_layers and by_kind.get("mlp") and by_kind["mlp"].ane_units:
            out.append(PieceSlice(i, "mlp", 0, by_kind["mlp"].ane_units))
    return out


# ----------------------------------------------------------------------------------------------------------
# Cost model


def chunk_spans(tokens: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of every prefill chunk of a `tokens`-long prompt."""
    starts = np.arange(0, tokens, chunk, dtype=np.float64)
    return starts, np.minimum(chunk, tokens - starts)


def _pairs(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Visible (query, key) pairs per chunk: every cached key plus the causal triangle."""
    return sizes * starts + sizes * (sizes + 1) / 2


def context_bucket(tokens: int, chunk: int) -> int:
    """The context of a `tokens`-long prefix's static ANE attention program: its chunks rounded up to a power of
    two (at most 2x waste)."""
    n = -(-tokens // chunk)
    return chunk * (1 << max(0, (n - 1).bit_length()))


def context_buckets(tokens: int, chunk: int) -> list[int]:
    """Every bucket a `tokens`-long prompt's chunks use: chunk x 1, 2, 4, ... up to the prompt's own bucket.

    The ANE's attention programs are exported once per bucket and each chunk runs the smallest one that holds its
    cache and itself, so a chunk attends over at most twice the keys it can see, not over the whole prompt's."""
    top = context_bucket(tokens, chunk)
    return [chunk << k for k in range((top // chunk).bit_length())]


def ane_pairs(starts: np.ndarray, chunk: int) -> np.ndarray:
    """(query, key) pairs a static ANE attention program computes per chunk: a whole (padded) chunk over its whole
    bucket (cache slots + the chunk: `context_bucket` of the chunk's end), whatever part the prompt fills."""
    return chunk * np.array([context_bucket(int(a) + chunk, chunk) for a in starts], dtype=np.float64)


def ane_piece_flops(p: Piece, starts: np.ndarray, sizes: np.ndarray, chunk: int) -> np.ndarray:
    """FLOPs of a piece as a static-shape ANE program computes them (attention: over `ane_pairs`)."""
    if p.kind != "attention":
        return piece_flops(p, starts, sizes)
    return p.token_flops * chunk + p.pair_flops * ane_pairs(starts, chunk)


def piece_flops(p: Piece, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """FLOPs of one layer's piece for each chunk (lm_head: the prompt's last row only)."""
    if p.kind == "lm_head":
        out = np.zeros_like(sizes)
        out[-1] = p.token_flops  # one row: the prompt's last position
        return out
    return p.token_flops * sizes + p.pair_flops * _pairs(starts, sizes)


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
    def of(cls, profile: Profile) -> "Lanes":
        mul = lambda v, k: None if v is None else v * k  # noqa: E731
        return cls(
            mul(profile.gpu_fp32_tflops, 1e12 * profile.gpu_efficiency), mul(profile.memory_bandwidth_gbs, 1e9),
            mul(profile.ane_fp16_tflops, 1e12 * profile.ane_efficiency), mul(profile.ane_bandwidth_gbs, 1e9),
            profile.ane_dispatch_s or 0.0,
            mul(profile.gpu_fp32_tflops, 1e12 * profile.gpu_efficiency * profile.gpu_recurrence_efficiency),
            mul(profile.gpu_fp32_tflops, 1e12 * profile.gpu_efficiency * profile.gpu_attention_efficiency),
            mul(profile.ane_fp16_tflops, 1e12 * profile.ane_efficiency * profile.ane_attention_efficiency),
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
        g = g + (1 - share) * p.pair_scores * _pairs(starts, sizes) * lanes.gpu_score_s  # the softmax
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


def decode_bytes_per_token(args: ModelArgs, moe: MoE | None, storage: Storage, context: int, kv_bytes: int) -> float:
    """Bytes one decode step reads: every weight used per token (active experts only), the KV cache, GDN state."""
    ps = pieces(args, moe, 0.0)
    h = args.hidden_size
    weights = 0.0
    for p in ps:
        if p.kind == "mtp":
            continue
        params = p.params
        if p.kind == "lm_head":
            params = args.vocab_size * h  # the embedding table is read one row per token
        if p.kind == "moe" and moe is not None:
            params = h * moe.experts + 3 * h * (moe.per_token * moe.intermediate + moe.shared_intermediate)
        weights += p.layers * storage.nbytes(params)
    return weights + kv_bytes_per_token(args, kv_bytes, with_mtp=False) * context + 2 * gdn_state_bytes(args)


@dataclass(frozen=True)
class DecodeRate:
    """Predicted decode tokens per second (None = unknown): the bandwidth roofline, plain decode (the roofline
    times the profile's decode efficiency) and MTP decode (one verify pass plus k draft steps per round)."""

    roofline_tps: float | None
    plain_tps: float | None
    mtp_tps: float | None


def verify_cost(ratio: float, measured_tokens: int, tokens: int) -> float:
    """A verify pass over `tokens` tokens in plain decode steps, from the profile's `ratio` measured at
    `measured_tokens`: linear in the tokens between one (one plain step) and the measured point."""
    if measured_tokens <= 1:
        return ratio
    return 1.0 + (ratio - 1.0) * (tokens - 1) / (measured_tokens - 1)


def predict_decode(args: ModelArgs, moe: MoE | None, storage: Storage, bw: float | None, context: int, kv_bytes: int,
                   accepted_length: float, depth: int, efficiency: float = 1.0, verify_ratio: float | None = None,
                   verify_tokens: int = 4) -> DecodeRate:
    """Decode rates at `context` tokens: a plain step reads every weight once (bandwidth roofline x efficiency);
    an MTP round is one verify pass over depth + 1 tokens (`verify_ratio` plain steps at `verify_tokens`) plus
    `depth` draft steps, and yields `accepted_length` tokens. MTP is None without a head or a verify ratio."""
    if bw is None:
        return DecodeRate(None, None, None)
    step = decode_bytes_per_token(args, moe, storage, context, kv_bytes)
    rate = bw * efficiency  # bytes per second a decode step really reads at
    if not args.mtp_num_hidden_layers or verify_ratio is None:
        return DecodeRate(bw / step, rate / step, None)
    mtp = next(p for p in pieces(args, moe, 0.0) if p.kind == "mtp")
    draft = storage.nbytes(mtp.params + args.vocab_size * args.hidden_size) + kv_bytes_per_token(args, kv_bytes, True, only_mtp=True) * context
    round_s = (verify_cost(verify_ratio, verify_tokens, depth + 1) * step + depth * draft) / rate
    return DecodeRate(bw / step, rate / step, accepted_length / round_s)


# ----------------------------------------------------------------------------------------------------------
# Memory governor


def kv_bytes_per_token(args: ModelArgs, kv_bytes: int, with_mtp: bool = True, only_mtp: bool = False) -> int:
    """KV bytes per token: full-attention layers only (+ the MTP layer); GDN layers keep a fixed state instead."""
    layers = 0 if only_mtp else args.layer_types.count("full_attention")
    layers += args.mtp_num_hidden_layers if with_mtp else 0
    return layers * 2 * args.num_key_value_heads * args.head_dim * kv_bytes


def gdn_state_bytes(args: ModelArgs) -> int:
    """Per sequence: every GDN layer's fp32 recurrent state and its conv window."""
    n = args.layer_types.count("linear_attention")
    conv = 2 * args.linear_num_key_heads * args.linear_key_head_dim + args.linear_num_value_heads * args.linear_value_head_dim
    state = args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim * 4
    return n * (state + (args.linear_conv_kernel_dim - 1) * conv * 4)


def prefill_buffer_bytes(args: ModelArgs, chunk: int) -> int:
    """Transient buffers of one prefill chunk in fp32: residual and projections, MLP, conv, and one logits row."""
    conv = 2 * args.linear_num_key_heads * args.linear_key_head_dim + args.linear_num_value_heads * args.linear_value_head_dim
    inter = args.intermediate_size
    return chunk * 4 * (6 * args.hidden_size + 3 * inter + 2 * conv) + 4 * args.vocab_size


def physical_memory_bytes() -> int:
    """RAM of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class Budget:
    """The governor's answer: budget lines (name, bytes) that add up to the GPU-wirable bytes, and the window."""

    memory_bytes: int
    wired_fraction: float
    lines: list[tuple[str, int]]
    context_window: int
    kv_bytes_per_token: int
    model_max: int

    @property
    def wirable_bytes(self) -> int:
        return int(self.memory_bytes * self.wired_fraction)

    def to_dict(self) -> dict:
        return {
            "memory_gb": round(self.memory_bytes / 1e9, 3),
            "wired_fraction": self.wired_fraction,
            "wirable_bytes": self.wirable_bytes,
            "context_window": self.context_window,
            "model_max_context": self.model_max,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "lines": [{"name": n, "bytes": b} for n, b in self.lines],
        }

    def text(self) -> list[str]:
        gb = lambda b: f"{b / 1e9:9.2f} GB"  # noqa: E731
        out = [f"memory: {self.memory_bytes / 1e9:.1f} GB RAM, GPU may wire {self.wired_fraction:.0%} = {self.wirable_bytes / 1e9:.2f} GB"]
        out += [f"  {gb(b)}  {n}" for n, b in self.lines]
        limit = " (the model's maximum)" if self.context_window == self.model_max else ""
        out.append(f"context window: {self.context_window} tokens{limit}")
        return out


def govern(
    args: ModelArgs,
    weight_bytes: float,
    memory_bytes: float,
    chunk: int,
    kv_bytes: int = 2,
    coreml_bytes: float = 0,
    wired_fraction: float = 0.75,
    weights_label: str = "",
    in_flight: int = 1,
) -> Budget:
    """The largest context window (a multiple of `chunk`, at most the model's maximum) that fits the wirable RAM.

    `in_flight`: chunks prefilled at once (a split prefill's wavefront keeps several), each with its buffers.
    Raises HeteroError when the fixed costs alone do not fit (memory below the weights).
    """
    wirable = int(memory_bytes * wired_fraction)
    fixed = [
        (f"weights{f' ({weights_label})' if weights_label else ''}", int(weight_bytes)),
        ("Core ML packages (ANE share, fp16)", int(coreml_bytes)),
        ("GDN recurrent state + conv window, one sequence", gdn_state_bytes(args)),
        (f"transient prefill buffers (chunk {chunk}{f', {in_flight} in flight' if in_flight > 1 else ''})",
         in_flight * prefill_buffer_bytes(args, chunk)),
        ("runtime reserve (MLX, allocator, decode)", RUNTIME_RESERVE),
    ]
    per_token = kv_bytes_per_token(args, kv_bytes)
    room = wirable - sum(b for _, b in fixed)
    window = min(args.max_position_embeddings, (room // per_token // chunk) * chunk) if per_token else args.max_position_embeddings
    if room <= 0 or window < chunk:
        raise HeteroError(
            f"{memory_bytes / 1e9:.1f} GB of RAM leaves {wirable / 1e9:.2f} GB the GPU may wire; the weights "
            f"({weight_bytes / 1e9:.2f} GB) and fixed buffers ({sum(b for _, b in fixed) / 1e9:.2f} GB in all) leave no room for "
            f"even one {chunk}-token chunk of KV cache"
        )
    kv = window * per_token
    lines = [*fixed, (f"KV cache: {window} tokens x {per_token} bytes", kv), ("unused (below one aligned step, or past the model maximum)", room - kv)]
    return Budget(int(memory_bytes), wired_fraction, lines, int(window), per_token, args.max_position_embeddings)


# ----------------------------------------------------------------------------------------------------------
# The whole plan


@dataclass
class Plan:
    """Everything `hetero plan` reports; `to_dict` is the `--json` form."""

    model: str
    args: ModelArgs
    storage: Storage
    profile: Profile
    context: int
    chunk: int
    prompt_tokens: int
    requested_fraction: float
    sliced_fraction: float
    pieces: list[Piece]
    slices: list[PieceSlice]
    flops: dict[str, tuple[float, float]]  # kind -> (total, ANE) at the context
    predicted: dict
    unknown: list[str]
    assumptions: list[str]
    memory: Budget | None = None
    offload: tuple[str, ...] = OFFLOADABLE  # the piece kinds that take a share
    programs: dict[str, int] = field(default_factory=dict)  # piece kind -> exported ANE programs, all layers
    program_budget: int = PROGRAM_WEIGHT_BUDGET  # fp16 weight bytes per program at most

    @property
    def effective_fraction(self) -> float:
        total = sum(t for t, _ in self.flops.values())
        return sum(a for _, a in self.flops.values()) / total if total else 0.0

    def caps(self) -> list[str]:
        out = []
        for p in self.pieces:
            if p.cap_reason:
                out.append(f"{p.kind}: requested {p.requested:.2f}, effective {p.ane_share:.2f} ({p.cap_reason})")
        return out

    def to_dict(self) -> dict:
        total = sum(t for t, _ in self.flops.values())
        d = {
            "model": self.model,
            "profile": self.profile.name,
            "storage": {"bits": self.storage.bits, "group_size": self.storage.group_size},
            "context": self.context,
            "chunk": self.chunk,
            "prompt_tokens": self.prompt_tokens,
            "requested_fraction": self.requested_fraction,
            "effective_fraction": round(self.effective_fraction, 6),
            "offload": list(self.offload),
            "pieces": {
                p.kind: {
                    "requested": p.requested,
                    "effective": round(p.ane_share, 6),
                    "cap_reason": p.cap_reason,
                    "layers": p.layers,
                    "units": p.units,
                    "ane_units": p.ane_units,
                    "unit": p.unit,
                    "flops": self.flops[p.kind][0],
                    "ane_flops": self.flops[p.kind][1],
                    "flop_share": round(self.flops[p.kind][0] / total, 6) if total else 0.0,
                    "weight_bytes": int(p.layers * self.storage.nbytes(p.params)),
                    "ane_weight_bytes": int(p.layers * p.ane_units * p.ane_unit_params * ANE_WEIGHT_BYTES),
                    "programs": self.programs.get(p.kind, 0),
                }
                for p in self.pieces
            },
            "caps": self.caps(),
            "ane_programs": {"count": sum(self.programs.values()), "weight_budget_bytes": self.program_budget},
            "layers": [asdict(s) for s in self.slices],
            "predicted": self.predicted,
            "unknown": self.unknown,
            "assumptions": self.assumptions,
        }
        if self.memory is not None:
            d["memory"] = self.memory.to_dict()
        return d


def make_plan(
    config: dict,
    profile: Profile,
    fraction: float,
    context: int,
    chunk: int = 512,
    prompt_tokens: int | None = None,
    bits: int | None = None,
    group_size: int | None = None,
    memory_gb: float | None = None,
    accepted_length: float = DEFAULT_ACCEPTED_LENGTH,
    draft_depth: int = DEFAULT_DRAFT_DEPTH,
    name: str = "",
    offload: tuple[str, ...] = OFFLOADABLE,
) -> Plan:
    """Plan one prefill of `context` tokens at ANE fraction `fraction` for `profile` (see the module docstring).

    `offload` names the piece kinds that take their share (`recommend` leaves out those the ANE lane of the
    profile runs too slowly to help); the others stay whole on the GPU, with the reason as their cap.
    """
    args, moe = model_shape(config)
    storage = storage_for(config, bits, group_size)
    if chunk <= 0 or chunk % ALIGN:
        raise HeteroError(f"--chunk {chunk}: must be a positive multiple of {ALIGN}")
    if not 0 < context <= args.max_position_embeddings:
        raise HeteroError(f"--context {context}: must be between 1 and the model's maximum, {args.max_position_embeddings}")
    prompt = prompt_tokens or context
    if not 0 < prompt <= context:
        raise HeteroError(f"--prompt-tokens {prompt}: must be between 1 and the context ({context})")
    if accepted_length < 1:
        raise HeteroError(f"--accepted-length {accepted_length}: a verify pass yields at least one token")
    limit = profile.ane_process_weight_limit_gb * 1e9 if profile.ane_process_weight_limit_gb else None
    ps, sliced = fit_ane_memory(args, moe, fraction, limit)
    lanes = Lanes.of(profile)
    ps = [p if p.kind in offload or not p.ane_units else
          Piece(**{**asdict(p), "ane_units": 0, "cap_reason": kept_on_gpu(p.kind, lanes)}) for p in ps]
    starts, sizes = chunk_spans(context, chunk)
    flops = {}
    for p in ps:
        total = p.layers * float(piece_flops(p, starts, sizes).sum())
        flops[p.kind] = (total, total * p.ane_share)

    gpu_only = predict_prefill(ps, storage, lanes, context, chunk, False, args.hidden_size)
    split = predict_prefill(ps, storage, lanes, context, chunk, True, args.hidden_size)
    ttft = predict_prefill(ps, storage, lanes, prompt, chunk, True, args.hidden_size)
    kv_bytes = 2  # bf16 / fp16 cache on the GPU
    decode = predict_decode(args, moe, storage, lanes.gpu_bw, context, kv_bytes, accepted_length, draft_depth,
                            profile.decode_efficiency, profile.mtp_verify_ratio, profile.mtp_verify_tokens)
    r = lambda v, n=4: None if v is None else round(v, n)  # noqa: E731
    overlap = None
    if split.wall_s and split.gpu_busy_s and split.ane_busy_s:
        overlap = (split.gpu_busy_s + split.ane_busy_s - split.wall_s) / min(split.gpu_busy_s, split.ane_busy_s)
    predicted = {
        "gpu_only_prefill_s": r(gpu_only.wall_s),
        "split_prefill_s": r(split.wall_s),
        "ttft_s": r(ttft.wall_s),
        "decode_roofline_tps": r(decode.roofline_tps, 2),
        "decode_plain_tps": r(decode.plain_tps, 2),
        "decode_mtp_tps": r(decode.mtp_tps, 2),
        "split_gpu_busy_s": r(split.gpu_busy_s),
        "split_ane_busy_s": r(split.ane_busy_s),
        "speedup": r(gpu_only.wall_s / split.wall_s, 3) if gpu_only.wall_s and split.wall_s else None,
        "overlap": r(overlap, 3),
        "accepted_length": accepted_length,
        "draft_depth": draft_depth,
    }
    budget = program_budget(profile)
    unknown = [f"{k} is unknown for {profile.chip}" for k in profile.unknown if k != "ane_process_weight_limit_gb"]
    unknown += ane_limit_unknowns(profile, ps, budget) + decode_unknowns(profile, args, lanes)
    if lanes.gpu_flops is None:
        unknown.append("prefill times are unknown: the profile has no GPU throughput")
    elif lanes.ane_flops is None and any(p.ane_units for p in ps):
        unknown.append("split prefill time and TTFT are unknown: the profile has no ANE throughput")
    if lanes.ane_bw is None and lanes.ane_flops is not None:
        unknown.append("ANE bandwidth unknown: ANE time counts compute only")
    assumptions = list(profile.notes)
    if not profile.measured:
        assumptions.append(f"GPU reaches {profile.gpu_efficiency:.0%} and the ANE {profile.ane_efficiency:.0%} of their peak figures on prefill matmuls (the profile's figures; `hetero tune --devices` measures this machine)")
    assumptions.append(f"MTP decode assumes {accepted_length} tokens per verify pass at draft depth {draft_depth}")
    if profile.mtp_verify_ratio is not None and draft_depth + 1 != profile.mtp_verify_tokens:
        assumptions.append(f"a verify pass over {draft_depth + 1} tokens costs "
                           f"{verify_cost(profile.mtp_verify_ratio, profile.mtp_verify_tokens, draft_depth + 1):.2f} plain "
                           f"steps: linear between 1 token and the profile's {profile.mtp_verify_ratio:g} at "
                           f"{profile.mtp_verify_tokens}")
    plan = Plan(name, args, storage, profile, context, chunk, prompt, fraction, sliced, ps, layer_slices(args, ps),
                flops, predicted, unknown, assumptions, offload=tuple(k for k in OFFLOADABLE if k in offload),
                programs=ane_programs(ps, budget), program_budget=budget)
    if memory_gb is not None:
        if memory_gb <= 0:
            raise HeteroError(f"--memory-gb {memory_gb}: must be positive")
        weights = sum(p.layers * storage.nbytes(p.params) for p in ps)
        plan.memory = govern(args, weights, memory_gb * 1e9, chunk, kv_bytes, ane_weight_bytes(ps),
                             profile.gpu_wired_fraction, storage.label,
                             SPLIT_IN_FLIGHT if any(p.ane_units for p in ps) else 1)
    return plan


def ane_limit_unknowns(profile: Profile, ps: list[Piece], budget: int) -> list[str]:
    """What the plan cannot know about the ANE's memory: a per-process limit no one has documented."""
    if profile.ane_process_weight_limit_gb is not None or not any(p.ane_units for p in ps):
        return []
    return [f"ane_process_weight_limit_gb: no per-process limit on the ANE's weights is documented or measured; "
            f"the plan assumes none ({ane_weight_bytes(ps) / 1e9:.1f} GB of fp16 weights in "
            f"{sum(ane_programs(ps, budget).values())} programs of at most {budget / 1e9:.2f} GB)"]


def decode_unknowns(profile: Profile, args: ModelArgs, lanes: Lanes) -> list[str]:
    """Why a decode prediction is missing."""
    if not args.mtp_num_hidden_layers:
        return ["decode_mtp_tps: the model has no MTP head"]
    if profile.mtp_verify_ratio is None and lanes.gpu_bw is not None:
        return ["decode_mtp_tps: the profile has no MTP verify cost (mtp_verify_ratio; `hetero tune --devices` "
                "measures it)"]
    return []


def effective_fraction(config: dict, fraction: float, tokens: int, chunk: int,
                       offload: tuple[str, ...] = OFFLOADABLE) -> float:
    """The ANE's share of a `tokens`-long prefill's FLOPs when each piece in `offload` is sliced at `fraction`."""
    args, moe = model_shape(config)
    starts, sizes = chunk_spans(tokens, chunk)
    total = ane = 0.0
    for p in pieces(args, moe, fraction):
        f = p.layers * float(piece_flops(p, starts, sizes).sum())
        total, ane = total + f, ane + (f * p.ane_share if p.kind in offload else 0.0)
    return ane / total if total else 0.0


def kept_on_gpu(kind: str, lanes: Lanes) -> str:
    """Why a piece kind takes no ANE share (a recommended plan, or one run with such a plan's kinds)."""
    ane, gpu = lanes.ane_rate(kind), lanes.gpu_rate(kind)
    if ane is None or gpu is None:
        return "kept on the GPU: not among the piece kinds this plan offloads"
    return (f"kept on the GPU: the ANE lane runs it at {ane / 1e9:.1f} GFLOP/s against the GPU's {gpu / 1e9:.1f} "
            f"GFLOP/s on this profile; offloading it does not shorten the prefill")


def recommend(config: dict, profile: Profile, context: int, chunk: int = 512, **kw) -> tuple[float, Plan]:
    """The F in [0, 1] (steps of 0.01), and the piece kinds that take it, with the shortest predicted split
    prefill: where both lanes balance. A kind the profile's ANE lane runs too slowly stays whole on the GPU
    (the plan's `offload`, with that cap)."""
    best: tuple[float, float, Plan] | None = None
    seen = set()
    subsets = [c for n in range(len(OFFLOADABLE), 0, -1) for c in combinations(OFFLOADABLE, n)]
    for offload in subsets:  # all kinds first: on ties the plan that offloads more wins
        for i in range(101):
            f = i / 100
            plan = make_plan(config, profile, f, context, chunk, offload=offload, **kw)
            key = tuple(p.ane_units for p in plan.pieces)
            if key in seen:  # same aligned slices as a smaller F or another subset: same plan
                continue
            seen.add(key)
            t = plan.predicted["split_prefill_s"]
            if t is None:
                raise HeteroError(f"cannot recommend a fraction for {profile.chip}: {'; '.join(plan.unknown) or 'throughput unknown'}")
            if best is None or t < best[1] - 1e-12:
                best = (f, t, plan)
    return best[0], best[2]


def program_line(plan: Plan) -> str:
    """How many programs the ANE's share is exported as, and why a layer's share may need several."""
    per_kind = ", ".join(f"{k} {n}" for k, n in plan.programs.items())
    return (f"ANE programs: {sum(plan.programs.values())} ({per_kind}); at most {plan.program_budget / 1e9:.2f} GB of "
            f"fp16 weights each (the ANE loads about 2 GB per program), a larger layer share is split")


def plan_lines(plan: Plan) -> list[str]:
    """The human-readable report of `hetero plan`."""
    a, pr = plan.args, plan.predicted
    fmt = lambda v, unit="s": "unknown" if v is None else f"{v:.3f} {unit}" if unit else f"{v}"  # noqa: E731
    out = [
        f"model: {plan.model} ({a.num_hidden_layers} layers: {a.layer_types.count('full_attention')} attention, "
        f"{a.layer_types.count('linear_attention')} GDN; hidden {a.hidden_size}), weights {plan.storage.label}",
        f"profile: {plan.profile.name} ({plan.profile.chip})",
        f"context {plan.context} tokens, chunk {plan.chunk}, prompt {plan.prompt_tokens}",
        f"ANE fraction: requested {plan.requested_fraction:.2f}, effective {plan.effective_fraction:.3f} of the prefill's FLOPs",
        "",
        f"{'piece':<15} {'layers':>6} {'requested':>9} {'effective':>9} {'FLOP share':>10}  ANE slice",
    ]
    total = sum(t for t, _ in plan.flops.values())
    for p in plan.pieces:
        slice_ = f"{p.ane_units}/{p.units} {p.unit}" if p.units else "-"
        out.append(f"{p.kind:<15} {p.layers:>6} {p.requested:>9.2f} {p.ane_share:>9.2f} {plan.flops[p.kind][0] / total:>10.3f}  {slice_}")
    if plan.programs:
        out += ["", program_line(plan)]
    if plan.caps():
        out += ["", "caps:"] + [f"  {c}" for c in plan.caps()]
    out += [
        "",
        "predicted:",
        f"  GPU-only prefill   {fmt(pr['gpu_only_prefill_s'])}",
        f"  split prefill      {fmt(pr['split_prefill_s'])}" + (f"  ({pr['speedup']}x)" if pr["speedup"] else ""),
        f"  TTFT ({plan.prompt_tokens} tokens) {fmt(pr['ttft_s'])}",
        f"  decode roofline    {fmt(pr['decode_roofline_tps'], 'tok/s')}",
        f"  plain decode       {fmt(pr['decode_plain_tps'], 'tok/s')}",
        f"  decode with MTP    {fmt(pr['decode_mtp_tps'], 'tok/s')}",
    ]
    if plan.unknown:
        out += ["", "unknown:"] + [f"  {u}" for u in plan.unknown]
    if plan.assumptions:
        out += ["", "assumptions:"] + [f"  {x}" for x in plan.assumptions]
    if plan.memory is not None:
        out += [""] + plan.memory.text()
    return out


# ----------------------------------------------------------------------------------------------------------
# The governor for a loaded model (`hetero run`, the server)

_WINDOWS: dict[tuple[int, float | None], tuple[weakref.ref, Budget]] = {}


def loaded_budget(model, memory_gb: float | None = None, chunk: int = 512, in_flight: int = 1) -> Budget:
    """The governor's budget for a loaded model: its actual weight bytes and cache dtype, this machine's RAM
    (or `memory_gb`), `in_flight` chunks of prefill buffers. Cached per model, memory size and chunks in flight."""
    from mlx.utils import tree_flatten

    key = (id(model), memory_gb, in_flight)
    ref, budget = _WINDOWS.get(key, (None, None))
    if ref is None or ref() is not model:  # an id can be reused once a model is freed
        weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        kv_bytes = model.model.norm.weight.dtype.size  # the cache holds K/V in the model's dtype
        memory = memory_gb * 1e9 if memory_gb is not None else physical_memory_bytes()
        budget = govern(model.args, weights, memory, chunk, kv_bytes, weights_label="as loaded", in_flight=in_flight)
        _WINDOWS[key] = (weakref.ref(model), budget)
    return budget


def check_prompt_fits(model, n_tokens: int, memory_gb: float | None = None, in_flight: int = 1) -> None:
    """HeteroError when a prompt of `n_tokens` exceeds the memory governor's context window (with `in_flight`
    chunks prefilled at once)."""
    budget = loaded_budget(model, memory_gb, in_flight=in_flight)
    if n_tokens >= budget.context_window:
        raise HeteroError(
            f"the prompt has {n_tokens} tokens but the memory governor's context window is {budget.context_window} "
            f"tokens ({budget.memory_bytes / 1e9:.1f} GB RAM, {budget.wirable_bytes / 1e9:.1f} GB GPU-wirable, "
            f"{budget.kv_bytes_per_token} KV bytes per token); shorten it or give more memory (--memory-gb)"
        )
