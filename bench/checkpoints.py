"""Checkpoints the benchmarks share: the bundled model and a larger random one of the same architecture."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx

from converters.hf_export import hf_config, save_hf_checkpoint
from hetero.loader import BUNDLED_MODEL
from hetero.models.qwen3_5 import Model, ModelArgs

# ~270M parameters (about 540 MB as bf16 on disk): large enough that a decode step is bound by reading the
# weights, and shaped like a real Qwen3.5 (one MTP layer and the lm_head are a small share of a step).
LARGE = dict(
    model_type="qwen3_5_text", hidden_size=1024, num_hidden_layers=20, intermediate_size=3072,
    num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
    linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=8192, full_attention_interval=4,
    tie_word_embeddings=True, max_position_embeddings=65536, mtp_num_hidden_layers=1,
)


def large_checkpoint(workdir: Path) -> Path:
    """Write (once) a random LARGE-shaped checkpoint with an MTP head, borrowing the bundled tokenizer."""
    out = Path(workdir) / "large"
    if (out / "model.safetensors").is_file():
        return out
    mx.random.seed(0)
    args = ModelArgs.from_config(LARGE)
    model = Model(args, with_mtp=True)
    mx.eval(model.parameters())
    save_hf_checkpoint(model, hf_config(args, eos_token_id=[]), out, dtype=mx.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, out / name)
    return out


def checkpoint(name: str, workdir: Path) -> Path:
    return BUNDLED_MODEL if name == "bundled" else large_checkpoint(workdir)
