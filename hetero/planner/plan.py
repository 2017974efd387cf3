"""The whole plan: `make_plan` turns a `PlanRequest` (model config, weight storage, context, chunk, hardware
profile, requested fraction F, ...) into the pieces' slices with their caps, the predicted prefill and decode
times, what is unknown and assumed, and (with a memory size) the governor's budget. The request is one object from
the command line (or the runtime's configuration) on; `Plan` is what `hetero plan` reports, and the one object a
split travels as, its request with it: the export builds its slices and programs, the runtime reports its
fractions from it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hetero.errors import HeteroError
from hetero.models.architectures import architecture
from hetero.models.interface import Args
from hetero.models.kv_quant import kv_quant
from hetero.planner.cost import ane_share, prefill_flops
from hetero.planner.governor import SPLIT_IN_FLIGHT, Budget, govern
from hetero.planner.hosts import HostPlan, Link, plan_hosts
from hetero.planner.predict import (
    Lanes,
    decode_bytes_per_token,
    decode_weight_bytes,
    distinct_experts,
    predict_decode,
    predict_prefill,
    verify_cost,
)
from hetero.planner.ranges import Ranges
from hetero.planner.shape import MoE, Storage, model_shape, ple_table_params, storage_for
from hetero.planner.slices import (
    ALIGN,
    OFFLOADABLE,
    PROGRAM_WEIGHT_BUDGET,
    Parameters,
    Piece,
    PieceSlice,
    ane_programs,
    ane_weight_bytes,
    ane_weights_label,
    fit_ane_memory,
    largest_program_bytes,
    layer_slices,
    never_split,
    parameter_counts,
    program_budget,
    split_for_budget,
)
from hetero.host.settings import DEFAULT_DRAFT_DEPTH
from hetero.profiles import Profile

PIECE_ALIASES = {"z": "gdn_in_proj"}  # `--pieces mlp,z`: the GDN input projections give only their z rows
DEFAULT_ACCEPTED_LENGTH = 2.5  # tokens per MTP verify pass assumed when none is given (DESIGN: 2-3)


@dataclass(frozen=True)
class PlanRequest:
    """What a plan is made from: the model, the machine, the split asked for and what decoding assumes. Built once
    where a command reads its flags (`hetero plan`, `convert --coreml`, `run --ane-fraction`); `make_plan` takes it
    whole and the plan keeps it (`Plan.request`)."""

    config: dict  # the checkpoint's config.json
    profile: Profile
    fraction: float = 0.0  # the ANE fraction asked for (`recommend` searches its own)
    context: int = 4096  # the prefill planned (and the context the governor's window must hold)
    chunk: int = 512  # prefill chunk, a multiple of 64
    prompt_tokens: int | None = None  # the TTFT predicted for this prompt (None: the whole context)
    bits: int | None = None  # how the GPU stores the weights when the checkpoint does not say (`storage_for`)
    group_size: int | None = None
    memory_gb: float | None = None  # RAM the governor budgets (None: no budget); across hosts, each host's
    accepted_length: float = DEFAULT_ACCEPTED_LENGTH  # tokens per MTP verify pass
    draft_depth: int = DEFAULT_DRAFT_DEPTH
    name: str = ""  # the model, as reports name it
    offload: tuple[str, ...] = OFFLOADABLE  # the piece kinds that take their share; the others stay on the GPU
    budget: int | None = None  # weight bytes per exported ANE program (None: `program_budget` of the profile)
    hosts: int | None = None  # also plan a pipeline over that many hosts (`hosts.plan_hosts`) ...
    link_gbps: float | None = None  # ... over a link of this rate and latency (None: the profile's)
    link_latency_ms: float | None = None
    ane_instances: int = 1  # ANEs the ANE lane drives at once (`Lanes.of`; the runtime's lane runs one)
    kv_bits: int | None = None  # attention KV stored quantized (`hetero.models.kv_quant`): decode and memory count it
    kv_group_size: int | None = None


@dataclass
class Plan:
    """Everything `hetero plan` reports, made from `request`; `to_dict` is the `--json` form."""

    request: PlanRequest
    args: Args
    storage: Storage
    sliced_fraction: float
    pieces: list[Piece]
    slices: list[PieceSlice]
    flops: dict[str, tuple[float, float]]  # kind -> (total, ANE) at the context
    predicted: dict
    unknown: list[str]
    assumptions: list[str]
    memory: Budget | None = None
    gpu_only_memory: Budget | None = None  # the same memory without the split: what the split costs
    programs: dict[str, int] = field(default_factory=dict)  # piece kind -> exported ANE programs, all layers
    program_budget: int = PROGRAM_WEIGHT_BUDGET  # weight bytes (as exported) per program at most
    moe: MoE | None = None  # the routed experts (None: a dense model)
    parameters: Parameters | None = None
    hosts: HostPlan | None = None  # `--hosts N`: the split across hosts with its predictions
    ranges: Ranges | None = None  # measured activation ranges (`planner.ranges.within_range`): units, order, scales

    # What the request says, as the plan's readers (the report, the export, the runtime) ask it
    model = property(lambda self: self.request.name, doc="The model, as reports name it.")
    profile = property(lambda self: self.request.profile)
    context = property(lambda self: self.request.context)
    chunk = property(lambda self: self.request.chunk)
    requested_fraction = property(lambda self: self.request.fraction)
    prompt_tokens = property(lambda self: self.request.prompt_tokens or self.request.context)

    @property
    def offload(self) -> tuple[str, ...]:
        """The piece kinds that take a share, in `OFFLOADABLE`'s order."""
        return tuple(k for k in OFFLOADABLE if k in self.request.offload)

    @property
    def effective_fraction(self) -> float:
        """The ANE's share of the prefill's FLOPs at the plan's context."""
        return ane_share(self.flops)

    def effective_fraction_at(self, tokens: int) -> float:
        """The ANE's share of the FLOPs of a `tokens`-long prefill in the plan's chunks (a prompt the split runs)."""
        return ane_share(prefill_flops(self.pieces, tokens, self.chunk))

    def program_parts(self, s: PieceSlice) -> list[PieceSlice]:
        """One of the plan's per-layer slices cut into the programs it is exported as (at most `program_budget`
        weight bytes each, as exported)."""
        return split_for_budget(self.args, s, self.program_budget, self.storage)

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
                    "ane_weight_bytes": ane_weight_bytes([p], self.storage),
                    "programs": self.programs.get(p.kind, 0),
                }
                for p in self.pieces
            },
            "caps": self.caps(),
            **({"fp16_headroom_bits": self.ranges.headroom(), "kept_on_gpu_for_range": self.ranges.kept_on_gpu()}
               if self.ranges is not None else {}),
            "ane_programs": {"count": sum(self.programs.values()), "weight_budget_bytes": self.program_budget},
            "layers": [asdict(s) for s in self.slices],
            "predicted": self.predicted,
            "parameters": asdict(self.parameters) if self.parameters else None,
            "experts": asdict(self.moe) if self.moe else None,
            "unknown": self.unknown,
            "assumptions": self.assumptions,
        }
        if self.memory is not None:
            d["memory"] = self.memory.to_dict()
            if self.gpu_only_memory is not None:
                d["memory"]["without_split"] = self.gpu_only_memory.to_dict()
        if self.hosts is not None:
            d["hosts"] = self.hosts.to_dict()
        return d


