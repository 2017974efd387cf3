"""The pre-flight check: everything that would fail to load a checkpoint, found before any weight is read.

It reads only config.json, the safetensors index and the shards' headers, builds the model lazily (MLX allocates
nothing until evaluation) to learn every parameter's name and shape, and maps the checkpoint's tensors onto it.
Anything that would fail to load is reported, one line each (`Preflight`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from hetero.checkpoint.dtypes import default_dtype
from hetero.checkpoint.safetensors import ST_DTYPES, checkpoint_tensors, drafter_path, mtp_drafter
from hetero.checkpoint.source import check_generation_config, is_hub_id, read_config, resolve
from hetero.errors import HeteroError
from hetero.models.architectures import architecture, parse_args
from hetero.models.interface import Args, CausalLM
from hetero.models.weights import canonical_name, checkpoint_has_mtp, is_expert_tensor, unfused_names


@dataclass
class Preflight:
    """What `hetero check` reports; `errors` empty means the checkpoint will load."""

    path: str
    model_type: str | None = None
    architecture: str | None = None
    supported: bool = False
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    shape_mismatches: list[str] = field(default_factory=list)
    n_tensors: int = 0
    total_bytes: int = 0
    peak_memory_bytes: int = 0
    has_mtp: bool = False
    mtp_folder: str | None = None  # where the MTP head is read from when not the checkpoint (mlx-vlm's drafter)
    quantization: dict | None = None
    shapes_checked: bool = False
    experts: int = 0  # routed experts per MoE layer (0: dense model)
    experts_per_token: int = 0
    shared_experts: int = 0  # per MoE layer (a gated shared expert: 1)
    moe_layers: int = 0  # backbone layers with a mixture-of-experts MLP
    layers: int = 0
    ple_layers: list[int] = field(default_factory=list)  # Qwen4-Exp layers with PLE n-gram tables (0-based)
    ple_table_params: int = 0  # their tables' parameters, all layers together

    @property
    def ok(self) -> bool:
        return not (self.errors or self.unmapped or self.missing or self.shape_mismatches)

    def first_problem(self) -> str:
        """The one line that says why loading would fail."""
        if self.errors:
            return self.errors[0]
        if self.unmapped:
            more = f" (and {len(self.unmapped) - 1} more)" if len(self.unmapped) > 1 else ""
            return (
                f"tensor {self.unmapped[0]!r} does not map onto a {self.model_type} model{more}: the checkpoint "
                f"follows another naming convention; run `hetero check --model {self.path}` for the full list"
            )
        if self.missing:
            more = f" (and {len(self.missing) - 1} more)" if len(self.missing) > 1 else ""
            return f"no tensor for parameter {self.missing[0]}{more}: the checkpoint is incomplete"
        return f"shape mismatch: {self.shape_mismatches[0]}"

    def lines(self) -> list[str]:
        """Human-readable report, one fact per line."""
        gb = lambda b: f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.1f} MB"  # noqa: E731
        status = "supported" if self.supported else "NOT supported"
        out = [f"model: {self.path}", f"architecture: {self.architecture or '?'} (model_type {self.model_type}): {status}"]
        if self.quantization:
            out.append(f"quantization: {self.quantization.get('bits')}-bit, group size {self.quantization.get('group_size')}")
        out.append(f"tensors: {self.n_tensors}, {gb(self.total_bytes)} on disk" + ("" if self.shapes_checked else " (shapes not checked: shards not local)"))
        if self.peak_memory_bytes:
            out.append(f"estimated peak memory: {gb(self.peak_memory_bytes)}")
        mtp = f"present, read from mlx-vlm's drafter folder {self.mtp_folder}" if self.mtp_folder else "present"
        out.append(f"MTP head: {mtp if self.has_mtp else 'absent (speculative decoding unavailable)'}")
        if self.experts:
            shared = f" + {self.shared_experts} shared" if self.shared_experts else ""
            out.append(f"experts: {self.experts} routed{shared}, {self.experts_per_token} active per token, "
                       f"mixture-of-experts MLP in {self.moe_layers} of {self.layers} layers")
        if self.ple_layers:
            out.append(f"PLE n-gram tables: {self.ple_table_params:,} parameters in all, on layers {self.ple_layers}")
        out += [f"error: {e}" for e in self.errors]
        out += [f"unmapped tensor: {n}" for n in self.unmapped]
        out += [f"missing parameter: {n}" for n in self.missing]
        out += [f"shape mismatch: {m}" for m in self.shape_mismatches]
        out += [f"warning: {w}" for w in self.warnings]
        out.append("result: OK, will load" if self.ok else "result: FAIL, will not load")
        return out

    def to_json(self) -> dict:
        d = {k: v for k, v in self.__dict__.items()}
        d["ok"] = self.ok
        return d


def sanitize_for(args: Args, weights: dict[str, mx.array], zero_centred: bool = True) -> dict[str, mx.array]:
    """Checkpoint tensors -> parameters, by the architecture's own `sanitize`; `zero_centred`: the checkpoint's
    norm form where no GDN conv tells it (`hetero.checkpoint.safetensors.norms_zero_centred`)."""
    return architecture(args.model_type).sanitize(args, weights, zero_centred)


def build_lazy_model(args: Args, with_mtp: bool, quantized_names: set[str] | None = None) -> CausalLM:
    """The model with lazily initialised parameters (no memory until evaluated)."""
    model = architecture(args.model_type).build(args, with_mtp)
    q = args.quantization
    if q:
        names = quantized_names or set()
        layers = {canonical_name(k): v for k, v in q.items() if isinstance(v, dict)}  # per-layer (mlx-lm: 8-bit routers)
        nn.quantize(
            model,
            group_size=q.get("group_size", 64),
            bits=q.get("bits", 4),
            class_predicate=lambda p, m: p in names and layers.get(p, True),
        )
    return model


def preflight(model: str | os.PathLike | None, dtype: mx.Dtype | None = None, context: int = 4096) -> Preflight:
    """Check a checkpoint without reading weights; never raises for problems in the checkpoint itself."""
    report = Preflight(path=str(model) if model is not None else "bundled model")
    try:
        path, args = _read_config(report, model)
        tensors, absent = checkpoint_tensors(path)
    except HeteroError as e:
        report.errors.append(str(e))
        return report
    _check_files(report, model, path, args, tensors, absent)
    quantized = {u for n in tensors for u in unfused_names(canonical_name(n) or n)}  # per-expert: their switch_mlp
    quantized = {n[: -len(".scales")] for n in quantized if n.endswith(".scales")}
    try:
        expected = dict(tree_flatten(build_lazy_model(args, report.has_mtp, quantized).parameters()))
    except (OverflowError, ValueError) as e:  # sizes each in range whose products are not (MLX dims are 32-bit)
        report.errors.append(f"config.json's sizes give a parameter MLX cannot hold ({e}); fix or re-download config.json")
        return report
    if _map_tensors(report, args, tensors, {k: tuple(v.shape) for k, v in expected.items()}):
        report.ple_table_params = architecture(args.model_type).shape(args).ple_table_params
        report.peak_memory_bytes = estimate_peak_memory(args, expected, dtype or default_dtype(), context)
    return report


def _read_config(report: Preflight, model: str | os.PathLike | None):
    """The checkpoint's directory and its config's arguments, with what the report says of them."""
    path = resolve(model, weights=False)
    config = read_config(path)
    report.model_type = config.get("model_type")
    report.architecture = ", ".join(config.get("architectures") or []) or None
    args = parse_args(config)
    check_generation_config(path)
    report.quantization = args.quantization
    report.layers = args.num_hidden_layers
    if args.moe_layers:
        report.experts, report.experts_per_token = args.num_experts, args.num_experts_per_tok
        report.shared_experts, report.moe_layers = 1, len(args.moe_layers)
    report.ple_layers = list(architecture(args.model_type).shape(args).ple_layers)
    report.supported = True
    return path, args


def _check_files(report: Preflight, model, path, args: Args, tensors: dict, absent: list[str]) -> None:
    """The shards on disk, the tensors' sizes and dtypes, and where the MTP head comes from."""
    arch = architecture(args.model_type)
    report.shapes_checked = not absent
    if absent and not is_hub_id(str(model)):
        report.errors += [f"shard {s} is listed in model.safetensors.index.json but missing from {path}" for s in absent]
    report.n_tensors = len(tensors)
    report.total_bytes = sum(t.nbytes for t in tensors.values())
    report.has_mtp = checkpoint_has_mtp(tensors)
    if args.mtp_num_hidden_layers and not report.has_mtp:
        drafter = (f", nor is there an mlx-vlm drafter folder at {drafter_path(path)} (`mlx_vlm convert --mtp` "
                   "writes it)" if arch.drafter_model_type else " (converted without it?)")
        report.warnings.append(f"config declares an MTP head but the checkpoint has no mtp.* tensors{drafter}: "
                               "plain decoding only")
    drafter_folder = mtp_drafter(path)
    if drafter_folder is not None and any(os.path.normpath(path / t.file).startswith(str(drafter_folder) + os.sep)
                                          for t in tensors.values()):  # the head's tensors were read from there
        report.mtp_folder = str(drafter_folder)
    bad_dtype = [t for t in tensors.values() if report.shapes_checked and t.dtype not in ST_DTYPES
                 and not arch.derived(t.name)]
    for t in bad_dtype:
        report.errors.append(f"tensor {t.name} in {t.file} has dtype {t.dtype}; hetero loads F32, F16, BF16 (and U32 quantized) weights")


