"""Speculative decoding with the model's own MTP head (and a copy lane), under exact acceptance.

One round, with the backbone at length n and the next token x = x_n sampled but not yet run:
  draft   the MTP head catches up on the committed (token, hidden) pairs it has not seen, which yields the
          first draft, then feeds itself k-1 more times (its post-norm output, the previous draft);
          or the copy lane proposes the continuation of an n-gram seen earlier in the context.
  verify  one backbone pass over [x, d_0..d_{k-1}]; GDN layers record the state after every token.
  accept  `accept_drafts` / `accept_greedy`: a drafts kept, then one corrected or bonus token.
  commit  attention KV trimmed to n+a+1, GDN state and conv window installed as recorded after token a,
          the MTP KV trimmed to its committed part; the verify hiddens h_n..h_{n+a} wait for the next catch-up.
Nothing accepted is ever re-run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from hetero.cache import GDNCache, KVCache, LayerCache, cache_arrays
from hetero.constrained import Constraint
from hetero.generate import ChunkFn, DecodeTimes, ProgressFn, prefill
from hetero.logprobs import LogprobRecorder
from hetero.models.qwen3_5 import RECURRENT_MAX_TOKENS, Model
from hetero.sampling import Sampler, accept_drafts, accept_greedy, sample, warp
from hetero.settings import DEFAULT_DRAFT_DEPTH, PLAIN
from hetero.validate import Bound

MAX_DEPTH = RECURRENT_MAX_TOKENS - 1  # a verify pass (k+1 tokens) must take the recorded recurrent path
DEPTH = Bound(1, MAX_DEPTH, integer=True)  # a draft depth: `--draft-depth`'s argparse type and `check_depth`
COPY_NGRAM = 3


def check_depth(depth, name: str = "--draft-depth") -> int:
    """`depth` when it is a draft depth (an integer in 1..MAX_DEPTH), else a one-line HeteroError naming `name`:
    the one check of a depth, made where one enters (`decode_depth`, a batch join, `mtp_generate_tokens`)."""
    return DEPTH.check(depth, name)


def decode_depth(has_mtp: bool, mtp: bool | None, given: int | None, tuned: int | str | None = None) -> int:
    """The depth policy: the draft depth a generation decodes at, 0 for plain decoding.

    `given` (the caller's `--draft-depth`, checked here) wins; else `tuned` (what `hetero tune` or the first-use
    calibration saved: a depth, or PLAIN); else DEFAULT_DRAFT_DEPTH. `mtp` False decodes plainly, True with MTP,
    None as the model can: MTP when it has a head, unless `tuned` is PLAIN and no depth is given. A saved depth
    outside 1..MAX_DEPTH (a hand-edited settings file) is ignored, never trusted."""
    if given is not None:
        check_depth(given)
    use_mtp = (has_mtp and (given is not None or tuned != PLAIN)) if mtp is None else mtp
    if not use_mtp:
        return 0
    if given is not None:
        return given
    return tuned if isinstance(tuned, int) and DEPTH.problem(tuned) is None else DEFAULT_DRAFT_DEPTH


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
        }


class CopyLane:
    """Proposes the continuation of the latest earlier occurrence of the context's last n-gram."""

    def __init__(self, tokens: list[int], n: int = COPY_NGRAM):
        self.n = n
        self.tokens: list[int] = []
        self.last_seen: dict[tuple[int, ...], int] = {}  # n-gram -> position right after its latest occurrence
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            if end > self.n:  # index the n-gram ending one before the newest token: its successor is known
                self.last_seen[tuple(self.tokens[end - 1 - self.n : end - 1])] = end - 1

    def propose(self, k: int) -> list[int]:
        if len(self.tokens) < self.n:
            return []
        start = self.last_seen.get(tuple(self.tokens[-self.n :]))
        return [] if start is None else self.tokens[start : start + k]