def make_plan(request: PlanRequest) -> Plan:
    """Plan one prefill of `request.context` tokens at ANE fraction `request.fraction` for `request.profile` (see
    the module docstring and `PlanRequest`): the kinds not in `request.offload` stay whole on the GPU, with the
    reason as their cap."""
    r = request
    quant = kv_quant(r.kv_bits, r.kv_group_size)
    args, moe = model_shape(r.config)
    storage = _checked(r, args, quant)
    limit = r.profile.ane_process_weight_limit_gb * 1e9 if r.profile.ane_process_weight_limit_gb else None
    ps, sliced = fit_ane_memory(args, moe, r.fraction, limit, storage)
    lanes = Lanes.of(r.profile, r.ane_instances)
    ps = [p if p.kind in r.offload or not p.ane_units else
          Piece(**{**asdict(p), "ane_units": 0, "cap_reason": kept_on_gpu(p.kind, lanes)}) for p in ps]
    kv_bytes = 2 if quant is None else quant.element_bytes(2)  # bf16 / fp16 cache on the GPU (or packed)
    predicted = _predicted(r, args, moe, storage, lanes, ps, kv_bytes)
    budget = program_budget(r.profile) if r.budget is None else r.budget
    unknown = [f"{k} is unknown for {r.profile.chip}" for k in r.profile.unknown if k not in ANE_MEMORY_UNKNOWNS]
    unknown += ane_limit_unknowns(r.profile, ps, budget, storage) + decode_unknowns(r.profile, args, lanes)
    unknown += lane_unknowns(lanes, ps)
    assumptions = _assumptions(r, args, moe)
    if r.memory_gb is not None and r.memory_gb <= 0:
        raise HeteroError(f"--memory-gb {r.memory_gb}: must be positive")
    plan = Plan(r, args, storage, sliced, ps, layer_slices(args, ps), prefill_flops(ps, r.context, r.chunk),
                predicted, unknown, assumptions, programs=ane_programs(ps, budget, storage), program_budget=budget,
                moe=moe, parameters=parameter_counts(args, moe), hosts=_across_hosts(r, args, moe, storage, kv_bytes))
    if r.memory_gb is not None and (r.hosts or 1) == 1:  # across hosts, the memory size is each host's (`hosts`)
        _govern(plan, moe, kv_bytes, "" if quant is None else quant.label)
    return plan


