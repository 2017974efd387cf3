"""Prompts with images for `qwen3_5` checkpoints that carry a vision tower: the tower loaded from the checkpoint,
each image's placeholder token expanded to one token per merged patch block, the images' embeddings put in place
of those tokens, and the 3-D (time, height, width) rotary positions of transformers' `get_rope_index`.

Positions: text tokens count on from the previous token; an image's tokens sit at (p, p + row, p + column) where p
is the position after the text before it, and the text after an image resumes at p + max(rows, columns). Every
later token is at its index plus `delta` (the last position + 1 - the prompt's length), in all three streams.

Caches: the prefix and session caches key an image's tokens by content keys drawn from a digest of its preprocessed
pixels (`ImagePrompt.cache_keys`), so the same image restores and another of the same size never matches; the tower
runs only over images with tokens after the restored prefix (`ImagePrompt.encode`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np
from PIL import Image

from hetero.errors import HeteroError
from hetero.models.cache import ModelCache
from hetero.models.interface import CausalLM
from hetero.models.qwen3_5_vision.args import VisionArgs
from hetero.models.qwen3_5_vision.model import VisionModel, load_vision, vision_name
from hetero.models.qwen3_5_vision.preprocess import ImageProcessor


IMAGE_KEY_BASE = 2**30  # cache keys of image tokens lie in [2^30, 2^31): above any vocabulary, within int32


@dataclass
class ImagePrompt:
    """A prompt ready for prefill: token ids with expanded image placeholders [S], the rotary positions [3, S] and
    the position shift of every later token; per image its patches, grid (t, h, w), token span [lo, hi), pixel
    digest and, once `encode` ran over it, its embeddings [tokens, hidden]."""

    tokens: list[int]
    positions: np.ndarray
    delta: int
    patches: list[np.ndarray]
    grids: list[tuple[int, int, int]]
    spans: list[tuple[int, int]]
    digests: list[str]
    embeddings: list[mx.array | None]

    @property
    def image_embeddings(self) -> mx.array:
        """Every image's embeddings in order [image tokens, hidden] (all must be encoded)."""
        if any(e is None for e in self.embeddings):
            raise ValueError("encode the images first")
        return mx.concatenate(self.embeddings) if self.embeddings else mx.zeros((0, 1))

    def encode(self, tower: VisionModel, start: int = 0) -> None:
        """Run the tower over the images that have tokens at or after `start` (those before come from a cache)."""
        for i, (lo, hi) in enumerate(self.spans):
            if hi > start and self.embeddings[i] is None:
                self.encode_image(tower, i)

    def encode_image(self, tower: VisionModel, i: int) -> None:
        """Run the tower over image i."""
        self.embeddings[i] = tower(mx.array(self.patches[i]), [self.grids[i]])  # [tokens, out_hidden]
        mx.eval(self.embeddings[i])

    def cache_keys(self) -> list[int]:
        """The tokens as the prefix and session caches key them: each image token replaced by a key drawn from its
        image's pixel digest and its index in the image, so the same image matches and another never does."""
        keys = list(self.tokens)
        for (lo, hi), digest in zip(self.spans, self.digests):
            keys[lo:hi] = content_keys(digest, hi - lo)
        return keys

    def inputs(self, embed, start: int, stop: int) -> tuple[mx.array, mx.array]:
        """Tokens [start, stop) -> (embeddings [1, S, hidden] with the images' rows in place, positions [3, S])."""
        pieces, at = [], start
        for (first, last), rows in zip(self.spans, self.embeddings):
            lo, hi = max(first, start), min(last, stop)
            if lo >= hi:
                continue
            if rows is None:
                raise ValueError("encode the images first")
            if at < lo:
                pieces.append(embed(mx.array(self.tokens[at:lo])))  # [n, hidden]
            pieces.append(rows[lo - first : hi - first])  # [hi - lo, hidden]
            at = hi
        if at < stop:
            pieces.append(embed(mx.array(self.tokens[at:stop])))
        dtype = embed(mx.array(self.tokens[start : start + 1])).dtype  # the text embeddings' (compute) dtype
        h = mx.concatenate([p.astype(dtype) for p in pieces])[None]  # [1, S, hidden]
        return h, mx.array(self.positions[:, start:stop])


def content_keys(digest: str, n: int) -> list[int]:
    """n cache keys for the tokens of an image with pixel `digest`: each a hash of (digest, index) in
    [IMAGE_KEY_BASE, 2 * IMAGE_KEY_BASE)."""
    out = []
    for j in range(n):
        h = hashlib.blake2b(f"{digest}:{j}".encode(), digest_size=4).digest()
        out.append(IMAGE_KEY_BASE + int.from_bytes(h, "little") % IMAGE_KEY_BASE)
    return out


def pixel_digest(patches: np.ndarray, grid: Sequence[int]) -> str:
    """sha256 of the preprocessed pixels the tower reads and their grid."""
    return hashlib.sha256(np.asarray(grid, np.int64).tobytes() + np.ascontiguousarray(patches).tobytes()).hexdigest()


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


def plan_prompt(processor: ImageProcessor, config: dict, tokens: Sequence[int], images: Sequence[Image.Image]
                ) -> ImagePrompt:
    """Token ids with one image placeholder per image (as the chat template writes them) and the decoded images
    -> the prompt with its placeholders expanded and the 3-D positions computed; the images not encoded yet."""
    image_token, merge = config["image_token_id"], processor.merge_size
    patches, grids = zip(*(processor(image) for image in images)) if images else ((), ())
    counts = [t * h * w // merge**2 for t, h, w in grids]
    expanded = expand_placeholders(tokens, image_token, counts)
    positions, delta = rope_positions(expanded, image_token, grids, merge)
    spans, at = [], 0
    for n in counts:  # consecutive images share one run of image tokens: cut it by the counts
        lo = next(i for i in range(at, len(expanded)) if expanded[i] == image_token)
        spans.append((lo, lo + n))
        at = lo + n
    digests = [pixel_digest(p, g) for p, g in zip(patches, grids)]
    return ImagePrompt(expanded, positions, delta, list(patches), [tuple(g) for g in grids], spans, digests,
                       [None] * len(counts))


def build_prompt(tower: VisionModel, processor: ImageProcessor, config: dict, tokens: Sequence[int],
                 images: Sequence[Image.Image]) -> ImagePrompt:
    """`plan_prompt`, then every image encoded by the tower."""
    if images and processor.merge_size != tower.args.spatial_merge_size:
        raise HeteroError(f"preprocessor_config.json merges {processor.merge_size} patches a side but the tower "
                          f"{tower.args.spatial_merge_size}; fix the checkpoint's files")
    prompt = plan_prompt(processor, config, tokens, images)
    prompt.encode(tower)
    return prompt


def prefill(model: CausalLM, prompt: ImagePrompt, image_token: int, cache: ModelCache) -> tuple[mx.array, mx.array]:
    """The whole prompt in one pass -> (logits [1, S, vocab], post-norm hidden [1, S, hidden])."""
    embeds, positions = prompt.inputs(model.model.embed_tokens, 0, len(prompt.tokens))  # [1, S, hidden], [3, S]
    hidden = model.model(mx.array([prompt.tokens]), cache.backbone, embeddings=embeds, positions=positions)
    return model.logits(hidden), hidden


def greedy(model: CausalLM, prompt: ImagePrompt, image_token: int, max_tokens: int, eos: Sequence[int] = ()
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
