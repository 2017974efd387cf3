"""One request down the pipeline: what rank 0 broadcasts to every rank (as JSON) before they run their sides.

`kind` is "generate", "logits" (every position's logits of `prompt`) or "stop" (the ranks stop serving). The
fields a generation needs are checked on rank 0 before it is sent (`PipelineEngine.generate`); the other ranks
take them as they come.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hetero.decode.options import DecodeOptions

KINDS = ("generate", "logits", "stop")


@dataclass(frozen=True)
class Request:
    """A pipelined request, the same on every rank: a generation's `options` travel whole, as rank 0's prologue
    resolved them (`hetero.prologue.open_request`: max_tokens bound to the window, a JSON Schema compiled into
    `options.grammar`, the seed drawn)."""

    kind: str
    prompt: list[int] = field(default_factory=list)
    options: DecodeOptions = field(default_factory=DecodeOptions)  # a generation's; a logits request's prefill_chunk
    depth: int = 0  # MTP draft depth (`decode.depth.decode_depth`, rank 0's); 0 decodes plainly
    eos: list[int] = field(default_factory=list)
    max_context: int = 0
    prefix_cache: int | None = None  # each rank's prefix-cache budget in bytes; None: no prefix cache
    marks: list[int] = field(default_factory=list)  # prompt positions that also end a prefill chunk
    stoppable: bool = False  # rank 0 answers every COMMIT with GO_ON or STOP

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown pipeline request kind {self.kind!r}")

    def to_json(self) -> dict:
        """The JSON-able form `Link.broadcast_json` sends."""
        return {**asdict(self), "options": self.options.to_json()}

    @classmethod
    def from_json(cls, data: dict) -> Request:
        """The request `to_json` sent."""
        return cls(**{**data, "options": DecodeOptions.from_json(data["options"])})
