"""A `qwen4_exp` / `qwen4_exp_text` config.json as typed arguments (`Qwen4Args.from_config`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero.errors import HeteroError
from hetero.models.args import Args, ConfigFields

MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")


@dataclass(kw_only=True)
class Qwen4Args(Args):
    """The text model's shape: the shared fields are `Args`' (the Qwen3.5 GDN, attention projections and MoE blocks
    take these arguments as they are), then hyper-connections, the GDN's output gate, PLE and QSA."""

    hc_count: int
    hc_lowrank: int
    output_gate_type: str = "silu"
    ple_layer_ids: list[int] = field(default_factory=list)  # one-indexed, as in the config
    ple_embed_dim: int = 0
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512
    indexer_n_heads: int = 0  # 0 only for a config without attention layers
    indexer_head_dim: int = 0
    indexer_budget: int = 0
    indexer_compress_ratio: int = 0

    @classmethod
    def from_config(cls, config: dict) -> "Qwen4Args":
        """Parse config.json (nested `text_config` or flat); raises HeteroError with one line on a bad value."""
        model_type = config.get("model_type")
        if model_type not in MODEL_TYPES:
            raise HeteroError(f"unsupported model_type {model_type!r}: expected one of {', '.join(MODEL_TYPES)}")
        get = ConfigFields(config)
        try:
            # full_attention: older configs; qwen_sparse_attention: mlx-vlm 0.7.10's name for the same QSA layer
            shared = get.shared(model_type, "indexed_attention", ("full_attention", "qwen_sparse_attention"),
                                linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                                linear_value_head_dim=128, partial_rotary_factor=1.0, max_position_embeddings=32768)
            args = cls(
                **shared,
                num_experts=int(get("num_experts", 512)),
                num_experts_per_tok=int(get("num_experts_per_tok", 10)),
                moe_intermediate_size=int(get("moe_intermediate_size", 512)),
                shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 512)),
                hc_count=int(get("hc_count", 4)),
                hc_lowrank=int(get("hc_lowrank", 320)),
                output_gate_type=str(get("output_gate_type") or get("hidden_act", "silu")),
                ple_layer_ids=sorted(set(get("ple_layer_ids") or [])),
                ple_embed_dim=int(get("ple_embed_dim") or shared["hidden_size"]),
                ple_conv_kernel_size=int(get("ple_conv_kernel_size", 4)),
                ngram_size=int(get("ngram_size", 3)),
                heads_per_ngram=int(get("heads_per_ngram", 8)),
                ngram_vocab_size_base=int(get("ngram_vocab_size_base", 20_000_000)),
                make_ngram_vocab_size_divisible_by=int(get("make_ngram_vocab_size_divisible_by", 128)),
                seed=int(get("seed", 1234)),
                split_ngram_parts=int(get("split_ngram_parts", 512)),
                indexer_n_heads=int(get("indexer_n_heads") or 0),
                indexer_head_dim=int(get("indexer_head_dim") or 0),
                indexer_budget=int(get("indexer_budget") or 0),
                indexer_compress_ratio=int(get("indexer_compress_ratio") or 0),
            )
        except (TypeError, ValueError) as e:
            raise get.bad_value(e) from None
        args.validate(get)
        return args

    def validate(self, get) -> None:
        """The invariants transformers checks, as one-line errors."""
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {"linear_attention",
                                                                                        "indexed_attention"}:
            raise HeteroError("config.json layer_types must list 'linear_attention'/'indexed_attention' once per layer")
        if self.hc_count <= 1:
            raise HeteroError(f"config.json: qwen4_exp needs hc_count > 1 (hyper-connection streams), got {self.hc_count}")
        if self.output_gate_type not in ("sigmoid", "silu"):
            raise HeteroError(f"config.json: output_gate_type {self.output_gate_type!r} is not 'sigmoid' or 'silu'")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise HeteroError(f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                              f"num_experts ({self.num_experts})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise HeteroError("config.json: linear_num_value_heads must be a multiple of linear_num_key_heads")
        if "indexed_attention" in self.layer_types and not self.qsa:  # transformers builds the indexer on them
            raise HeteroError("config.json: the attention layers of qwen4_exp need the QSA fields (indexer_n_heads, "
                              "indexer_head_dim, indexer_budget, indexer_compress_ratio)")
        if self.qsa:
            if int(get("indexer_kv_heads") or 1) != 1:
                raise HeteroError("config.json: qwen4_exp QSA needs indexer_kv_heads = 1")
            if min(self.indexer_head_dim, self.indexer_budget, self.indexer_compress_ratio) <= 0:
                raise HeteroError("config.json: QSA needs indexer_head_dim, indexer_budget and indexer_compress_ratio")
            if self.indexer_budget % self.indexer_compress_ratio:
                raise HeteroError("config.json: indexer_budget must be a multiple of indexer_compress_ratio")
            if self.rotary_dims > self.indexer_head_dim:
                raise HeteroError("config.json: the rotary dims must fit the QSA indexer head (indexer_head_dim)")
        if self.ple_layer_ids:
            if self.ngram_heads <= 0 or self.ple_embed_dim % self.ngram_heads:
                raise HeteroError(f"config.json: ple_embed_dim ({self.ple_embed_dim}) must be a multiple of the n-gram "
                                  f"heads ((ngram_size - 1) * heads_per_ngram = {self.ngram_heads})")
            bad = [i for i in self.ple_layer_ids if not 1 <= i <= self.num_hidden_layers
                   or self.layer_types[i - 1] != "linear_attention"]
            if bad:
                raise HeteroError(f"config.json: ple_layer_ids {bad} are not (one-indexed) linear_attention layers")
            if not self.eos_token_id:
                raise HeteroError("config.json: PLE layers need eos_token_id (it pads the n-gram context)")

    @property
    def qsa(self) -> bool:
        """Whether the attention layers select their keys with the token indexer."""
        return self.indexer_n_heads > 0

    @property
    def ngram_heads(self) -> int:
        """Hashed embedding heads per PLE layer: heads_per_ngram for each n-gram order 2..ngram_size."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def moe_layers(self) -> list[int]:
        """Every layer's MLP is a mixture of experts."""
        return list(range(self.num_hidden_layers))

    @property
    def intermediate_size(self) -> int:
        return 0  # no dense MLP layer
