"""Bad image bytes are the client's error, whatever the decoder raises: truncated, oversized and random bytes in every
image field of every API (OpenAI chat `image_url`, Responses `input_image`, Anthropic `image` blocks, also inside a
`tool_result`), and the same for the base64 text that carries them, streamed or not, get a 400 that names the field
and says what is wrong in one line, never a 500.

Before, a PNG cut inside its header reached Pillow's `Image.open`, whose OSError ("Truncated File Read") no catch
named: a 500. And a PNG cut inside its last chunk decoded (Pillow reads the pixels before it): a damaged file taken
as whole. Every decoder now runs inside `hetero.server.refusals.refusing`, and a PNG must end with its IEND chunk.
"""

from __future__ import annotations

import base64
import json
import os

import hetero  # noqa: F401  (before torch: the fast BLAS under MLX)
import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetero.caches.prefix import PrefixCache
from tests.test_server import LiveServer
from tests.vision_checkpoint import draw_image, encoded, save_chat_tokenizer, save_vl

MAX_MB = 0.05  # the server's --max-image-mb: an oversized image costs little to send
FUZZ = settings(max_examples=int(os.environ.get("HETERO_FUZZ_EXAMPLES", 60)), deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
IMAGES = {fmt: encoded(draw_image(40, 32, seed=5), fmt) for fmt in ("PNG", "JPEG", "WEBP")}
MEDIA = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("vl-fuzz")
    save_vl(path, "small")
    save_chat_tokenizer(path)
    engine = hetero.load(path)
    engine.prefix_cache = PrefixCache()
    live = LiveServer(engine, max_image_mb=MAX_MB)
    yield live, engine.name
    live.stop()


def request(api: str, model: str, data: bytes | str, media: str, stream: bool) -> tuple[str, dict, str]:
    """(path, body, the field that holds the image) for an image of `data` sent through `api` (text: the base64
    itself)."""
    b64 = data if isinstance(data, str) else base64.b64encode(data).decode()
    url = f"data:{media};base64,{b64}"
    block = {"type": "image", "source": {"type": "base64", "media_type": media, "data": b64}}
    if api == "chat":
        return "/v1/chat/completions", {"model": model, "max_tokens": 2, "stream": stream, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "what is it?"}]}]}, "messages[0].content[0]"
    if api == "responses":
        return "/v1/responses", {"model": model, "max_output_tokens": 2, "stream": stream, "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": url},
                                         {"type": "input_text", "text": "what is it?"}]}]}, "input[0].content[0]"
    if api == "messages":
        return "/v1/messages", {"model": model, "max_tokens": 2, "stream": stream, "messages": [
            {"role": "user", "content": [block, {"type": "text", "text": "what is it?"}]}]}, "messages[0].content[0]"
    return "/v1/messages", {"model": model, "max_tokens": 2, "stream": stream, "messages": [  # inside a tool_result
        {"role": "user", "content": "take a screenshot"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [block]}]}]}, \
        "messages[2].content[0]"


def bad_bytes() -> st.SearchStrategy[tuple[str, bytes, str]]:
    """(what, bytes or base64 text, media type): a real image cut anywhere (its header included), random bytes, bytes
    past --max-image-mb, or its base64 cut anywhere or made of random text."""
    cut = st.sampled_from(sorted(IMAGES)).flatmap(lambda fmt: st.integers(0, len(IMAGES[fmt]) - 1).map(
        lambda k: ("truncated", IMAGES[fmt][:k], MEDIA[fmt])))
    noise = st.binary(min_size=0, max_size=4096).map(lambda b: ("random", b, "image/png"))
    big = st.integers(int(MAX_MB * 2**20) + 1, int(MAX_MB * 2**20) + 40_000).map(
        lambda n: ("oversized", np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes(), "image/png"))
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="
    text = st.one_of(  # the base64 decoder's own input: a real image's base64 cut anywhere, or text of its alphabet
        st.sampled_from(sorted(IMAGES)).flatmap(lambda fmt: st.integers(1, len(_b64(fmt)) - 1).map(
            lambda k: ("base64 cut", _b64(fmt)[:k], MEDIA[fmt]))),
        st.text(alphabet=alphabet + "!@ \n-_", min_size=1, max_size=200).map(lambda t: ("base64 text", t, "image/png")))
    return st.one_of(cut, noise, big, text)


def _b64(fmt: str) -> str:
    return base64.b64encode(IMAGES[fmt]).decode()


@FUZZ
@given(api=st.sampled_from(["chat", "responses", "messages", "tool_result"]), bad=bad_bytes(), stream=st.booleans())
def test_bad_image_bytes_are_a_400_in_every_image_field(server, api, bad, stream):
    live, model = server
    what, data, media = bad
    path, body, field = request(api, model, data, media, stream)
    r = httpx.post(live.url + path, content=json.dumps(body), timeout=60,
                   headers={"content-type": "application/json", "anthropic-version": "2023-06-01"})
    assert r.status_code == 400, (what, len(data), r.status_code, r.text[:500])
    error = r.json()["error"]
    message = error["message"]
    assert field in message and "\n" not in message and "Traceback" not in message, message
    if what == "oversized":
        assert "image too large" in message


@pytest.mark.parametrize("fmt", sorted(IMAGES))
def test_every_cut_of_a_real_image_is_refused(server, fmt):
    """Not a draw: every cut point of each format, through the decoder the server runs (the whole file decodes)."""
    from hetero.server.refusals import RequestError, refusing
    from hetero.models.qwen3_5_vision.preprocess import decode_image

    whole = IMAGES[fmt]
    decode_image(whole)
    for k in range(len(whole)):
        with pytest.raises(RequestError) as e, refusing("image", "the image cannot be decoded", "invalid_image"):
            decode_image(whole[:k])
        assert e.value.status == 400 and e.value.code == "invalid_image"


def test_a_png_cut_inside_its_header_was_a_500():
    """The issue's own case, named: the PNG signature and part of IHDR."""
    from hetero.server.refusals import RequestError, refusing
    from hetero.models.qwen3_5_vision.preprocess import decode_image

    with pytest.raises(RequestError, match="Truncated File Read"), refusing("image", "the image cannot be decoded"):
        decode_image(IMAGES["PNG"][:20])
