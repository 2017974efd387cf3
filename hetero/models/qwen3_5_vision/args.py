"""The tower's hyper-parameters, read from a checkpoint config's `vision_config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VisionArgs:
    """`vision_config` of a `qwen3_5` checkpoint (defaults: transformers' `Qwen3_5VisionConfig`)."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    rope_theta: float = 10_000.0

    @classmethod
    def from_config(cls, vision_config: dict[str, Any]) -> "VisionArgs":
        """The known fields of a `vision_config` dict; the rest (initializer_range, model_type ...) is ignored."""
        fields = {k: vision_config[k] for k in cls.__dataclass_fields__ if k in vision_config}
        rope = vision_config.get("rope_parameters") or {}
        if "rope_theta" in rope:
            fields["rope_theta"] = rope["rope_theta"]
        return cls(**fields)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one language-model token."""
        return self.spatial_merge_size**2
