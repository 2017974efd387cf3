"""The memory governor (shared/DESIGN.md section 7): from weights, KV bytes per token, GDN state, prefill buffers,
Core ML packages and the GPU-wirable share of RAM it resolves the largest aligned context window that fits, line
by line; for a loaded model it refuses a prompt beyond that window."""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field

from hetero.errors import HeteroError
from hetero.models.architectures import shape
from hetero.models.interface import Args
from hetero.planner.shape import MoE, gdn_state_bytes, kv_bytes_per_token, moe_of

RUNTIME_RESERVE = 1 << 30  # MLX runtime, allocator slack and decode activations: kept free by the governor
SPLIT_IN_FLIGHT = 4  # chunks a split prefill keeps in progress: enough for both lanes to find work


def prefill_buffer_bytes(args: Args, chunk: int, moe: MoE | None = None) -> int:
    """Transient buffers of one prefill chunk in fp32: residual and projections, the MLP (an MoE layer: router
    logits, each token's top-k experts' gate/up/product rows and outputs, the shared expert), conv, one logits row."""
    conv = 2 * args.linear_num_key_heads * args.linear_key_head_dim + args.linear_num_value_heads * args.linear_value_head_dim
    mlp = 3 * args.intermediate_size if args.num_hidden_layers > len(args.moe_layers) else 0
    if moe is not None:
        k = moe.per_token
        mlp = max(mlp, moe.experts + k * (3 * moe.intermediate + args.hidden_size) + 3 * moe.shared_intermediate)
    streams = shape(args).residual_width  # Qwen4-Exp's residual: hc streams of hidden_size
    return chunk * 4 * (6 * streams + mlp + 2 * conv) + 4 * args.vocab_size


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
    on_disk: list[tuple[str, int]] = field(default_factory=list)  # read from the files as needed: not counted

    @property
    def wirable_bytes(self) -> int:
        return int(self.memory_bytes * self.wired_fraction)

    @property
    def memory_tokens(self) -> int:
        """Tokens of KV the memory left after the fixed costs would hold, were the model's maximum no limit."""
        kv = next((b for n, b in self.lines if n.startswith("KV cache")), 0)
        unused = next((b for n, b in self.lines if n.startswith("unused")), 0)
        return (kv + unused) // self.kv_bytes_per_token if self.kv_bytes_per_token else 0

    def to_dict(self) -> dict:
        return {
            "memory_gb": round(self.memory_bytes / 1e9, 3),
            "wired_fraction": self.wired_fraction,
            "wirable_bytes": self.wirable_bytes,
            "context_window": self.context_window,
            "model_max_context": self.model_max,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "memory_tokens": self.memory_tokens,
            "lines": [{"name": n, "bytes": b} for n, b in self.lines],
            "on_disk": [{"name": n, "bytes": b} for n, b in self.on_disk],
        }

    def text(self) -> list[str]:
        gb = lambda b: f"{b / 1e9:9.2f} GB"  # noqa: E731
        out = [f"memory: {self.memory_bytes / 1e9:.1f} GB RAM, GPU may wire {self.wired_fraction:.0%} = {self.wirable_bytes / 1e9:.2f} GB"]
        out += [f"  {gb(b)}  {n}" for n, b in self.lines]
        out += [f"  {gb(b)}  {n} (on disk, memory-mapped: not counted)" for n, b in self.on_disk]
        limit = ""
        if self.context_window == self.model_max and self.kv_bytes_per_token:
            limit = f" (the model's maximum; the memory would hold {self.memory_tokens:,})"
        elif self.context_window == self.model_max:
            limit = " (the model's maximum)"
        out.append(f"context window: {self.context_window} tokens{limit}")
        return out


