"""Slicing: a requested ANE fraction -> the aligned share of every piece of a prefill (shared/DESIGN.md section 4).

Attention layers give F of their KV-head groups (whole groups, their query heads along), MLPs F of their
intermediate channels (multiples of 64), an MoE layer's shared expert F of its channels, GDN input projections only
their `z` rows (capped at z / (qkv + z + b + a)); the routed experts, the recurrent path, embeddings, lm_head and
the MTP head give nothing. Each cap carries its reason. Also here: the per-layer slices the exporter builds and the
pipeline runs, the ANE's weight bytes as exported (fp16, or a quantized checkpoint's per-group lookup tables), the
per-program budget and the programs a share is exported as, the fit to a measured per-process ANE limit, and the
weight counts (total, active per token).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from hetero.errors import HeteroError
from hetero.models.args import SUPPORTED_MODEL_TYPES
from hetero.models.qwen3_5 import ModelArgs
from hetero.models.qwen4_exp.args import MODEL_TYPES as QWEN4_TYPES, Qwen4Args
from hetero.planner.shape import MoE, Storage, ple_table_params
from hetero.profiles import Profile

ALIGN = 64  # channel and row slices come in multiples of 64 (the exporter's BC1S channel tile)
ANE_WEIGHT_BYTES = 2  # the exporter embeds fp16 weights (a float checkpoint's, or one quantized to more than 4 bits)
DELTA_BLOCK = 64  # the chunked delta rule's block size: its intra-block matmuls scale with it
# Weights per exported ANE program: below the documented ~2 GB per program (a weights.bin past 2^31 bytes fails
# to load), with room for the package's own metadata. The exporter splits a larger share into several programs.
PROGRAM_WEIGHT_BUDGET = int(1.5 * 2**30)
KINDS = ("attention", "qsa_indexer", "mlp", "moe", "shared_expert", "gdn_in_proj", "gdn_recurrence", "gdn_out_proj",
         "hyper_connections", "ple", "lm_head", "mtp")
OFFLOADABLE = ("attention", "mlp", "gdn_in_proj", "shared_expert")  # the kinds that may give the ANE a share
EXACT_PATH = {
    "gdn_recurrence": "conv and delta-rule recurrence carry state across the whole context: exact GPU path",
    "gdn_out_proj": "gated norm and out_proj follow the recurrence: exact GPU path",
    "lm_head": "embeddings, final norm and lm_head (last row only) stay on the GPU",
    "mtp": "the MTP head stays on the GPU: its KV feeds speculative decoding",
    "moe": "routed experts stay on the GPU: each token picks its own experts, a static ANE program cannot gather them",
    "hyper_connections": "the hyper-connection mixers read and write the residual streams: exact GPU path",
    "ple": "PLE gathers hashed n-gram rows from disk and carries a conv window: exact GPU path",
    "qsa_indexer": "the QSA indexer's keys and selection decide which keys every query reads (the ANE's heads "
                   "included): exact GPU path",
}
SPLIT_MODEL_TYPES = SUPPORTED_MODEL_TYPES + QWEN4_TYPES  # the checkpoints the split prefill has programs for


LUT_BITS = (1, 2, 3, 4)  # index widths Core ML has whose per-group table (group >= 32) costs less than fp16


def lut_bytes_per_weight(bits: int, group: int) -> float:
    """Bytes per weight of a per-group lookup table as the exporter embeds a quantized checkpoint's weights
    (`hetero.coreml.graphs.palette`): the index (`bits` / 8) plus the group's 2^bits fp16 entries."""
    return bits / 8 + 2 * 2**bits / group


def never_split(args: ModelArgs | Qwen4Args) -> dict[str, str]:
    """Offloadable piece kinds this architecture never gives the ANE, with the reason: Qwen4-Exp's dense MLP, which it
    has none of (every layer is MoE: its shared expert is the `shared_expert` piece)."""
    if not isinstance(args, Qwen4Args):
        return {}
    return {"mlp": "every qwen4_exp layer is mixture-of-experts: its shared expert is the shared_expert piece"}


