"""The Qwen3.5 family's config.json as typed model arguments (`ModelArgs.from_config`): nested or flat text
fields, RoPE flat or in `rope_parameters`, layer types, experts, the MTP head."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero.errors import HeteroError
from hetero.models.args import Args, ConfigFields

MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")  # every layer (and the MTP layer) is mixture-of-experts


@dataclass(kw_only=True)
class ModelArgs(Args):
    """The text model's shape, read from an HF config (any of the three layouts); the shared fields are `Args`'."""

    intermediate_size: int
    mlp_only_layers: list[int] = field(default_factory=list)
    decoder_sparse_step: int = 1

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        """Parse config.json; raises HeteroError for unknown or unsupported architectures.

        Experts: `qwen3_5_moe(_text)` configs carry no mlp_only_layers / decoder_sparse_step / norm_topk_prob and
        HF's modeling has none (every layer sparse, top-k always renormalised), so they default to [] / 1 / true;
        `qwen3_next` reads them with HF's defaults ([], 1, true; mlx-lm defaults norm_topk_prob to false, HF and
        the released config say true). intermediate_size (the dense MLP's width) is needed only when some layer is
        dense.
        """
        model_type = config.get("model_type")
        if model_type not in MODEL_TYPES:
            raise HeteroError(
                f"unsupported model_type {model_type!r}: hetero runs {', '.join(MODEL_TYPES)} checkpoints"
            )
        get = ConfigFields(config)
        try:
            args = cls(
                **get.shared(model_type, "full_attention"),
                intermediate_size=int(get("intermediate_size") or 0),
                num_experts=int(get("num_experts", 0) or 0),
                num_experts_per_tok=int(get("num_experts_per_tok", 0) or 0),
                moe_intermediate_size=int(get("moe_intermediate_size", 0) or 0),
                shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 0) or 0),
                mlp_only_layers=list(get("mlp_only_layers") or []),
                decoder_sparse_step=int(get("decoder_sparse_step", 1) or 1),
            )
        except (TypeError, ValueError) as e:
            raise get.bad_value(e) from None
        n_layers = args.num_hidden_layers
        if len(args.layer_types) != n_layers or set(args.layer_types) - {"linear_attention", "full_attention"}:
            raise HeteroError("config.json layer_types must list 'linear_attention'/'full_attention' once per layer")
        if args.linear_num_value_heads % args.linear_num_key_heads:
            raise HeteroError("config.json: linear_num_value_heads must be a multiple of linear_num_key_heads")
        if model_type in MOE_MODEL_TYPES and args.num_experts <= 0:
            raise HeteroError(f"config.json: a {model_type} config needs num_experts >= 1")
        if args.moe_layers or args.mtp_moe_layers:
            if not 1 <= args.num_experts_per_tok <= args.num_experts:
                raise HeteroError(f"config.json: num_experts_per_tok ({args.num_experts_per_tok}) must be between 1 and "
                                  f"num_experts ({args.num_experts})")
            if args.moe_intermediate_size <= 0:
                raise HeteroError("config.json: a mixture-of-experts config needs moe_intermediate_size >= 1")
        if len(args.moe_layers) < n_layers and args.intermediate_size <= 0:
            raise HeteroError("config.json lacks intermediate_size: the dense MLP layers need it")
        return args

    @property
    def moe_layers(self) -> list[int]:
        """Layers whose MLP is a mixture of experts (HF's rule); empty for a dense model."""
        return self._sparse(range(self.num_hidden_layers))

    @property
    def mtp_moe_layers(self) -> list[int]:
        """MTP layers whose MLP is a mixture of experts.

        Neither HF transformers nor mlx-lm builds the MTP head. vLLM (qwen3_next_mtp.py, qwen3_5_mtp.py) builds
        MTP layer j as a decoder layer named `mtp.layers.{j}` and applies the backbone's rule to j, so with the
        released configs (decoder_sparse_step 1, no mlp_only_layers) it is MoE; Qwen3.5-MoE checkpoint indexes
        list `mtp.layers.0.mlp.gate.weight`, `mtp.layers.0.mlp.shared_expert.*` and `mtp.layers.0.mlp.experts.*`.
        """
        return self._sparse(range(max(1, self.mtp_num_hidden_layers)))

    def _sparse(self, indices: range) -> list[int]:
        if self.num_experts <= 0:
            return []
        return [i for i in indices if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0]

    @property
    def is_moe(self) -> bool:
        """Whether any backbone layer is a mixture of experts."""
        return bool(self.moe_layers)
