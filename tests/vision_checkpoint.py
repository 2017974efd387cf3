"""Tiny random `qwen3_5` vision-language checkpoints written by transformers (`save_pretrained`), with the
`preprocessor_config.json` of transformers' `Qwen2VLImageProcessor`, and test images drawn with Pillow.

Test-only: imports torch and transformers. Two tower layouts differ in every shape the tower has (width, heads,
patch size, position table, activation), so a layout assumption in the MLX tower fails one of them.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tests.helpers import HIDDEN, INTERVAL, TEXT, VOCAB, randomize_

LAYOUTS = {
    "small": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, num_position_embeddings=16, hidden_act="gelu_pytorch_tanh"),
    "wide": dict(depth=2, hidden_size=48, intermediate_size=96, num_heads=4, patch_size=8, temporal_patch_size=2,
                 spatial_merge_size=2, num_position_embeddings=36, hidden_act="gelu"),
}
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = VOCAB - 4, VOCAB - 3, VOCAB - 2, VOCAB - 1


def save_vl(path: Path, layout: str, seed: int = 3, max_pixels: int = 64 * 64):
    """Write a `qwen3_5` checkpoint with the `layout` tower and its processor config; returns the HF model."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(**TEXT, full_attention_interval=INTERVAL, tie_word_embeddings=False, rope_parameters={
        "rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [2, 3, 3], "mrope_interleaved": True,
    })
    vision = dict(LAYOUTS[layout], out_hidden_size=HIDDEN)
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False,
                           image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
                           vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    model = Qwen3_5ForConditionalGeneration(config).float().eval()
    randomize_(model, seed)
    with torch.no_grad():  # LayerNorms near 1 (randomize_ treats them as zero-centred), biases that matter
        for name, p in model.model.visual.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape))
    model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["full_attention_interval"] = INTERVAL
    (path / "config.json").write_text(json.dumps(config, indent=1))
    v = LAYOUTS[layout]
    (path / "preprocessor_config.json").write_text(json.dumps(dict(
        image_processor_type="Qwen2VLImageProcessor", do_resize=True, do_rescale=True, rescale_factor=1 / 255,
        do_normalize=True, do_convert_rgb=True, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
        resample=3, patch_size=v["patch_size"], temporal_patch_size=v["temporal_patch_size"],
        merge_size=v["spatial_merge_size"], size={"shortest_edge": 16 * 16, "longest_edge": max_pixels},
    ), indent=1))
    return model


def hf_processor(path: Path):
    """transformers' own image processor for the checkpoint (the PIL backend: no torchvision here)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = json.loads((path / "preprocessor_config.json").read_text())
    config.pop("image_processor_type")
    return Qwen2VLImageProcessorPil(**config)


def draw_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A smooth gradient with noise: resizing and every channel matter."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([255 * x / width, 255 * y / height, 128 + 100 * np.sin((x + y) / 5)], axis=-1)
    pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    if mode == "RGBA":
        image.putalpha(Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8)))
    return image


def encoded(image: Image.Image, fmt: str) -> bytes:
    """The image as a PNG / JPEG / WEBP file's bytes."""
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


SPECIALS = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>", IMAGE_TOKEN: "<|image_pad|>",
            VIDEO_TOKEN: "<|video_pad|>", VISION_START: "<|vision_start|>", VISION_END: "<|vision_end|>"}


def save_chat_tokenizer(path: Path) -> None:
    """A character-level tokenizer that fits the checkpoint's 256-token vocabulary, written as sentencepiece-style
    BPE (space as "▁", newline by byte fallback): printable ASCII and `<0x0A>` at 3..98, `<unk>` at 99, two-letter
    pieces (which encoding never makes, but decoding names) up to 251, ChatML and Qwen's vision special tokens at
    their config ids, and the ChatML template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    from hetero.training.tokenizer_train import CHAT_TEMPLATE

    chars = ["\u2581" if c == 32 else chr(c) for c in range(32, 127)] + ["<0x0A>"]
    chars += ["<unk>"] + [a + b for a in "etaoinshr" for b in "etaoinshrdlucmfwyp"]  # 2-letter words up to 251
    vocab = {**{t: i for i, t in SPECIALS.items()}, **{c: 3 + i for i, c in enumerate(chars[: IMAGE_TOKEN - 3])}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS.values()])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )))


def add_mtp_head(path: Path, seed: int = 5) -> None:
    """Add a random MTP head (`mtp.*`, released checkpoints' naming) to a `save_vl` checkpoint."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((path / "config.json").read_text())
    text = config["text_config"]
    h, heads, kv, d, inter = (text[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                 "head_dim", "intermediate_size"))
    rng = np.random.default_rng(seed)
    proj = lambda rows, cols: (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)  # noqa: E731
    norm = lambda n: (0.3 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    layer = "mtp.layers.0."
    mtp = {"mtp.fc.weight": proj(h, 2 * h), "mtp.pre_fc_norm_embedding.weight": norm(h),
           "mtp.pre_fc_norm_hidden.weight": norm(h), "mtp.norm.weight": norm(h),
           layer + "input_layernorm.weight": norm(h), layer + "post_attention_layernorm.weight": norm(h),
           layer + "self_attn.q_proj.weight": proj(2 * heads * d, h), layer + "self_attn.k_proj.weight": proj(kv * d, h),
           layer + "self_attn.v_proj.weight": proj(kv * d, h), layer + "self_attn.o_proj.weight": proj(h, heads * d),
           layer + "self_attn.q_norm.weight": norm(d), layer + "self_attn.k_norm.weight": norm(d),
           layer + "mlp.gate_proj.weight": proj(inter, h), layer + "mlp.up_proj.weight": proj(inter, h),
           layer + "mlp.down_proj.weight": proj(h, inter)}
    weights = load_file(str(path / "model.safetensors"))
    save_file({**weights, **mtp}, str(path / "model.safetensors"), metadata={"format": "pt"})
    text["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=1))