def govern(
    args: Args,
    weight_bytes: float,
    memory_bytes: float,
    chunk: int,
    kv_bytes: float = 2,
    coreml_bytes: float = 0,
    wired_fraction: float = 0.75,
    weights_label: str = "",
    in_flight: int = 1,
    moe: MoE | None = None,
    coreml_label: str = "Core ML programs (ANE share)",
    split_copy_bytes: int = 0,
    kv_label: str = "",
) -> Budget:
    """The largest context window (a multiple of `chunk`, at most the model's maximum) that fits the wirable RAM.

    `kv_bytes`: bytes per stored K or V value (2 for bf16; quantized KV: `KVQuant.element_bytes`).
    `in_flight`: chunks prefilled at once (a split prefill's wavefront keeps several), each with its buffers.
    `moe`: the routed experts' shape (their prefill buffers); `weight_bytes` already counts every expert.
    `coreml_bytes`: what the ANE's share holds (its programs as exported: fp16, or a quantized checkpoint's lookup
    tables; a loaded engine: its ANE worker process), counted inside the wirable share as the conservative case.
    `split_copy_bytes`: the GPU lane's shares of split pieces that are gathered copies, not views of the weights
    (channels chosen by range, a quantized layer's columns).
    Raises HeteroError when the fixed costs alone do not fit (memory below the weights).
    """
    wirable = int(memory_bytes * wired_fraction)
    fixed = [
        (f"weights{f' ({weights_label})' if weights_label else ''}", int(weight_bytes)),
        (coreml_label, int(coreml_bytes)),
        *([("GPU lane's split shares gathered beside the weights", int(split_copy_bytes))] if split_copy_bytes else []),
        ("GDN recurrent state + conv window, one sequence", gdn_state_bytes(args)),
        (f"transient prefill buffers (chunk {chunk}{f', {in_flight} in flight' if in_flight > 1 else ''})",
         in_flight * prefill_buffer_bytes(args, chunk, moe)),
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
    what = f"KV cache ({kv_label})" if kv_label else "KV cache"
    lines = [*fixed, (f"{what}: {window} tokens x {per_token} bytes", kv), ("unused (below one aligned step, or past the model maximum)", room - kv)]
    return Budget(int(memory_bytes), wired_fraction, lines, int(window), per_token, args.max_position_embeddings)


_WINDOWS: dict[tuple, tuple[weakref.ref, Budget]] = {}


def loaded_budget(model, memory_gb: float | None = None, chunk: int = 512, in_flight: int = 1,
                  ane_worker_bytes: int = 0, split_copy_bytes: int = 0) -> Budget:
    """The governor's budget for a loaded model: its actual weight bytes and cache dtype, this machine's RAM
    (or `memory_gb`), `in_flight` chunks of prefill buffers, and what the ANE lane's worker process holds (its
    programs, buffers and interpreter, as it reports them) and the GPU lane's gathered split shares. Cached per
    model, memory size, chunks in flight and those bytes (in MiB)."""
    from mlx.utils import tree_flatten

    ane_worker_bytes = ane_worker_bytes >> 20 << 20  # MiB steps: a worker's few pages more need no new budget
    key = (id(model), memory_gb, in_flight, ane_worker_bytes, split_copy_bytes, getattr(model, "kv_quant", None))
    ref, budget = _WINDOWS.get(key, (None, None))
    if ref is None or ref() is not model:  # an id can be reused once a model is freed
        weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        kv_bytes = model.model.norm.weight.dtype.size  # the cache holds K/V in the model's dtype
        quant = getattr(model, "kv_quant", None)
        if quant is not None:  # or packed, with a scale and a bias in that dtype per group
            kv_bytes = quant.element_bytes(kv_bytes)
        memory = memory_gb * 1e9 if memory_gb is not None else physical_memory_bytes()
        budget = govern(model.args, weights, memory, chunk, kv_bytes, coreml_bytes=ane_worker_bytes,
                        weights_label="as loaded", in_flight=in_flight, moe=moe_of(model.args),
                        coreml_label="ANE lane's worker process (programs, buffers, interpreter)",
                        split_copy_bytes=split_copy_bytes, kv_label=quant.label if quant is not None else "")
        budget.on_disk = list(model.on_disk)  # read from the checkpoint's files (Qwen4-Exp's PLE n-gram tables)
        _WINDOWS[key] = (weakref.ref(model), budget)
    return budget


def check_prompt_fits(model, n_tokens: int, memory_gb: float | None = None, in_flight: int = 1,
                      ane_worker_bytes: int = 0, split_copy_bytes: int = 0) -> None:
    """HeteroError when a prompt of `n_tokens` exceeds the memory governor's context window (with `in_flight`
    chunks prefilled at once, beside an ANE lane worker holding `ane_worker_bytes` and the GPU lane's gathered
    split shares)."""
    budget = loaded_budget(model, memory_gb, in_flight=in_flight, ane_worker_bytes=ane_worker_bytes,
                           split_copy_bytes=split_copy_bytes)
    if n_tokens >= budget.context_window:
        raise HeteroError(
            f"the prompt has {n_tokens} tokens but the memory governor's context window is {budget.context_window} "
            f"tokens ({budget.memory_bytes / 1e9:.1f} GB RAM, {budget.wirable_bytes / 1e9:.1f} GB GPU-wirable, "
            f"{budget.kv_bytes_per_token} KV bytes per token); shorten it or give more memory (--memory-gb)"
        )
