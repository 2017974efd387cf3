"""A prompt with images through the ANE split prefill (the reference executor runs the ANE lane here): the images'
embeddings enter on the GPU lane, both lanes' attention rotates by the prompt's 3-D positions (the ANE programs by
RoPE tables made from them), and the MTP head's pairs take them too. Against GPU-only with the same images: the
split's own tolerance (`verify`), identical greedy tokens, the same MTP KV; a square and a non-square image, each
cut across a chunk edge with text after it. One tiny checkpoint and one export serve every test."""

from __future__ import annotations

import json

import hetero  # noqa: F401  (before torch: the fast BLAS under MLX)
import mlx.core as mx
import numpy as np
import pytest

from hetero.cli.main import main
from hetero.coreml.graphs.attention import AttentionShape, rope_tables
from hetero.decode.prefill import prefill
from hetero.models.mrope import apply_mrope, frequency_positions
from hetero.pipeline import configure, verify
from tests.vision_checkpoint import add_mtp_head, draw_image, encoded, save_chat_tokenizer, save_vl

SIZES = {"square": (64, 64), "non-square": (80, 48)}  # 64 and 60 image tokens
TEXT = "What is in the picture? Tell me about it in some detail please."  # after the image: ~75 tokens of text
CHUNK = 64


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(engine, path, split at 0.5 of every piece): a tiny VL checkpoint with a chat tokenizer and an MTP head."""
    path = tmp_path_factory.mktemp("vlm-split")
    save_vl(path, "small")
    save_chat_tokenizer(path)
    add_mtp_head(path)
    engine = hetero.load(path)
    return engine, path, configure(engine, 0.5, CHUNK)


def image_prompt(engine, size: str, seed: int = 4):
    png = encoded(draw_image(*SIZES[size], seed=seed), "PNG")
    prompt = engine.image_prompt(engine.encode_prompt(TEXT, chat=True, images=1), [png])
    engine.vision.encode(prompt)
    return png, prompt


def test_rope_tables_from_3d_positions(vlm):
    """The ANE's RoPE tables from a chunk's 3-D positions: text positions (one in all three streams) give exactly
    the 1-D tables, image positions the angles `apply_mrope` turns by, frequency by frequency."""
    engine, _, _ = vlm
    args = engine.model.args
    shape = AttentionShape(args.hidden_size, 2, 1, args.head_dim, args.rotary_dims, CHUNK, CHUNK, 1e-6)
    text = np.broadcast_to(np.arange(CHUNK, CHUNK + 50), (3, 50))  # a text chunk of 50 tokens at 64..113
    at = frequency_positions(text, args.rotary_dims, args.mrope_section, CHUNK)
    plain = rope_tables(CHUNK, shape, args.rope_theta)
    for name, table in rope_tables(CHUNK, shape, args.rope_theta, at).items():
        assert np.array_equal(table, plain[name])  # padding rows too: they count on from the last position
    _, prompt = image_prompt(engine, "non-square")
    positions = prompt.positions[:, :CHUNK]  # [3, 64]: text, then image tokens at (t, row, column)
    tables = rope_tables(0, shape, args.rope_theta, frequency_positions(positions, args.rotary_dims,
                                                                        args.mrope_section, CHUNK))
    half = args.rotary_dims // 2
    x = mx.concatenate([mx.ones((1, 1, CHUNK, half)), mx.zeros((1, 1, CHUNK, args.head_dim - half))], -1)
    turned = np.array(apply_mrope(x, mx.array(positions), args.rotary, args.mrope_section))
    np.testing.assert_allclose(tables["cos"][0, 0].T, turned[0, 0, :, :half], atol=1e-3)  # (1, 0) -> (cos, sin)
    np.testing.assert_allclose(tables["sin"][0, 0].T, turned[0, 0, :, half : 2 * half], atol=1e-3)


@pytest.mark.parametrize("size", sorted(SIZES))
def test_split_with_an_image_verifies_against_gpu_only(vlm, size):
    """The image starts in chunk 0 and ends in chunk 1, text follows to a third chunk; the split passes `--verify`
    against GPU-only with the same image (its own tolerance, 16 greedy tokens identical)."""
    engine, _, run = vlm
    _, prompt = image_prompt(engine, size)
    (lo, hi), = prompt.spans
    assert lo < CHUNK < hi < len(prompt.tokens) - CHUNK  # cut across a chunk edge, text after it
    check = verify(run, prompt.tokens, n_tokens=16, images=prompt)
    assert check["match"], check
    assert check["greedy_match_tokens"] == 16 and check["reference"] == "fp32"


def test_split_generates_gpu_only_tokens_with_an_image(vlm):
    """`Engine.generate(..., images=..., split=...)`: plain and MTP decoding give the GPU-only run's tokens."""
    engine, _, run = vlm
    png, _ = image_prompt(engine, "non-square", seed=7)
    common = dict(max_tokens=10, chat=True, images=[png], use_prefix_cache=False, prefill_chunk=CHUNK)
    want = engine.generate(TEXT, mtp=False, **common)
    split = engine.generate(TEXT, mtp=False, split=run, **common)
    assert run.last is not None and run.last.ane_busy_s > 0  # the split ran (not a GPU-only fallback)
    assert split.tokens == want.tokens and split.stats["prompt_tokens"] == want.stats["prompt_tokens"]
    assert engine.generate(TEXT, mtp=True, draft_depth=2, split=run, **common).tokens == want.tokens