@dataclass(frozen=True)
class PieceSlice:
    """One layer's ANE share of one piece: units [start, stop).

    Units: attention -> KV heads (their query-head groups come along), mlp -> intermediate channels,
    shared_expert -> the shared expert's intermediate channels, gdn_in_proj -> rows of in_proj_z (the only rows of
    the GDN input projections that may leave).
    """

    layer: int
    piece: str
    start: int
    stop: int


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
    active_params: int | None = None  # weights one token reads per layer (MoE: its top-k experts); None = all

    @property
    def token_params(self) -> int:
        """Weights per layer one decoded token reads."""
        return self.params if self.active_params is None else self.active_params

    @property
    def ane_share(self) -> float:
        return self.ane_units / self.units if self.units else 0.0


def _aligned(x: float, step: int, total: int) -> int:
    """x rounded to the nearest multiple of `step` (half up), within [0, total]."""
    return max(0, min(total, int(math.floor(x / step + 0.5)) * step))


def pieces(args: ModelArgs | Qwen4Args, moe: MoE | None, fraction: float) -> list[Piece]:
    """The pieces of one prefill with their aligned ANE shares for a requested fraction (no memory cap). Qwen4-Exp
    adds its hyper-connections, PLE projections (the n-gram tables stay on disk: `shape.ple_table_params`), the QSA
    indexer (on the GPU: the ANE's heads attend to the keys it selects) and its own MTP head; its attention heads,
    shared experts and GDN z rows split as Qwen3.5's do."""
    if not 0.0 <= fraction <= 1.0:
        raise HeteroError(f"--ane-fraction {fraction}: must be between 0 and 1")
    return _pieces(args, moe, fraction)


