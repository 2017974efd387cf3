"""A checkpoint's eyes for the engine: its vision tower and image processor (loaded on first use), the text that
stands for one image in a prompt, and images (file bytes or Pillow images) -> an `ImagePrompt` ready to prefill."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
from PIL import Image

from hetero.checkpoint.tokenizer import Tokenizer
from hetero.errors import HeteroError
from hetero.models.qwen3_5_vision.model import VisionModel
from hetero.models.qwen3_5_vision.preprocess import ImageProcessor, decode_image
from hetero.vision.prompt import ImagePrompt, has_tower, load_tower, plan_prompt

ImageInput = bytes | Image.Image  # an image file's bytes (PNG / JPEG / WebP) or a decoded image


class Vision:
    """The vision side of one checkpoint (`qwen3_5` with a `vision_config`)."""

    def __init__(self, path: Path, config: dict, tokenizer: Tokenizer, dtype: mx.Dtype = mx.float32):
        self.path, self.config, self.dtype = Path(path), config, dtype
        self.image_token = int(config["image_token_id"])
        self.processor = ImageProcessor.from_checkpoint(path)
        self._tower: VisionModel | None = None
        self._tokenizer = tokenizer

    @property
    def marker_ids(self) -> list[int]:
        """The token ids of one image's marker: vision start, the image token, vision end."""
        ids = [self.config.get("vision_start_token_id"), self.image_token, self.config.get("vision_end_token_id")]
        return [i for i in ids if isinstance(i, int)]

    @property
    def marker(self) -> str:
        """What the chat template writes for one image: vision start, the image token, vision end."""
        ids = self.marker_ids
        text = self._tokenizer.decode(ids)
        if self._tokenizer.encode(text) != ids:
            raise HeteroError(f"{self.path}: the tokenizer does not read {text!r} back as the image tokens {ids}; "
                              "re-download its tokenizer files")
        return text

    @classmethod
    def of(cls, path: Path, config: dict, tokenizer: Tokenizer, dtype: mx.Dtype = mx.float32) -> "Vision | None":
        """The checkpoint's vision side, or None for a text-only checkpoint."""
        return cls(path, config, tokenizer, dtype) if has_tower(config) else None

    @property
    def tower(self) -> VisionModel:
        """The tower, read from the checkpoint's files on the first image."""
        if self._tower is None:
            tower = load_tower(self.path, self.config, self.dtype)
            if tower.args.spatial_merge_size != self.processor.merge_size:
                raise HeteroError(f"{self.path}: preprocessor_config.json merges {self.processor.merge_size} patches "
                                  f"a side but the tower {tower.args.spatial_merge_size}; fix the checkpoint's files")
            self._tower = tower
        return self._tower

    def plan(self, ids: Sequence[int], images: Sequence[ImageInput]) -> ImagePrompt:
        """Token ids with one image token per image -> the prompt with its placeholders expanded and its images
        preprocessed (not encoded yet: `encode`). A damaged or unsupported image is a one-line HeteroError."""
        decoded = [as_image(image, i) for i, image in enumerate(images)]
        return plan_prompt(self.processor, self.config, ids, decoded)

    def encode(self, prompt: ImagePrompt, start: int = 0) -> None:
        """Run the tower over the prompt's images that have tokens at or after `start`."""
        prompt.encode(self.tower, start)


def as_image(image: ImageInput, index: int = 0) -> Image.Image:
    """File bytes or a Pillow image -> a decoded Pillow image (errors name the image by its index)."""
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, (bytes, bytearray, memoryview)):
        try:
            return decode_image(bytes(image))
        except HeteroError as e:
            raise HeteroError(f"image {index}: {e}") from None
    raise HeteroError(f"image {index} is a {type(image).__name__}: give the file's bytes or a PIL image")


def read_images(files: list[str] | None) -> list:
    """`hetero run --image` files as decoded images, in order; one that cannot be read or is no PNG / JPEG / WebP
    image is refused in one line that names it."""
    images = []
    for name in files or []:
        try:
            images.append(decode_image(Path(name).read_bytes()))
        except OSError as e:
            raise HeteroError(f"--image {name}: cannot read it ({e.strerror or e})") from None
        except HeteroError as e:
            raise HeteroError(f"--image {name}: {e}") from None
    return images
