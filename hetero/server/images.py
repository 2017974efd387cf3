"""Images in requests for a checkpoint with a vision tower: OpenAI chat `image_url`, Responses `input_image` and
Anthropic `image` parts -> decoded images, each standing in the text as a marker until the chat template has
placed it, then as the checkpoint's image tokens (`Engine.image_marker`), in the order the prompt shows them.

Sources: data URLs and Anthropic base64 blocks; local file paths (`file://` or absolute) only with
`hetero serve --allow-local-images`; http(s) URLs are refused (the server fetches nothing). Each image is at most
`max_bytes` as a file and `preprocess.decode_image`'s pixel bound when decoded; every refusal is one 400 line that
names the part.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

from PIL import Image

from hetero.errors import HeteroError
from hetero.models.qwen3_5_vision.preprocess import decode_image
from hetero.server.refusals import RequestError, refusing
from hetero.vision.prompt import ImagePrompt

DEFAULT_MAX_IMAGE_MB = 20.0
_SLOT = "\ue000hetero-image-{}\ue000"  # private-use characters: no template or client text writes them
_SLOT_RE = re.compile("\ue000hetero-image-(\\d+)\ue000")


class ImageInputs(list):
    """Collects a request's images while its messages are converted (`take`, one per image part, returns the
    text that stands for it) and places them once the template has rendered the prompt (`place`).

    A list, as the placeholder collector is, but one that stays empty: no image is omitted."""

    def __init__(self, vision, tokenizer, allow_local: bool = False,
                 max_bytes: int = int(DEFAULT_MAX_IMAGE_MB * 2**20)):
        super().__init__()
        self.marker, self.marker_ids, self.tokenizer = vision.marker, vision.marker_ids, tokenizer
        self.allow_local, self.max_bytes = allow_local, max_bytes
        pads = [vision.image_token, vision.config.get("video_token_id")]
        # an image's (or video's) token written as text in a message reads as text, never as an image slot
        self._quoted = re.compile("|".join(re.escape(tokenizer.decode([t])) for t in pads if isinstance(t, int)))
        self.images: list[Image.Image] = []

    def take(self, part: dict, place: str) -> str:
        """An image part -> its slot text; the image is read and decoded now, so a bad one is a 400 naming it,
        whatever the decoder raised."""
        data = self._bytes(part, place)
        with refusing(place, "the image cannot be decoded (send the file again, whole)", "invalid_image"):
            self.images.append(decode_image(data))
        return _SLOT.format(len(self.images) - 1)

    def encode(self, text: str) -> list[int]:
        """A rendered prompt with slots -> token ids: each slot the image's marker tokens, the text between them as
        the tokenizer reads it, except image tokens quoted in it (read as plain text)."""
        ids: list[int] = []
        for i, piece in enumerate(_SLOT_RE.split(text)):  # text, slot number, text, ...
            if i % 2:
                ids += self.marker_ids
                continue
            at = 0
            for quoted in self._quoted.finditer(piece):
                ids += self.tokenizer.encode(piece[at : quoted.start()]) + self.tokenizer.encode_plain(quoted.group())
                at = quoted.end()
            ids += self.tokenizer.encode(piece[at:])
        return ids

    def substitute(self, text: str) -> str:
        """Every slot in `text` -> the checkpoint's image marker."""
        return _SLOT_RE.sub(lambda _: self.marker, text)

    def order(self, prompt: str) -> list[Image.Image]:
        """The images in the order the rendered prompt shows their slots (each once)."""
        seen = [int(m) for m in _SLOT_RE.findall(prompt)]
        if sorted(seen) != list(range(len(self.images))):
            raise RequestError(400, f"the chat template placed {len(seen)} of the request's {len(self.images)} "
                               "image(s); send images in user messages", "messages", "invalid_image")
        return [self.images[i] for i in seen]

    def _bytes(self, part: dict, place: str) -> bytes:
        kind = part.get("type")
        if kind == "image":  # Anthropic: {"source": {"type": "base64", "media_type", "data"} | {"type": "url", ...}}
            source = part.get("source")
            if not isinstance(source, dict):
                raise RequestError(400, f"'{place}.source' must be an object", f"{place}.source")
            if source.get("type") == "base64":
                return self._base64(source.get("data"), f"{place}.source.data")
            if source.get("type") == "url":
                return self._url(source.get("url"), f"{place}.source.url")
            raise RequestError(400, f"'{place}.source.type' {source.get('type')!r} is not supported: send base64 "
                               "image data", f"{place}.source.type")
        url = part.get("image_url")  # chat: {"image_url": {"url"}}; Responses: {"image_url": "..."}
        if isinstance(url, dict):
            url = url.get("url")
        if url is None and part.get("file_id") is not None:
            raise RequestError(400, f"'{place}.file_id': uploaded files are not stored here; send the image as a "
                               "data URL", f"{place}.file_id")
        return self._url(url, f"{place}.image_url")

    def _url(self, url: Any, where: str) -> bytes:
        if not isinstance(url, str) or not url:
            raise RequestError(400, f"'{where}' must be a data URL (data:image/png;base64,...)", where)
        if url.startswith("data:"):
            head, comma, data = url.partition(",")
            if not comma or not head.endswith(";base64"):
                raise RequestError(400, f"'{where}': a data URL must be base64 (data:image/png;base64,...)", where)
            return self._base64(data, where)
        if url.startswith(("http://", "https://")):
            raise RequestError(400, f"'{where}': image URLs are not fetched (this server reaches no network); send "
                               "the image as a data URL (data:image/png;base64,...)", where, "invalid_image")
        path = Path(url[len("file://"):] if url.startswith("file://") else url)
        if not path.is_absolute():
            raise RequestError(400, f"'{where}' must be a data URL (data:image/png;base64,...), or an absolute file "
                               "path under --allow-local-images", where)
        if not self.allow_local:
            raise RequestError(400, f"'{where}': local image paths are read only when the server runs with "
                               "--allow-local-images; send the image as a data URL", where, "invalid_image")
        with refusing(where, f"cannot read {path}", "invalid_image"):
            self._check_size(path.stat().st_size, where)
            return path.read_bytes()

    def _base64(self, data: Any, where: str) -> bytes:
        if not isinstance(data, str):
            raise RequestError(400, f"'{where}' must be base64 text", where)
        self._check_size(len(data) * 3 // 4, where)
        with refusing(where, "not valid base64", "invalid_image"):
            return base64.b64decode(data, validate=True)

    def _check_size(self, size: int, where: str) -> None:
        if size > self.max_bytes:
            raise RequestError(400, f"'{where}': image too large ({size / 2**20:.1f} MB; at most "
                               f"{self.max_bytes / 2**20:g} MB, hetero serve --max-image-mb)", where, "image_too_large")


def place_images(engine, images: ImageInputs, prompt: str, ids: list[int], mark: int | None
                 ) -> tuple[list[int], ImagePrompt, int | None]:
    """The rendered prompt's ids (one image token per image) -> the expanded ids, their `ImagePrompt` and `mark`
    moved past the image tokens before it."""
    with refusing("messages", "the images cannot be placed in the prompt", "invalid_image", prefix=False):
        try:
            vision = engine.image_prompt(ids, images.order(prompt))
        except HeteroError as e:
            code = "context_length_exceeded" if "context window" in str(e) else "invalid_image"
            raise RequestError(400, str(e), "messages", code) from None
    if mark is not None:
        extra = 0  # image tokens added before the mark
        for lo, hi in vision.spans:
            if lo - extra < mark:  # the image's placeholder stood before the mark
                extra += hi - lo - 1
        mark += extra
    return vision.tokens, vision, mark
