"""What a generation records as it runs: wall-clock marks, the backbone's trace (for checkpoints), MTP counters."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx


@dataclass
class DecodeTimes:
    """Wall-clock marks of one generation, filled in as it runs."""

    start: float = 0.0
    first_token: float = 0.0
    end: float = 0.0
    prompt_tokens: int = 0
    generated: int = 0
    finish_reason: str = "length"

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.start

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        span = self.end - self.first_token
        return (self.generated - 1) / span if self.generated > 1 and span > 0 else 0.0


@dataclass
class Trace:
    """What the backbone ran for one generation, for a checkpoint of its end state.

    `hidden` holds post-norm hiddens [1, H]: the prompt's last position, then one per decode step;
    `tokens` the ids each decode step ran (scalar arrays, evaluated lazily).
    """

    hidden: list[mx.array] = field(default_factory=list)
    tokens: list[mx.array] = field(default_factory=list)


@dataclass
class MTPStats:
    """Per-generation speculation counters; `to_dict` gives the `mtp` block of `--json`."""

    depth: int
    rounds: int = 0
    mtp_rounds: int = 0
    reached: list[int] = field(default_factory=list)  # reached[i]: MTP rounds that drafted position i
    accepted: list[int] = field(default_factory=list)  # accepted[i]: MTP rounds with positions 0..i all accepted
    accepted_lengths: int = 0  # sum over rounds of (accepted + 1)
    emitted: int = 0  # tokens emitted by verify passes
    copy_drafted: int = 0
    copy_accepted: int = 0

    def __post_init__(self) -> None:
        self.reached = [0] * self.depth
        self.accepted = [0] * self.depth

    def record(self, drafted: int, n_accepted: int, copied: bool) -> None:
        self.rounds += 1
        self.accepted_lengths += n_accepted + 1
        if copied:
            self.copy_drafted += drafted
            self.copy_accepted += n_accepted
            return
        self.mtp_rounds += 1
        for i in range(min(drafted, self.depth)):
            self.reached[i] += 1
            self.accepted[i] += int(n_accepted > i)

    def to_dict(self) -> dict:
        return {
            "depth": self.depth,
            "rounds": self.rounds,
            "acceptance_by_depth": [round(a / r, 4) if r else None for a, r in zip(self.accepted, self.reached)],
            "mean_accepted_length": round(self.accepted_lengths / self.rounds, 4) if self.rounds else None,
            "tokens_per_pass": round(self.emitted / self.rounds, 4) if self.rounds else None,
            "copy_drafted": self.copy_drafted,
            "copy_accepted": self.copy_accepted,
            # the raw counts behind the ratios (summed across requests by the server's /metrics)
            "mtp_rounds": self.mtp_rounds,
            "drafted_by_depth": list(self.reached),
            "accepted_by_depth": list(self.accepted),
            "emitted": self.emitted,
        }