def _checked(r: PlanRequest, args: Args, quant) -> Storage:
    """The request checked against the model (one line for what is wrong); the weights' storage."""
    arch = architecture(args.model_type)
    if quant is not None and not arch.quantized_kv:  # as `kv_quant.use_kv_quant` refuses at load
        raise HeteroError(f"--kv-bits: {arch.name} models keep full-precision KV only; leave --kv-bits out")
    if quant is not None:
        quant.check(args.head_dim)
    storage = storage_for(r.config, r.bits, r.group_size)
    if r.chunk <= 0 or r.chunk % ALIGN:
        raise HeteroError(f"--chunk {r.chunk}: must be a positive multiple of {ALIGN}")
    if not 0 < r.context <= args.max_position_embeddings:
        raise HeteroError(f"--context {r.context}: must be between 1 and the model's maximum, "
                          f"{args.max_position_embeddings}")
    prompt = r.prompt_tokens or r.context
    if not 0 < prompt <= r.context:
        raise HeteroError(f"--prompt-tokens {prompt}: must be between 1 and the context ({r.context})")
    if r.accepted_length < 1:
        raise HeteroError(f"--accepted-length {r.accepted_length}: a verify pass yields at least one token")
    cannot = never_split(args)
    if r.fraction and r.offload != OFFLOADABLE and all(k in cannot for k in r.offload):
        raise HeteroError(f"--pieces {','.join(r.offload)}: a {args.model_type} checkpoint gives the ANE none of it ("
                          f"{'; '.join(f'{k}: {cannot[k]}' for k in r.offload)}); offload "
                          f"{', '.join(k for k in OFFLOADABLE if k not in cannot)} (or all)")
    return storage


def _predicted(r: PlanRequest, args: Args, moe: MoE | None, storage: Storage, lanes: Lanes, ps: list[Piece],
               kv_bytes: float) -> dict:
    """The predicted prefill (GPU-only, split, TTFT) and decode rates, as `hetero plan` reports them."""
    gpu_only = predict_prefill(ps, storage, lanes, r.context, r.chunk, False, args.hidden_size)
    split = predict_prefill(ps, storage, lanes, r.context, r.chunk, True, args.hidden_size)
    ttft = predict_prefill(ps, storage, lanes, r.prompt_tokens or r.context, r.chunk, True, args.hidden_size)
    decode = predict_decode(args, moe, storage, lanes.gpu_bw, r.context, kv_bytes, r.accepted_length, r.draft_depth,
                            r.profile.decode_efficiency, r.profile.mtp_verify_ratio, r.profile.mtp_verify_tokens)
    rd = lambda v, n=4: None if v is None else round(v, n)  # noqa: E731
    overlap = None
    if split.wall_s and split.gpu_busy_s and split.ane_busy_s:
        overlap = (split.gpu_busy_s + split.ane_busy_s - split.wall_s) / min(split.gpu_busy_s, split.ane_busy_s)
    return {
        "gpu_only_prefill_s": rd(gpu_only.wall_s),
        "split_prefill_s": rd(split.wall_s),
        "ttft_s": rd(ttft.wall_s),
        "decode_roofline_tps": rd(decode.roofline_tps, 2),
        "decode_plain_tps": rd(decode.plain_tps, 2),
        "decode_mtp_tps": rd(decode.mtp_tps, 2),
        "split_gpu_busy_s": rd(split.gpu_busy_s),
        "split_ane_busy_s": rd(split.ane_busy_s),
        "speedup": rd(gpu_only.wall_s / split.wall_s, 3) if gpu_only.wall_s and split.wall_s else None,
        "overlap": rd(overlap, 3),
        "accepted_length": r.accepted_length,
        "draft_depth": r.draft_depth,
        "decode_bytes_per_token": round(decode_bytes_per_token(args, moe, storage, r.context, kv_bytes)),
        "decode_weight_bytes_per_token": round(decode_weight_bytes(args, moe, storage)),
    }


