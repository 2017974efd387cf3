"""A request's decode options: one typed object, checked once where it is made (the server's parser, the library's
keywords, the CLI's flags) and passed whole from there to the row that decodes it.

Each option is read where it applies: `sampling` and `seed` make the row's `Sampler`, `penalties` its `Penalizer`,
`copy` its copy lane, `prefill_chunk` its prefill (`hetero.decode.stepper.Batch.prefilled`); `max_tokens` ends it
(`hetero.decode.rows.Row.take`); the engine resolves `mtp` / `draft_depth` to a depth (`depth.decode_depth`) and
`json_schema` / `json_object` / `grammar` / `thinking_budget` to a constraint; `logprobs` sizes the recorder. A new
option is one field here (its check in `__post_init__`) and the one place that reads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hetero.decode.depth import check_depth
from hetero.decode.logprobs import check_top
from hetero.decode.penalties import PENALTY_NAMES, Penalties
from hetero.decode.sampling import SamplingParams
from hetero.errors import HeteroError
from hetero.validate import check_seed

SAMPLING_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams))  # temperature, top_k, top_p, min_p


@dataclass(frozen=True)
class DecodeOptions:
    """How a request decodes; the defaults are greedy, 256 tokens, the depth policy's MTP (`depth.decode_depth`).

    `mtp` None decodes with the MTP head whenever the checkpoint has one (unless `hetero tune` saved "off" and no
    `draft_depth` is given); `draft_depth` None takes the tuned or calibrated depth. `copy` lets the copy lane draft
    (MTP). `logprobs` N (0..20) reports each token's raw logprob and N alternatives; `json_schema` / `json_object`
    constrain the output to JSON, `grammar` (an llguidance grammar, e.g. `hetero.tools.call_grammar`'s forced tool
    call) to that grammar. `penalties` (presence, frequency, repetition, logit_bias) follow vLLM
    (`hetero.decode.penalties`) and keep MTP exact. `thinking_budget` N closes the think block (the chat template's
    way) once it has taken N tokens, its closing text included, so the answer follows
    (`hetero.tools.thinking_budget`; a grammar, which leaves no room for a think block, takes precedence).
    """

    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    penalties: Penalties = field(default_factory=Penalties)
    prefill_chunk: int = 512
    mtp: bool | None = None
    draft_depth: int | None = None
    copy: bool = True
    logprobs: int | None = None
    json_schema: dict | None = None
    json_object: bool = False
    grammar: str | None = None
    thinking_budget: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise HeteroError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if not isinstance(self.prefill_chunk, int) or self.prefill_chunk <= 0:
            raise HeteroError(f"--prefill-chunk must be a positive integer, got {self.prefill_chunk!r}")
        check_seed(self.seed)
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

    def to_json(self) -> dict:
        """The JSON-able form (a pipelined request sends it to every rank)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> DecodeOptions:
        """The options `to_json` made (logit_bias keys come back as strings: `Penalties` takes them)."""
        return cls(**{**data, "sampling": SamplingParams(**data["sampling"]),
                      "penalties": Penalties(**data["penalties"])})


def decode_options(base: DecodeOptions | None = None, *args, **named) -> DecodeOptions:
    """`base` (default: all defaults; or positional max_tokens, sampling) with the `named` options replaced: its own
    fields, SamplingParams' (temperature, top_k, top_p, min_p) and the penalties' public names (presence_penalty,
    frequency_penalty, repetition_penalty, logit_bias) by name, as `Engine.generate` and the server take them. An
    unknown name is a one-line HeteroError."""
    if len(args) > 2:
        raise TypeError("only max_tokens and sampling may be given by position; name the other options")
    own = {f.name for f in dataclasses.fields(DecodeOptions)}
    unknown = sorted(set(named) - own - set(SAMPLING_NAMES) - set(PENALTY_NAMES))
    if unknown:
        raise HeteroError(f"unknown generation argument {unknown[0]!r}; see hetero.GenerationRequest for the fields")
    fields = {k: v for k, v in named.items() if k in own}
    fields.update(zip(("max_tokens", "sampling"), args))
    options = dataclasses.replace(base, **fields) if base is not None else DecodeOptions(**fields)
    sampling = {k: v for k, v in named.items() if k in SAMPLING_NAMES}
    penalties = {PENALTY_NAMES[k]: v for k, v in named.items() if k in PENALTY_NAMES}
    if sampling or penalties:
        options = dataclasses.replace(options, sampling=dataclasses.replace(options.sampling, **sampling),
                                      penalties=dataclasses.replace(options.penalties, **penalties))
    return options
