"""config.json as typed arguments, what every architecture shares: the fields all of them read (`Args`, which each
architecture's arguments extend) and the reader they parse a config with (`ConfigFields`: nested under
`text_config` or flat, and a value that fails its conversion reported by the field's name)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero.errors import HeteroError
from hetero.models.rope import Rotary, rotary_of


@dataclass(kw_only=True)
class Args:
    """The fields every architecture's arguments share, named as config.json names them: what the loader, the
    planner, the governor and the caches read without asking which architecture they hold. Each architecture's
    arguments extend it (`qwen3_5.args.ModelArgs`, `qwen4_exp.args.Qwen4Args`) and parse a config into it."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    vocab_size: int
    layer_types: list[str]  # "linear_attention" (GDN) or the architecture's attention kind, one per layer
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
    eos_token_id: list[int] = field(default_factory=list)
    quantization: dict | None = None

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rotary(self) -> Rotary:
        """The rotation every attention layer applies (`hetero.models.rope`: default, linear, yarn, dynamic)."""
        return rotary_of(self.rope_parameters, self.rotary_dims, self.rope_theta, self.max_position_embeddings)

    # Each architecture says: `intermediate_size` (the dense MLP's width, 0 without a dense layer) and `moe_layers`
    # (the backbone layers whose MLP is a mixture of experts)


def check_activation(name) -> None:
    """transformers' Qwen MLPs (and the GDN conv) apply `hidden_act`; hetero implements SiLU (SwiGLU) alone, so any
    other is refused in one line rather than run as SiLU."""
    if name not in ("silu", "swish"):
        raise HeteroError(f"unsupported hidden_act {name!r} in config.json: hetero implements silu (SwiGLU) only")


class ConfigFields:
    """Reads a checkpoint config's fields, from its text_config first, then its top level; remembers the last field
    read, so that a value that fails its conversion (int(), float()) is reported by name (`bad_value`)."""

    def __init__(self, config: dict):
        self.text, self.config, self.last = config.get("text_config") or config, config, None

    def __call__(self, key: str, default=None):
        self.last = key
        return self.text.get(key, self.config.get(key, default))

    def shared(self, model_type: str, attention: str, aliases: tuple[str, ...] = (), **defaults) -> dict:
        """The fields every architecture's arguments share (`Args`), read from the config: layer types default to
        GDN layers with every `full_attention_interval`-th one of kind `attention` (`aliases`: other names of that
        kind), RoPE of a type `hetero.models.rope` implements (default, with mrope sections; linear, yarn, dynamic),
        the MLPs' activation SiLU. `defaults`: the architecture's own for the fields a config may lack (GDN heads
        and dims, partial_rotary_factor, max_position_embeddings); without one a field is required."""
        n_layers, hidden = int(self("num_hidden_layers")), int(self("hidden_size"))
        heads, interval = int(self("num_attention_heads")), int(self("full_attention_interval", 4))
        types = self("layer_types") or [attention if (i + 1) % interval == 0 else "linear_attention"
                                        for i in range(n_layers)]
        rope = self("rope_parameters") or self("rope_scaling") or {}
        check_activation(self("hidden_act", "silu"))
        eos, d = self("eos_token_id", []), defaults.get
        fields = dict(
            model_type=model_type, hidden_size=hidden, num_hidden_layers=n_layers, num_attention_heads=heads,
            num_key_value_heads=int(self("num_key_value_heads", heads)), head_dim=int(self("head_dim") or hidden // heads),
            **{k: int(self(k, d(k))) for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                                "linear_value_head_dim")},
            vocab_size=int(self("vocab_size")),
            layer_types=[attention if t in aliases else t for t in types],
            linear_conv_kernel_dim=int(self("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(self("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", self("rope_theta", 10_000_000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                 self("partial_rotary_factor", d("partial_rotary_factor", 0.25)))),
            mrope_section=[int(n) for n in rope.get("mrope_section") or (11, 11, 10)],
            tie_word_embeddings=bool(self("tie_word_embeddings", False)),
            attention_bias=bool(self("attention_bias", False)),
            max_position_embeddings=int(self("max_position_embeddings", d("max_position_embeddings", 262_144))),
            mtp_num_hidden_layers=int(self("mtp_num_hidden_layers", 0) or 0),
            norm_topk_prob=bool(self("norm_topk_prob", True)),
            eos_token_id=[eos] if isinstance(eos, int) else list(eos or []),
            quantization=self.config.get("quantization") or self.config.get("quantization_config"),
            rope_parameters=dict(rope),
        )
        head_dim = fields["head_dim"]
        rotary_of(rope, int(head_dim * fields["partial_rotary_factor"]), fields["rope_theta"],
                  fields["max_position_embeddings"])  # a rope type it does not implement is refused here, in one line
        return fields

    def bad_value(self, error: Exception) -> HeteroError:
        """One line naming the field read last (the one whose value failed) and what was wrong with it."""
        value = self(self.last) if self.last is not None else None
        what = "is missing" if value is None else f"has a bad value ({value!r}: {error})"
        return HeteroError(f"config.json: the field {self.last!r} {what}; fix config.json (the checkpoint's own, as "
                           "transformers saves it)")
