"""Repetition penalties and logit bias, as vLLM applies them, exact under MTP.

`Penalties` is what a request asks for (validated where it enters); `Penalizer` is one row's running state: the
prompt's tokens and the counts of the tokens generated so far, on the host. For one position, with `count[t]` the
times token t appears among the generated tokens before it and `seen[t]` whether t is in the prompt or among them:

  z = logits + bias                                        logit_bias, before everything else
  z = where(seen, where(z > 0, z / r, z * r), z)           repetition_penalty r (HF / vLLM form; 1 is off)
  z = z - frequency * count - presence * (count > 0)       OpenAI / vLLM frequency and presence penalties

then the usual temperature / top-k / top-p / min-p warp (`hetero.decode.sampling.warp`), or the argmax when greedy; a JSON
constraint's mask goes after the penalties. Logprobs stay those of the raw model.

Speculative rounds (DESIGN.md section 3) stay exact because every distribution is penalized for the tokens before
its own position: verify position i with the counts of the committed tokens plus drafts d_0..d_{i-1}, MTP draft
step j with the committed tokens plus d_0..d_{j-1}. Acceptance then compares the same penalized target a plain
decode would sample from with the proposal the draft was drawn from, so the output law is plain penalized decoding's.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from hetero.errors import HeteroError
from hetero.validate import Bound

PRESENCE = Bound(-2, 2)  # OpenAI's range for presence_penalty and frequency_penalty
FREQUENCY = Bound(-2, 2)
REPETITION = Bound(0, 2, lo_open=True)  # vLLM's (0, 2]; 1 is off, > 1 discourages repeats, < 1 encourages them
BIAS = Bound(-100, 100)  # OpenAI's logit_bias range: -100 bans a token in practice, 100 all but forces it
PENALTY_NAMES = {"presence_penalty": "presence", "frequency_penalty": "frequency",  # public (OpenAI) name -> field
                 "repetition_penalty": "repetition", "logit_bias": "logit_bias"}


@dataclass(frozen=True)
class Penalties:
    """A request's penalties (vLLM semantics, see the module docstring); the defaults are all off.

    presence in [-2, 2], frequency in [-2, 2] (per generated occurrence), repetition in (0, 2] (1: off),
    logit_bias {token id: bias in [-100, 100]}; keys may be ints or their decimal strings (JSON object keys) and
    are held as ints. Token ids are checked against a vocabulary by `check_vocab`, where the model is known.
    """

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        PRESENCE.check(self.presence, "presence_penalty")
        FREQUENCY.check(self.frequency, "frequency_penalty")
        REPETITION.check(self.repetition, "repetition_penalty (1 is off)")
        object.__setattr__(self, "logit_bias", _bias_dict(self.logit_bias))

    @property
    def active(self) -> bool:
        """Whether any of them changes a logit (rows without take the stepper's plain path)."""
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.logit_bias)

    @property
    def counting(self) -> bool:
        """Whether the generated tokens matter (not only the constant logit_bias)."""
        return bool(self.presence or self.frequency or self.repetition != 1.0)

    def check_vocab(self, vocab: int) -> None:
        """One-line HeteroError when a logit_bias key is no token id of a `vocab`-sized model."""
        bad = next((t for t in self.logit_bias if t >= vocab), None)
        if bad is not None:
            raise HeteroError(f"logit_bias names token id {bad}, outside the model's vocabulary (0..{vocab - 1})")


def _bias_dict(bias) -> dict[int, float]:
    """logit_bias as {int id: float}, or a one-line HeteroError for a non-object, a bad key or a bad value."""
    if bias is None:
        return {}
    if not isinstance(bias, Mapping):
        raise HeteroError(f"logit_bias must be an object mapping token ids to biases, got {type(bias).__name__}")
    out = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().isdigit():
            token = int(key)
        elif isinstance(key, numbers.Integral) and not isinstance(key, bool) and key >= 0:
            token = int(key)
        else:
            raise HeteroError(f"logit_bias key {key!r} is not a token id (an integer >= 0)")
        out[token] = float(BIAS.check(value, f"logit_bias[{token}]"))
    return out


