"""The conformance harness's checks of the Qwen3.5 vision tower (`conformance_space.vision_tower` draws): a nested
`qwen3_5` checkpoint whose tower (depth, width, heads, patch, temporal patch, merge size, position table, activation)
and text mrope sections are drawn, and a prompt holding one image of a drawn grid.

- tower: hetero's tower embeddings of the image's patches against transformers' `Qwen3_5VisionModel` in float64,
  within `conformance_checks.TOL` at every merged token;
- image logits: the prompt with its image (3-D rotary positions) in one pass and in chunks that cut the image,
  against transformers' `Qwen3_5ForConditionalGeneration` in float64 at every position;
- image greedy: hetero's greedy tokens after the image are transformers' (its argmax on the same tokens);
- split (`check_vision_split`): the split with the image passes `--verify`, the lane's tower programs included.

The patches are random (a drawn grid of preprocessed pixels), not an image through the processor: the processor is
checked against transformers' own in tests/test_vision_tower.py.
"""

from __future__ import annotations

import numpy as np
import torch

from conformance_space import Draw


class Patches:
    """Stands in for the checkpoint's image processor where the prompt is planned: every image is the draw's
    patches and grid (what `hetero.vision.prompt.plan_prompt` reads from a processor: a call and `merge_size`)."""

    def __init__(self, pixels: np.ndarray, grid: tuple[int, int, int], merge: int):
        self.pixels, self.grid, self.merge_size = pixels, grid, merge

    def __call__(self, image) -> tuple[np.ndarray, tuple[int, int, int]]:
        return self.pixels, self.grid


def image_input(draw: Draw) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The draw's image as preprocessed patches [t*h*w, 3*tp*p*p] (random, seeded) and its grid (1, h, w)."""
    v = draw.vision
    merge, (across, down) = v["spatial_merge_size"], v["image"]
    grid = (1, down * merge, across * merge)
    width = 3 * v["temporal_patch_size"] * v["patch_size"] ** 2
    pixels = np.random.default_rng(draw.seed + 2).standard_normal((grid[1] * grid[2], width)).astype(np.float32)
    return pixels, grid


def prompt_ids(draw: Draw) -> list[int]:
    """Text, the image between its start and end tokens (one placeholder, expanded when planned), text."""
    vocab = draw.config["vocab_size"]
    text = np.random.default_rng(draw.seed).integers(2, vocab - 4, 12).tolist()
    return text[:5] + [vocab - 2, vocab - 4, vocab - 1] + text[5:]


def hf_inputs(tokens: list[int], image_token: int, pixels: np.ndarray, grid, dtype) -> dict:
    """What transformers' processor gives the model: expanded image tokens, their token types, pixels, grid."""
    ids = torch.tensor([tokens])
    return dict(input_ids=ids, mm_token_type_ids=(ids == image_token).int(), pixel_values=torch.tensor(pixels, dtype=dtype),
                image_grid_thw=torch.tensor([list(grid)]), use_cache=False)


def check_vision(draw: Draw, path, hf, result) -> None:
    """The tower, the image prompt's logits (one pass and chunked) and its greedy tokens (module docstring)."""
    import mlx.core as mx

    import conformance_checks as cc
    from hetero.checkpoint.loader import load_model
    from hetero.decode.prefill import prefill
    from hetero.vision.prompt import greedy, load_tower, plan_prompt

    model, path, config = load_model(path, mx.float32)
    tower = load_tower(path, config, mx.float32)
    pixels, grid = image_input(draw)
    image_token = config["image_token_id"]
    prompt = plan_prompt(Patches(pixels, grid, tower.args.spatial_merge_size), config, prompt_ids(draw), [None])
    prompt.encode(tower)
    exact = cc.hf_float64(draw, hf)
    with torch.no_grad():
        ref_tower = exact.model.visual(torch.tensor(pixels, dtype=torch.float64),
                                       grid_thw=torch.tensor([list(grid)])).pooler_output.numpy()
        own_tower = hf.model.visual(torch.tensor(pixels), grid_thw=torch.tensor([list(grid)])).pooler_output.numpy()
    bound = max(cc.TOL, cc.K * cc.relative(own_tower, ref_tower))
    result.bound("tower", cc.relative(np.array(prompt.embeddings[0]), ref_tower), bound)
    tokens = greedy(model, prompt, image_token, cc.GREEDY)
    special = set(range(draw.config["vocab_size"] - 4, draw.config["vocab_size"]))  # image / video / their marks
    tokens = tokens[: next((i for i, t in enumerate(tokens) if t in special), len(tokens))]  # text tokens only
    seq = prompt.tokens + tokens[:-1]
    with torch.no_grad(), cc.stable_topk():
        ref32 = hf(**hf_inputs(seq, image_token, pixels, grid, torch.float32)).logits[0].numpy()
        ref64 = exact(**hf_inputs(seq, image_token, pixels, grid, torch.float64)).logits[0].numpy()
    n = len(prompt.tokens)
    bound = max(cc.TOL, cc.K * cc.relative(ref32[:n], ref64[:n]))
    result.errors["transformers"] = cc.relative(ref32[:n], ref64[:n])
    for chunk in (n, *draw.chunks):
        logits = np.array(prefill(model, prompt.tokens, model.make_cache(), chunk, all_logits=True, images=prompt)[0])
        result.bound("logits" if chunk == n else "chunked", cc.relative(logits, ref64[:n]), bound)
    result.bound("greedy", cc._greedy_misses(tokens, ref64, n - 1, 2 * bound), 0)


def check_vision_split(draw: Draw, path, dtype: str, result, lane: str = "thread") -> None:
    """The split of the image prompt at fraction 0.5 in `dtype`: `--verify` passes with the lane's tower programs
    against the GPU tower (`vision` in the report)."""
    import types

    import conformance_checks as cc
    from hetero.errors import HeteroError
    from hetero.pipeline import configure, verify
    from hetero.vision.prompt import load_tower, plan_prompt

    engine = cc.split_engine(path, cc.DTYPES[dtype])
    tower = load_tower(engine.path, engine.config, cc.DTYPES[dtype])
    engine.vision = types.SimpleNamespace(tower=tower)
    pixels, grid = image_input(draw)
    text = np.random.default_rng(draw.seed + 1).integers(2, draw.config["vocab_size"] - 4, 140).tolist()
    ids = prompt_ids(draw) + text  # past two chunks of 64 with the image's tokens
    prompt = plan_prompt(Patches(pixels, grid, tower.args.spatial_merge_size), engine.config, ids, [None])
    prompt.encode(tower)
    try:
        run = configure(engine, 0.5, 64, lane=lane)
    except HeteroError as e:
        result.refused[f"{dtype} split"] = str(e)
        return
    report = verify(run, prompt.tokens, n_tokens=cc.GREEDY, images=prompt)
    cc.judge_split(draw, run, report, dtype, result)
