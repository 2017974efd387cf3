"""Write a `Model` back out as an HF-format Qwen3.5 checkpoint: the inverse of `qwen3_5.sanitize`.

The layout is the one real Qwen3.5 checkpoints ship in: `config.json` with `model_type: qwen3_5` and the text
fields nested under `text_config`; `model.safetensors` with the backbone under `model.language_model.*`, the
MTP head under `mtp.*` and no `lm_head` when tied; zero-centred norms (w - 1; the GDN output norm as-is);
conv1d weights as `[C, 1, K]`. `hetero.checkpoint.loader.load_model`, transformers and mlx-lm all read it.

Mixture-of-experts models are written as `qwen3_5_moe` (`qwen3_5_moe_text` under `text_config`), their routed
experts one tensor per expert (`...mlp.experts.{e}.gate_proj.weight`, as the released checkpoints and
transformers' `save_pretrained` write them) or, with `experts="fused"`, transformers 5's in-memory layout
(`...mlp.experts.gate_up_proj` [E, 2I, H] and `...mlp.experts.down_proj` [E, H, I]).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from hetero.models.qwen3_5 import Model, ModelArgs
from hetero.models.qwen3_5.weights import is_zero_centred_norm

FP32_PARAMS = ("A_log",)  # the decay parameter stays fp32 on disk, as the loaders keep it in memory
_SWITCH = re.compile(r"(.*\.mlp)\.switch_mlp\.(gate_proj|up_proj|down_proj)\.weight$")
EXPERT_LAYOUTS = ("per_expert", "fused")


def hf_config(args: ModelArgs, eos_token_id: list[int], full_attention_interval: int = 4) -> dict:
    """The nested `qwen3_5` (or, with experts, `qwen3_5_moe`) config.json for `args` (text fields under
    `text_config`)."""
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
    if not args.num_experts:
        return {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "text_config": text,
            "tie_word_embeddings": args.tie_word_embeddings,
        }
    if len(args.moe_layers) != args.num_hidden_layers:  # HF's qwen3_5_moe has no dense layers to describe
        raise ValueError("a qwen3_5_moe config has a mixture-of-experts MLP in every layer")
    del text["intermediate_size"]  # no dense MLP anywhere (the released qwen3_5_moe configs have none)
    text.update(
        model_type="qwen3_5_moe_text",
        num_experts=args.num_experts,
        num_experts_per_tok=args.num_experts_per_tok,
        moe_intermediate_size=args.moe_intermediate_size,
        shared_expert_intermediate_size=args.shared_expert_intermediate_size,
    )
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": args.tie_word_embeddings,
    }


def hf_weights(model: Model, dtype: mx.Dtype = mx.bfloat16, experts: str = "per_expert") -> dict[str, mx.array]:
    """In-memory parameters -> checkpoint tensors (HF names, zero-centred norms, [C, 1, K] conv, routed experts
    in the `experts` layout of `EXPERT_LAYOUTS`)."""
    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"experts layout {experts!r}: one of {EXPERT_LAYOUTS}")
    out: dict[str, mx.array] = {}
    stacked = dict(tree_flatten(model.parameters()))
    params = {n: v for n, v in stacked.items() if not _SWITCH.match(n)}
    for name, value in stacked.items():
        m = _SWITCH.match(name)
        if m is None:
            continue
        mlp, proj = m.groups()  # value [E, out, in]
        if experts == "per_expert":
            params.update({f"{mlp}.experts.{e}.{proj}.weight": value[e] for e in range(value.shape[0])})
        elif proj == "down_proj":
            params[f"{mlp}.experts.down_proj"] = value  # [E, H, I]
        elif proj == "gate_proj":  # [E, 2I, H]: gate rows, then up rows
            params[f"{mlp}.experts.gate_up_proj"] = mx.concatenate([value, stacked[f"{mlp}.switch_mlp.up_proj.weight"]], axis=1)
    for name, value in params.items():
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


def save_hf_checkpoint(model: Model, config: dict, out_dir: Path, dtype: mx.Dtype = mx.bfloat16,
                       experts: str = "per_expert") -> Path:
    """Write config.json, generation_config.json and model.safetensors for `model` into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = hf_weights(model, dtype, experts)
    mx.eval(weights)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    text = config.get("text_config", config)
    eos = text.get("eos_token_id", config.get("eos_token_id", []))
    eos = [eos] if isinstance(eos, int) else list(eos)
    generation = {"eos_token_id": eos, "pad_token_id": eos[-1] if eos else None, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out_dir / "model.safetensors"