def _pieces(args: ModelArgs | Qwen4Args, moe: MoE | None, fraction: float) -> list[Piece]:
    h, H, Hkv, D = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim
    n_attn = sum(t != "linear_attention" for t in args.layer_types)  # full attention (Qwen4-Exp: QSA)
    n_gdn = args.num_hidden_layers - n_attn
    group = H // Hkv
    q4 = isinstance(args, Qwen4Args)
    out: list[Piece] = []

    attn_params = h * (2 * H * D + 2 * Hkv * D + H * D)  # q + gate, k, v, o
    index_params = h * (args.indexer_n_heads + 1) * args.indexer_head_dim if q4 and args.qsa else 0
    # QSA's indexer scores each query against every compressed block (one per indexer_compress_ratio keys)
    index_pair_flops = 2.0 * args.indexer_n_heads * args.indexer_head_dim / args.indexer_compress_ratio if index_params else 0.0
    kv = _aligned(fraction * Hkv, 1, Hkv)
    cap = None
    if kv != fraction * Hkv:
        cap = f"heads go in whole KV groups ({group} query heads each): {fraction:g} x {Hkv} groups rounds to {kv}"
    if n_attn:
        out.append(Piece("attention", n_attn, Hkv, "kv_groups", kv, attn_params, 2.0 * attn_params, 4.0 * H * D,
                         attn_params // Hkv, fraction, cap, pair_scores=H))
    if n_attn and index_params:  # the ANE's heads attend to the keys it selects: it never leaves the GPU
        out.append(Piece("qsa_indexer", n_attn, 0, "", 0, index_params, 2.0 * index_params, index_pair_flops,
                         requested=fraction, cap_reason=EXACT_PATH["qsa_indexer"] if fraction else None))

    dense_layers = args.num_hidden_layers - len(args.moe_layers)
    if dense_layers:
        I = args.intermediate_size
        c = _aligned(fraction * I, ALIGN, I)
        cap = None if c == fraction * I else f"channels in multiples of {ALIGN}: {fraction:g} x {I} rounds to {c}"
        out.append(Piece("mlp", dense_layers, I, "channels", c, 3 * h * I, 6.0 * h * I, 0.0, 3 * h, fraction, cap))
    if moe is not None:
        routed, active = moe_params(h, moe)
        out.append(Piece("moe", len(args.moe_layers), 0, "", 0, routed, 2.0 * active, requested=fraction,
                         cap_reason=moe_cap(h, moe) if fraction else None, active_params=active))
        if moe.shared_intermediate:
            I = moe.shared_intermediate
            c = _aligned(fraction * I, ALIGN, I)
            cap = None if c == fraction * I else f"channels in multiples of {ALIGN}: {fraction:g} x {I} rounds to {c}"
            out.append(Piece("shared_expert", len(args.moe_layers), I, "channels", c, 3 * h * I, 6.0 * h * I, 0.0,
                             3 * h, fraction, cap))
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

    if q4:
        hc = hyper_params(args)
        out.append(Piece("hyper_connections", args.num_hidden_layers, 0, "", 0, 2 * hc, 4.0 * hc, requested=fraction,
                         cap_reason=EXACT_PATH["hyper_connections"] if fraction else None))
        if args.ple_layer_ids:  # the n-gram tables stay on disk (`shape.ple_table_params`): not among the weights
            E, S = args.ple_embed_dim, args.hc_count * h
            ple = E * S + E * h + S * args.ple_conv_kernel_size  # key_proj, value_proj, the dilated conv
            out.append(Piece("ple", len(args.ple_layer_ids), 0, "", 0, ple, 2.0 * ple, requested=fraction,
                             cap_reason=EXACT_PATH["ple"] if fraction else None))
    head_params = args.vocab_size * h * (1 if args.tie_word_embeddings else 2)
    head_params += hyper_params(args, final=True) if q4 else 0  # Qwen4-Exp's final mixer in place of the final norm
    out.append(Piece("lm_head", 1, 0, "", 0, head_params, 2.0 * h * args.vocab_size, requested=fraction,
                     cap_reason=EXACT_PATH["lm_head"] if fraction else None))
    if q4 and args.mtp_num_hidden_layers:  # fc_embedding, fc_hidden; one QSA + MoE layer with hc; its own mixer
        routed, active = moe_params(h, moe)
        base = 2 * h * h + attn_params + index_params + 3 * h * moe.shared_intermediate + 2 * hyper_params(args)
        base += hyper_params(args, final=True)
        out.append(Piece("mtp", 1, 0, "", 0, base + routed, 2.0 * (base + active), 4.0 * H * D + index_pair_flops,
                         requested=fraction, cap_reason=EXACT_PATH["mtp"] if fraction else None,
                         pair_scores=H, active_params=base + active))
    elif args.mtp_num_hidden_layers:
        n = args.mtp_num_hidden_layers
        mtp_params = mtp_active = n * attn_params + 2 * h * h  # + fc
        for j in range(n):  # an MTP layer's MLP is an MoE block where the backbone's rule says so (vLLM's layout)
            if moe is not None and j in args.mtp_moe_layers:
                routed, active = moe_params(h, moe)
                mtp_params += routed + 3 * h * moe.shared_intermediate
                mtp_active += active + 3 * h * moe.shared_intermediate
            else:
                mtp_params += 3 * h * args.intermediate_size
                mtp_active += 3 * h * args.intermediate_size
        out.append(Piece("mtp", 1, 0, "", 0, mtp_params, 2.0 * mtp_active, 4.0 * H * D * n,
                         requested=fraction, cap_reason=EXACT_PATH["mtp"] if fraction else None,
                         pair_scores=H * n, active_params=mtp_active if moe is not None else None))
    return out


def hyper_params(args: Qwen4Args, final: bool = False) -> int:
    """Weights of one Qwen4-Exp hyper-connection (two per decoder layer): the low-rank input mixer (down, up) and,
    unless it is a `final` mixer, the per-stream injection weights."""
    S = args.hc_count * args.hidden_size
    return 2 * S * args.hc_lowrank + (0 if final else S * args.hc_count)


@dataclass(frozen=True)
class Parameters:
    """Weight counts (matrices; norm vectors aside): all of them, and those one token uses (MoE: the router, its
    top-k experts and the shared expert); `mtp_*` is the MTP head's part of each. The embedding and lm_head
    matrices both count, as model cards count them. `on_disk`: Qwen4-Exp's PLE n-gram tables, read from the
    checkpoint's files and never held, so not in `total` (a model card's total includes them)."""

    total: int
    active: int
    mtp_total: int
    mtp_active: int
    on_disk: int = 0


def parameter_counts(args: ModelArgs, moe: MoE | None) -> Parameters:
    """Total and active-per-token weights of the network `pieces` describes."""
    ps = pieces(args, moe, 0.0)
    mtp = next((p for p in ps if p.kind == "mtp"), None)
    return Parameters(sum(p.layers * p.params for p in ps), sum(p.layers * p.token_params for p in ps),
                      mtp.params if mtp else 0, mtp.token_params if mtp else 0, ple_table_params(args))


def moe_params(hidden: int, moe: MoE) -> tuple[int, int]:
    """(all, active per token) weights of one layer's router and routed experts, with the shared expert's
    one-output sigmoid gate; the shared expert itself is its own piece."""
    gates = hidden * moe.experts + (hidden if moe.shared_intermediate else 0)
    per_expert = 3 * hidden * moe.intermediate  # gate, up, down
    return gates + moe.experts * per_expert, gates + moe.per_token * per_expert


def moe_cap(hidden: int, moe: MoE) -> str:
    """Why the routed experts take no ANE share, with the numbers of the static formulation that would."""
    per_layer = 3 * hidden * moe.intermediate * moe.experts * ANE_WEIGHT_BYTES
    return (f"{EXACT_PATH['moe']}; the static form (all {moe.experts} experts dense, unpicked ones weighted 0) "
            f"computes {moe.experts / moe.per_token:g}x the routed FLOPs and bakes {per_layer / 1e9:.2f} GB of fp16 "
            f"weights per layer (docs/planner.md, Mixture of experts)")


def delta_rule_flops(nv: int, dk: int, dv: int) -> float:
    """FLOPs per token of the chunked delta rule: intra-block matmuls (QK^T, KK^T, attn @ V) and the state's
    read, update and output."""
    return nv * 2.0 * (2 * DELTA_BLOCK * dk + DELTA_BLOCK * dv + 3 * dk * dv)


def ane_bytes_per_weight(storage: Storage | None = None) -> float:
    """Bytes one weight of the ANE's share costs as the exporter writes it: a checkpoint quantized to at most 4 bits
    keeps its own quantization as per-group lookup tables (the index, plus 2^bits fp16 entries per group: 1.0 byte at
    4 bits, group 64, against the checkpoint's 0.5625); anything else is fp16 (2 bytes). None: fp16."""
    if storage is not None and storage.bits in LUT_BITS and 2**storage.bits <= storage.group_size:
        return lut_bytes_per_weight(storage.bits, storage.group_size)
    return float(ANE_WEIGHT_BYTES)


def ane_weights_label(storage: Storage | None = None) -> str:
    """How the ANE's share is stored, for the plan's lines."""
    if ane_bytes_per_weight(storage) == ANE_WEIGHT_BYTES:
        return "fp16"
    return f"{storage.bits}-bit lookup tables per group of {storage.group_size}, exact"


def ane_weight_bytes(ps: list[Piece], storage: Storage | None = None) -> int:
    """Bytes of every weight the ANE's share carries as exported (what Core ML keeps resident); `storage` is the
    checkpoint's (None: fp16)."""
    per = ane_bytes_per_weight(storage)
    return int(sum(p.layers * p.ane_units * p.ane_unit_params * per for p in ps))


def program_budget(profile: Profile) -> int:
    """Weight bytes per exported ANE program: the exporter's budget, or the profile's per-program limit or its
    per-instance weight window (the device window one ANE instance maps a program's weights into) if lower."""
    limits = [PROGRAM_WEIGHT_BUDGET]
    for gb in (profile.ane_program_weight_limit_gb, profile.ane_instance_weight_window_gb):
        if gb is not None:
            limits.append(int(gb * 1e9))
    return min(limits)


def budget_spans(kind: str, units: int, per_unit: int, budget: int = PROGRAM_WEIGHT_BUDGET) -> list[tuple[int, int]]:
    """`units` units of `per_unit` weight bytes each cut into programs of at most `budget` bytes: unit ranges
    [start, stop), channel and row parts in multiples of ALIGN (KV groups whole)."""
    per_part = max(1, budget // per_unit)
    if kind != "attention" and per_part >= ALIGN:
        per_part -= per_part % ALIGN
    return [(a, min(a + per_part, units)) for a in range(0, units, per_part)]


def unit_bytes(args: ModelArgs, piece: str, storage: Storage | None = None) -> int:
    """Weight bytes as exported (`ane_bytes_per_weight`; None: fp16) one unit of a piece carries (one KV head's
    group, one MLP or shared-expert channel, one z row)."""
    h, H, Hkv, D = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim
    per_unit = {"attention": h * (2 * H * D + 2 * Hkv * D + H * D) // Hkv, "mlp": 3 * h, "shared_expert": 3 * h,
                "gdn_in_proj": h}
    if piece not in per_unit:
        raise HeteroError(f"piece {piece!r} takes no ANE share")
    return math.ceil(per_unit[piece] * ane_bytes_per_weight(storage))


def split_for_budget(args: ModelArgs, s: PieceSlice, budget: int = PROGRAM_WEIGHT_BUDGET,
                     storage: Storage | None = None) -> list[PieceSlice]:
    """A slice cut into the programs it is exported as: consecutive parts of at most `budget` weight bytes as
    exported (channel and row parts in multiples of 64)."""
    spans = budget_spans(s.piece, s.stop - s.start, unit_bytes(args, s.piece, storage), budget)
    return [PieceSlice(s.layer, s.piece, s.start + a, s.start + b) for a, b in spans]


def program_spans(p: Piece, budget: int = PROGRAM_WEIGHT_BUDGET, storage: Storage | None = None) -> list[tuple[int, int]]:
    """One layer's ANE share of `p` cut into programs of at most `budget` weight bytes as exported."""
    return budget_spans(p.kind, p.ane_units, math.ceil(p.ane_unit_params * ane_bytes_per_weight(storage)), budget)


def ane_programs(ps: list[Piece], budget: int = PROGRAM_WEIGHT_BUDGET, storage: Storage | None = None) -> dict[str, int]:
    """How many ANE programs each piece kind is exported as, over all its layers."""
    return {p.kind: p.layers * len(program_spans(p, budget, storage)) for p in ps if p.ane_units}


def largest_program_bytes(ps: list[Piece], budget: int = PROGRAM_WEIGHT_BUDGET, storage: Storage | None = None) -> int:
    """The weight bytes of the largest program the share is exported as (what one ANE instance must map)."""
    per = ane_bytes_per_weight(storage)
    return max((math.ceil((b - a) * p.ane_unit_params * per) for p in ps if p.ane_units
                for a, b in program_spans(p, budget, storage)), default=0)


def fit_ane_memory(args: ModelArgs, moe: MoE | None, fraction: float, limit_bytes: float | None,
                   storage: Storage | None = None) -> tuple[list[Piece], float]:
    """Pieces for `fraction`, scaled down to the largest fraction whose ANE weights (as exported for `storage`)
    fit `limit_bytes` (a per-process limit a profile measured; None = none known).

    Returns (pieces, the fraction actually sliced); caps name the limit on every piece they shrink.
    """
    ps = pieces(args, moe, fraction)
    need = ane_weight_bytes(ps, storage)
    if limit_bytes is None or need <= limit_bytes:
        return ps, fraction
    lo, hi = 0.0, fraction
    for _ in range(30):  # bisection: ANE bytes grow monotonically with the fraction
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ane_weight_bytes(pieces(args, moe, mid), storage) <= limit_bytes else (lo, mid)
    fitted = pieces(args, moe, lo)
    why = (f"ANE memory: at {fraction:g} the ANE share needs {need / 1e9:.1f} GB of weights "
           f"({ane_weights_label(storage)}), above the "
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
        if kind != "linear_attention" and by_kind.get("attention") and by_kind["attention"].ane_units:
            out.append(PieceSlice(i, "attention", 0, by_kind["attention"].ane_units))
        if kind == "linear_attention" and by_kind.get("gdn_in_proj") and by_kind["gdn_in_proj"].ane_units:
            out.append(PieceSlice(i, "gdn_in_proj", 0, by_kind["gdn_in_proj"].ane_units))
        if i not in moe_layers and by_kind.get("mlp") and by_kind["mlp"].ane_units:
            out.append(PieceSlice(i, "mlp", 0, by_kind["mlp"].ane_units))
        if i in moe_layers and by_kind.get("shared_expert") and by_kind["shared_expert"].ane_units:
            out.append(PieceSlice(i, "shared_expert", 0, by_kind["shared_expert"].ane_units))
    return out