@dataclass
class Decoder:
    """Speculative decoding state between rounds.

    The backbone has run every committed token but `x`, the latest one; `pending_hidden` [m, H] holds the
    backbone hiddens the MTP head has not consumed yet, paired with `pending_tokens + [x]`.
    """

    model: Model
    cache: list[LayerCache]
    x: int
    pending_hidden: mx.array
    pending_tokens: list[int] = field(default_factory=list)
    lane: CopyLane | None = None

    @property
    def backbone(self) -> list[LayerCache]:
        return self.cache[: len(self.model.layers)]

    @property
    def mtp_cache(self) -> list[KVCache]:
        return self.cache[len(self.model.layers) :]  # type: ignore[return-value]

    @property
    def length(self) -> int:
        """Tokens the backbone has run (all committed tokens but x)."""
        return self.backbone[0].offset

    def propose(
        self, k: int, copy_k: int, sampler: Sampler, constraint: Constraint | None = None
    ) -> tuple[list[int], mx.array | None, bool]:
        """Drafts for one round: (ids, their proposal log-probs or None for a point mass, from the copy lane).

        With a `constraint`, drafts are legal and consumed by it (copied ones cut at the first illegal token)."""
        if self.lane is not None and copy_k > 0:
            copied = self.lane.propose(copy_k)
            if constraint is not None:
                copied = copied[: constraint.extend(copied)]
            if copied:
                return copied, None, True
        if k == 0:
            return [], None, False
        drafts, logprobs = _draft(
            self.model, self.mtp_cache, self.pending_tokens + [self.x], self.pending_hidden, k, sampler, constraint
        )
        self.pending_tokens, self.pending_hidden = [], self.pending_hidden[:0]
        return drafts, logprobs, False

    def verify(self, drafts: list[int]) -> tuple[mx.array, mx.array]:
        """One backbone pass over [x, drafts], GDN layers recording: (target logits [k+1, V], hiddens [k+1, H])."""
        for c in self.backbone:
            if isinstance(c, GDNCache):
                c.start_recording()
        hidden = self.model.model(mx.array([self.x] + drafts)[None], self.backbone)[0]  # [k+1, H]
        return self.model.logits(hidden), hidden

    def commit(self, drafts: list[int], hidden: mx.array, accepted: int, nxt: int, mtp_ran: bool) -> None:
        """Keep x and the first `accepted` drafts; `nxt` becomes the new x. Nothing is re-run."""
        n = self.length - len(drafts) - 1  # where the verify pass started
        for c in self.backbone:
            if isinstance(c, GDNCache):
                c.commit(accepted + 1)
            else:
                c.trim_to(n + accepted + 1)
        for c in self.mtp_cache:  # drop the draft chain's speculative positions, keep the catch-up
            c.trim_to(c.offset - (len(drafts) - 1 if mtp_ran and drafts else 0))
        if not mtp_ran:
            self.pending_tokens.append(self.x)
        self.pending_tokens += drafts[:accepted]
        self.pending_hidden = mx.concatenate([self.pending_hidden, hidden[: accepted + 1]], axis=0)
        mx.eval(self.pending_hidden, *cache_arrays(self.cache))
        if self.lane is not None:
            self.lane.extend(drafts[:accepted] + [nxt])
        self.x = nxt


def run_round(
    decoder: Decoder,
    sampler: Sampler,
    k: int,
    copy_k: int,
    constraint: Constraint | None = None,
    logprobs: LogprobRecorder | None = None,
) -> tuple[list[int], int, bool]:
    """Draft, verify, accept, commit: returns (drafts, accepted count, from the copy lane); decoder.x is the new token.

    A `constraint` (which has consumed decoder.x) masks verify position i given x and d_0..d_{i-1}, the masks the
    drafts were proposed under; it is rolled back over the rejected drafts and advanced by the new token.
    `logprobs` records the kept drafts and the new token from the unmasked target rows.
    """
    drafts, draft_logprobs, copied = decoder.propose(k, copy_k, sampler, constraint)
    target, hidden = decoder.verify(drafts)  # [k+1, V], [k+1, H]
    masked = target if constraint is None else mx.where(constraint.recent_masks(len(drafts) + 1), target, -mx.inf)
    d = mx.array(drafts, dtype=mx.int32)
    if sampler.params.greedy:
        n_acc, nxt = accept_greedy(masked, d)
    else:
        n_acc, nxt = accept_drafts(warp(masked, sampler.params), d, draft_logprobs, sampler.next_key())
    mx.eval(n_acc, nxt)
    accepted, token = n_acc.item(), nxt.item()
    if constraint is not None:
        constraint.rollback(len(drafts) - accepted)
        constraint.advance(token)
    if logprobs is not None:
        logprobs.add(target[: accepted + 1], drafts[:accepted] + [token])
    decoder.commit(drafts, hidden, accepted, token, mtp_ran=bool(drafts) and not copied)
    return drafts, accepted, copied


