"""Prompts with images for `qwen3_5` checkpoints that carry a vision tower: the tower loaded from the checkpoint,
each image's placeholder token expanded to one token per merged patch block, the images' embeddings put in place
of those tokens, and the 3-D (time, height, width) rotary positions of transformers' `get_rope_index`.

Positions: text tokens count on from the previous token; an image's tokens sit at (p, p + row, p + column) where p
is the position after the text before it, and the text after an image resumes at p + max(rows, columns). Every
later token is at its index plus `delta` (the last position + 1 - the prompt's length), in all three streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np
from PIL import Image

from hetero.cache import ModelCache
from hetero.errors import HeteroError
from hetero.models.qwen3_5 import Model
from hetero.models.qwen3_5_vision.args import VisionArgs
from hetero.models.qwen3_5_vision.model import VisionModel, load_vision, vision_name
from hetero.models.qwen3_5_vision.preprocess import ImageProcessor


@dataclass
class ImagePrompt:
    """A prompt ready for prefill: token ids with expanded image placeholders [S], the images' embeddings
    [image tokens, hidden] in order, the rotary positions [3, S] and the position shift of every later token."""

    tokens: list[int]
    image_embeddings: mx.array
    positions: np.ndarray
    delta: int


def has_tower(config: dict) -> bool:
    """Whether a checkpoint's config describes a vision tower (`qwen3_5` with `vision_config`)."""
    return isinstance(config.get("vision_config"), dict) and "image_token_id" in config


def load_tower(path: Path, config: dict, dtype: mx.Dtype = mx.float32) -> VisionModel:
    """The vision tower of the checkpoint in `path` (its `model.visual.*` or `vision_tower.*` tensors)."""
    if not has_tower(config):
        raise HeteroError("this checkpoint has no vision tower (no vision_config): it cannot read images")
    weights = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        weights.update({k: v for k, v in mx.load(str(file)).items() if vision_name(k) is not None})
    if not weights:
        raise HeteroError(f"{path}: config.json has a vision_config but no vision tensors are stored; re-download it")
    return load_vision(VisionArgs.from_config(config["vision_config"]), weights, dtype)


def expand_placeholders(tokens: Sequence[int], image_token: int, counts: Sequence[int]) -> list[int]:
    """Each image placeholder token (one per image, in order) -> `counts[i]` copies of it."""
    found = sum(1 for t in tokens if t == image_token)
    if found != len(counts):
        raise HeteroError(f"the prompt has {found} image placeholder(s) for {len(counts)} image(s)")
    out, images = [], iter(counts)
    for t in tokens:
        out.extend([t] * next(images) if t == image_token else [t])
    return out


def rope_positions(tokens: Sequence[int], image_token: int, grids: Sequence[Sequence[int]], merge: int
                   ) -> tuple[np.ndarray, int]:
    """(positions [3, S] int, delta) for expanded `tokens` with images of `grids` ((t, h, w) in patches)."""
    positions = np.zeros((3, len(tokens)), dtype=np.int64)
    pos, i, images = 0, 0, iter(grids)
    while i < len(tokens):
        if tokens[i] != image_token:
            positions[:, i] = pos
            pos, i = pos + 1, i + 1
            continue
        t, h, w = next(images)
        h, w = h // merge, w // merge
        tt, rows, cols = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        n = t * h * w
        positions[:, i : i + n] = np.stack([tt.ravel(), rows.ravel(), cols.ravel()]) + pos
        pos, i = pos + max(h, w), i + n
    return positions, int(positions.max(initial=-1)) + 1 - len(tokens)


def build_prompt(tower: VisionModel, processor: ImageProcessor, config: dict, tokens: Sequence[int],
                 images: Sequence[Image.Image]) -> ImagePrompt:
    """Token ids with one image placeholder per image (as the chat template writes them) and the decoded images
    -> the prompt with its placeholders expanded, the images encoded and the 3-D positions computed."""
    merge = tower.args.spatial_merge_size
    patches, grids = zip(*(processor(image) for image in images)) if images else ((), ())
    counts = [t * h * w // merge**2 for t, h, w in grids]
    expanded = expand_placeholders(tokens, config["image_token_id"], counts)
    embeddings = tower(mx.array(np.concatenate(patches)), grids) if images else mx.zeros((0, 1))
    positions, delta = rope_positions(expanded, config["image_token_id"], grids, merge)
    return ImagePrompt(expanded, embeddings, positions, delta)


def prefill(model: Model, prompt: ImagePrompt, image_token: int, cache: ModelCache) -> tuple[mx.array, mx.array]:
    """The whole prompt in one pass -> (logits [1, S, vocab], post-norm hidden [1, S, hidden])."""
    tokens = mx.array([prompt.tokens])  # [1, S]
    embeds = model.model.embed_tokens(tokens)  # [1, S, hidden]
    where = np.flatnonzero(np.array(prompt.tokens) == image_token)
    if len(where):
        embeds[0, mx.array(where)] = prompt.image_embeddings.astype(embeds.dtype)
    hidden = model.model(tokens, cache.backbone, embeddings=embeds, positions=mx.array(prompt.positions))
    return model.logits(hidden), hidden


def greedy(model: Model, prompt: ImagePrompt, image_token: int, max_tokens: int, eos: Sequence[int] = ()
           ) -> list[int]:
    """Greedy continuation of a prompt with images (plain decoding, every step at its shifted position)."""
    cache = model.make_cache()
    logits, _ = prefill(model, prompt, image_token, cache)
    out: list[int] = []
    token = int(mx.argmax(logits[0, -1]).item())
    while True:
        out.append(token)
        if len(out) >= max_tokens or token in eos:
            return out
        position = len(prompt.tokens) + len(out) - 1 + prompt.delta
        step = mx.array([[position]] * 3)  # [3, 1]
        logits = model.logits(model.model(mx.array([[token]]), cache.backbone, positions=step))  # [1, 1, vocab]
        token = int(mx.argmax(logits[0, -1]).item())