def lane_unknowns(lanes: Lanes, ps: list[Piece]) -> list[str]:
    """Why a prefill prediction is missing or partial: a lane's throughput or bandwidth the profile lacks."""
    out = []
    if lanes.gpu_flops is None:
        out.append("prefill times are unknown: the profile has no GPU throughput")
    elif lanes.ane_flops is None and any(p.ane_units for p in ps):
        out.append("split prefill time and TTFT are unknown: the profile has no ANE throughput")
    if lanes.ane_bw is None and lanes.ane_flops is not None:
        out.append("ANE bandwidth unknown: ANE time counts compute only")
    return out


def _assumptions(r: PlanRequest, args: Args, moe: MoE | None) -> list[str]:
    """What the predictions assume: the profile's notes and efficiencies, the MTP verify pass and what it reads."""
    profile, depth = r.profile, r.draft_depth
    out = list(profile.notes)
    if not profile.measured:
        out.append(f"GPU reaches {profile.gpu_efficiency:.0%} and the ANE {profile.ane_efficiency:.0%} of their "
                   "peak figures on prefill matmuls (the profile's figures; `hetero tune --devices` measures this "
                   "machine)")
    out.append(f"MTP decode assumes {r.accepted_length} tokens per verify pass at draft depth {depth}")
    if moe is not None and args.mtp_num_hidden_layers:
        out.append(f"a verify pass over {depth + 1} tokens reads the experts they pick between them: "
                   f"{distinct_experts(moe, depth + 1):.1f} of {moe.experts} per layer against "
                   f"{moe.per_token} for one token (uniform routing)")
    if profile.mtp_verify_ratio is not None and depth + 1 != profile.mtp_verify_tokens:
        out.append(f"a verify pass over {depth + 1} tokens costs "
                   f"{verify_cost(profile.mtp_verify_ratio, profile.mtp_verify_tokens, depth + 1):.2f} plain "
                   f"steps: linear between 1 token and the profile's {profile.mtp_verify_ratio:g} at "
                   f"{profile.mtp_verify_tokens}")
    return out


def _across_hosts(r: PlanRequest, args: Args, moe: MoE | None, storage: Storage, kv_bytes: float) -> HostPlan | None:
    """With `hosts`, the pipeline across that many hosts (`hosts.plan_hosts`) over the link asked (or the
    profile's)."""
    if r.hosts is None:
        return None
    arch = architecture(args.model_type)
    if not arch.across_hosts:
        raise HeteroError(f"--hosts: the pipeline across hosts does not run {arch.name} checkpoints yet; plan one host")
    for flag, v in (("--link-gbps", r.link_gbps), ("--link-latency-ms", r.link_latency_ms)):
        if v is not None and (v < 0 or (flag == "--link-gbps" and v == 0)):
            raise HeteroError(f"{flag} {v}: must be positive")
    link = Link(r.profile.link_gbps if r.link_gbps is None else r.link_gbps,
                r.profile.link_latency_ms if r.link_latency_ms is None else r.link_latency_ms)
    return plan_hosts(args, moe, storage, r.profile, r.hosts, r.context, r.prompt_tokens or r.context, r.chunk, link,
                      kv_bytes, r.accepted_length, r.draft_depth, r.memory_gb)


