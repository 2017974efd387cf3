"""Pipeline parallelism across hosts (issue 15): the model's backbone layers split across ranks by the planner's
per-layer cost, never cutting a layer; the embedding lives on rank 0, the final norm, lm_head and the MTP head on
the last rank, and their cost counts on those ranks.

The split balances prefill FLOPs of a `SPLIT_TOKENS`-long prompt in 512-token chunks (attention layers cost more
than GDN layers as the context grows; MoE layers count their active experts). It depends on the config only, so
every rank, the runtime and `hetero plan --hosts` derive the same split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from hetero.errors import HeteroError
from hetero.host.settings import DEFAULT_DRAFT_DEPTH
from hetero.models.interface import Args
from hetero.planner.cost import chunk_spans, piece_flops
from hetero.planner.governor import RUNTIME_RESERVE, prefill_buffer_bytes
from hetero.planner.predict import Lanes, distinct_experts, gpu_chunk_seconds, verify_cost
from hetero.planner.shape import MoE, Storage, gdn_state_bytes, moe_of
from hetero.planner.slices import Piece, pieces
from hetero.profiles import Profile

SPLIT_TOKENS = 16384  # the prompt length the split balances: a long agent prompt, where pipelining pays
SPLIT_CHUNK = 512


@dataclass(frozen=True)
class LayerCosts:
    """Prefill FLOPs per backbone layer, plus what only rank 0 (embedding) and the last rank (final norm, lm_head
    on the last row, the MTP head over the prompt) compute."""

    layers: list[float]
    first: float
    last: float


def layer_costs(args: Args, moe: MoE | None = None, tokens: int = SPLIT_TOKENS, chunk: int = SPLIT_CHUNK,
                mtp: bool = True) -> LayerCosts:
    """FLOPs each backbone layer spends on a `tokens`-long prefill in `chunk`-token chunks (the planner's pieces:
    attention or GDN mixer, then a dense MLP or the MoE block with its active experts). `mtp`: the last rank also
    runs the MTP head over the prompt (as a prefill for MTP decoding does), when the model has one."""
    moe = moe if moe is not None else moe_of(args)
    starts, sizes = chunk_spans(tokens, chunk)
    by_kind = {p.kind: float(piece_flops(p, starts, sizes).sum()) for p in pieces(args, moe, 0.0)}
    f = lambda *kinds: sum(by_kind.get(k, 0.0) for k in kinds)  # noqa: E731
    attention, gdn = f("attention"), f("gdn_in_proj", "gdn_recurrence", "gdn_out_proj")
    moe_layers = set(args.moe_layers)
    per_layer = [(attention if t == "full_attention" else gdn) + (f("moe") if i in moe_layers else f("mlp"))
                 for i, t in enumerate(args.layer_types)]
    return LayerCosts(per_layer, 0.0, f("lm_head") + (f("mtp") if mtp else 0.0))  # the embedding: a gather, no FLOPs


def split_layers(args: Args, n_ranks: int, *, moe: MoE | None = None, tokens: int = SPLIT_TOKENS,
                 chunk: int = SPLIT_CHUNK, mtp: bool = True) -> list[range]:
    """One `range` of backbone layer indices per rank, contiguous, in order, covering every layer once.

    Rank 0 also holds the embedding, the last rank the final norm, lm_head and the MTP head (their cost counts
    there). The ranges minimise the busiest rank's prefill FLOPs (`layer_costs`: a `tokens`-long prompt in
    `chunk`-token chunks), since a prefill pipelined by chunk takes about the slowest rank's share. Deterministic:
    every rank computes the same split from the same args. `moe`: the routed experts' shape, read from the args
    when not given. `mtp=False` when the last rank will not run an MTP head over the prompt (a checkpoint without
    `mtp.*` tensors, or decoding without MTP): the last rank then takes more layers. Raises HeteroError unless
    1 <= n_ranks <= num_hidden_layers (no rank is left empty).
    """
    n_layers = args.num_hidden_layers
    if not 1 <= n_ranks <= n_layers:
        raise HeteroError(f"cannot split {n_layers} layers across {n_ranks} ranks: each rank needs at least one layer")
    return balanced_ranges(layer_costs(args, moe, tokens, chunk, mtp), n_ranks)


def balanced_ranges(costs: LayerCosts, n_ranks: int) -> list[range]:
    """Contiguous non-empty ranges minimising the largest rank total (rank 0 adds `first`, the last rank `last`).

    Dynamic programme over (ranks, layers): exact, O(n_ranks x layers^2), which is nothing for a few hundred layers.
    On equal maxima the earliest cut wins, so the answer is the same wherever it is computed.
    """
    c, n = costs.layers, len(costs.layers)
    prefix = [0.0]
    for x in c:
        prefix.append(prefix[-1] + x)

    def part(r: int, i: int, j: int) -> float:  # rank r's total with layers [i, j)
        return prefix[j] - prefix[i] + (costs.first if r == 0 else 0.0) + (costs.last if r == n_ranks - 1 else 0.0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_ranks)]  # best[r][j]: the least max over ranks 0..r holding layers [0, j)
    cut = [[0] * (n + 1) for _ in range(n_ranks)]
    for j in range(1, n + 1):
        best[0][j] = part(0, 0, j)
    for r in range(1, n_ranks):
        for j in range(r + 1, n + 1):
            for i in range(r, j):  # rank r takes [i, j); ranks 0..r-1 hold [0, i), one layer each at least
                v = max(best[r - 1][i], part(r, i, j))
                if v < best[r][j]:
                    best[r][j], cut[r][j] = v, i
    bounds, j = [n], n
    for r in range(n_ranks - 1, 0, -1):
        j = cut[r][j]
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


# ----------------------------------------------------------------------------------------------------------
# `hetero plan --hosts N`: memory per host and the pipelined prefill and decode

ACTIVATION_BYTES = 2  # a hidden state crosses the link in the model's dtype: bf16 on a Mac
TOKEN_MESSAGE_BYTES = 64  # sampled tokens (and an MTP round's drafts) going back to rank 0: a few int32
MEASURE_LINK = ("measure with `iperf3 -c HOST` (bandwidth) and `ping HOST` (latency) between the hosts, "
                "then pass --link-gbps / --link-latency-ms")
MEASURE_LINK_SHORT = "measure with iperf3 and ping between the hosts, pass --link-gbps / --link-latency-ms"


@dataclass(frozen=True)
class Link:
    """The link between consecutive ranks: usable bandwidth (Gb/s) and a message's fixed cost (ms); None = unknown."""

    gbps: float | None
    latency_ms: float | None

    @property
    def known(self) -> bool:
        return self.gbps is not None and self.latency_ms is not None

    def seconds(self, nbytes: float) -> float:
        """One message of `nbytes` (the link must be known)."""
        return self.latency_ms / 1e3 + nbytes * 8 / (self.gbps * 1e9)

    def label(self) -> str:
        if not self.known:
            missing = [n for n, v in (("bandwidth", self.gbps), ("latency", self.latency_ms)) if v is None]
            return f"{' and '.join(missing)} unknown ({MEASURE_LINK})"
        return f"{self.gbps:g} Gb/s, {self.latency_ms:g} ms per message"


