"""One generation request, validated once where it enters (CLI, HTTP or library), and the events its stream yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hetero.decode.depth import check_depth
from hetero.decode.logprobs import TokenLogprob, check_top
from hetero.decode.penalties import Penalties
from hetero.decode.prefill import ProgressFn
from hetero.decode.sampling import SamplingParams
from hetero.errors import HeteroError


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate and how: `Engine.stream(request)` runs it.

    `mtp` None decodes with the MTP head whenever the checkpoint has one (unless `hetero tune` saved "off" and no
    `draft_depth` is given); `draft_depth` None takes the tuned or calibrated depth (`depth.decode_depth`).
    `logprobs` N (0..20) reports each token's raw logprob and N alternatives; `json_schema` / `json_object`
    constrain the output to JSON, `grammar` (an llguidance grammar, e.g. `hetero.tools.call_grammar`'s forced tool
    call) to that grammar. `presence_penalty` and `frequency_penalty` (in [-2, 2]), `repetition_penalty`
    (in (0, 2], 1 is off) and `logit_bias` ({token id: bias in [-100, 100]}) follow vLLM (`hetero.decode.penalties`)
    and keep MTP exact. `thinking_budget` N closes the think block (the chat template's way) once it has taken N
    tokens, its closing text included, so the answer follows (`hetero.tools.thinking_budget`; a grammar, which leaves no
    room for a think block, takes precedence). `mark` (a prompt position, where a chat transcript ends) also ends a
    prefill chunk, so the prefix cache checkpoints it. `prompt_cache` is an mlx-lm cache holding the tokens before the
    prompt. `images` (PNG / JPEG / WebP bytes or PIL images) go with a prompt that holds one image token per
    image (`Engine.image_marker` in its text; a `chat` prompt gets them before its text), or are an
    `ImagePrompt` already planned for the prompt's expanded tokens (`Engine.image_prompt`); `mark` then counts in
    the expanded prompt. The engine's parts a request may name: `split` (an ANE split prefill: `.prefill(ids, on_chunk)`)
    and `batch` (a `hetero.decode.loop.Seat` in a shared decode batch). `progress(done, total)` runs after every
    prefill chunk on the generating thread.
    """

    prompt: str | list[int]
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    chat: bool = False
    prefill_chunk: int = 512
    mtp: bool | None = None
    draft_depth: int | None = None
    copy: bool = True
    logprobs: int | None = None
    json_schema: dict | None = None
    json_object: bool = False
    grammar: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    thinking_budget: int | None = None
    mark: int | None = None
    prompt_cache: list | None = None
    use_prefix_cache: bool = True
    split: object | None = None
    batch: object | None = None
    progress: ProgressFn | None = None
    images: Any = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise HeteroError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if not isinstance(self.prefill_chunk, int) or self.prefill_chunk <= 0:
            raise HeteroError(f"--prefill-chunk must be a positive integer, got {self.prefill_chunk!r}")
        if self.draft_depth is not None:
            check_depth(self.draft_depth)
        if self.logprobs is not None:
            check_top(self.logprobs)
        if self.thinking_budget is not None and (not isinstance(self.thinking_budget, int)
                                                 or isinstance(self.thinking_budget, bool) or self.thinking_budget < 0):
            raise HeteroError("thinking_budget must be a whole number of tokens (0 or more), "
                              f"got {self.thinking_budget!r}")
        if sum((self.json_schema is not None, self.json_object, self.grammar is not None)) > 1:
            raise HeteroError("give one of json_schema, json_object or grammar")
        object.__setattr__(self, "logit_bias", self.penalties.logit_bias or None)  # checked; keys as ints

    @property
    def penalties(self) -> Penalties:
        """The request's penalties and logit bias, checked (a one-line HeteroError for a value out of range)."""
        return Penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty, self.logit_bias)


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
