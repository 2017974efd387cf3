"""The human-readable report of `hetero plan` (its `--json` form is `Plan.to_dict`)."""

from __future__ import annotations

from hetero.planner.hosts import MEASURE_LINK_SHORT
from hetero.planner.plan import Plan
from hetero.planner.slices import ane_weight_bytes, ane_weights_label


def program_line(plan: Plan) -> str:
    """How many programs the ANE's share is exported as, and why a layer's share may need several."""
    per_kind = ", ".join(f"{k} {n}" for k, n in plan.programs.items())
    return (f"ANE programs: {sum(plan.programs.values())} ({per_kind}); at most {plan.program_budget / 1e9:.2f} GB of "
            f"weights each ({ane_weights_label(plan.storage)}; the ANE loads about 2 GB per program), a larger layer "
            f"share is split")


def split_cost_line(plan: Plan) -> str | None:
    """What the split costs in memory and the window it leaves, against the same memory GPU-only."""
    m, alone = plan.memory, plan.gpu_only_memory
    if m is None or alone is None:
        return None
    coreml = ane_weight_bytes(plan.pieces, plan.storage)
    transient = lambda b: next(v for n, v in b.lines if n.startswith("transient"))  # noqa: E731
    extra = transient(m) - transient(alone)  # the wavefront's further chunks in flight
    return (f"the split costs {(coreml + extra) / 1e9:.2f} GB ({coreml / 1e9:.2f} GB of Core ML programs, "
            f"{ane_weights_label(plan.storage)}; {extra / 1e9:.2f} GB of buffers for the chunks in flight): context "
            f"window {m.context_window} tokens with it, {alone.context_window} GPU-only")


def parameter_lines(plan: Plan) -> list[str]:
    """Total and active parameters, the experts, and the bytes one decoded token reads."""
    n, pr, m = plan.parameters, plan.predicted, plan.moe
    if n is None:
        return []
    b = lambda x: f"{x / 1e9:.2f}B"  # noqa: E731
    mtp = f" (MTP head {b(n.mtp_total)})" if n.mtp_total else ""
    if n.on_disk:  # Qwen4-Exp: the PLE tables count in the model's total but stay in its files
        out = [f"parameters: {b(n.total + n.on_disk)} total: {b(n.total)} weights{mtp} + {b(n.on_disk)} PLE n-gram "
               f"tables on disk (memory-mapped, rows read as the n-grams hash); {b(n.active)} active per token"]
    else:
        out = [f"parameters: {b(n.total)} total{mtp}, {b(n.active)} active per token"]
    if m is not None:
        shared = " + 1 shared" if m.shared_intermediate else ""
        out.append(f"experts: {m.experts} per MoE layer ({len(plan.args.moe_layers)} layers), {m.per_token} routed{shared} "
                   f"per token; all resident, only the active ones read per decoded token")
    out.append(f"bytes per decoded token: {pr['decode_bytes_per_token'] / 1e9:.2f} GB at {plan.context} tokens of context "
               f"(weights {pr['decode_weight_bytes_per_token'] / 1e9:.2f} GB, then KV cache and GDN state)")
    return out


def plan_lines(plan: Plan) -> list[str]:
    """The human-readable report of `hetero plan`."""
    a, pr = plan.args, plan.predicted
    fmt = lambda v, unit="s": "unknown" if v is None else f"{v:.3f} {unit}" if unit else f"{v}"  # noqa: E731
    out = [
        f"model: {plan.model} ({a.num_hidden_layers} layers: {a.num_hidden_layers - a.layer_types.count('linear_attention')} attention, "
        f"{a.layer_types.count('linear_attention')} GDN; hidden {a.hidden_size}), weights {plan.storage.label}",
        *parameter_lines(plan),
        f"profile: {plan.profile.name} ({plan.profile.chip})",
        f"context {plan.context} tokens, chunk {plan.chunk}, prompt {plan.prompt_tokens}",
        f"ANE fraction: requested {plan.requested_fraction:.2f}, effective {plan.effective_fraction:.3f} of the prefill's FLOPs",
        "",
        f"{'piece':<17} {'layers':>6} {'requested':>9} {'effective':>9} {'FLOP share':>10}  ANE slice",
    ]
    total = sum(t for t, _ in plan.flops.values())
    for p in plan.pieces:
        slice_ = f"{p.ane_units}/{p.units} {p.unit}" if p.units else "-"
        out.append(f"{p.kind:<17} {p.layers:>6} {p.requested:>9.2f} {p.ane_share:>9.2f} {plan.flops[p.kind][0] / total:>10.3f}  {slice_}")
    out += headroom_lines(plan)
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
        if split_cost_line(plan):
            out.append(split_cost_line(plan))
    if plan.hosts is not None:
        out += [""] + host_lines(plan)
    return out