def _govern(plan: Plan, moe: MoE | None, kv_bytes: float, kv_label: str) -> None:
    """The governor's budget of `request.memory_gb` for the plan, and the window the same memory leaves GPU-only
    (the split's cost, shown next to its own)."""
    r, args, storage, ps = plan.request, plan.args, plan.storage, plan.pieces
    weights = sum(p.layers * storage.nbytes(p.params) for p in ps)
    split = any(p.ane_units for p in ps)
    wired = r.profile.gpu_wired_fraction
    plan.memory = govern(args, weights, r.memory_gb * 1e9, r.chunk, kv_bytes, ane_weight_bytes(ps, storage), wired,
                         storage.label, SPLIT_IN_FLIGHT if split else 1, moe=moe,
                         coreml_label=f"Core ML programs (ANE share, {ane_weights_label(storage)})", kv_label=kv_label)
    plan.memory.on_disk = disk_lines(args)
    if split:
        plan.gpu_only_memory = govern(args, weights, r.memory_gb * 1e9, r.chunk, kv_bytes, 0, wired, storage.label, 1,
                                      moe=moe, kv_label=kv_label)


def disk_lines(args) -> list[tuple[str, int]]:
    """What the model reads from its files as needed instead of holding: Qwen4-Exp's PLE n-gram tables, which a
    converted checkpoint keeps as the original stores them (bf16, unquantized) and the engine memory-maps."""
    params = ple_table_params(args)
    return [(f"PLE n-gram tables, {params / 1e9:.2f}B parameters in bf16", 2 * params)] if params else []


def parse_pieces(text: str) -> tuple[str, ...]:
    """`--pieces KINDS`: comma-separated piece kinds that take the ANE share (`z` names `gdn_in_proj`, `all` every
    kind), as `make_plan`'s `offload`; a kind that cannot take a share is a one-line error naming those that can."""
    if text.strip() == "all":
        return OFFLOADABLE
    kinds = [PIECE_ALIASES.get(k.strip(), k.strip()) for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in OFFLOADABLE]
    if bad or not kinds:
        what = f"{', '.join(bad)} cannot take an ANE share" if bad else "no piece kind given"
        raise HeteroError(f"--pieces {text!r}: {what}; choose from {', '.join(OFFLOADABLE)} (z = gdn_in_proj), "
                          f"comma-separated, or all")
    return tuple(k for k in OFFLOADABLE if k in kinds)


ANE_MEMORY_UNKNOWNS = ("ane_process_weight_limit_gb", "ane_instance_weight_window_gb")  # said by ane_limit_unknowns


def ane_limit_unknowns(profile: Profile, ps: list[Piece], budget: int, storage: Storage | None = None) -> list[str]:
    """What the plan cannot know about the ANE's memory: a per-process limit no one has documented, and the
    per-instance weight window no one has measured on this chip."""
    if not any(p.ane_units for p in ps):
        return []
    out = []
    if profile.ane_process_weight_limit_gb is None:
        out.append(f"ane_process_weight_limit_gb: no per-process limit on the ANE's weights is documented or measured; "
                   f"the plan assumes none ({ane_weight_bytes(ps, storage) / 1e9:.1f} GB of weights "
                   f"({ane_weights_label(storage)}) in {sum(ane_programs(ps, budget, storage).values())} programs of at "
                   f"most {budget / 1e9:.2f} GB)")
    if profile.ane_instance_weight_window_gb is None:
        out.append(f"ane_instance_weight_window_gb: the device window one ANE instance maps a program's weights into is "
                   f"not measured for {profile.chip} (oMLX's private path: about 4 GiB, a larger blob fails to load); "
                   f"the largest program here holds {largest_program_bytes(ps, budget, storage) / 1e9:.2f} GB")
    return out


def decode_unknowns(profile: Profile, args: Args, lanes: Lanes) -> list[str]:
    """Why a decode prediction is missing."""
    if not args.mtp_num_hidden_layers:
        return ["decode_mtp_tps: the model has no MTP head"]
    if profile.mtp_verify_ratio is None and lanes.gpu_bw is not None:
        return ["decode_mtp_tps: the profile has no MTP verify cost (mtp_verify_ratio; `hetero tune --devices` "
                "measures it)"]
    return []


def kept_on_gpu(kind: str, lanes: Lanes) -> str:
    """Why a piece kind takes no ANE share (a recommended plan, or one run with such a plan's kinds)."""
    ane, gpu = lanes.ane_rate(kind), lanes.gpu_rate(kind)
    if ane is None or gpu is None:
        return "kept on the GPU: not among the piece kinds this plan offloads"
    return (f"kept on the GPU: the ANE lane runs it at {ane / 1e9:.1f} GFLOP/s against the GPU's {gpu / 1e9:.1f} "
            f"GFLOP/s on this profile; offloading it does not shorten the prefill")
