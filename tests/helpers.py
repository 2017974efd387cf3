"""Tiny random checkpoints written by HF transformers itself (`save_pretrained`), for parity and numerics tests.

Test-only: imports torch and transformers. Weights are randomised so that every parameter matters: zero-centred
norms get std-0.3 noise (the final norm also a +1 offset), the GDN decay parameters spread from weak to strong
decay, projections are scaled so that logits spread over a few units (HF's own init, std 0.02, would give
near-constant logits).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

# One torch thread: these models are tiny, and on a 2-core machine shared with other jobs torch's thread pool
# spins and waits on descheduled threads (measured: HF generate 0.08 s with 1 thread, up to 5 s with 2).
torch.set_num_threads(1)

VOCAB = 256
HIDDEN = 64

# Shared text-model fields; head_dim 32, 4 layers alternating GDN / full attention (interval 2).
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # 2 value heads per key head: the q/k repeat and the fused grouping matter
    rms_norm_eps=1e-6,
    eos_token_id=None,
    pad_token_id=None,
    bos_token_id=None,
)
INTERVAL = 2


def randomize_(model, seed: int, gain: float = 1.0, embed_std: float = 0.2) -> None:
    """Overwrite every parameter of an HF Qwen3.5 / Qwen3-Next model with non-trivial random values.

    `gain` scales the projections inside the blocks. At 1.0 the random network is chaotic (it amplifies a
    small weight perturbation ~5x by the logits, measured); 0.5 keeps each block's update smaller than the
    residual stream, closer to how trained models respond to weight noise (used for the quantization tests).
    """
    gen = torch.Generator().manual_seed(seed)
    randn = lambda shape: torch.randn(shape, generator=gen)  # noqa: E731
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # GDN output norm: plain scale w
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif name in ("model.norm.weight", "model.language_model.norm.weight"):
                p.copy_(1.0 + 0.3 * randn(p.shape))  # final norm, zero-centred: effective scale ~2 spreads the logits
            elif name.endswith("norm.weight"):  # zero-centred: effective scale 1 + w
                p.copy_(0.3 * randn(p.shape))
            elif name.endswith("A_log"):  # exp(A_log) from 0.05 (weak decay) to 5 (strong decay)
                p.copy_(torch.empty(p.shape).uniform_(math.log(0.05), math.log(5.0), generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(randn(p.shape))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * randn(p.shape))
            elif name.endswith("embed_tokens.weight"):
                # Small next to the blocks' updates: with tied embeddings a dominant e_t in the residual makes
                # "repeat the input token" the greedy argmax, and continuations collapse into one token.
                p.copy_(embed_std * randn(p.shape))
            elif name.endswith("lm_head.weight"):  # logits std ~ 4
                p.copy_(2.0 * randn(p.shape) / math.sqrt(p.shape[1]))
            elif p.ndim == 2:  # projections
                p.copy_(gain * randn(p.shape) / math.sqrt(p.shape[1]))
            elif p.ndim >= 3:  # vision patch embedding and the like (weights we must skip)
                p.copy_(0.02 * randn(p.shape))
            else:  # biases (vision tower)
                p.copy_(0.02 * randn(p.shape))


def _patch_config(path: Path, **updates) -> None:
    file = path / "config.json"
    config = json.loads(file.read_text())
    drop = updates.pop("_drop", ())
    for key in drop:
        config.pop(key, None)
    config.update(updates)
    file.write_text(json.dumps(config, indent=1))


def save_flat(path: Path, tie: bool, partial: float = 0.5, seed: int = 0, gain: float = 1.0, embed_std: float = 0.2):
    """`qwen3_5_text` (flat `model.*`) via Qwen3_5ForCausalLM; returns the HF model (eval, fp32)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        **TEXT,
        full_attention_interval=INTERVAL,
        tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": partial},
    )
    model = Qwen3_5ForCausalLM(config).float().eval()
    randomize_(model, seed, gain, embed_std)
    if tie:
        model.tie_weights()
    model.save_pretrained(path)
    _patch_config(path, full_attention_interval=INTERVAL)  # real configs carry it next to layer_types
    return model