def _map_tensors(report: Preflight, args: Args, tensors: dict, expected: dict[str, tuple[int, ...]]) -> bool:
    """The checkpoint's tensors mapped onto the parameters `expected` (name -> shape): unmapped, missing and
    mismatched ones into the report. False when the mapping itself failed (said in the report)."""
    if report.shapes_checked:
        placeholders = {n: mx.zeros(t.shape, dtype=ST_DTYPES.get(t.dtype, mx.float32)) for n, t in tensors.items()}
        try:
            mapped = {k: tuple(v.shape) for k, v in sanitize_for(args, placeholders).items()}
        except HeteroError as e:  # experts missing or beyond num_experts
            report.errors.append(str(e))
            return False
        except ValueError as e:  # a fused projection whose shape cannot be split, experts of different shapes
            report.shape_mismatches.append(f"fused GDN projections or stacked experts do not match the config's sizes ({e})")
            return False
    else:
        mapped = {}
        for n in tensors:
            c = canonical_name(n)
            if c is not None and not (args.tie_word_embeddings and c == "lm_head.weight"):
                mapped.update({u: None for u in unfused_names(c)})
    reverse = {}
    for n in tensors:
        c = canonical_name(n)
        for u in unfused_names(c) if c else []:
            reverse[u] = re.sub(r"\.experts\.\d+\.", ".experts.*.", n) if is_expert_tensor(c) else n  # stacked: all experts
    report.unmapped = sorted(reverse.get(k, k) for k in mapped if k not in expected)
    report.missing = sorted(k for k in expected if k not in mapped)
    for k, shape in mapped.items():
        if shape is not None and k in expected and shape != expected[k]:
            report.shape_mismatches.append(f"{reverse.get(k, k)}: checkpoint {list(shape)}, config expects {list(expected[k])}")
    return True


def estimate_peak_memory(args: Args, params: dict[str, mx.array], dtype: mx.Dtype, context: int, chunk: int = 512) -> int:
    """Loaded weights + KV cache for `context` tokens + GDN state + one prefill chunk's transient buffers."""
    weights = sum(v.size * (v.dtype.size if v.dtype == mx.uint32 or not mx.issubdtype(v.dtype, mx.floating) else dtype.size) for v in params.values())
    n_attn = len(args.layer_types) - args.layer_types.count("linear_attention") + args.mtp_num_hidden_layers
    kv = n_attn * 2 * args.num_key_value_heads * args.head_dim * context * dtype.size
    gdn = args.layer_types.count("linear_attention") * args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim * 4
    conv = 2 * args.linear_num_key_heads * args.linear_key_head_dim + args.linear_num_value_heads * args.linear_value_head_dim
    mlp = max(args.intermediate_size, args.num_experts_per_tok * args.moe_intermediate_size + args.shared_expert_intermediate_size)
    transient = chunk * 4 * (6 * args.hidden_size + 3 * mlp + 2 * conv + args.vocab_size)
    return int(weights + kv + gdn + transient)
