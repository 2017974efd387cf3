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


def build(path: Path, nested: bool = False, ple_layer_ids=(1, 2), seed: int = 0, mtp: bool = False,
          mtp_fused_experts: bool = False, **overrides):
    """Write a tiny checkpoint to `path`; returns the HF model (eval mode) for oracle logits. With `mtp`, the
    checkpoint also carries a random MTP head under the shipped `mtp.*` names (`add_mtp`), which transformers
    itself neither builds nor loads."""
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
    if mtp:
        add_mtp(path, text, seed, mtp_fused_experts)
    return model


def mtp_tensors(text: dict, seed: int, fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors with the names and shapes the released Qwen4-Exp head ships (mlx-vlm 0.7.10 reads them:
    `speculative/drafters/qwen4_exp_mtp`): the two pre-fc norms (embedding [d], hidden [hc*d]), `fc_embedding` and
    `fc_hidden` [d, d], one QSA + MoE decoder layer with hyper-connections (`layers.0.*`, built here by transformers'
    own decoder layer so every name and shape is its) and the head's final mixer (`hyper_connection_mixer.*`).
    Experts per expert (as save_pretrained writes the backbone's), or fused `gate_up_proj` / `down_proj`."""
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import (Qwen4ExpTextDecoderLayer, Qwen4ExpTextGatedResidual,
                                                                  Qwen4ExpTextRMSNorm)

    config = Qwen4ExpTextConfig(**dict(text, num_hidden_layers=1, layer_types=["indexed_attention"], ple_layer_ids=[]))
    d = config.hidden_size
    head = torch.nn.Module()
    head.pre_fc_norm_embedding = Qwen4ExpTextRMSNorm(d, eps=config.rms_norm_eps)
    head.pre_fc_norm_hidden = Qwen4ExpTextRMSNorm(config.hc_count * d, eps=config.rms_norm_eps)
    head.fc_embedding = torch.nn.Linear(d, d, bias=False)
    head.fc_hidden = torch.nn.Linear(d, d, bias=False)
    head.layers = torch.nn.ModuleList([Qwen4ExpTextDecoderLayer(config, 0)])
    head.hyper_connection_mixer = Qwen4ExpTextGatedResidual(config, use_combine=False)
    randomize_(head, seed + 1000)
    out = {}
    for name, value in head.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj") and not fused_experts:  # [E, 2I, d]: gate rows, then up rows
            base, half = name[: -len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"mtp.{base}{e}.gate_proj.weight"] = value[e, :half]
                out[f"mtp.{base}{e}.up_proj.weight"] = value[e, half:]
        elif name.endswith("mlp.experts.down_proj") and not fused_experts:  # [E, d, I]
            base = name[: -len("down_proj")]
            for e in range(value.shape[0]):
                out[f"mtp.{base}{e}.down_proj.weight"] = value[e]
        else:
            out[f"mtp.{name}"] = value
    return {k: v.detach().contiguous() for k, v in out.items()}


def add_mtp(path: Path, text: dict, seed: int, fused_experts: bool = False) -> None:
    """Write `mtp_tensors` into the saved checkpoint (its single file, or a new shard listed in the index) and
    declare the head in config.json (`mtp_num_hidden_layers`)."""
    from safetensors.torch import load_file, save_file

    tensors = mtp_tensors(text, seed, fused_experts)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        save_file(tensors, path / "mtp.safetensors", metadata={"format": "pt"})
        data = json.loads(index.read_text())
        data["weight_map"].update({k: "mtp.safetensors" for k in tensors})
        index.write_text(json.dumps(data))
    else:
        save_file({**load_file(path / "model.safetensors"), **tensors}, path / "model.safetensors", metadata={"format": "pt"})
    patch_config(path, mtp_num_hidden_layers=1)


def hf_logits(model, tokens: list[int]):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def patch_config(path: Path, **updates) -> None:
    config = json.loads((path / "config.json").read_text())
    (config.get("text_config") or config).update(updates)
    (path / "config.json").write_text(json.dumps(config))


def add_tokenizer(path: Path) -> None:
    """The byte-level BPE tokenizer files of `tiny_checkpoint` (so `hetero.load` / `hetero run` take the folder)."""
    from hetero.training.tokenizer_train import save_tokenizer, train_tokenizer
    from tiny_checkpoint import TEXT as CORPUS

    save_tokenizer(train_tokenizer([CORPUS] * 4, vocab_size=VOCAB), path)
