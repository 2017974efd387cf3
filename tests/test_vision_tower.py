"""The MLX vision tower and image preprocessing against transformers' `Qwen3_5VisionModel` and its own
`Qwen2VLImageProcessor`, on tiny random checkpoints of two tower layouts, square and non-square images."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from PIL import Image

from hetero.errors import HeteroError
from hetero.models.qwen3_5_vision.args import VisionArgs
from hetero.models.qwen3_5_vision.model import load_vision
from hetero.models.qwen3_5_vision.preprocess import ImageProcessor, decode_image
from tests.vision_checkpoint import LAYOUTS, draw_image, encoded, hf_processor, save_vl

SIZES = [(64, 64), (80, 48)]  # (width, height): square, and non-square (both resized to other grids)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"vl-{request.param}")
    model = save_vl(path, request.param)
    args = VisionArgs.from_config(json.loads((path / "config.json").read_text())["vision_config"])
    return path, model, args


def hf_tower(model, pixel_values: np.ndarray, grid) -> np.ndarray:
    with torch.no_grad():
        out = model.model.visual(torch.tensor(pixel_values), grid_thw=torch.tensor([grid]))
    return out.pooler_output.numpy()


@pytest.mark.parametrize("size", SIZES)
def test_tower_matches_transformers(checkpoint, size):
    path, model, args = checkpoint
    tower = load_vision(args, mx.load(str(path / "model.safetensors")))
    pixels, grid = ImageProcessor.from_checkpoint(path)(draw_image(*size))
    ours = np.array(tower(mx.array(pixels), [grid]))
    ref = hf_tower(model, pixels, grid)
    assert ours.shape == ref.shape == (grid[1] * grid[2] // args.merge_unit, 64)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_two_images_encode_independently(checkpoint):
    path, model, args = checkpoint
    tower = load_vision(args, mx.load(str(path / "model.safetensors")))
    proc = ImageProcessor.from_checkpoint(path)
    (a, ga), (b, gb) = proc(draw_image(*SIZES[0], seed=1)), proc(draw_image(*SIZES[1], seed=2))
    both = np.array(tower(mx.array(np.concatenate([a, b])), [ga, gb]))
    ref = np.concatenate([hf_tower(model, a, ga), hf_tower(model, b, gb)])
    np.testing.assert_allclose(both, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_video_frames_use_the_temporal_patch(checkpoint):
    """t = 2 frames: the temporal half of the patch embedding and per-frame attention both matter."""
    path, model, args = checkpoint
    tower = load_vision(args, mx.load(str(path / "model.safetensors")))
    pixels, (_, h, w) = ImageProcessor.from_checkpoint(path)(draw_image(*SIZES[1]))
    rng = np.random.default_rng(0)
    frames = np.concatenate([pixels, pixels + 0.1 * rng.standard_normal(pixels.shape, dtype=np.float32)])
    ours = np.array(tower(mx.array(frames), [(2, h, w)]))
    ref = hf_tower(model, frames, (2, h, w))
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_mlx_vlm_naming_loads_the_same_tower(checkpoint):
    """mlx-vlm's conversions: `vision_tower.*`, the patch embedding channels-last [D, T, P, P, C]."""
    path, _, args = checkpoint
    weights = mx.load(str(path / "model.safetensors"))
    converted = {}
    for key, value in weights.items():
        if key.startswith("model.visual."):
            key = "vision_tower." + key[len("model.visual."):]
            if key.endswith("patch_embed.proj.weight"):
                value = value.transpose(0, 2, 3, 4, 1)
        converted[key] = value
    pixels, grid = ImageProcessor.from_checkpoint(path)(draw_image(*SIZES[1]))
    hf_layout = np.array(load_vision(args, weights)(mx.array(pixels), [grid]))
    mlx_layout = np.array(load_vision(args, converted)(mx.array(pixels), [grid]))
    np.testing.assert_array_equal(mlx_layout, hf_layout)


def test_missing_tower_weights_are_one_clear_error(checkpoint):
    path, _, args = checkpoint
    weights = {k: v for k, v in mx.load(str(path / "model.safetensors")).items() if "merger" not in k}
    with pytest.raises(HeteroError, match="vision tower does not match"):
        load_vision(args, weights)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
@pytest.mark.parametrize("size", SIZES + [(37, 101)])
def test_preprocessing_equals_transformers_processor(checkpoint, fmt, size):
    path = checkpoint[0]
    image = decode_image(encoded(draw_image(*size), fmt))
    ref = hf_processor(path)(images=[image], return_tensors="np")
    pixels, grid = ImageProcessor.from_checkpoint(path)(image)
    assert [list(grid)] == ref["image_grid_thw"].tolist()
    np.testing.assert_array_equal(pixels, ref["pixel_values"])


def test_transparency_is_composed_over_white(checkpoint):
    path = checkpoint[0]
    image = decode_image(encoded(draw_image(48, 40, mode="RGBA"), "PNG"))
    ref = hf_processor(path)(images=[image], return_tensors="np")
    np.testing.assert_array_equal(ImageProcessor.from_checkpoint(path)(image)[0], ref["pixel_values"])


def test_large_images_are_resized_within_max_pixels(checkpoint):
    path = checkpoint[0]
    proc = ImageProcessor.from_checkpoint(path)
    ref = hf_processor(path)(images=[draw_image(300, 200)], return_tensors="np")
    pixels, (_, h, w) = proc(draw_image(300, 200))
    assert h * w * proc.patch_size**2 <= proc.max_pixels
    assert [[1, h, w]] == ref["image_grid_thw"].tolist()
    np.testing.assert_array_equal(pixels, ref["pixel_values"])


def test_bad_images_are_one_clear_error():
    with pytest.raises(HeteroError, match="not recognised"):
        decode_image(b"this is not an image")
    with pytest.raises(HeteroError, match="format GIF is not supported"):
        decode_image(encoded(draw_image(16, 16), "GIF"))
    with pytest.raises(HeteroError, match="damaged"):
        decode_image(encoded(draw_image(64, 64), "PNG")[:200])
    with pytest.raises(HeteroError, match="above 1000 pixels"):
        decode_image(encoded(draw_image(64, 64), "PNG"), max_pixels=1000)
    with pytest.raises(HeteroError, match="aspect ratio"):
        ImageProcessor()(Image.new("RGB", (1, 300)))


def test_bfloat16_tower_stays_bfloat16_and_near_float32(checkpoint):
    """A Mac loads the tower in bf16: activations stay bf16 (the rotary angles alone in fp32) and the result stays
    within bf16's precision of the fp32 tower."""
    path, _, args = checkpoint
    weights = mx.load(str(path / "model.safetensors"))
    pixels, grid = ImageProcessor.from_checkpoint(path)(draw_image(*SIZES[1]))
    full = np.array(load_vision(args, weights)(mx.array(pixels), [grid]))
    half = load_vision(args, weights, mx.bfloat16)(mx.array(pixels), [grid])
    assert half.dtype == mx.bfloat16
    np.testing.assert_allclose(np.array(half.astype(mx.float32)), full, atol=0.05 * np.abs(full).max())
