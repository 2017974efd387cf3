"""Images through `hetero serve` on loopback with the real openai and anthropic clients, for a tiny VL checkpoint of
each tower layout: the first token's logprobs equal transformers' (given its own processor's inputs) within 1e-4,
the greedy reply is transformers' through chat `image_url`, Anthropic `image` and Responses `input_image`; the next
turn with the same image reads its tokens from the prefix cache; bad images are one 400 line each."""

from __future__ import annotations

import base64
import io

import hetero  # noqa: F401  (before torch: the fast BLAS under MLX)
import anthropic
import numpy as np
import openai
import pytest
import torch

from hetero.caches.prefix import PrefixCache
from tests.test_image_prompt import hf_inputs
from tests.test_server import LiveServer
from tests.vision_checkpoint import IMAGE_TOKEN, LAYOUTS, add_mtp_head, draw_image, encoded, save_chat_tokenizer, save_vl

QUESTION = "What is in the picture?"


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def vlm(request, tmp_path_factory):
    """(server, engine, HF model, path) for a tiny VL checkpoint with an MTP head, its server on loopback."""
    path = tmp_path_factory.mktemp(f"vlm-serve-{request.param}")
    hf = save_vl(path, request.param)
    save_chat_tokenizer(path)
    add_mtp_head(path)
    engine = hetero.load(path)
    engine.prefix_cache = PrefixCache()
    server = LiveServer(engine, max_image_mb=0.05, allow_local_images=True)
    yield server, engine, hf, path
    server.stop()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def reference(engine, hf, path, image) -> tuple[np.ndarray, list[int]]:
    """transformers' log-softmax of the last position and its greedy tokens (up to an EOS) for the chat prompt."""
    ids = engine.encode_prompt(QUESTION, chat=True, images=1)
    inputs = hf_inputs(path, ids, [image])
    with torch.no_grad():
        logits = hf(**inputs).logits[0, -1].double()
        out = hf.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens = out[0, inputs["input_ids"].shape[1]:].tolist()
    for i, t in enumerate(tokens):
        if t in engine.eos_ids:
            tokens = tokens[:i]
            break
    return torch.log_softmax(logits, -1).numpy(), tokens


def test_chat_image_url_equals_transformers(vlm):
    server, engine, hf, path = vlm
    image = draw_image(80, 48, seed=7)  # non-square
    ref, tokens = reference(engine, hf, path, image)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(encoded(image, "PNG"))}},
                                             {"type": "text", "text": QUESTION}]}]
    r = server.openai().chat.completions.create(model=engine.name, messages=messages, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=5, extra_body={"mtp": True})
    first = r.choices[0].logprobs.content[0]
    assert tokens and first.token == engine.tokenizer.decode([tokens[0]])
    for alt in first.top_logprobs:
        token = engine.tokenizer.token_to_id(alt.token)
        np.testing.assert_allclose(alt.logprob, ref[token], rtol=1e-4, atol=1e-4)
    assert r.choices[0].message.content == engine.tokenizer.decode(tokens)
    assert r.usage.prompt_tokens == len(engine.image_prompt(engine.encode_prompt(QUESTION, chat=True, images=1),
                                                            [image]).tokens)


def test_anthropic_and_responses_images_equal_transformers(vlm):
    server, engine, hf, path = vlm
    image = draw_image(64, 64, seed=8)
    _, tokens = reference(engine, hf, path, image)
    png = base64.b64encode(encoded(image, "PNG")).decode()
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    reply = server.anthropic().messages.create(model=engine.name, max_tokens=6, messages=[
        {"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}])
    assert "".join(b.text for b in reply.content if b.type == "text") == engine.tokenizer.decode(tokens)
    items = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64," + png},
                                          {"type": "input_text", "text": QUESTION}]}]
    response = server.openai().responses.create(model=engine.name, input=items, max_output_tokens=6, temperature=0)
    assert response.output_text == engine.tokenizer.decode(tokens)


def test_next_turn_reads_the_image_from_the_cache(vlm, tmp_path):
    """The second turn with the same image reports the image's tokens as cached; the same conversation with another
    image of the same size only its text before the image; a local file path (allowed here) is the same image."""
    server, engine, hf, path = vlm
    client = server.openai()
    image, other = encoded(draw_image(64, 64, seed=11), "PNG"), encoded(draw_image(64, 64, seed=12), "PNG")
    prompt = engine.image_prompt(engine.encode_prompt(QUESTION, chat=True, images=1), [image])
    (lo, hi), = prompt.spans

    def turn(url: str, then: str | None = None):
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": QUESTION}]}]
        if then is not None:
            messages += [{"role": "assistant", "content": then}, {"role": "user", "content": "And the colours?"}]
        return client.chat.completions.create(model=engine.name, messages=messages, max_tokens=4, temperature=0)

    first = turn(data_url(image))
    second = turn(data_url(image), first.choices[0].message.content)
    assert second.usage.prompt_tokens_details.cached_tokens >= hi
    changed = turn(data_url(other), first.choices[0].message.content)
    assert changed.usage.prompt_tokens_details.cached_tokens <= lo
    file = tmp_path / "shot.png"
    file.write_bytes(image)
    local = turn(str(file), first.choices[0].message.content)
    assert local.usage.prompt_tokens_details.cached_tokens >= hi
    assert local.choices[0].message.content == second.choices[0].message.content


