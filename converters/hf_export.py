"""Write a `Model` back out as an HF-format Qwen3.5 checkpoint: the inverse of `qwen3_5.sanitize`.

The layout is the one real Qwen3.5 checkpoints ship in: `config.json` with `model_type: qwen3_5` and the text
fields nested under `text_config`; `model.safetensors` with the backbone under `model.language_model.*`, the
MTP head under `mtp.*` and no `lm_head` when tied; zero-centred norms (w - 1; the GDN output norm as-is);
conv1d weights as `[C, 1, K]`. `hetero.loader.load_model`, transformers and mlx-lm all read it.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from hetero.models.qwen3_5 import Model, ModelArgs, is_zero_centred_norm

FP32_PARAMS = ("A_log",)  # the decay parameter stays fp32 on disk, as the loaders keep it in memory


def hf_config(args: ModelArgs, eos_token_id: list[int], full_attention_interval: int = 4) -> dict:
    """The nested `qwen3_5` config.json for `args` (text fields under `text_config`)."""
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.intermediate_size,
        "linear_num_key_heads": args.linear_num_key_heads,
        "linear_num_value_heads": args.linear_num_value_heads,
        "linear_key_head_dim": args.linear_key_head_dim,
        "linear_value_head_dim": args.linear_value_head_dim,
        "linear_conv_kernel_dim": args.linear_conv_kernel_dim,
        "full_attention_interval": full_attention_interval,
        "layer_types": list(args.layer_types),
        "rms_norm_eps": args.rms_norm_eps,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_word_embeddings,
        "max_position_embeddings": args.max_position_embeddings,
        "eos_token_id": list(eos_token_id),
        "attention_bias": args.attention_bias,
        "attn_output_gate": True,
        "mtp_num_hidden_layers": max(1, args.mtp_num_hidden_layers),
        "mtp_use_dedicated_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": args.rope_theta,
            "partial_rotary_factor": args.partial_rotary_factor,
        },
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": args.tie_word_embeddings,
    }


def hf_weights(model: Model, dtype: mx.Dtype = mx.bfloat16) -> dict[str, mx.array]:
    """In-memory parameters -> checkpoint tensors (HF names, zero-centred norms, [C, 1, K] conv)."""
    out: dict[str, mx.array] = {}
    for name, value in tree_flatten(model.parameters()):
        value = value.astype(mx.float32)
        if is_zero_centred_norm(name):
            value = value - 1.0  # shifted in memory (1 + w); stored zero-centred, shifted again exactly once at load
        elif name.endswith("conv1d.weight"):
            value = value.swapaxes(1, 2)  # [C, K, 1] -> [C, 1, K]
        if name.startswith("model."):
            name = "model.language_model." + name[len("model.") :]
        out[name] = value if name.endswith(FP32_PARAMS) else value.astype(dtype)
    if model.args.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def save_hf_checkpoint(model: Model, config: dict, out_dir: Path, dtype: mx.Dtype = mx.bfloat16) -> Path:
    """Write config.json, generation_config.json and model.safetensors for `model` into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = hf_weights(model, dtype)
    mx.eval(weights)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    text = config.get("text_config", config)
    eos = text.get("eos_token_id", config.get("eos_token_id", []))
    eos = [eos] if isinstance(eos, int) else list(eos)
    generation = {"eos_token_id": eos, "pad_token_id": eos[-1] if eos else None, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out_dir / "model.safetensors"
