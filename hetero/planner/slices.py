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
from hetero.models.architectures import shape
from hetero.models.interface import Args, Shape
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
ATTENTION_BIAS = "attention with biases (attention_bias) stays on the GPU: the ANE's programs take none"
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


LUT_BITS = (1, 2, 3, 4)  # index widths Core ML has whose per-group table (group >= 32) costs less than fp16


def lut_bytes_per_weight(bits: int, group: int) -> float:
    """Bytes per weight of a per-group lookup table as the exporter embeds a quantized checkpoint's weights
    (`hetero.coreml.graphs.palette`): the index (`bits` / 8) plus the group's 2^bits fp16 entries."""
    return bits / 8 + 2 * 2**bits / group


def never_split(args: Args) -> dict[str, str]:
    """Offloadable piece kinds this model never gives the ANE, with the reason (`Shape.never_split`: Qwen4-Exp has no
    dense MLP, every layer is MoE and its shared expert is the `shared_expert` piece; attention with biases)."""
    cannot = dict(shape(args).never_split)
    if args.attention_bias:
        cannot["attention"] = ATTENTION_BIAS
    return cannot


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


def pieces(args: Args, moe: MoE | None, fraction: float) -> list[Piece]:
    """The pieces of one prefill with their aligned ANE shares for a requested fraction (no memory cap). Qwen4-Exp
    adds its hyper-connections, PLE projections (the n-gram tables stay on disk: `shape.ple_table_params`), the QSA
    indexer (on the GPU: the ANE's heads attend to the keys it selects) and its own MTP head; its attention heads,
    shared experts and GDN z rows split as Qwen3.5's do."""
    if not 0.0 <= fraction <= 1.0:
        raise HeteroError(f"--ane-fraction {fraction}: must be between 0 and 1")
    return _pieces(args, moe, fraction)


def _pieces(args: Args, moe: MoE | None, fraction: float) -> list[Piece]:
    net = shape(args)
    return [*_attention(args, net, fraction), *_mlp(args, moe, fraction), *_gdn(args, fraction),
            *_exact(args, net, fraction), _head(args, net, fraction), *_mtp(args, net, moe, fraction)]


def _exact_piece(kind: str, layers: int, params: int, token_flops: float, fraction: float, pair_flops: float = 0.0,
                 **more) -> Piece:
    """A piece that always stays on the GPU (`EXACT_PATH` says why, when a share was asked)."""
    return Piece(kind, layers, 0, "", 0, params, token_flops, pair_flops, requested=fraction,
                 cap_reason=EXACT_PATH[kind] if fraction else None, **more)


def _channels(kind: str, layers: int, I: int, h: int, fraction: float) -> Piece:
    """A SwiGLU of I intermediate channels (a dense MLP, a shared expert): F of its channels, in multiples of 64."""
    c = _aligned(fraction * I, ALIGN, I)
    cap = None if c == fraction * I else f"channels in multiples of {ALIGN}: {fraction:g} x {I} rounds to {c}"
    return Piece(kind, layers, I, "channels", c, 3 * h * I, 6.0 * h * I, 0.0, 3 * h, fraction, cap)


def attention_params(args: Args) -> int:
    """Weights of one attention layer's projections: q + gate, k, v, o."""
    h, H, Hkv, D = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim
    return h * (2 * H * D + 2 * Hkv * D + H * D)


def _attention(args: Args, net: Shape, fraction: float) -> list[Piece]:
    """The attention layers' heads in whole KV-head groups, and a key selection (a QSA indexer) on the GPU."""
    H, Hkv, D = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    n_attn = sum(t != "linear_attention" for t in args.layer_types)  # full attention (Qwen4-Exp: QSA)
    if not n_attn:
        return []
    params, kv = attention_params(args), _aligned(fraction * Hkv, 1, Hkv)
    cap = None
    if kv != fraction * Hkv:
        cap = f"heads go in whole KV groups ({H // Hkv} query heads each): {fraction:g} x {Hkv} groups rounds to {kv}"
    if args.attention_bias and fraction:  # the other kinds still split
        kv, cap = 0, ATTENTION_BIAS
    out = [Piece("attention", n_attn, Hkv, "kv_groups", kv, params, 2.0 * params, 4.0 * H * D, params // Hkv,
                 fraction, cap, pair_scores=H)]
    if net.indexer_params:  # the ANE's heads attend to the keys it selects: it never leaves the GPU
        out.append(_exact_piece("qsa_indexer", n_attn, net.indexer_params, 2.0 * net.indexer_params, fraction,
                                net.indexer_pair_flops))
    return out


def _mlp(args: Args, moe: MoE | None, fraction: float) -> list[Piece]:
    """Dense MLPs' channels; an MoE layer's routed experts (on the GPU) and its shared expert's channels."""
    h, out = args.hidden_size, []
    dense_layers = args.num_hidden_layers - len(args.moe_layers)
    if dense_layers:
        out.append(_channels("mlp", dense_layers, args.intermediate_size, h, fraction))
    if moe is not None:
        routed, active = moe_params(h, moe)
        out.append(Piece("moe", len(args.moe_layers), 0, "", 0, routed, 2.0 * active, requested=fraction,
                         cap_reason=moe_cap(h, moe) if fraction else None, active_params=active))
        if moe.shared_intermediate:
            out.append(_channels("shared_expert", len(args.moe_layers), moe.shared_intermediate, h, fraction))
    return out