def test_split_fills_the_caches_at_the_images_positions(vlm):
    """The split's cache (backbone K/V, the MTP head's K/V at each pair's 3-D position) and carry are GPU-only's
    within fp16 rounding of the ANE's share, and the attention caches hold the prompt's position shift."""
    engine, _, run = vlm
    model = engine.model
    _, prompt = image_prompt(engine, "square")
    cache, n, carry = run.prefill(prompt.tokens, images=prompt)
    assert n == len(prompt.tokens) - 1
    gpu = model.make_cache()
    prefill(model, prompt.tokens[:n], gpu, CHUNK, mtp=True, images=prompt)
    for ours, theirs in zip(cache, gpu):
        if hasattr(ours, "keys"):
            assert ours.offset == theirs.offset and ours.shift == theirs.shift == prompt.delta != 0
            for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
                a, b = np.array(a[:, :, : ours.offset]), np.array(b[:, :, : ours.offset])
                assert np.linalg.norm(a - b) <= 5e-3 * np.linalg.norm(b)
    assert len(cache.mtp) and cache.mtp[0].offset == n - 1


def test_split_chunk_edges_key_images_by_their_pixels(vlm):
    """The split checkpoints its chunk edges under the image's content keys: the same image again restores past
    it, another image of the same size matches only the text before it, and every answer is the cold run's."""
    from hetero.caches.prefix import PrefixCache

    engine, _, run = vlm
    (png, prompt), (other, _) = image_prompt(engine, "square", seed=1), image_prompt(engine, "square", seed=2)
    (lo, hi), = prompt.spans
    turn = lambda image, **kw: engine.generate(TEXT, max_tokens=6, chat=True, images=[image], mtp=False,  # noqa: E731
                                               prefill_chunk=CHUNK, **kw)
    cold = {image: turn(image, use_prefix_cache=False).tokens for image in (png, other)}
    engine.prefix_cache = PrefixCache()
    try:
        first = turn(png, split=run)
        assert first.stats["cached_tokens"] == 0 and first.tokens == cold[png]
        again = turn(png, split=run)
        assert again.stats["cached_tokens"] >= hi and again.tokens == cold[png]
        changed = turn(other, split=run)
        assert changed.stats["cached_tokens"] <= lo and changed.tokens == cold[other]
    finally:
        engine.prefix_cache = None


def test_attention_left_whole_on_the_gpu_rotates_by_the_images_positions(vlm):
    """With only the MLPs offloaded, the attention layers run whole on the GPU lane at the 3-D positions."""
    engine, _, _ = vlm
    run = configure(engine, 0.5, CHUNK, offload=("mlp",))
    _, prompt = image_prompt(engine, "non-square")
    check = verify(run, prompt.tokens, n_tokens=8, images=prompt)
    assert check["match"] and check["distance"] < 1e-3, check


def test_text_prompts_split_as_before(vlm):
    """A text prompt on the same checkpoint and split: verify passes and the tokens are GPU-only's."""
    engine, _, run = vlm
    ids = engine.encode_prompt(TEXT * 3, chat=True)
    check = verify(run, ids, n_tokens=8)
    assert check["match"], check


def test_hetero_run_image_with_ane_fraction_and_verify(vlm, tmp_path, capsys):
    """`hetero run --image F --ane-fraction 0.5 --verify`: the GPU-only run's tokens, and the verify block checks
    the split against GPU-only with the same image."""
    engine, path, _ = vlm
    png = tmp_path / "picture.png"
    png.write_bytes(encoded(draw_image(*SIZES["square"], seed=5), "PNG"))
    want = engine.generate(TEXT, max_tokens=6, chat=True, images=[png.read_bytes()], mtp=False,
                           use_prefix_cache=False)
    argv = ["run", "--model", str(path), "--image", str(png), "--prompt", TEXT, "--max-tokens", "6", "--no-mtp",
            "--ane-fraction", "0.5", "--prefill-chunk", str(CHUNK), "--verify", "--verify-tokens", "8", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == want.tokens and out["prompt_tokens"] == want.stats["prompt_tokens"]
    assert out["pipeline"]["ane_busy_s"] > 0
    assert out["verify"]["match"] and out["verify"]["greedy_match_tokens"] == 8, out["verify"]


def test_server_prefills_an_image_chat_through_the_split(vlm):
    """`hetero serve --ane-fraction`: an OpenAI chat with an image goes through the split and answers what the same
    chat GPU-only (`ane_fraction: 0`) does."""
    import base64

    import httpx

    from tests.test_server import LiveServer

    engine, _, run = vlm
    url = "data:image/png;base64," + base64.b64encode(encoded(draw_image(80, 48, seed=9), "PNG")).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": TEXT}]}]
    server = LiveServer(engine, split=run)
    try:
        ask = lambda **extra: server.openai().chat.completions.create(  # noqa: E731
            model=engine.name, messages=messages, max_tokens=6, temperature=0, extra_body={"mtp": False, **extra})
        gpu_only = ask(ane_fraction=0)
        assert httpx.get(server.url + "/health").json()["requests"]["split_prefills"] == 0
        split = ask()
        assert httpx.get(server.url + "/health").json()["requests"]["split_prefills"] == 1
        assert split.choices[0].message.content == gpu_only.choices[0].message.content
        assert split.usage.prompt_tokens == gpu_only.usage.prompt_tokens
    finally:
        server.stop()