class Penalizer:
    """One row's penalties and what they depend on: the prompt's tokens and the generated tokens committed so far.

    `add` counts committed tokens (host-side, numpy); `__call__` penalizes logits for positions after the committed
    tokens and some drafts. The device copies of the counts are made once per round, and only for rows that have
    penalties: rows without one have no Penalizer at all.
    """

    def __init__(self, penalties: Penalties, prompt: Sequence[int], vocab: int) -> None:
        penalties.check_vocab(vocab)
        self.penalties, self.vocab = penalties, vocab
        self.counts = np.zeros(vocab, dtype=np.int32)  # [V] times each token was generated (committed ones)
        self.generated = 0
        self._counts_dev: mx.array | None = None  # [V] float32 copy of `counts`, until the next `add`
        self.bias: mx.array | None = None  # [V] float32
        if penalties.logit_bias:
            bias = np.zeros(vocab, dtype=np.float32)
            bias[list(penalties.logit_bias)] = list(penalties.logit_bias.values())
            self.bias = mx.array(bias)
        self.in_prompt: mx.array | None = None  # [V] bool, for the repetition penalty only
        if penalties.repetition != 1.0:
            seen = np.zeros(vocab, dtype=bool)
            seen[np.asarray(prompt, dtype=np.int64)] = True
            self.in_prompt = mx.array(seen)

    def add(self, tokens: Iterable[int]) -> None:
        """Count committed generated tokens (the first token, then each round's kept drafts and next token)."""
        tokens = list(tokens)
        if tokens and self.penalties.counting:
            np.add.at(self.counts, np.asarray(tokens, dtype=np.int64), 1)
            self._counts_dev = None
        self.generated += len(tokens)

    def __call__(self, logits: mx.array, drafts: Sequence[int | mx.array] = ()) -> mx.array:
        """logits [n, V] -> penalized logits [n, V] (float32) for n consecutive positions after the committed tokens.

        `drafts` (m >= n - 1 ints or lazy scalars) are the uncommitted tokens before the last position; position i
        sees all but the last n - 1 - i of them: a verify row [x, d_0..d_{k-1}] gives n = k + 1 and the k drafts
        (position i sees d_0..d_{i-1}); MTP draft step j gives n = 1 and d_0..d_{j-1}.
        """
        n, m, p = logits.shape[0], len(drafts), self.penalties
        if m < n - 1:
            raise ValueError(f"{n} positions need at least {n - 1} drafts before them, got {m}")
        z = logits.astype(mx.float32)
        if self.bias is not None:
            z = z + self.bias
        if not p.counting:
            return z
        if self._counts_dev is None:
            self._counts_dev = mx.array(self.counts.astype(np.float32))
        counts = mx.broadcast_to(self._counts_dev, (n, self.vocab))  # [n, V]
        if m:
            ids = mx.stack([mx.array(d) for d in drafts]).astype(mx.int32).reshape(m)  # [m]
            onehot = (ids[:, None] == mx.arange(self.vocab)[None]).astype(mx.float32)  # [m, V]
            before = mx.concatenate([mx.zeros((1, self.vocab)), mx.cumsum(onehot, axis=0)])  # [m+1, V] drafts[:t]
            counts = counts + before[m - n + 1 :]  # [n, V]: position i sees drafts[: m - n + 1 + i]
        if p.repetition != 1.0:
            seen = mx.logical_or(self.in_prompt[None], counts > 0)  # [n, V]
            z = mx.where(seen, mx.where(z > 0, z / p.repetition, z * p.repetition), z)
        if p.frequency:
            z = z - p.frequency * counts
        if p.presence:
            z = z - p.presence * (counts > 0).astype(mx.float32)
        return z


def penalizer_for(penalties: Penalties | None, prompt: Sequence[int], vocab: int) -> Penalizer | None:
    """A row's Penalizer, or None when `penalties` change nothing (the row then takes the unpenalized path)."""
    return Penalizer(penalties, prompt, vocab) if penalties is not None and penalties.active else None
