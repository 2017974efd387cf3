"""Images through `Engine.generate` / `Engine.logits` against transformers fed its own processor's inputs (two tower
layouts, a square and a non-square image): the last position's logits within 1e-4, and the greedy continuation
identical with whole and chunked prefill and with MTP speculative decoding; the prefix and session caches key an
image by its pixels (the same image restores, another of the same size never matches)."""

from __future__ import annotations

import json

import hetero  # noqa: F401  (before torch: the fast BLAS under MLX)
import numpy as np
import pytest
import torch

from hetero.caches.prefix import PrefixCache
from hetero.caches.session import SessionStore
from hetero.errors import HeteroError
from tests.test_image_prompt import hf_inputs, last_logits_close
from tests.vision_checkpoint import (IMAGE_TOKEN, LAYOUTS, add_mtp_head, draw_image, encoded, save_chat_tokenizer,
                                     save_vl)

SIZES = {"square": (64, 64), "non-square": (80, 48)}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def vlm(request, tmp_path_factory):
    """(engine, HF model, path): a tiny VL checkpoint with a chat tokenizer and an MTP head (transformers drops it)."""
    path = tmp_path_factory.mktemp(f"vlm-engine-{request.param}")
    hf = save_vl(path, request.param)
    save_chat_tokenizer(path)
    add_mtp_head(path)
    return hetero.load(path), hf, path


