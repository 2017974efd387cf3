"""Checkpoints the benchmarks share: the bundled model, a larger random one of the same architecture, a random one with
Qwen3.5-27B's attention and GDN head shapes, and a random mixture-of-experts one shaped like Qwen3.5-35B-A3B scaled
down."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from hetero.checkpoint.source import BUNDLED_MODEL
from hetero.models.qwen3_5 import Model, ModelArgs
from hetero.training.hf_export import hf_config, save_hf_checkpoint

# ~270M parameters (about 540 MB as bf16 on disk): large enough that a decode step is bound by reading the
# weights, and shaped like a real Qwen3.5 (one MTP layer and the lm_head are a small share of a step).
LARGE = dict(
    model_type="qwen3_5_text", hidden_size=1024, num_hidden_layers=20, intermediate_size=3072,
    num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
    linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=8192, full_attention_interval=4,
    tie_word_embeddings=True, max_position_embeddings=65536, mtp_num_hidden_layers=1,
)


# Qwen3.5-35B-A3B halved in width and depth, a quarter of its experts (still top-8), a small vocabulary: about
# 1.18B parameters (2.4 GB as bf16 on disk, 4.7 GB per engine in fp32), about 233M of them active per token (MTP
# head not counted), so a decode step reads 8 of 64 experts per layer and a prefill chunk sends 8 (token, expert)
# pairs per token through the experts.
MOE = dict(
    model_type="qwen3_5_moe_text", hidden_size=1024, num_hidden_layers=20, num_attention_heads=8,
    num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
    linear_value_head_dim=64, vocab_size=8192, full_attention_interval=4, tie_word_embeddings=False,
    max_position_embeddings=65536, mtp_num_hidden_layers=1, num_experts=64, num_experts_per_tok=8,
    moe_intermediate_size=256, shared_expert_intermediate_size=256,
)


# Qwen3.5-27B's attention and GDN head shapes (24 query heads, 4 KV heads of 256; GDN 16 key and 48 value heads of
# 128), at a narrower residual (1024 against 5120) and 4 layers (one of them attention): the KV rows quantized are
# the 27B's, and a 16K-token prefill stays within minutes on two cores.
REAL27 = dict(
    model_type="qwen3_5_text", hidden_size=1024, num_hidden_layers=4, intermediate_size=3072,
    num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
    linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=4096, full_attention_interval=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False, max_position_embeddings=65536, mtp_num_hidden_layers=1,
)


def _random_checkpoint(workdir: Path, name: str, shape: dict) -> Path:
    """Write (once) a random `shape` checkpoint with an MTP head, borrowing the bundled tokenizer."""
    out = Path(workdir) / name
    if (out / "model.safetensors").is_file():
        return out
    mx.random.seed(0)
    args = ModelArgs.from_config(shape)
    model = Model(args, with_mtp=True)
    mx.eval(model.parameters())
    save_hf_checkpoint(model, hf_config(args, eos_token_id=[]), out, dtype=mx.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, out / name)
    return out


def large_checkpoint(workdir: Path) -> Path:
    """Write (once) a random LARGE-shaped checkpoint with an MTP head, borrowing the bundled tokenizer."""
    return _random_checkpoint(workdir, "large", LARGE)


def moe_checkpoint(workdir: Path) -> Path:
    """Write (once) a random MOE-shaped `qwen3_5_moe` checkpoint with an MTP head (its own MoE block), the experts
    fused as transformers 5 holds them (`experts.gate_up_proj`, the layout mlx-lm's qwen3_5_moe reads), borrowing
    the bundled tokenizer."""
    out = Path(workdir) / "moe"
    if (out / "model.safetensors").is_file():
        return out
    mx.random.seed(0)
    args = ModelArgs.from_config(MOE)
    model = Model(args, with_mtp=True)
    experts = [(n, p) for n, p in tree_flatten(model.parameters()) if ".switch_mlp." in n]
    # SwitchLinear starts at zero; draw the experts as nn.Linear draws its weights, U(-1/sqrt(in), 1/sqrt(in))
    scale = lambda p: p.shape[-1] ** -0.5  # noqa: E731
    model.update(tree_unflatten([(n, mx.random.uniform(-scale(p), scale(p), p.shape)) for n, p in experts]))
    mx.eval(model.parameters())
    save_hf_checkpoint(model, hf_config(args, eos_token_id=[]), out, dtype=mx.bfloat16, experts="fused")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, out / name)
    return out


# Qwen3.8-Flash-Next (docs/qwen4_flash_next/config.json) scaled down with its structure: 4 hc streams with a
# low-rank mixer, QSA on every 4th layer (the indexer's budget of 512 tokens drops keys from a 4K prompt), one PLE
# layer (16 n-gram heads per token, a 5M-parameter table), 128 routed experts top-10 plus a shared expert, the
# sigmoid GDN gate, partial rotary 0.25, and an MTP head; about 60M parameters, so transformers prefills 4K tokens
# on two cores in well under a minute.
QWEN4 = dict(
    vocab_size=8192, hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    num_experts=128, num_experts_per_tok=10, moe_intermediate_size=128, shared_expert_intermediate_size=128,
    hc_count=4, hc_lowrank=64, ple_layer_ids=[1], ple_embed_dim=256, ngram_size=3, heads_per_ngram=8,
    ngram_vocab_size_base=20_000, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=4, indexer_n_heads=4,
    indexer_kv_heads=1, indexer_head_dim=64, indexer_budget=512, indexer_compress_ratio=4, output_gate_type="sigmoid",
    eos_token_id=1, max_position_embeddings=65536,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)],
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10]},
)


def qwen4_checkpoint(workdir: Path) -> Path:
    """Write (once) a random QWEN4-shaped `qwen4_exp` checkpoint (nested, a tiny vision tower beside it) with
    transformers' own classes and an MTP head under the shipped `mtp.*` names (tests/qwen4_checkpoint.py builds both;
    torch and transformers are test-only). Its attention layers are named `full_attention`, as the released config
    names them (transformers writes `indexed_attention`, which mlx-vlm 0.7.10 refuses; both read `full_attention`)."""
    out = Path(workdir) / "qwen4"
    if (out / "config.json").is_file():
        return out
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from qwen4_checkpoint import build, patch_config

    build(out, nested=True, ple_layer_ids=QWEN4["ple_layer_ids"], mtp=True,
          **{k: v for k, v in QWEN4.items() if k != "ple_layer_ids"})
    patch_config(out, layer_types=QWEN4["layer_types"])
    return out


CHECKPOINTS = {"bundled": lambda workdir: BUNDLED_MODEL, "large": large_checkpoint, "moe": moe_checkpoint,
               "real27": lambda workdir: _random_checkpoint(workdir, "real27", REAL27), "qwen4": qwen4_checkpoint}


def checkpoint(name: str, workdir: Path) -> Path:
    return CHECKPOINTS[name](workdir)
