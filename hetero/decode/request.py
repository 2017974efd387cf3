"""One generation request, validated once where it enters (CLI, HTTP or library), and the events its stream yields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hetero.decode.logprobs import TokenLogprob
from hetero.decode.options import DecodeOptions, decode_options
from hetero.decode.prefill import ProgressFn


@dataclass(frozen=True, init=False)
class GenerationRequest:
    """What to generate and how: `Engine.stream(request)` runs it.

    `GenerationRequest(prompt, max_tokens=..., temperature=..., seed=..., chat=..., ...)`: the prompt, its decode
    options by name (`DecodeOptions`' fields, SamplingParams' temperature / top_k / top_p / min_p, and
    presence_penalty / frequency_penalty / repetition_penalty / logit_bias), and the request's own fields below;
    `options=` gives a `DecodeOptions` whole (named options then replace its values). The options are checked here,
    once, and travel whole to the row (`request.options`; `request.seed` and the like read them too).

    `chat` wraps a text prompt in the chat template as one user turn. `mark` (a prompt position, where a chat
    transcript ends) also ends a prefill chunk, so the prefix cache checkpoints it. `prompt_cache` is an mlx-lm cache
    holding the tokens before the prompt; `use_prefix_cache` False leaves the engine's prefix cache out. `images`
    (PNG / JPEG / WebP bytes or PIL images) go with a prompt that holds one image token per image
    (`Engine.image_marker` in its text; a `chat` prompt gets them before its text), or are an `ImagePrompt` already
    planned for the prompt's expanded tokens (`Engine.image_prompt`); `mark` then counts in the expanded prompt. The
    engine's parts a request may name: `split` (an ANE split prefill: `.prefill(ids, on_chunk)`) and `batch` (a
    `hetero.decode.loop.Seat` in a shared decode batch). `progress(done, total)` runs after every prefill chunk on
    the generating thread.
    """

    prompt: str | list[int]
    options: DecodeOptions
    chat: bool = False
    mark: int | None = None
    prompt_cache: list | None = None
    use_prefix_cache: bool = True
    split: object | None = None
    batch: object | None = None
    progress: ProgressFn | None = None
    images: Any = ()

    def __init__(self, prompt: str | list[int], *args, options: DecodeOptions | None = None, **named) -> None:
        own = {f.name: f for f in dataclasses.fields(GenerationRequest)[2:]}
        for name, f in own.items():
            object.__setattr__(self, name, named.pop(name) if name in named else f.default)
        object.__setattr__(self, "prompt", prompt)
        object.__setattr__(self, "options", decode_options(options, *args, **named))

    def __getattr__(self, name: str):
        """A decode option read off the request (`request.max_tokens`), as before they were grouped."""
        if name != "options" and name in DecodeOptions.__dataclass_fields__:
            return getattr(self.options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


@dataclass(frozen=True)
class Prefilled:
    """The prompt is in the cache and the first token is drawn: its size, and the tokens read from a cache."""

    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Token:
    """One generated token (EOS is never one), the text it completes (may be empty) and its logprobs if asked."""

    id: int
    text: str
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class Finished:
    """The generation's end: its text's last piece (held back by the detokenizer), why it ended, and its stats (the
    keys `hetero run --json` prints)."""

    text: str
    finish_reason: str
    stats: dict


Event = Prefilled | Token | Finished
STOP = "stop"  # `stream.send(STOP)` ends a generation at the token just yielded; the reply is its `Finished`
