"""Tiny random Qwen4-Exp checkpoints written by transformers itself (test-only: imports torch and transformers).

QSA is active from a few dozen tokens (budget 8 tokens in blocks of 4), PLE sits on one or two GDN layers, the
streams, experts and n-gram tables are small so that a forward pass takes milliseconds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

torch.set_num_threads(1)

VOCAB = 320  # fits the byte-level BPE tokenizer of tiny_checkpoint (for the Engine test)
EOS = 1
TEXT = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
    hc_count=2, hc_lowrank=8, ple_embed_dim=16, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50,
    make_ngram_vocab_size_divisible_by=8, split_ngram_parts=2, indexer_n_heads=8, indexer_kv_heads=1,
    indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4, output_gate_type="sigmoid", eos_token_id=EOS,
    layer_types=["linear_attention", "linear_attention", "indexed_attention", "linear_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [2, 1, 1]},
)


def randomize_(model, seed: int) -> None:
    """Every parameter non-trivial: zero-centred norms get noise, the GDN decay spreads, projections ~1/sqrt(in)."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda shape: torch.randn(shape, generator=gen)  # noqa: E731
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(0.3 * randn(p.shape))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(math.log(0.05), math.log(5.0), generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(randn(p.shape))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * randn(p.shape))
            elif "ngram_embedding" in name:
                p.copy_(randn(p.shape))
            elif name.endswith("lm_head.weight"):
                p.copy_(2.0 * randn(p.shape) / math.sqrt(p.shape[1]))
            elif name.endswith(("embed_tokens.weight",)):
                p.copy_(0.5 * randn(p.shape))
            elif p.ndim >= 2:
                p.copy_(randn(p.shape) / math.sqrt(p.shape[-1]))


def build(path: Path, nested: bool = False, ple_layer_ids=(1, 2), seed: int = 0, **overrides):
    """Write a tiny checkpoint to `path`; returns the HF model (eval mode) for oracle logits."""
    from transformers import Qwen4ExpConfig, Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration, Qwen4ExpTextConfig

    torch.manual_seed(seed)
    text = dict(TEXT, ple_layer_ids=list(ple_layer_ids), **overrides)
    if nested:
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                      num_position_embeddings=16)
        config = Qwen4ExpConfig(text_config=text, vision_config=vision, image_token_id=90, video_token_id=91,
                                vision_start_token_id=92, vision_end_token_id=93)
        model = Qwen4ExpForConditionalGeneration(config)
    else:
        model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**text))
    randomize_(model, seed)
    model.eval()
    model.save_pretrained(path)
    return model


def hf_logits(model, tokens: list[int]):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def patch_config(path: Path, **updates) -> None:
    config = json.loads((path / "config.json").read_text())
    (config.get("text_config") or config).update(updates)
    (path / "config.json").write_text(json.dumps(config))


def add_tokenizer(path: Path) -> None:
    """The byte-level BPE tokenizer files of `tiny_checkpoint` (so `hetero.load` / `hetero run` take the folder)."""
    from converters.tokenizer_train import save_tokenizer, train_tokenizer
    from tiny_checkpoint import TEXT as CORPUS

    save_tokenizer(train_tokenizer([CORPUS] * 4, vocab_size=VOCAB), path)