def _gdn(args: Args, fraction: float) -> list[Piece]:
    """GDN layers: the input projections' z rows (capped at z / (qkv + z + b + a)); conv, recurrence, gated norm
    and out_proj on the exact GPU path."""
    n_gdn = args.layer_types.count("linear_attention")
    if not n_gdn:
        return []
    h = args.hidden_size
    nk, nv = args.linear_num_key_heads, args.linear_num_value_heads
    dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
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
    K = args.linear_conv_kernel_dim
    return [Piece("gdn_in_proj", n_gdn, rows, "rows", zr, h * rows, 2.0 * h * rows, 0.0, h, fraction, cap),
            _exact_piece("gdn_recurrence", n_gdn, qkv * K, 2.0 * qkv * K + delta_rule_flops(nv, dk, dv), fraction),
            _exact_piece("gdn_out_proj", n_gdn, z * h, 2.0 * z * h + 8.0 * z, fraction)]


def _exact(args: Args, net: Shape, fraction: float) -> list[Piece]:
    """The architecture's own per-layer parts, all on the exact GPU path: hyper-connections, PLE projections (the
    n-gram tables stay on disk: `shape.ple_table_params`)."""
    out = []
    if net.hyper_params:  # two per layer: around the mixer and around the MLP
        out.append(_exact_piece("hyper_connections", args.num_hidden_layers, 2 * net.hyper_params,
                                4.0 * net.hyper_params, fraction))
    if net.ple_layers:
        out.append(_exact_piece("ple", len(net.ple_layers), net.ple_params, 2.0 * net.ple_params, fraction))
    return out


def _head(args: Args, net: Shape, fraction: float) -> Piece:
    """Embeddings and lm_head (both count unless tied), and a final hyper-connection mixer in place of the norm."""
    h = args.hidden_size
    params = args.vocab_size * h * (1 if args.tie_word_embeddings else 2) + net.final_mixer_params
    return _exact_piece("lm_head", 1, params, 2.0 * h * args.vocab_size, fraction)


def _mtp(args: Args, net: Shape, moe: MoE | None, fraction: float) -> list[Piece]:
    """The MTP head: its input projections, then per layer attention (with its key selection and hyper-connections)
    and an MLP (MoE where its architecture makes it so, vLLM's layout), and its own final mixer where it has one."""
    n = net.mtp_layers
    if not n:
        return []
    h, H, D = args.hidden_size, args.num_attention_heads, args.head_dim
    layer = attention_params(args) + net.indexer_params + 2 * net.hyper_params
    params = active = net.mtp_input_params + n * layer + net.final_mixer_params
    for j in range(n):
        if moe is not None and j in net.mtp_moe_layers:
            routed, per_token = moe_params(h, moe)
            params += routed + 3 * h * moe.shared_intermediate
            active += per_token + 3 * h * moe.shared_intermediate
        else:
            params += 3 * h * args.intermediate_size
            active += 3 * h * args.intermediate_size
    return [_exact_piece("mtp", 1, params, 2.0 * active, fraction, 4.0 * H * D * n + net.indexer_pair_flops * n,
                         pair_scores=H * n, active_params=active if moe is not None else None)]


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


def parameter_counts(args: Args, moe: MoE | None) -> Parameters:
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


def unit_bytes(args: Args, piece: str, storage: Storage | None = None) -> int:
    """Weight bytes as exported (`ane_bytes_per_weight`; None: fp16) one unit of a piece carries (one KV head's
    group, one MLP or shared-expert channel, one z row)."""
    h, H, Hkv, D = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim
    per_unit = {"attention": h * (2 * H * D + 2 * Hkv * D + H * D) // Hkv, "mlp": 3 * h, "shared_expert": 3 * h,
                "gdn_in_proj": h}
    if piece not in per_unit:
        raise HeteroError(f"piece {piece!r} takes no ANE share")
    return math.ceil(per_unit[piece] * ane_bytes_per_weight(storage))


def split_for_budget(args: Args, s: PieceSlice, budget: int = PROGRAM_WEIGHT_BUDGET,
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


def fit_ane_memory(args: Args, moe: MoE | None, fraction: float, limit_bytes: float | None,
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


def ane_slices(args: Args, fraction: float, moe: MoE | None = None) -> list[PieceSlice]:
    """Per-layer ANE slices for a fraction (alignment only; the caller passes an already memory-capped one).

    This is what the Core ML exporter builds and what the pipeline runs.
    """
    return layer_slices(args, pieces(args, moe, fraction))


def layer_slices(args: Args, ps: list[Piece]) -> list[PieceSlice]:
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