def gif() -> bytes:
    buf = io.BytesIO()
    draw_image(16, 16).save(buf, format="GIF")
    return buf.getvalue()


@pytest.mark.parametrize("url, message", [
    (data_url(b"\x89PNG\r\n\x1a\n broken"), "image not recognised"),
    (data_url(gif(), "gif"), "image format GIF is not supported"),
    (data_url(np.random.default_rng(0).integers(0, 256, 80_000, dtype=np.uint8).tobytes()), "image too large"),
    ("https://example.com/cat.png", "image URLs are not fetched"),
    ("data:image/png,raw", "a data URL must be base64"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("shot.png", "must be a data URL"),
])
def test_bad_images_are_one_400_line(vlm, url, message):
    server, engine, _, _ = vlm
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        server.openai().chat.completions.create(model=engine.name, messages=messages, max_tokens=1)
    text = e.value.body["message"]
    assert message in text and "\n" not in text and "messages[0].content[0]" in text


def test_local_paths_need_the_flag(vlm, tmp_path):
    _, engine, _, _ = vlm
    file = tmp_path / "shot.png"
    file.write_bytes(encoded(draw_image(64, 64), "PNG"))
    server = LiveServer(engine)
    try:
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file://" + str(file)}}]}]
        with pytest.raises(openai.BadRequestError, match="--allow-local-images"):
            server.openai().chat.completions.create(model=engine.name, messages=messages, max_tokens=1)
        block = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
        with pytest.raises(anthropic.BadRequestError, match="not fetched"):
            server.anthropic().messages.create(model=engine.name, max_tokens=1,
                                               messages=[{"role": "user", "content": [block]}])
    finally:
        server.stop()


def test_concurrent_image_requests_in_one_decode_batch(vlm):
    """Two requests with different images decoding in one shared batch (plain and MTP rows): each gets
    transformers' greedy reply."""
    from concurrent.futures import ThreadPoolExecutor

    _, engine, hf, path = vlm
    images = [draw_image(64, 64, seed=21), draw_image(80, 48, seed=22)]
    want = [engine.tokenizer.decode(reference(engine, hf, path, image)[1]) for image in images]
    server = LiveServer(engine, max_batch=4)
    try:
        def ask(i: int) -> str:
            messages = [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(encoded(images[i], "PNG"))}},
                {"type": "text", "text": QUESTION}]}]
            r = server.openai().chat.completions.create(model=engine.name, messages=messages, max_tokens=6,
                                                        extra_body={"mtp": bool(i)})
            return r.choices[0].message.content

        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(ask, [0, 1])) == want
    finally:
        server.stop()


def test_an_image_token_quoted_in_text_stays_text(vlm):
    """A message (or an earlier reply) that writes `<|image_pad|>` as text: it is read as plain text, never as a
    second image slot, and the one real image is still read."""
    server, engine, _, _ = vlm
    image = encoded(draw_image(64, 64, seed=13), "PNG")
    quoted = "What does <|image_pad|> mean?"
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                             {"type": "text", "text": quoted}]}]
    r = server.openai().chat.completions.create(model=engine.name, messages=messages, max_tokens=1)
    plain = engine.tokenizer.encode_plain("<|image_pad|>")
    assert len(plain) > 1 and IMAGE_TOKEN not in plain
    image_tokens = len(engine.image_prompt([IMAGE_TOKEN], [image]).tokens)
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": engine.image_marker + quoted}])
    head, rest = text.split(engine.image_marker)
    before, after = rest.split("<|image_pad|>")
    count = lambda s: len(engine.tokenizer.encode(s))  # noqa: E731
    assert r.usage.prompt_tokens == count(head) + 2 + image_tokens + count(before) + len(plain) + count(after)


def test_image_flags_reach_the_settings():
    from hetero.cli.parser import build_parser
    from hetero.errors import HeteroError
    from hetero.server.app import ServerSettings

    given = ServerSettings.from_args(build_parser().parse_args(["serve", "--allow-local-images", "--max-image-mb", "3"]))
    default = ServerSettings.from_args(build_parser().parse_args(["serve"]))
    assert (given.allow_local_images, given.max_image_mb) == (True, 3.0)
    assert (default.allow_local_images, default.max_image_mb) == (False, 20.0)
    with pytest.raises(HeteroError, match="--max-image-mb"):
        ServerSettings(max_image_mb=0)
