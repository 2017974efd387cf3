"""A prompt with images through the library against transformers' `Qwen3_5ForConditionalGeneration` fed its own
processor's inputs: the last position's logits and the greedy continuation, on tiny random checkpoints of two
tower layouts with a square and a non-square image; text-only prompts keep their exact positions."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch

from hetero.checkpoint.loader import load_model
from hetero.errors import HeteroError
from hetero.models.qwen3_5_vision.preprocess import ImageProcessor
from hetero.vision.prompt import build_prompt, expand_placeholders, greedy, load_tower, prefill, rope_positions
from tests.helpers import random_tokens
from tests.vision_checkpoint import (IMAGE_TOKEN, LAYOUTS, VISION_END, VISION_START, draw_image, hf_processor,
                                     save_vl)

SIZES = [(64, 64), (80, 48)]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"vlm-{request.param}")
    hf = save_vl(path, request.param)
    model, _, config = load_model(path)
    return path, hf, model, config, load_tower(path, config)


def chat(n_images: int, seed: int) -> list[int]:
    """Text, then each image between its vision start/end tokens, then text (one placeholder per image)."""
    text = lambda n, s: [t % IMAGE_TOKEN for t in random_tokens(n, s)]  # noqa: E731  (no stray special tokens)
    tokens = text(7, seed)
    for i in range(n_images):
        tokens += [VISION_START, IMAGE_TOKEN, VISION_END] + text(3 + i, seed + 1 + i)
    return tokens


def hf_inputs(path, tokens: list[int], images) -> dict:
    """What transformers' processor gives the model: expanded image tokens, pixel values, grids, token types."""
    processed = hf_processor(path)(images=images, return_tensors="pt") if images else {}
    counts = [int(g.prod()) // 4 for g in processed["image_grid_thw"]] if images else []
    ids = torch.tensor([expand_placeholders_hf(tokens, counts)])
    inputs = dict(input_ids=ids, mm_token_type_ids=(ids == IMAGE_TOKEN).int())
    if images:
        inputs.update(pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"])
    return inputs


def expand_placeholders_hf(tokens: list[int], counts: list[int]) -> list[int]:
    """The processor's own expansion, written out independently of hetero's."""
    out, k = [], 0
    for t in tokens:
        if t == IMAGE_TOKEN:
            out += [IMAGE_TOKEN] * counts[k]
            k += 1
        else:
            out.append(t)
    return out


def last_logits_close(ours: np.ndarray, ref: np.ndarray) -> None:
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("sizes", [[SIZES[0]], [SIZES[1]], SIZES], ids=["square", "non-square", "two-images"])
def test_logits_and_greedy_match_transformers(checkpoint, sizes):
    path, hf, model, config, tower = checkpoint
    images = [draw_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    tokens = chat(len(images), seed=11)
    prompt = build_prompt(tower, ImageProcessor.from_checkpoint(path), config, tokens, images)
    inputs = hf_inputs(path, tokens, images)
    assert prompt.tokens == inputs["input_ids"][0].tolist()
    logits, _ = prefill(model, prompt, IMAGE_TOKEN, model.make_cache())
    with torch.no_grad():
        ref = hf(**inputs).logits[0, -1].numpy()
    last_logits_close(np.array(logits[0, -1]), ref)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert greedy(model, prompt, IMAGE_TOKEN, max_tokens=8) == out[0, len(prompt.tokens):].tolist()


def test_image_positions_follow_transformers_rope_index(checkpoint):
    path, hf, model, config, tower = checkpoint
    images = [draw_image(*SIZES[1]), draw_image(*SIZES[0], seed=1)]
    tokens = chat(2, seed=3)
    prompt = build_prompt(tower, ImageProcessor.from_checkpoint(path), config, tokens, images)
    inputs = hf_inputs(path, tokens, images)
    ref, ref_delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    np.testing.assert_array_equal(prompt.positions, ref[:, 0].numpy())
    assert prompt.delta == int(ref_delta[0, 0]) < 0  # the image's block takes fewer positions than tokens


def test_text_only_prompts_keep_their_positions(checkpoint):
    """No image: the 3-D positions are the token indices, and the logits equal the plain text path's."""
    path, hf, model, config, tower = checkpoint
    tokens = chat(0, seed=5)
    prompt = build_prompt(tower, ImageProcessor.from_checkpoint(path), config, tokens, [])
    assert prompt.delta == 0 and (prompt.positions == np.arange(len(tokens))).all()
    with_positions, _ = prefill(model, prompt, IMAGE_TOKEN, model.make_cache())
    plain, _ = model(mx.array([tokens]), model.make_cache())
    np.testing.assert_allclose(np.array(with_positions), np.array(plain), rtol=1e-5, atol=1e-5)


def test_placeholder_count_must_match_the_images():
    with pytest.raises(HeteroError, match="1 image placeholder"):
        expand_placeholders([1, IMAGE_TOKEN, 2], IMAGE_TOKEN, [4, 4])
    positions, delta = rope_positions([1, IMAGE_TOKEN, IMAGE_TOKEN, 2], IMAGE_TOKEN, [(1, 2, 4)], merge=2)
    assert positions.tolist() == [[0, 1, 1, 3], [0, 1, 1, 3], [0, 1, 2, 3]] and delta == 0


def test_checkpoint_without_a_tower_is_one_clear_error(tmp_path):
    from tests.helpers import save_flat

    save_flat(tmp_path, tie=False)
    with pytest.raises(HeteroError, match="no vision tower"):
        load_tower(tmp_path, json.loads((tmp_path / "config.json").read_text()))


def test_tower_nested_under_the_language_model_loads(checkpoint, tmp_path):
    """Some conversions store the tower as `model.language_model.visual.*` (mlx-vlm reads that name too): both the
    text model (which skips it) and the tower load, and the prompt's logits are unchanged."""
    import shutil

    path, hf, model, config, tower = checkpoint
    weights = {k.replace("model.visual.", "model.language_model.visual.", 1): v
               for k, v in mx.load(str(path / "model.safetensors")).items()}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(path / name, tmp_path / name)
    moved_model, _, _ = load_model(tmp_path)
    moved_tower = load_tower(tmp_path, config)
    images, tokens = [draw_image(*SIZES[1])], chat(1, seed=2)
    proc = ImageProcessor.from_checkpoint(path)
    before = prefill(model, build_prompt(tower, proc, config, tokens, images), IMAGE_TOKEN, model.make_cache())[0]
    prompt = build_prompt(moved_tower, proc, config, tokens, images)
    after = prefill(moved_model, prompt, IMAGE_TOKEN, moved_model.make_cache())[0]
    np.testing.assert_array_equal(np.array(after), np.array(before))
