"""The vision tower on the ANE lane (the reference executor in the lane's worker process here): a split prompt's image
is encoded by the tower's Core ML programs on the ANE lane while the GPU lane prefills the text before it, and the
answer is the GPU-only one: greedy tokens, and the last logits within the split's tolerance of transformers'. A lane
that fails (its worker killed, a non-finite output) leaves the image to the GPU tower with the GPU-only answer, an
image the prefix cache holds is never sent to the lane, and `verify` (`hetero run --verify`) checks the lane's
embeddings against the GPU tower. One tiny checkpoint and one export (text and vision programs) serve every test;
`hetero plan`'s prediction of the tower is checked by hand."""

from __future__ import annotations

import json
import os

import hetero  # noqa: F401  (before torch: the fast BLAS under MLX)
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetero.errors import HeteroError
from hetero.pipeline import configure, verify
from hetero.pipeline.verification import ANE_FLOOR
from tests.vision_checkpoint import add_mtp_head, draw_image, encoded, save_chat_tokenizer, save_vl

CHUNK = 64
BEFORE = "Here is a long preamble of text before the picture that we show, for the GPU lane to prefill. " * 2
AFTER = "What is in the picture? Tell me."
SIZE = (80, 48)  # non-square: 60 image tokens, 240 patches in the 256-patch bucket


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(engine, path, split at 0.5 with its programs and the tower's exported and loaded in its worker)."""
    path = tmp_path_factory.mktemp("vlm-lane")
    save_vl(path, "small")
    save_chat_tokenizer(path)
    add_mtp_head(path)
    engine = hetero.load(path)
    run = configure(engine, 0.5, CHUNK, offload=("mlp",))
    ids, png = prompt_ids(engine), picture()
    run.prepare(engine.image_prompt(ids, [png]).tokens, images=engine.image_prompt(ids, [png]))
    return engine, path, run


def prompt_ids(engine) -> list[int]:
    """A chat turn whose image comes after two chunks of text (the GPU lane's work while the lane encodes it)."""
    return engine.encode_prompt(BEFORE + engine.image_marker + AFTER, chat=True)


def picture(seed: int = 4) -> bytes:
    return encoded(draw_image(*SIZE, seed=seed), "PNG")


def faults_at(monkeypatch, job: int) -> None:
    """The lane's worker can import tests/ane_faults.py (its loaders' faults), which strike at its `job`th job."""
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("HETERO_TEST_FAULT_AT", str(job))


def generate(engine, run=None, png=None, **kw):
    common = dict(max_tokens=8, images=[png or picture()], mtp=False, use_prefix_cache=False, prefill_chunk=CHUNK)
    return engine.generate(prompt_ids(engine), split=run, **{**common, **kw})


def test_the_lane_encodes_the_image_and_the_tokens_are_gpu_only(vlm):
    """The image is encoded on the ANE lane (not the GPU tower) while the chunks before it run on the GPU lane, and
    plain and MTP decoding give the GPU-only tokens."""
    engine, _, run = vlm
    prompt = engine.image_prompt(prompt_ids(engine), [picture()])
    (lo, _), = prompt.spans
    assert lo >= 2 * CHUNK  # two whole chunks of text before the image
    want = generate(engine)
    before = run.lane_images
    got = generate(engine, run)
    assert run.lane_images == before + 1
    assert [v["lane"] for v in run.last.vision] == ["ane"] and run.last.ane_busy_s > 0
    assert got.tokens == want.tokens and got.stats["prompt_tokens"] == want.stats["prompt_tokens"]
    assert generate(engine, run, mtp=True, draft_depth=2).tokens == want.tokens


def test_lane_prefill_logits_match_transformers(vlm):
    """The split prefill with the lane's embeddings against transformers' own forward (its processor's inputs): the
    GPU-only run's last logits are within 1e-4 relative of transformers', the split's with the lane's fp16 tower
    within the split's fp16 allowance (`verification.ANE_FLOOR`), with the same argmax."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    from tests.vision_checkpoint import hf_processor

    engine, path, run = vlm
    ids = prompt_ids(engine)
    image = draw_image(*SIZE, seed=4)
    prompt = engine.image_prompt(ids, [encoded(image, "PNG")])
    hf = hf_processor(path)(images=[image], return_tensors="pt")
    model = Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        tokens = torch.tensor([prompt.tokens])
        ref = model(input_ids=tokens, mm_token_type_ids=(tokens == engine.vision.image_token).int(),
                    pixel_values=hf["pixel_values"], image_grid_thw=hf["image_grid_thw"]).logits[0, -1].numpy()
    cache, n, carry = run.prefill(prompt.tokens, images=prompt)
    assert [v["lane"] for v in run.last.vision] == ["ane"]
    logits = engine.model.logits(engine.model.model(mx.array([prompt.tokens[n:]]), cache.backbone,
                                                    positions=mx.array(prompt.positions[:, n:])))
    ours = np.array(logits[0, -1].astype(mx.float32))
    gpu = np.array(engine.logits(ids, chunk=CHUNK, images=[encoded(image, "PNG")])[-1])
    scale = np.abs(ref).max()
    assert np.abs(gpu - ref).max() / scale < 1e-4  # the GPU-only path: transformers' within 1e-4
    assert np.abs(ours - ref).max() / scale < ANE_FLOOR  # the lane's fp16 tower and MLP shares: the split's allowance
    assert int(np.argmax(ours)) == int(np.argmax(ref))


@pytest.mark.parametrize("fault", ["dies", "garbage"])
def test_a_failing_lane_gives_the_gpu_only_answer(vlm, fault, monkeypatch, capsys):
    """The lane's worker killed, or its vision program returning NaN, during the tower's first program: one warning
    line, the prompt prefilled GPU-only with the GPU tower (the lane's embeddings taken back out): GPU-only tokens."""
    engine, _, _ = vlm
    faults_at(monkeypatch, 1)  # the first job of the new worker: the tower's patch embedding
    run = configure(engine, 0.5, CHUNK, offload=("mlp",))
    run.ane_loader = f"ane_faults:{fault}"
    want = generate(engine)
    got = generate(engine, run)
    assert got.tokens == want.tokens
    assert run.lane_failures == 1 and run.lane_images == 0
    assert "vision_patch_embed" in run.last_failure  # the fault struck the tower's program (not the worker's start)
    assert "prefilled GPU-only" in capsys.readouterr().err


def test_a_cached_image_is_not_sent_to_the_lane(vlm):
    """The same prompt again with the prefix cache: its image comes back from the cache, neither the lane nor the
    GPU tower encodes it, and the answer is the first one's."""
    from hetero.caches.prefix import PrefixCache

    engine, _, run = vlm
    engine.prefix_cache = PrefixCache()
    try:
        first = generate(engine, run, use_prefix_cache=True)
        assert run.last.vision[0]["lane"] == "ane"
        encoded_before = run.lane_images
        calls = []
        tower = engine.vision.tower
        real = tower.encode
        tower.encode = lambda *a: calls.append(a) or real(*a)
        try:
            again = generate(engine, run, use_prefix_cache=True)
        finally:
            del tower.encode
        assert again.stats["cached_tokens"] > prompt_ids(engine).index(engine.vision.image_token)
        assert run.lane_images == encoded_before and not calls
        assert again.tokens == first.tokens
    finally:
        engine.prefix_cache = None


def test_verify_checks_the_lanes_embeddings_against_the_gpu_tower(vlm, monkeypatch):
    """`verify` (`--verify`) runs the image through the lane's programs and the GPU tower: cosine >= 0.9999 and
    PSNR >= 60 dB pass; a lane whose embeddings are 5% off fails the check, and with it the match."""
    engine, _, run = vlm
    prompt = engine.image_prompt(prompt_ids(engine), [picture()])
    engine.vision.encode(prompt)
    check = verify(run, prompt.tokens, n_tokens=8, images=prompt)
    (vision,) = check["vision"]
    assert vision["ok"] and vision["cosine"] >= 0.9999 and vision["psnr_db"] >= 60, vision
    assert check["match"], check
    lane = run.vision_lane(run.splitter(len(prompt.tokens)))
    real = lane.encoder
    monkeypatch.setattr(lane, "encoder", lambda images, i: (lambda: real(images, i)() * 1.05))
    check = verify(run, prompt.tokens, n_tokens=8, images=prompt)
    assert not check["vision"][0]["ok"] and not check["match"], check


def test_verify_says_non_finite_lane_embeddings_in_one_line(vlm, monkeypatch, capsys):
    """A lane whose vision program returns NaN (its worker's first job here: no text on the lane) under `verify`:
    one warning line naming the image, the check fails as non-finite, no traceback, and the prompt keeps the GPU
    tower's embeddings."""
    engine, _, _ = vlm
    faults_at(monkeypatch, 1)
    run = configure(engine, 0.0, CHUNK)
    run.ane_loader = "ane_faults:garbage"
    prompt = engine.image_prompt(prompt_ids(engine), [picture()])
    engine.vision.encode(prompt)
    gpu = np.array(prompt.embeddings[0])
    capsys.readouterr()
    check = verify(run, prompt.tokens, n_tokens=4, images=prompt)
    assert not check["match"] and check["vision"] == [{"image": 0, "bucket": 256, "non_finite": True, "ok": False}]
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "non-finite" in line] == [next(
        line for line in err.splitlines() if line.startswith("warning: --verify: image 0:"))] and "Traceback" not in err
    np.testing.assert_array_equal(np.array(prompt.embeddings[0]), gpu)


def test_lane_choice_follows_the_prediction_both_ways():
    """`lane_choice` by hand: an image ready before the GPU lane reaches it, or late by less than the GPU tower's
    seconds, goes to the lane; a tiny image right at the start (the lane's padded bucket slower than the GPU) and a
    second image queued behind the first until too late go to the GPU; an unknown rate leaves the lane."""
    from hetero.planner.vision import TowerTime, lane_choice

    def t(ane: float | None, gpu: float | None) -> TowerTime:
        return TowerTime(64, 64, 16, 256, 4, gpu, ane)

    assert lane_choice([t(2.0, 1.0)], [3.0]) == [True]  # ready before the text is prefilled
    assert lane_choice([t(3.5, 1.0)], [3.0]) == [True]  # 0.5 s late: a shorter wait than encoding it on the GPU
    assert lane_choice([t(4.5, 1.0)], [3.0]) == [False]  # 1.5 s late: the GPU encodes it in 1 s
    assert lane_choice([t(0.01, 0.001)], [0.0]) == [False]  # tiny, and no text to hide it behind
    assert lane_choice([t(2.0, 1.0), t(2.0, 1.0)], [2.0, 2.5]) == [True, False]  # the second, queued: 1.5 s late
    assert lane_choice([t(2.0, 2.0), t(2.0, 2.0)], [2.0, 2.5]) == [True, True]  # 1.5 s late < 2 s on the GPU
    assert lane_choice([t(None, 1.0), t(4.5, 1.0)], [None, 3.0]) == [True, False]


def test_the_prediction_sends_a_tiny_image_at_the_start_to_the_gpu(vlm):
    """A 16x16 image (4 tokens: 16 patches in a 256-patch bucket) right after the chat template's first tokens:
    the prediction gives it to the GPU tower, which encodes it; the answer is the GPU-only one. The fixture's
    image after two chunks of text goes to the lane (the prediction's other way)."""
    engine, _, run = vlm
    ids = engine.encode_prompt(engine.image_marker + AFTER, chat=True)
    tiny = encoded(draw_image(16, 16, seed=2), "PNG")
    want = engine.generate(ids, images=[tiny], max_tokens=6, mtp=False, use_prefix_cache=False, prefill_chunk=CHUNK)
    got = engine.generate(ids, images=[tiny], max_tokens=6, mtp=False, use_prefix_cache=False, prefill_chunk=CHUNK,
                          split=run)
    (choice,) = run.vision_choice
    assert choice["lane"] == "gpu" and choice["predicted_text_before_s"] == 0.0
    assert choice["predicted_ane_s"] > choice["predicted_gpu_s"]
    assert [v["lane"] for v in run.last.vision] == ["gpu"] and got.tokens == want.tokens
    generate(engine, run)
    (choice,) = run.vision_choice
    assert choice["lane"] == "ane" and choice["predicted_ane_s"] < choice["predicted_text_before_s"]
    assert [v["lane"] for v in run.last.vision] == ["ane"]


def test_tower_prediction_counts_each_lanes_work():
    """The tower's predicted seconds, counted by hand for a small tower: the GPU over the image's own patches, the
    ANE over its whole bucket plus one call per program."""
    from hetero.models.qwen3_5_vision.args import VisionArgs
    from hetero.planner.predict import Lanes
    from hetero.planner.vision import predict_tower, vision_bucket

    a = VisionArgs(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=8, out_hidden_size=32)
    lanes = Lanes(gpu_flops=1e12, gpu_bw=None, ane_flops=4e12, ane_bw=None, ane_call_s=1e-3)
    p = predict_tower(a, lanes, 80, 48)  # 80x48 -> 10 x 6 patches of 8 pixels (multiples of 16): 60 patches
    assert (p.patches, p.bucket, p.tokens) == (60, 256, 15)
    assert [vision_bucket(n, 4) for n in (1, 256, 257, 1024, 1025)] == [256, 256, 512, 1024, 2048]

    def flops(n: int, window: int) -> float:
        D, I = 64, 128
        embed = 2 * 3 * 2 * 8 * 8 * D * n
        blocks = 2 * (2 * (4 * D * D + 2 * D * I) * n + 2 * 2 * D * n * window)  # projections + QK^T and AV
        merger = 2 * (4 * D) * (4 * D + 32) * n / 4
        return embed + blocks + merger

    assert p.gpu_s == pytest.approx(flops(60, 60) / 1e12)
    assert p.ane_s == pytest.approx(flops(256, 256) / 4e12 + 4 * 1e-3)


def test_hetero_plan_predicts_the_tower_per_image_bucket(capsys):
    """`hetero plan` on a checkpoint with a vision tower: a line per image size (patches, bucket, tokens, GPU and
    ANE-lane seconds), and the same in `--json`."""
    from pathlib import Path

    from hetero.cli.main import main

    config = str(Path(__file__).parent / "data" / "qwen3.5-27b.json")
    assert main(["plan", "--model", config, "--ane-fraction", "0.5", "--profile", "m4-max"]) == 0
    text = capsys.readouterr().out
    assert "vision tower (depth 27, hidden 1152" in text
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("1024x1024"))
    assert row[1:4] == ["4096", "4096", "1024"] and row[4] != "unknown" and row[6] != "unknown"
    assert main(["plan", "--model", config, "--ane-fraction", "0.5", "--profile", "m4-max", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["vision"]
    assert [r["image"] for r in rows] == ["448x448", "1024x1024", "1920x1080"]
    assert all(r["bucket"] >= r["patches"] and r["gpu_s"] > 0 and r["ane_s"] > 0 for r in rows[:2])
    assert rows[0]["ane_s"] < rows[1]["ane_s"] and rows[1]["gpu_s"] < rows[2]["gpu_s"]
    big = rows[2]  # 8,160 patches: above the lane's cap, the GPU tower's, and the plan says so
    assert big["patches"] > 4096 and big["bucket"] is None and big["ane_s"] is None and big["lane"] == "gpu"
    assert "4,096-patch cap" in big["why"]
    assert "GPU tower" in next(line for line in text.splitlines() if line.strip().startswith("1920x1080"))


@given(t=st.integers(1, 4), h=st.integers(1, 200), w=st.integers(1, 200))
def test_the_lanes_buckets_stop_at_the_cap(t, h, w):
    """Any grid: the lane's bucket holds the image and is at most MAX_VISION_PATCHES, or there is none (the GPU
    tower's image), exactly when the uncapped bucket would pass the cap; such an image always goes to the GPU."""
    from hetero.models.qwen3_5_vision.args import VisionArgs
    from hetero.planner.predict import Lanes
    from hetero.planner.vision import MAX_VISION_PATCHES, lane_bucket, lane_choice, predict_grid, vision_bucket

    a = VisionArgs(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=8, out_hidden_size=32)
    n = t * h * w
    bucket = lane_bucket(n, a.merge_unit)
    assert (bucket is None) == (vision_bucket(n, a.merge_unit) > MAX_VISION_PATCHES)
    assert bucket is None or n <= bucket <= MAX_VISION_PATCHES
    p = predict_grid(a, Lanes(gpu_flops=1e12, gpu_bw=None, ane_flops=4e12, ane_bw=None, ane_call_s=1e-3), (t, h, w))
    assert p.over_cap == (bucket is None) and (p.ane_s is None) == p.over_cap
    if p.over_cap:  # however long the text before it: the GPU
        assert lane_choice([p], [1e9]) == [False]


def test_an_image_above_the_cap_is_encoded_by_the_gpu_tower(capsys):
    """The lane's encoders leave an image above the cap to the GPU tower, saying so in one line."""
    import types

    from hetero.pipeline.vision_lane import VisionLane, image_bucket

    images = types.SimpleNamespace(grids=[(1, 68, 120)], embeddings=[None], patches=[None])
    with pytest.raises(HeteroError, match="8,160 patches, above the ANE lane's 4,096-patch cap"):
        image_bucket(images, 0, 4)
    lane = object.__new__(VisionLane)
    lane.tower = types.SimpleNamespace(args=types.SimpleNamespace(merge_unit=4))
    assert lane.encoders(images) == {}
    assert "image 0 is encoded on the GPU" in capsys.readouterr().err