def mtp_generate_tokens(
    model: Model,
    prompt: list[int],
    sampler: Sampler,
    max_tokens: int,
    eos_ids: set[int],
    depth: int = DEFAULT_DRAFT_DEPTH,
    copy: bool = True,
    chunk: int = 512,
    progress: ProgressFn | None = None,
    times: DecodeTimes | None = None,
    stats: MTPStats | None = None,
    cache: list[LayerCache] | None = None,
    max_context: int | None = None,
    skip: int = 0,
    carry: mx.array | None = None,
    on_chunk: ChunkFn | None = None,
    on_commit: Callable[[Decoder, list[int]], None] | None = None,
    constraint: Constraint | None = None,
    logprobs: LogprobRecorder | None = None,
    marks: Sequence[int] = (),
) -> Iterator[int]:
    """Yield generated token ids (EOS excluded), exactly as `generate_tokens` would in distribution.

    `skip`/`carry`/`on_chunk`/`marks` as in `start`; `on_commit(decoder, tokens)` sees the committed state after
    the first token and after every round, with the tokens that state newly committed (the last one is decoder.x).
    `constraint` and `logprobs` as in `generate_tokens`; `logprobs` may record a few tokens past the last one
    yielded (those a round committed after an EOS or max_tokens): its i-th item is the i-th token yielded.
    """
    check_depth(depth, "draft depth")  # past MAX_DEPTH a verify pass would not record the states it rolls back to
    times = times if times is not None else DecodeTimes()
    stats = stats if stats is not None else MTPStats(depth)
    times.start, times.prompt_tokens = times.start or time.perf_counter(), len(prompt)  # a caller may start earlier
    max_context = max_context or model.args.max_position_embeddings
    if max_tokens <= 0:
        times.first_token = times.end = time.perf_counter()
        return
    decoder = start(model, prompt, sampler, cache, chunk, progress, copy, skip, carry, on_chunk, constraint, logprobs,
                    marks)
    if on_commit is not None:
        on_commit(decoder, [decoder.x])
    emitted = 0

    def emit(token: int) -> bool:
        """Account for one token; False when generation stops here (EOS)."""
        nonlocal emitted
        if emitted == 0:
            times.first_token = time.perf_counter()
        if token in eos_ids:
            times.finish_reason = "stop"
            return False
        emitted += 1
        times.generated = emitted
        times.end = time.perf_counter()
        return True

    if not emit(decoder.x):
        return
    yield decoder.x
    while emitted < max_tokens:
        room = min(max_tokens - emitted - 1, max_context - decoder.length - 2)  # drafts never overshoot
        k = max(0, min(depth, room))
        copy_k = max(0, min(MAX_DEPTH, 2 * depth, room))
        drafts, accepted, copied = run_round(decoder, sampler, k, copy_k, constraint, logprobs)
        stats.record(len(drafts), accepted, copied)
        if on_commit is not None:
            on_commit(decoder, drafts[:accepted] + [decoder.x])
        for token in drafts[:accepted] + [decoder.x]:
            if not emit(token):
                return
            stats.emitted += 1
            yield token
            if emitted >= max_tokens:
                return


def start(
    model: Model,
    prompt: list[int],
    sampler: Sampler,
    cache: list[LayerCache] | None = None,
    chunk: int = 512,
    progress: ProgressFn | None = None,
    copy: bool = True,
    skip: int = 0,
    carry: mx.array | None = None,
    on_chunk: ChunkFn | None = None,
    constraint: Constraint | None = None,
    logprobs: LogprobRecorder | None = None,
    marks: Sequence[int] = (),
) -> Decoder:
    """Prefill the prompt (backbone and MTP head) and sample the first token.

    With `skip` > 0, `cache` already holds prompt[:skip] (a restored checkpoint) and `carry` [1, H] is its
    h_{skip-1}; only prompt[skip:] is prefilled. `on_chunk` sees the cache after every prefill chunk and at
    `marks` (`generate.prefill`).
    """
    cache = cache if cache is not None else model.make_cache()
    logits, last_hidden = prefill(
        model, prompt[skip:], cache, chunk, progress, mtp=True, carry=carry, on_chunk=on_chunk, marks=marks
    )  # logits [1, V], last_hidden [1, H]
    x = sampler(logits[-1] if constraint is None else constraint.apply(logits[-1])).item()
    if constraint is not None:
        constraint.advance(x)
    if logprobs is not None:
        logprobs.add(logits[-1:], [x])
    lane = CopyLane(prompt + [x]) if copy else None
    return Decoder(model, cache, x, last_hidden, lane=lane)


def _draft(
    model: Model,
    mtp_cache: list[KVCache],
    tokens: list[int],
    hidden: mx.array,
    k: int,
    sampler: Sampler,
    constraint: Constraint | None = None,
) -> tuple[list[int], mx.array | None]:
    """k draft tokens from the MTP head; the first call also feeds it every committed pair it has not seen.

    tokens [m] pair with hidden [m, H] (token t_{p+1} with backbone hidden h_p). Returns the drafts and, when
    sampling, their proposal log-probabilities [k, V] (None: argmax drafts, a point mass). With a `constraint`
    each draft is drawn from the masked head distribution and consumed (one sync per draft); an EOS draft ends
    the chain early.
    """
    z = model.mtp_hidden(mx.array(tokens)[None], hidden[None], mtp_cache)[:, -1:]  # [1, 1, H]
    drafts, logprobs = [], []
    for j in range(k):
        logits = model.logits(z)[0, -1]  # [V]
        if constraint is not None:
            logits = constraint.apply(logits)
        if sampler.params.greedy:
            d = mx.argmax(logits)
        else:
            q = warp(logits, sampler.params)
            d = sample(q, sampler.next_key())
            logprobs.append(q)
        drafts.append(d)
        if constraint is not None:
            constraint.advance(d.item())
            if constraint.ended:
                break
        if j + 1 < k:
            z = model.mtp_hidden(d.reshape(1, 1), z, mtp_cache)  # [1, 1, H] fed its own post-norm output
    mx.eval(drafts, logprobs)
    return [int(d.item()) for d in drafts], (mx.stack(logprobs) if logprobs else None)
