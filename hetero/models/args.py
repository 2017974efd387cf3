"""The Qwen3.5 family's config.json as typed model arguments (`ModelArgs.from_config`): nested or flat text
fields, RoPE flat or in `rope_parameters`, layer types, experts, the MTP head."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero.errors import HeteroError
from hetero.models.rope import Rotary, rotary_of

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")  # every layer (and the MTP layer) is mixture-of-experts



class ConfigFields:
    """Reads a checkpoint config's fields, from its text_config first, then its top level; remembers the last field
    read, so that a value that fails its conversion (int(), float()) is reported by name (`bad_value`)."""

    def __init__(self, config: dict):
        self.text, self.config, self.last = config.get("text_config") or config, config, None

    def __call__(self, key: str, default=None):
        self.last = key
        return self.text.get(key, self.config.get(key, default))

    def bad_value(self, error: Exception) -> HeteroError:
        """One line naming the field read last (the one whose value failed) and what was wrong with it."""
        value = self(self.last) if self.last is not None else None
        what = "is missing" if value is None else f"has a bad value ({value!r}: {error})"
        return HeteroError(f"config.json: the field {self.last!r} {what}; fix config.json (the checkpoint's own, as "
                           "transformers saves it)")

def check_activation(name) -> None:
    """transformers' Qwen MLPs (and the GDN conv) apply `hidden_act`; hetero implements SiLU (SwiGLU) alone, so any
    other is refused in one line rather than run as SiLU."""
    if name not in ("silu", "swish"):
        raise HeteroError(f"unsupported hidden_act {name!r} in config.json: hetero implements silu (SwiGLU) only")


@dataclass
class ModelArgs:
    """The text model's shape, read from an HF config (any of the three layouts)."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    vocab_size: int
    layer_types: list[str]
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    mrope_section: list[int] = field(default_factory=lambda: [11, 11, 10])  # image positions (t, h, w); HF's default
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 262_144
    rope_parameters: dict = field(default_factory=dict)  # as config.json gives them: the rope type and its scaling
    mtp_num_hidden_layers: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    mlp_only_layers: list[int] = field(default_factory=list)
    decoder_sparse_step: int = 1
    eos_token_id: list[int] = field(default_factory=list)
    quantization: dict | None = None

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
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise HeteroError(
                f"unsupported model_type {model_type!r}: hetero runs {', '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
            )
        get = ConfigFields(config)
        try:
            n_layers = int(get("num_hidden_layers"))
            hidden = int(get("hidden_size"))
            heads = int(get("num_attention_heads"))
            interval = int(get("full_attention_interval", 4))
            layer_types = get("layer_types") or [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
            ]
            rope = get("rope_parameters") or get("rope_scaling") or {}
            check_activation(get("hidden_act", "silu"))
            eos = get("eos_token_id", [])
            args = cls(
                model_type=model_type,
                hidden_size=hidden,
                num_hidden_layers=n_layers,
                intermediate_size=int(get("intermediate_size") or 0),
                num_attention_heads=heads,
                num_key_value_heads=int(get("num_key_value_heads", heads)),
                head_dim=int(get("head_dim") or hidden // heads),
                linear_num_key_heads=int(get("linear_num_key_heads")),
                linear_num_value_heads=int(get("linear_num_value_heads")),
                linear_key_head_dim=int(get("linear_key_head_dim")),
                linear_value_head_dim=int(get("linear_value_head_dim")),
                vocab_size=int(get("vocab_size")),
                layer_types=list(layer_types),
                linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
                rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", get("rope_theta", 10_000_000.0))),
                partial_rotary_factor=float(rope.get("partial_rotary_factor", get("partial_rotary_factor", 0.25))),
                mrope_section=[int(n) for n in rope.get("mrope_section") or (11, 11, 10)],
                tie_word_embeddings=bool(get("tie_word_embeddings", False)),
                attention_bias=bool(get("attention_bias", False)),
                max_position_embeddings=int(get("max_position_embeddings", 262_144)),
                rope_parameters=dict(rope),
                mtp_num_hidden_layers=int(get("mtp_num_hidden_layers", 0) or 0),
                num_experts=int(get("num_experts", 0) or 0),
                num_experts_per_tok=int(get("num_experts_per_tok", 0) or 0),
                moe_intermediate_size=int(get("moe_intermediate_size", 0) or 0),
                shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 0) or 0),
                norm_topk_prob=bool(get("norm_topk_prob", True)),
                mlp_only_layers=list(get("mlp_only_layers") or []),
                decoder_sparse_step=int(get("decoder_sparse_step", 1) or 1),
                eos_token_id=[eos] if isinstance(eos, int) else list(eos or []),
                quantization=config.get("quantization") or config.get("quantization_config"),
            )
        except (TypeError, ValueError) as e:
            raise get.bad_value(e) from None
        args.rotary  # a rope type it does not implement is refused here, in one line
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

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rotary(self) -> Rotary:
        """The rotation every attention layer applies (`hetero.models.rope`: default, linear, yarn, dynamic)."""
        return rotary_of(self.rope_parameters, self.rotary_dims, self.rope_theta, self.max_position_embeddings)
