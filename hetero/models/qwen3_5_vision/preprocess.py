"""Image file bytes -> the tower's flattened patches, as transformers' `Qwen2VLImageProcessor` computes them:
decode (Pillow), RGB (alpha over white), resize (bicubic) to multiples of patch x merge within [min, max] pixels,
rescale and normalize, then patches in spatial-merge-block order, each repeated over the temporal patch."""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from hetero.errors import HeteroError

FORMATS = ("PNG", "JPEG", "WEBP")
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageProcessor:
    """The parameters of a checkpoint's `preprocessor_config.json` (defaults: transformers' Qwen2-VL processor)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    resample: int = 3  # PIL's BICUBIC
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD

    @classmethod
    def from_config(cls, config: dict) -> "ImageProcessor":
        """From a `preprocessor_config.json` dict: `size` {shortest_edge, longest_edge} or min/max_pixels."""
        size = config.get("size") or {}
        fields = {k: config[k] for k in cls.__dataclass_fields__ if k in config}
        fields["min_pixels"] = size.get("shortest_edge", config.get("min_pixels", cls.min_pixels))
        fields["max_pixels"] = size.get("longest_edge", config.get("max_pixels", cls.max_pixels))
        for key in ("image_mean", "image_std"):
            if key in fields:
                value = fields[key]
                fields[key] = tuple(value) if isinstance(value, (list, tuple)) else (value,) * 3
        return cls(**fields)

    @classmethod
    def from_checkpoint(cls, path: Path) -> "ImageProcessor":
        """The checkpoint directory's `preprocessor_config.json`, or the defaults where it has none."""
        file = Path(path) / "preprocessor_config.json"
        if not file.is_file():
            return cls()
        try:
            return cls.from_config(json.loads(file.read_text()))
        except (json.JSONDecodeError, TypeError) as e:
            raise HeteroError(f"{file}: not a valid image processor config ({e}); re-download it") from None

    @property
    def factor(self) -> int:
        """Image sides become multiples of this: one merged block of patches."""
        return self.patch_size * self.merge_size

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after resizing: multiples of `factor`, area within [min_pixels, max_pixels]."""
        if max(height, width) / min(height, width) > 200:
            raise HeteroError(f"image of {width}x{height}: its aspect ratio is above 200; crop it")
        f = self.factor
        h, w = round(height / f) * f, round(width / f) * f
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h, w

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """A Pillow image -> (patches [h*w, C*T*P*P] fp32, grid (1, h, w) in patches)."""
        rgb = to_rgb(image)
        height, width = self.target_size(rgb.height, rgb.width)
        pixels = np.asarray(rgb.resize((width, height), resample=self.resample))  # [H, W, 3] uint8
        x = pixels.transpose(2, 0, 1)  # [3, H, W]
        if self.do_rescale:  # as transformers: the product in float64, then float32
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        x = x.astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.image_mean, dtype=np.float32)[:, None, None]
            std = np.array(self.image_std, dtype=np.float32)[:, None, None]
            x = (x - mean) / std
        return self.patchify(x)

    def patchify(self, x: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """[C, H, W] -> patches [h*w, C*T*P*P] in merge-block order (each frame patch repeated T times)."""
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        c, height, width = x.shape
        gh, gw = height // p, width // p
        blocks = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
        blocks = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))  # [..., C, T, P, P]
        return np.ascontiguousarray(blocks.reshape(gh * gw, c * t * p * p), dtype=np.float32), (1, gh, gw)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB; an image with transparency is composed over white first, as transformers does."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


PNG_END = b"IEND\xaeB`\x82"  # the IEND chunk's type and CRC: the last 8 bytes of every whole PNG


def decode_image(data: bytes, max_pixels: int = 64_000_000) -> Image.Image:
    """PNG / JPEG / WebP bytes -> a decoded Pillow image; anything else or a damaged file is a HeteroError."""
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise HeteroError(f"image not recognised: send {', '.join(FORMATS)}") from None
    except Image.DecompressionBombError as e:  # Pillow's own guard, far above `max_pixels`
        raise HeteroError(f"image too large ({e}): send a smaller one") from None
    if image.format not in FORMATS:
        raise HeteroError(f"image format {image.format} is not supported: send {', '.join(FORMATS)}")
    if image.width * image.height > max_pixels:
        raise HeteroError(f"image of {image.width}x{image.height} is above {max_pixels} pixels: send a smaller one")
    try:
        image.load()
    except (OSError, ValueError, SyntaxError) as e:
        raise HeteroError(f"image data is damaged ({e}): send the file again") from None
    if image.format == "PNG" and PNG_END not in data[-64:]:  # Pillow decodes a PNG cut inside its last chunks
        raise HeteroError("image data is damaged (the PNG ends before its IEND chunk: it was cut short): send the "
                          "file again")
    return image
