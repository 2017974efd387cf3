"""The checks on a checkpoint's config.json: `check_config` validates the JSON types and ranges of its fields
before any is used, so a bad file is one clear error, not a traceback deep in the model code."""

from __future__ import annotations

from hetero.errors import HeteroError
from hetero.validate import NONNEG_INT, POSITIVE, POSITIVE_INT, Bound


# Sizes that must be integers >= 1 wherever they appear (flat or under text_config)
CONFIG_POSITIVE_INTS = (
    "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "vocab_size", "linear_conv_kernel_dim", "max_position_embeddings", "full_attention_interval",
    "decoder_sparse_step", "num_experts_per_tok", "moe_intermediate_size",
)
CONFIG_NONNEG_INTS = ("mtp_num_hidden_layers", "num_experts", "shared_expert_intermediate_size")
MAX_DIM = 2**31 - 1  # MLX array dimensions are 32-bit
# Counts that size Python lists (one object per layer): far above any released model, far below a hang
CONFIG_MAX = {"num_hidden_layers": 4096, "mtp_num_hidden_layers": 64}
CONFIG_FLOATS = {
    "rms_norm_eps": POSITIVE,
    "rope_theta": POSITIVE,
    "partial_rotary_factor": Bound(0, 1, lo_open=True),
}
CONFIG_BOOLS = ("tie_word_embeddings", "attention_bias", "norm_topk_prob")
CONFIG_DICTS = ("rope_parameters", "rope_scaling", "quantization", "quantization_config")
QUANT_BITS = (2, 3, 4, 5, 6, 8)


def check_config(config, where: str = "config.json", required: tuple[str, ...] = ()) -> dict:
    """`config` itself when its fields have the JSON types and ranges hetero relies on, else a HeteroError.

    Checks the fields that are present, flat or under `text_config`; with `required` (its architecture's
    `required_fields`) also that those text-model sizes are there.
    """
    if not isinstance(config, dict):
        raise HeteroError(f"{where} must hold a JSON object, got a JSON {_json_type(config)}; re-download it")
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise HeteroError(f"{where}: text_config must be an object, got a JSON {_json_type(text)}; fix or re-download it")
    if not isinstance(config.get("model_type", ""), str):
        raise HeteroError(f"{where}: model_type must be a string, got a JSON {_json_type(config['model_type'])}")
    for scope, fields in ((None, config), ("text_config", text or {})):
        _check_fields(fields, where, scope)
    if required:
        merged = {**config, **(text or {})}
        needed = required
        if merged.get("num_experts"):  # MoE: ModelArgs checks the experts' sizes, and the dense width where a layer is dense
            needed = tuple(k for k in required if k != "intermediate_size")
        missing = [k for k in needed if merged.get(k) is None]
        if missing:
            raise HeteroError(f"{where} lacks {', '.join(missing)}: a {config.get('model_type')} config needs them; re-download it")
        heads, kv = merged["num_attention_heads"], merged.get("num_key_value_heads") or merged["num_attention_heads"]
        if heads % kv:
            raise HeteroError(f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})")
        if merged.get("head_dim") is None and merged["hidden_size"] % heads:
            raise HeteroError(f"{where}: without head_dim, hidden_size ({merged['hidden_size']}) must be a multiple of "
                              f"num_attention_heads ({heads})")
    return config


def _check_fields(fields: dict, where: str, scope: str | None) -> None:
    """Type and range of each known field present in one level of the config."""
    name = lambda k: f"{where}: {scope + '.' if scope else ''}{k}"  # noqa: E731
    for key in CONFIG_POSITIVE_INTS:
        _check_value(fields, key, Bound(1, CONFIG_MAX.get(key, MAX_DIM), integer=True), name(key))
    for key in CONFIG_NONNEG_INTS:
        _check_value(fields, key, Bound(0, CONFIG_MAX.get(key, MAX_DIM), integer=True), name(key))
    for key, bound in CONFIG_FLOATS.items():
        _check_value(fields, key, bound, name(key))
    for key in CONFIG_BOOLS:
        if fields.get(key) is not None and not isinstance(fields[key], bool):
            raise HeteroError(f"{name(key)} must be true or false, got {fields[key]!r}")
    for key in CONFIG_DICTS:
        if fields.get(key) is not None and not isinstance(fields[key], dict):
            raise HeteroError(f"{name(key)} must be an object, got a JSON {_json_type(fields[key])}")
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    for key, bound in CONFIG_FLOATS.items():
        _check_value(rope, key, bound, name(f"rope_parameters.{key}"))
    if not isinstance(rope.get("rope_type", rope.get("type", "default")), str):
        raise HeteroError(f"{name('rope_parameters.rope_type')} must be a string")
    layer_types = fields.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)):
        raise HeteroError(f"{name('layer_types')} must be a list of 'linear_attention' / 'full_attention' strings")
    for key in ("mlp_only_layers",):
        v = fields.get(key)
        if v is not None and not (isinstance(v, list) and all(NONNEG_INT.problem(i) is None for i in v)):
            raise HeteroError(f"{name(key)} must be a list of layer indices (integers >= 0)")
    eos = fields.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if any(NONNEG_INT.problem(i) is not None for i in ids):
        raise HeteroError(f"{name('eos_token_id')} must be a token id or a list of them (integers >= 0), got {eos!r}")
    if fields.get("quantization"):  # MLX's own format; other tools' quantization_config is not ours to judge
        _check_quantization(fields["quantization"], name("quantization"))


def _check_quantization(q: dict, name: str) -> None:
    bits, group = q.get("bits", 4), q.get("group_size", 64)
    if isinstance(bits, bool) or bits not in QUANT_BITS:
        raise HeteroError(f"{name}.bits must be one of {list(QUANT_BITS)}, got {bits!r}")
    POSITIVE_INT.check(group, f"{name}.group_size")


def _check_value(fields: dict, key: str, bound: Bound, name: str) -> None:
    if fields.get(key) is not None:
        why = bound.problem(fields[key])
        if why is not None:
            raise HeteroError(f"{name} {why}; fix or re-download config.json")


def _json_type(value) -> str:
    """The JSON name of a parsed value's type."""
    if value is None:
        return "null"
    for t, n in ((bool, "boolean"), (str, "string"), (int, "number"), (float, "number"), (list, "array"), (dict, "object")):
        if isinstance(value, t):
            return n
    return type(value).__name__