def save_nested(path: Path, tie: bool = False, seed: int = 1):
    """`qwen3_5` (text under `text_config`, weights under `model.language_model.*`, a tiny vision tower)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(
        **TEXT,
        full_attention_interval=INTERVAL,
        tie_word_embeddings=tie,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 2],
            "mrope_interleaved": True,
        },
    )
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
        spatial_merge_size=2, out_hidden_size=HIDDEN, num_position_embeddings=16,
    )
    config = Qwen3_5Config(
        text_config=text, vision_config=vision, tie_word_embeddings=tie,
        image_token_id=VOCAB - 4, video_token_id=VOCAB - 3, vision_start_token_id=VOCAB - 2, vision_end_token_id=VOCAB - 1,
    )
    model = Qwen3_5ForConditionalGeneration(config).float().eval()
    randomize_(model, seed)
    model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["full_attention_interval"] = INTERVAL
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return model


def save_next(path: Path, tie: bool = True, seed: int = 2):
    """`qwen3_next` with dense MLPs (num_experts 0) and fused in_proj_qkvz / in_proj_ba.

    config.json is rewritten to the form of the released Qwen3-Next configs: flat rope_theta /
    partial_rotary_factor and full_attention_interval, no layer_types, no rope_parameters.
    """
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    fields = dict(TEXT, linear_value_head_dim=24)  # Dk != Dv catches a transposed state or split
    config = Qwen3NextConfig(
        **fields,
        full_attention_interval=INTERVAL,
        tie_word_embeddings=tie,
        num_experts=0,
        mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
    )
    model = Qwen3NextForCausalLM(config).float().eval()
    randomize_(model, seed)
    if tie:
        model.tie_weights()
    model.save_pretrained(path)
    _patch_config(
        path,
        _drop=("layer_types", "rope_parameters"),
        full_attention_interval=INTERVAL,
        rope_theta=10_000.0,
        partial_rotary_factor=0.5,
        rope_scaling=None,
    )
    return model


def hf_logits(model, tokens: list[int]) -> np.ndarray:
    """[S, vocab] fp32 logits of an HF model for one sequence."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def random_tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def add_mtp(path: Path, seed: int = 5) -> dict[str, np.ndarray]:
    """Add an MTP head in the HF naming (`mtp.*`) to a flat checkpoint saved by `save_flat`.

    Norms are zero-centred (std 0.3) like the released checkpoints; sets `mtp_num_hidden_layers: 1`.
    Returns the added tensors as stored.
    """
    from safetensors.numpy import load_file, save_file

    config = json.loads((path / "config.json").read_text())
    h, heads, kv, d, inter = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"))
    rng = np.random.default_rng(seed)
    proj = lambda rows, cols: (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)  # noqa: E731
    norm = lambda n: (0.3 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    layer = "mtp.layers.0."
    mtp = {
        "mtp.fc.weight": proj(h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": norm(h),
        "mtp.pre_fc_norm_hidden.weight": norm(h),
        "mtp.norm.weight": norm(h),
        layer + "input_layernorm.weight": norm(h),
        layer + "post_attention_layernorm.weight": norm(h),
        layer + "self_attn.q_proj.weight": proj(2 * heads * d, h),
        layer + "self_attn.k_proj.weight": proj(kv * d, h),
        layer + "self_attn.v_proj.weight": proj(kv * d, h),
        layer + "self_attn.o_proj.weight": proj(h, heads * d),
        layer + "self_attn.q_norm.weight": norm(d),
        layer + "self_attn.k_norm.weight": norm(d),
        layer + "mlp.gate_proj.weight": proj(inter, h),
        layer + "mlp.up_proj.weight": proj(inter, h),
        layer + "mlp.down_proj.weight": proj(h, inter),
    }
    weights = load_file(str(path / "model.safetensors"))
    save_file({**weights, **mtp}, str(path / "model.safetensors"), metadata={"format": "pt"})
    _patch_config(path, mtp_num_hidden_layers=1)
    return mtp