@dataclass
class Rank:
    """One host's part: its backbone layers, what else it holds, its memory at the context and its busy times."""

    rank: int
    layers: range
    attention: int
    gdn: int
    extras: list[str]  # "embedding", "final norm + lm_head", "MTP head"
    weight_bytes: int
    kv_bytes_per_token: int
    state_bytes: int  # GDN recurrent state + conv window, one sequence
    buffer_bytes: int  # one prefill chunk's transients, the hidden chunk it receives, the runtime reserve
    context: int
    prefill_s: float | None  # busy over the whole prompt
    decode_s: float | None  # one plain decode step's part
    window: int | None = None  # the largest context that fits this host (with a memory size)

    @property
    def memory_bytes(self) -> int:
        """What this host holds at the plan's context."""
        return self.weight_bytes + self.kv_bytes_per_token * self.context + self.state_bytes + self.buffer_bytes

    def to_dict(self) -> dict:
        return {"rank": self.rank, "layers": [self.layers.start, self.layers.stop], "attention_layers": self.attention,
                "gdn_layers": self.gdn, "extras": self.extras, "weight_bytes": self.weight_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token, "state_bytes": self.state_bytes,
                "buffer_bytes": self.buffer_bytes, "memory_bytes": self.memory_bytes,
                "prefill_busy_s": None if self.prefill_s is None else round(self.prefill_s, 6),
                "decode_step_s": None if self.decode_s is None else round(self.decode_s, 9), "context_window": self.window}


