"""The network as the planner sees it: a model config read from a file, a directory or the hub, its shape
(`ModelArgs` plus routed experts), how the GPU stores its weights, and the per-token and per-sequence state sizes
(KV bytes per token, GDN state) that both the decode cost and the memory governor count."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from hetero.checkpoint.loader import parse_args, read_config, resolve
from hetero.errors import HeteroError
from hetero.models.qwen3_5 import ModelArgs
from hetero.models.qwen4_exp.args import Qwen4Args


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


def model_shape(config: dict) -> tuple[ModelArgs | Qwen4Args, MoE | None]:
    """The network's shape from a config: its architecture's arguments (`ModelArgs`, or `Qwen4Args` for
    `qwen4_exp`) plus the routed experts of MoE models."""
    args = parse_args(config)
    return args, moe_of(args)


def mtp_layers(args: ModelArgs | Qwen4Args) -> int:
    """Decoder layers of the MTP head: `mtp_num_hidden_layers`, except Qwen4-Exp's head, which is one layer
    whatever that field says (the released head ships `mtp.layers.0` alone; mlx-vlm reads the field as a depth)."""
    if isinstance(args, Qwen4Args):
        return min(1, args.mtp_num_hidden_layers)
    return args.mtp_num_hidden_layers


def ple_table_params(args: ModelArgs | Qwen4Args) -> int:
    """Weights of all PLE n-gram tables (Qwen4-Exp): read from the checkpoint's files, never held in memory."""
    if not isinstance(args, Qwen4Args) or not args.ple_layer_ids:
        return 0
    divisor, width = args.make_ngram_vocab_size_divisible_by, args.ple_embed_dim // args.ngram_heads
    rows = [-(-_vocab_rows(args.ngram_vocab_size_base, i, args.ngram_heads) // divisor) * divisor
            for i in range(len(args.ple_layer_ids))]
    return sum(rows) * width


@lru_cache(maxsize=64)
def _vocab_rows(base: int, ple_index: int, heads: int) -> int:
    """Rows of one PLE layer's heads' prime vocabularies (as the model hashes into them), before padding."""
    from hetero.models.qwen4_exp.ple import head_vocab_sizes

    return sum(head_vocab_sizes(base, ple_index, heads))


def moe_of(args: ModelArgs) -> MoE | None:
    """The routed experts of a parsed `ModelArgs` (None for a dense model)."""
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


def kv_bytes_per_token(args: ModelArgs, kv_bytes: float, with_mtp: bool = True, only_mtp: bool = False) -> int:
    """KV bytes per token: attention layers only (+ the MTP layer); GDN layers keep a fixed state instead. A
    Qwen4-Exp QSA layer also keeps one raw index key of `indexer_head_dim` values per token. `kv_bytes` per stored
    value may be fractional (quantized KV: packed bits plus each group's scale and bias)."""
    layers = 0 if only_mtp else sum(t != "linear_attention" for t in args.layer_types)
    layers += mtp_layers(args) if with_mtp else 0
    index_key = getattr(args, "indexer_head_dim", 0)  # 0 for the Qwen3.5 family
    return math.ceil(layers * (2 * args.num_key_value_heads * args.head_dim + index_key) * kv_bytes)


def gdn_state_bytes(args: ModelArgs | Qwen4Args) -> int:
    """Per sequence: every GDN layer's fp32 recurrent state and its conv window (and, on Qwen4-Exp's PLE layers, the
    dilated conv's window over the hc streams, counted in fp32)."""
    n = args.layer_types.count("linear_attention")
    conv = 2 * args.linear_num_key_heads * args.linear_key_head_dim + args.linear_num_value_heads * args.linear_value_head_dim
    state = args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim * 4
    ple = 0
    if isinstance(args, Qwen4Args):
        ple = len(args.ple_layer_ids) * (args.ple_conv_kernel_size - 1) * args.ngram_size * args.hc_count * args.hidden_size * 4
    return n * (state + (args.linear_conv_kernel_dim - 1) * conv * 4) + ple