def headroom_lines(plan: Plan) -> list[str]:
    """How far the ANE's values stay inside fp16, per piece kind, as a split run measured them on the GPU lane."""
    if not plan.slices:
        return []
    if plan.ranges is None:
        return ["fp16 headroom: not measured yet (the first split run of this checkpoint measures it on the GPU lane, "
                "over 512 tokens; then `hetero plan` and `hetero doctor` report it)"]
    kept = {k: v for k, v in plan.ranges.kept_on_gpu().items() if v}
    return [f"fp16 headroom (bits, measured): " + ", ".join(f"{k} {v:g}" for k, v in plan.ranges.headroom().items())
            + ("; kept on the GPU lane for range: " + ", ".join(f"{k} {v} units" for k, v in kept.items())
               if kept else "")]


def host_lines(plan: Plan) -> list[str]:
    """`--hosts N`: the split, memory per host, the pipelined prefill and the decode across hosts."""
    hp, pr = plan.hosts, plan.hosts.predicted
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    unknown = "unknown" if len(hp.ranks) == 1 or hp.link.known else f"unknown ({MEASURE_LINK_SHORT})"
    t = lambda v, unit="s": unknown if v is None else f"{v:.3f} {unit}"  # noqa: E731
    head = "lm_head and the MTP head" if plan.args.mtp_num_hidden_layers else "lm_head"
    out = [f"hosts: {len(hp.ranks)}, a pipeline of GPU-only ranks (layers balanced by prefill FLOPs; {head} on the "
           f"last rank)",
           f"link: {hp.link.label()}" if len(hp.ranks) > 1 else "link: none (one host)",
           f"{'rank':>4} {'layers':>8} {'attn':>4} {'GDN':>4} {'weights':>10} {f'KV@{plan.context}':>12} {'memory':>10}  "
           f"{'window' if hp.memory_gb is not None else ''}  also"]
    for r in hp.ranks:
        window = "" if r.window is None else (f"{r.window}" if r.window else "does not fit")
        out.append(f"{r.rank:>4} {f'{r.layers.start}-{r.layers.stop - 1}':>8} {r.attention:>4} {r.gdn:>4} "
                   f"{gb(r.weight_bytes):>10} {gb(r.kv_bytes_per_token * plan.context):>12} {gb(r.memory_bytes):>10}  "
                   f"{window:>{6 if hp.memory_gb is not None else 0}}  {', '.join(r.extras) or '-'}")
    if hp.memory_gb is not None:
        windows = [r.window for r in hp.ranks]
        out.append(f"context window across hosts ({hp.memory_gb:g} GB each): "
                   + ("a host does not fit" if 0 in windows else f"{min(windows)} tokens"))
    out += [
        f"predicted across {len(hp.ranks)} host{'s' if len(hp.ranks) > 1 else ''}:",
        f"  prefill ({hp.prompt_tokens} tokens, pipelined by chunk) {t(pr['prefill_s'])}"
        + (f"  (busiest rank {pr['busiest_rank_prefill_s']:.3f} s; one host {pr['one_host_prefill_s']:.3f} s)"
           if pr["busiest_rank_prefill_s"] is not None else ""),
        f"  link per chunk     {t(None if pr['link_s_per_chunk'] is None else pr['link_s_per_chunk'] * 1e3, 'ms')}",
        f"  plain decode       {t(pr['decode_plain_tps'], 'tok/s')}"
        + (f"  (one host {pr['one_host_decode_plain_tps']:.2f} tok/s)" if pr["one_host_decode_plain_tps"] else ""),
        f"  decode with MTP    {t(pr['decode_mtp_tps'], 'tok/s')}",
    ]
    if hp.unknown:
        out += ["  unknown:"] + [f"    {u}" for u in hp.unknown]
    out += ["  assumptions:"] + [f"    {a}" for a in hp.assumptions]
    return out