@dataclass
class HostPlan:
    """The split across hosts with its predictions (None = unknown) and what is unknown or assumed."""

    ranks: list[Rank]
    link: Link
    prompt_tokens: int
    predicted: dict
    unknown: list[str]
    assumptions: list[str]
    memory_gb: float | None = None

    def to_dict(self) -> dict:
        return {"hosts": len(self.ranks), "link_gbps": self.link.gbps, "link_latency_ms": self.link.latency_ms,
                "ranks": [r.to_dict() for r in self.ranks], "predicted": self.predicted, "unknown": self.unknown,
                "assumptions": self.assumptions, "memory_gb": self.memory_gb}


def rank_pieces(args: Args, moe: MoE | None, layers: range, last: bool) -> list[Piece]:
    """The planner's pieces restricted to one rank: its layers' mixers and MLPs, and lm_head and the MTP head on the
    last rank."""
    types = [args.layer_types[i] for i in layers]
    n_attn = types.count("full_attention")
    n_gdn = len(types) - n_attn
    moe_layers = set(args.moe_layers)
    n_moe = sum(i in moe_layers for i in layers)
    count = {"attention": n_attn, "gdn_in_proj": n_gdn, "gdn_recurrence": n_gdn, "gdn_out_proj": n_gdn,
             "mlp": len(types) - n_moe, "moe": n_moe, "shared_expert": n_moe, "lm_head": int(last), "mtp": int(last)}
    return [replace(p, layers=count[p.kind]) for p in pieces(args, moe, 0.0) if count[p.kind]]


@dataclass(frozen=True)
class HostSetup:
    """What every rank's figures read: the model, its storage, the profile and its lanes, the chunk, the context the
    memory and decode are planned at, and the prompt the prefill is."""

    args: Args
    moe: MoE | None
    storage: Storage
    profile: Profile
    lanes: Lanes
    chunk: int
    context: int
    prompt_tokens: int
    kv_layer: int  # one attention layer's KV bytes per token (quantized KV: fractional bytes, rounded up)

    @property
    def mtp(self) -> int:
        """The MTP head's layers (0: none)."""
        return self.args.mtp_num_hidden_layers

    def read_seconds(self, nbytes: float) -> float:
        """Seconds the GPU takes to read `nbytes` while decoding (the lanes' bandwidth must be known)."""
        return nbytes / (self.lanes.gpu_bw * self.profile.decode_efficiency)


def plan_hosts(args: Args, moe: MoE | None, storage: Storage, profile: Profile, n_hosts: int, context: int,
               prompt_tokens: int, chunk: int, link: Link, kv_bytes: float = 2, accepted_length: float = 2.5,
               depth: int = DEFAULT_DRAFT_DEPTH, memory_gb: float | None = None) -> HostPlan:
    """Memory per host and the pipelined prefill and decode for `split_layers(args, n_hosts)` (GPU-only per host).

    Prefill, pipelined by chunk: rank r starts chunk c once it finished chunk c-1 and chunk c's hidden states have
    arrived; the link to the next rank sends one chunk at a time ((chunk x hidden) activations per message). So the
    wall time is about the busiest rank's share plus the pipeline's fill and drain plus the transfers nothing
    hides, and the first token goes back to rank 0. Decode: one token passes every rank in turn (each reads its
    own weights, KV and state) plus n - 1 hops of one hidden state and one back to rank 0 with the sampled token;
    an MTP round is one verify pass the same way plus the draft steps on the last rank.
    """
    kv_layer = math.ceil(2 * args.num_key_value_heads * args.head_dim * kv_bytes)
    setup = HostSetup(args, moe, storage, profile, Lanes.of(profile), chunk, context, prompt_tokens, kv_layer)
    ranks: list[Rank] = []
    chunks: list[np.ndarray | None] = []  # per rank: seconds per chunk (None: the profile has no GPU throughput)
    for r, layers in enumerate(split_layers(args, n_hosts, moe=moe)):
        rank, seconds = host_rank(setup, r, layers, n_hosts)
        ranks.append(rank)
        chunks.append(seconds)
    if memory_gb is not None:
        fit_windows(ranks, setup, memory_gb)
    predicted, unknown = host_predictions(setup, ranks, chunks, link, accepted_length, depth)
    return HostPlan(ranks, link, prompt_tokens, predicted, unknown, host_assumptions(n_hosts, setup.mtp), memory_gb)


