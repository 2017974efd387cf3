"""One request down the pipeline: what rank 0 broadcasts to every rank (as JSON) before they run their sides.

`kind` is "generate", "logits" (every position's logits of `prompt`) or "stop" (the ranks stop serving). The
fields a generation needs are checked on rank 0 before it is sent (`PipelineEngine.generate`); the other ranks
take them as they come.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hetero.decode.penalties import Penalties
from hetero.decode.sampling import SamplingParams

KINDS = ("generate", "logits", "stop")


@dataclass(frozen=True)
class Request:
    """A pipelined request, the same on every rank."""

    kind: str
    prompt: list[int] = field(default_factory=list)
    chunk: int = 512  # prefill chunk: the edges are those of one process's prefill
    max_tokens: int = 0
    depth: int = 0  # MTP draft depth (`decode.depth.decode_depth`, rank 0's); 0 decodes plainly
    copy: bool = True  # the copy lane's drafts (MTP)
    seed: int = 0
    eos: list[int] = field(default_factory=list)
    max_context: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prefix_cache: int | None = None  # each rank's prefix-cache budget in bytes; None: no prefix cache
    marks: list[int] = field(default_factory=list)  # prompt positions that also end a prefill chunk
    grammar: str | None = None  # the JSON constraint's grammar (compiled on rank 0); None: unconstrained
    logprobs: int | None = None  # top alternatives per token; None: no logprobs
    stoppable: bool = False  # rank 0 answers every COMMIT with GO_ON or STOP
    penalties: Penalties = field(default_factory=Penalties)  # presence / frequency / repetition, logit_bias (last rank)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown pipeline request kind {self.kind!r}")

    def to_json(self) -> dict:
        """The JSON-able form `Link.broadcast_json` sends."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Request:
        """The request `to_json` sent."""
        return cls(**{**data, "sampling": SamplingParams(**data.get("sampling", {})),
                      "penalties": Penalties(**data.get("penalties", {}))})  # logit_bias keys come back as strings
