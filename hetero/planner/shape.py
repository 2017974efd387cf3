"""The network as the planner sees it: a model config read from a file, a directory or the hub, its shape (its
architecture's arguments plus routed experts), how the GPU stores its weights, and the per-token and per-sequence
state sizes (KV bytes per token, GDN state) that both the decode cost and the memory governor count."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from hetero.checkpoint.source import read_config, resolve
from hetero.errors import HeteroError
from hetero.models.architectures import parse_args, shape
from hetero.models.interface import Args


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


def read_model_config(model: str | None) -> tuple[dict, str]:
    """(config dict, display name) from a bare config.json, a checkpoint directory or a hub id (small files only)."""

    if model is not None and Path(model).is_file():
        try:
            return json.loads(Path(model).read_text()), str(model)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HeteroError(f"{model} is not valid JSON ({e})") from None
    return read_config(resolve(model, weights=False)), model or "bundled"


def model_shape(config: dict) -> tuple[Args, MoE | None]:
    """The network's shape from a config: its architecture's arguments (`Architecture.parse`) plus the routed
    experts of MoE models."""
    args = parse_args(config)
    return args, moe_of(args)


def mtp_layers(args: Args) -> int:
    """Decoder layers of the MTP head as its architecture builds it (`Shape.mtp_layers`)."""
    return shape(args).mtp_layers


def ple_table_params(args: Args) -> int:
    """Weights of all PLE n-gram tables (Qwen4-Exp): read from the checkpoint's files, never held in memory."""
    return shape(args).ple_table_params


def moe_of(args: Args) -> MoE | None:
    """The routed experts of parsed arguments (None for a dense model)."""
    if not args.moe_layers:
        return None
    return MoE(args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size,
               args.shared_expert_intermediate_size)


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


def kv_bytes_per_token(args: Args, kv_bytes: float, with_mtp: bool = True, only_mtp: bool = False) -> int:
    """KV bytes per token: attention layers only (+ the MTP layer); GDN layers keep a fixed state instead. A
    Qwen4-Exp QSA layer also keeps one raw index key of `indexer_head_dim` values per token. `kv_bytes` per stored
    value may be fractional (quantized KV: packed bits plus each group's scale and bias)."""
    layers = 0 if only_mtp else sum(t != "linear_attention" for t in args.layer_types)
    layers += mtp_layers(args) if with_mtp else 0
    index_key = shape(args).index_key_dim  # 0 where an attention layer keeps nothing beside its K/V
    return math.ceil(layers * (2 * args.num_key_value_heads * args.head_dim + index_key) * kv_bytes)


def gdn_state_bytes(args: Args) -> int:
    """Per sequence: every GDN layer's fp32 recurrent state and its conv window (and, on Qwen4-Exp's PLE layers, the
    dilated conv's window over the hc streams, counted in fp32)."""
    n = args.layer_types.count("linear_attention")
    conv = 2 * args.linear_num_key_heads * args.linear_key_head_dim + args.linear_num_value_heads * args.linear_value_head_dim
    state = args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim * 4
    return n * (state + (args.linear_conv_kernel_dim - 1) * conv * 4) + shape(args).ple_state_bytes