def host_rank(setup: HostSetup, r: int, layers: range, n_hosts: int) -> tuple[Rank, np.ndarray | None]:
    """Rank `r` holding backbone `layers` (and the embedding on rank 0, the head on the last): its weights, KV per
    token, state and buffers, its busy time over the prompt and its part of one decode step; with its seconds per
    prefill chunk (None when the profile has no GPU throughput)."""
    args, storage, h, V, mtp = setup.args, setup.storage, setup.args.hidden_size, setup.args.vocab_size, setup.mtp
    first, last = r == 0, r == n_hosts - 1
    ps = rank_pieces(args, setup.moe, layers, last)
    backbone = [p for p in ps if p.kind not in ("lm_head", "mtp")]
    matrices = {"embed_tokens"} if first else set()  # vocab x hidden matrices this rank holds
    if last:
        matrices.add("embed_tokens" if args.tie_word_embeddings else "lm_head")
        if mtp:  # the MTP head embeds its draft tokens with embed_tokens: the last rank keeps a copy
            matrices.add("embed_tokens")
    weights = sum(p.layers * storage.nbytes(p.params) for p in backbone) + len(matrices) * storage.nbytes(V * h)
    extras = (["embedding"] if first else []) + (["final norm + lm_head"] if last else [])
    if last and mtp:
        weights += storage.nbytes(next(p for p in ps if p.kind == "mtp").params)
        extras.append("MTP head")
    attn = sum(args.layer_types[i] == "full_attention" for i in layers)
    gdn = len(layers) - attn
    kv = (attn + (mtp if last else 0)) * setup.kv_layer
    state = gdn * (gdn_state_bytes(args) // max(1, args.layer_types.count("linear_attention")))
    received = 0 if first else setup.chunk * h * 4  # the hidden chunk it receives, 4 bytes a value
    buffers = prefill_buffer_bytes(args, setup.chunk, setup.moe) + received + RUNTIME_RESERVE
    t = gpu_chunk_seconds(ps, storage, setup.lanes, setup.prompt_tokens, setup.chunk)
    decode = None
    if setup.lanes.gpu_bw is not None:
        read = sum(p.layers * storage.nbytes(p.token_params) for p in backbone)
        read += storage.nbytes(V * h) if last else 0  # lm_head's matrix (the embedding: one row)
        read += attn * setup.kv_layer * setup.context + 2 * state
        decode = setup.read_seconds(read)
    rank = Rank(r, layers, attn, gdn, extras, int(weights), kv, state, buffers, setup.context,
                None if t is None else float(t.sum()), decode)
    return rank, t


def fit_windows(ranks: list[Rank], setup: HostSetup, memory_gb: float) -> None:
    """Set each rank's `window`: the largest context (whole chunks, at most the model's) whose KV fits beside its
    weights, state and buffers in what the GPU may wire of a `memory_gb` host; 0 when not one chunk fits."""
    wirable = memory_gb * 1e9 * setup.profile.gpu_wired_fraction
    top, chunk = setup.args.max_position_embeddings, setup.chunk
    for rk in ranks:
        room = wirable - (rk.weight_bytes + rk.state_bytes + rk.buffer_bytes)
        window = top if not rk.kv_bytes_per_token else min(top, int(room // rk.kv_bytes_per_token // chunk * chunk))
        rk.window = window if room > 0 and window >= chunk else 0


def _r4(v: float | None, n: int = 4) -> float | None:
    return None if v is None else round(v, n)


def host_predictions(setup: HostSetup, ranks: list[Rank], chunks: list[np.ndarray | None], link: Link,
                     accepted_length: float, depth: int) -> tuple[dict, list[str]]:
    """The plan's predictions across hosts (None where unknown) and the lines saying what is unknown and why:
    prefill (busiest rank, one host, pipelined over the link), the link's seconds per chunk, plain and MTP decode."""
    n_hosts, h = len(ranks), setup.args.hidden_size
    predicted: dict = {"prefill_s": None, "busiest_rank_prefill_s": None, "one_host_prefill_s": None,
                       "link_s_per_chunk": None, "decode_plain_tps": None, "decode_mtp_tps": None,
                       "one_host_decode_plain_tps": None}
    unknown = []
    prefill_known = not any(t is None for t in chunks)
    if not prefill_known:
        unknown.append("prefill across hosts is unknown: the profile has no GPU throughput")
    else:
        predicted["busiest_rank_prefill_s"] = _r4(max(float(t.sum()) for t in chunks))
        predicted["one_host_prefill_s"] = _r4(float(sum(t.sum() for t in chunks)))
    if n_hosts > 1 and not link.known:
        unknown.append(f"link between hosts: {link.label()}; prefill and decode across hosts stay unknown")
    steps = [rk.decode_s for rk in ranks]
    if None not in steps:
        predicted["one_host_decode_plain_tps"] = _r4(1.0 / sum(steps), 2)
    if link.known or n_hosts == 1:
        hop = (lambda n: link.seconds(n)) if n_hosts > 1 else (lambda n: 0.0)  # noqa: E731
        if prefill_known:
            _, sizes = chunk_spans(setup.prompt_tokens, setup.chunk)
            sends = [hop(s * h * ACTIVATION_BYTES) for s in sizes]
            back = hop(TOKEN_MESSAGE_BYTES) if n_hosts > 1 else 0.0
            predicted["prefill_s"] = _r4(pipeline_wall(chunks, sends) + back)
            predicted["link_s_per_chunk"] = _r4(hop(setup.chunk * h * ACTIVATION_BYTES), 6)
        hops = (n_hosts - 1) * hop(h * ACTIVATION_BYTES) + hop(TOKEN_MESSAGE_BYTES)
        if None not in steps:
            predicted["decode_plain_tps"] = _r4(1.0 / (sum(steps) + hops), 2)
            if setup.mtp and setup.profile.mtp_verify_ratio is not None:
                predicted["decode_mtp_tps"] = _r4(mtp_tps(setup, sum(steps), hop, n_hosts, accepted_length, depth), 2)
    if setup.mtp and setup.profile.mtp_verify_ratio is None:
        unknown.append("decode with MTP across hosts: the profile has no MTP verify cost (mtp_verify_ratio)")
    return predicted, unknown


def mtp_tps(setup: HostSetup, step_s: float, hop, n_hosts: int, accepted_length: float, depth: int) -> float:
    """Tokens per second of MTP decoding across hosts: `accepted_length` tokens per round of one verify pass over
    `depth + 1` tokens through every rank (`step_s`: one plain step's busy time summed over the ranks; MoE reads the
    union of the verify tokens' experts), `depth` draft steps on the last rank and the round's hops (`hop(nbytes)`:
    one message's seconds)."""
    args, moe, storage, profile, h = setup.args, setup.moe, setup.storage, setup.profile, setup.args.hidden_size
    ratio = verify_cost(profile.mtp_verify_ratio, profile.mtp_verify_tokens, depth + 1)
    extra = 0.0
    if moe is not None:  # the verify tokens' union of experts, beyond one token's top-k
        expert = storage.nbytes(3 * h * moe.intermediate)
        extra = setup.read_seconds(len(args.moe_layers) * (distinct_experts(moe, depth + 1) - moe.per_token) * expert)
    head = next(p for p in pieces(args, moe, 0.0) if p.kind == "mtp")
    draft = setup.read_seconds(storage.nbytes(head.token_params + args.vocab_size * h)
                               + setup.mtp * setup.kv_layer * setup.context)
    verify_hops = (n_hosts - 1) * hop((depth + 1) * h * ACTIVATION_BYTES) + hop(TOKEN_MESSAGE_BYTES)
    return accepted_length / (ratio * step_s + extra + depth * draft + verify_hops)


def host_assumptions(n_hosts: int, mtp: int) -> list[str]:
    """What a plan across `n_hosts` assumes (`mtp`: the model has an MTP head), one line each."""
    out = [f"layers split by prefill FLOPs of a {SPLIT_TOKENS}-token prompt (`split_layers`, as the runtime splits "
           f"them); each host runs its part on its GPU alone, with this profile's figures"]
    if n_hosts > 1:
        out.append(f"hidden states cross the link in {8 * ACTIVATION_BYTES}-bit floats, one message per chunk; "
                   f"a link sends while its ranks compute")
        if mtp:
            out.append("the last rank keeps a copy of embed_tokens for the MTP head's draft tokens")
    return out


def pipeline_wall(chunks: list, sends: list[float]) -> float:
    """Wall time of a prefill pipelined by chunk: rank r runs chunk c after its own chunk c-1 and after chunk c's
    hidden states arrive from rank r-1; each link carries one chunk at a time (a flow shop with the links as stages).

    `chunks[r][c]`: rank r's seconds on chunk c; `sends[c]`: one link's seconds for chunk c's hidden states."""
    n_ranks = len(chunks)
    done = [0.0] * n_ranks  # when each rank finished its latest chunk
    link_free = [0.0] * max(0, n_ranks - 1)  # when each link finished its latest message
    for c, send in enumerate(sends):
        arrived = 0.0
        for r in range(n_ranks):
            done[r] = max(done[r], arrived) + float(chunks[r][c])
            if r < n_ranks - 1:
                link_free[r] = max(link_free[r], done[r]) + send
                arrived = link_free[r]
    return done[-1]
