"""A tiny random Qwen3.5 checkpoint with an MTP head and a byte-level BPE tokenizer, written by MLX alone.

For the prefix-cache, session-store and server tests: `hetero.load(path)` reads it like any checkpoint, so the
tests go through the real loader, tokenizer and chat template. No torch, a fraction of a second to write.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from hetero.models.qwen3_5 import Model, ModelArgs
from hetero.training.tokenizer_train import save_tokenizer, train_tokenizer

TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
    "        self.y = y\n\nimport os\nprint(os.path.join('a', 'b'))\nfor i in range(10):\n    print(i)\n"
)


def write_tiny_model(path: Path, seed: int = 0, max_context: int = 4096) -> Path:
    """Write config.json, model.safetensors and the tokenizer files of a random 3-layer model to `path`."""
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer([TEXT] * 4, vocab_size=320)
    save_tokenizer(tok, path)
    vocab = 64 * math.ceil(tok.get_vocab_size() / 64)
    config = tiny_config(vocab, eos=2, max_context=max_context)
    weights = random_weights(Model(ModelArgs.from_config(config), with_mtp=True), seed)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def tiny_config(vocab: int, eos: int, max_context: int = 4096) -> dict:
    """The config of the random 3-layer model (2 GDN + 1 attention layer, an MTP head) with its vocabulary size and
    EOS id."""
    return dict(
        model_type="qwen3_5_text", hidden_size=32, num_hidden_layers=3, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        vocab_size=vocab, layer_types=["linear_attention", "full_attention", "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
        mtp_num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=max_context,
        eos_token_id=eos, rms_norm_eps=1e-6,
    )


def random_weights(model: Model, seed: int) -> dict[str, mx.array]:
    """fp32 weights for every parameter of `model`: fan-in scaled normals, zero-centred norms, decays from weak to
    strong, logits spread over a few units (clear greedy choices)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            v = 0.3 * rng.standard_normal(p.shape)
        elif name.endswith("A_log"):  # decay from weak to strong
            v = rng.uniform(math.log(0.05), math.log(5.0), p.shape)
        elif name.endswith(("embed_tokens.weight", "dt_bias")):
            v = rng.standard_normal(p.shape)
        elif name == "lm_head.weight":  # logits spread over a few units: clear greedy choices
            v = 3.0 * rng.standard_normal(p.shape) / math.sqrt(p.shape[1])
        else:
            v = rng.standard_normal(p.shape) / math.sqrt(p.shape[-1])
        weights[name] = mx.array(v.astype(np.float32))
    return weights


# Qwen3.5-9B's layer shapes at an eighth of its width: head_dim 256, GDN key and value heads of 128, hidden =
# query heads x head_dim = value heads x 128 = 2 x key heads x 128, intermediate = 3 x hidden, partial RoPE 0.25 at
# theta 1e7, one attention layer in four. Only the width (and GQA 2 instead of 4, so a half split takes whole KV
# groups) is scaled down.
REAL_SHAPES = dict(
    model_type="qwen3_5_text", hidden_size=512, num_hidden_layers=4, intermediate_size=1536,
    num_attention_heads=4, num_key_value_heads=2, head_dim=256, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    full_attention_interval=4, rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                                "partial_rotary_factor": 0.25},
    mtp_num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=4096, eos_token_id=2,
    rms_norm_eps=1e-6,
)


def write_real_shape_model(path: Path, seed: int = 0, layers: int = 4) -> Path:
    """Write a random checkpoint with Qwen3.5's real layer shapes (`REAL_SHAPES`, `layers` deep) and the tiny
    model's tokenizer to `path`."""
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer([TEXT] * 4, vocab_size=320)
    save_tokenizer(tok, path)
    config = dict(REAL_SHAPES, num_hidden_layers=layers, vocab_size=64 * math.ceil(tok.get_vocab_size() / 64))
    weights = random_weights(Model(ModelArgs.from_config(config), with_mtp=True), seed)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path
