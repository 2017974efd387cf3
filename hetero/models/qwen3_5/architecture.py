"""The Qwen3.5 family (`qwen3_5`, `qwen3_5_text`, their MoE siblings, `qwen3_next`) as the engine asks it
(`hetero.models.interface.Architecture`)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from hetero.models.interface import Shape
from hetero.models.qwen3_5.args import MODEL_TYPES, ModelArgs
from hetero.models.qwen3_5.model import Model
from hetero.models.qwen3_5.weights import sanitize

# The text model's sizes a config must carry (head_dim may follow from hidden_size / num_attention_heads)
REQUIRED_FIELDS = (
    "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "linear_num_key_heads",
    "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "vocab_size",
)


class Qwen35:
    """Gated DeltaNet + gated full attention, a dense or mixture-of-experts MLP, an MTP head of full-attention
    layers; the vision tower of `qwen3_5` checkpoints (`hetero.models.qwen3_5_vision`)."""

    name = "qwen3_5"
    model_types = MODEL_TYPES
    required_fields = REQUIRED_FIELDS
    quantized_kv = True
    across_hosts = True
    reads_images = True
    drafter_model_type = None  # mlx-vlm's drafters of this family: their names are untested here

    parse = staticmethod(ModelArgs.from_config)
    sanitize = staticmethod(sanitize)
    build = staticmethod(Model)  # (args, with_mtp)

    @staticmethod
    def derived(name: str) -> bool:
        return False  # every stored tensor is a parameter

    @staticmethod
    def keep_on_disk(model: Model, weights: dict[str, mx.array], path: Path, tensors: dict) -> None:
        return None  # every parameter is held in memory

    @staticmethod
    def stored_as_is(path: Path, tensors: dict) -> dict[str, mx.array]:
        return {}  # every parameter is converted

    @staticmethod
    def shape(args: ModelArgs) -> Shape:
        return Shape(residual_width=args.hidden_size, mtp_layers=args.mtp_num_hidden_layers,
                     mtp_moe_layers=tuple(args.mtp_moe_layers), mtp_input_params=2 * args.hidden_size**2)


QWEN3_5 = Qwen35()