def hf_greedy(hf, inputs: dict, n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("size", sorted(SIZES))
def test_logits_and_greedy_match_transformers(vlm, size):
    engine, hf, path = vlm
    image = draw_image(*SIZES[size], seed=4)
    ids = engine.encode_prompt("What is in the picture?", chat=True, images=1)
    inputs = hf_inputs(path, ids, [image])
    with torch.no_grad():
        ref = hf(**inputs).logits[0, -1].numpy()
    png = encoded(image, "PNG")
    last_logits_close(engine.logits(ids, images=[png])[-1], ref)
    last_logits_close(engine.logits(ids, chunk=16, images=[png])[-1], ref)  # the image cut across chunks
    want = hf_greedy(hf, inputs, 8)
    for options in (dict(mtp=False), dict(mtp=False, prefill_chunk=16), dict(mtp=True, draft_depth=2)):
        out = engine.generate("What is in the picture?", max_tokens=8, chat=True, images=[png],
                              use_prefix_cache=False, **options)
        assert out.tokens == want, options
        assert out.stats["prompt_tokens"] == inputs["input_ids"].shape[1]


def test_prefix_cache_keys_images_by_their_pixels(vlm, tmp_path):
    """A second turn with the same image restores its tokens; another image of the same size matches only the text
    before it; every answer is the cold run's; a new engine restores the image from the session cache on disk."""
    engine, hf, path = vlm
    first, other = draw_image(64, 64, seed=1), draw_image(64, 64, seed=2)
    turn = lambda image: dict(max_tokens=6, chat=True, images=[encoded(image, "PNG")], mtp=False,  # noqa: E731
                              prefill_chunk=16)
    cold = {seed: engine.generate("Describe it.", use_prefix_cache=False, **turn(img)).tokens
            for seed, img in ((1, first), (2, other))}
    prompt = engine.image_prompt(engine.encode_prompt("Describe it.", chat=True, images=1), [encoded(first, "PNG")])
    (lo, hi), = prompt.spans
    engine.prefix_cache = PrefixCache(store=SessionStore(tmp_path))
    try:
        one = engine.generate("Describe it.", **turn(first))
        assert one.stats["cached_tokens"] == 0 and one.tokens == cold[1]
        again = engine.generate("Describe it.", **turn(first))
        assert again.stats["cached_tokens"] >= hi and again.tokens == cold[1]  # the image's tokens came from the cache
        changed = engine.generate("Describe it.", **turn(other))
        assert changed.stats["cached_tokens"] <= lo and changed.tokens == cold[2]  # same size, other pixels
    finally:
        engine.prefix_cache = None
    fresh = hetero.load(path)
    fresh.prefix_cache = PrefixCache(store=SessionStore(tmp_path))
    from_disk = fresh.generate("Describe it.", **turn(first))
    assert from_disk.stats["cached_tokens"] >= hi and from_disk.tokens == cold[1]


def test_image_keys_differ_per_image_and_stay_out_of_the_vocabulary(vlm):
    engine, _, _ = vlm
    ids = engine.encode_prompt("x", chat=True, images=1)
    a = engine.image_prompt(ids, [encoded(draw_image(64, 64, seed=1), "PNG")])
    b = engine.image_prompt(ids, [encoded(draw_image(64, 64, seed=2), "PNG")])
    same = engine.image_prompt(ids, [draw_image(64, 64, seed=1)])
    (lo, hi), = a.spans
    ka, kb = a.cache_keys(), b.cache_keys()
    assert ka[:lo] == kb[:lo] == ids[:lo] and ka[hi:] == kb[hi:]
    assert all(x != y for x, y in zip(ka[lo:hi], kb[lo:hi])) and same.cache_keys() == ka
    assert min(ka[lo:hi]) >= engine.model.args.vocab_size and len(set(ka[lo:hi])) == hi - lo


def test_bad_images_are_one_line(vlm, tmp_path):
    engine, _, _ = vlm
    with pytest.raises(HeteroError, match="image 0: image not recognised"):
        engine.generate("x", max_tokens=1, chat=True, images=[b"not an image"])
    with pytest.raises(HeteroError, match="1 image placeholder"):
        engine.image_prompt(engine.encode_prompt("x", chat=True, images=1), [draw_image(64, 64)] * 2)
    from tests.helpers import save_flat

    save_flat(tmp_path, tie=False)
    save_chat_tokenizer(tmp_path)
    text_only = hetero.load(tmp_path)
    with pytest.raises(HeteroError, match="no vision tower"):
        text_only.generate("<|image_pad|>", max_tokens=1, images=[draw_image(64, 64)])


def test_images_after_an_mlx_lm_prompt_cache_say_what_to_do_and_that_works(vlm):
    """Images after an mlx-lm prompt_cache are refused in one line that says what to do instead: leave the
    prompt_cache out, send the whole conversation, and let the prefix cache reuse its prefix; done that way, the
    second turn's prefix (its image included) comes from the cache."""
    from hetero.library import prefill

    engine, _, _ = vlm
    png = encoded(draw_image(64, 64, seed=6), "PNG")
    cache = prefill(engine, engine.encode_prompt("Earlier turn.", chat=True))
    with pytest.raises(HeteroError) as e:
        engine.generate("Look.", max_tokens=1, chat=True, images=[png], prompt_cache=cache)
    line = str(e.value)
    assert "\n" not in line and "leave prompt_cache out" in line and "engine.prefix_cache = " in line
    exec(line.split("set ", 1)[1].split(" (", 1)[0], {"hetero": hetero, "engine": engine})  # the advice, as given
    try:
        assert isinstance(engine.prefix_cache, PrefixCache)
        turn = dict(max_tokens=3, chat=True, images=[png], mtp=False, prefill_chunk=16)
        first, again = engine.generate("Look.", **turn), engine.generate("Look.", **turn)
        (_, hi), = engine.image_prompt(engine.encode_prompt("Look.", chat=True, images=1), [png]).spans
        assert again.stats["cached_tokens"] >= hi and again.tokens == first.tokens  # the image came from the cache
    finally:
        engine.prefix_cache = None


def test_mlx_lm_shaped_stream_generate_takes_images(vlm):
    """`hetero.library.stream_generate` with images: the engine's tokens, and the expanded prompt's size."""
    from hetero.library import stream_generate

    engine, _, _ = vlm
    png = encoded(draw_image(80, 48, seed=9), "PNG")
    want = engine.generate("Look.", max_tokens=5, chat=True, images=[png], mtp=False, use_prefix_cache=False)
    steps = list(stream_generate(engine, prompt="Look.", max_tokens=5, chat=True, images=[png], mtp=False,
                                 use_prefix_cache=False))
    assert [s.token for s in steps if s.token is not None] == want.tokens
    assert steps[-1].prompt_tokens == want.stats["prompt_tokens"] > len(engine.encode_prompt("Look.", chat=True))


def test_hetero_run_takes_images_before_the_prompt(vlm, tmp_path):
    """`hetero run --image FILE` (a subprocess, as a user runs it) puts the image before the prompt in one chat
    turn: its tokens are the library's with the same image (which match transformers above); an unreadable file
    and a file that is no image are refused in one line, without a traceback (the ANE split takes images:
    tests/test_image_split.py)."""
    from tests.test_cli import hetero_cli

    engine, _, path = vlm
    png = tmp_path / "picture.png"
    png.write_bytes(encoded(draw_image(*SIZES["non-square"], seed=5), "PNG"))
    want = engine.generate("What is in the picture?", max_tokens=6, chat=True, images=[png.read_bytes()],
                           mtp=False, use_prefix_cache=False)
    out = hetero_cli("run", "--model", str(path), "--image", str(png), "--prompt", "What is in the picture?",
                     "--max-tokens", "6", "--no-mtp", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["tokens"] == want.tokens and result["prompt_tokens"] == want.stats["prompt_tokens"]
    (tmp_path / "notes.txt").write_text("not an image")
    for extra, says in [(["--image", str(tmp_path / "missing.png")], "cannot read it"),
                        (["--image", str(tmp_path / "notes.txt")], "notes.txt: image not recognised")]:
        bad = hetero_cli("run", "--model", str(path), "--prompt", "hi", "--max-tokens", "2", *extra)
        assert bad.returncode == 1, (extra, bad.stderr)
        assert says in bad.stderr and "Traceback" not in bad.stderr, (extra, bad.stderr)
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
