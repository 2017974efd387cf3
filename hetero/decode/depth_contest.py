"""Plain decoding against MTP draft depths, timed in alternated pairs until the difference is beyond the noise.

One pair: the same prompt decoded plainly and at a depth, back to back (greedy, so each decodes the same tokens every
time), giving the ratio of their tokens/s. Neighbours in time share the machine's state, so a slow minute slows both
sides of a pair and leaves their ratio; the order inside a pair alternates, so neither side is always the first.
Rounds of pairs over a few prompts go on until the 95% interval of the median ratio (`hetero.host.confidence`)
excludes 1, or lies within `TIE` of it, or a time cap is reached. A depth whose drafts are (almost) never accepted
cannot pay (`can_pay`: each round costs at least a plain step for its accepted length of tokens) and never wins,
whatever the clock said.

`decide` turns the samples into a `Verdict`: beyond the noise, the faster; inside it, the better expected rate (the
acceptance model's prediction from the measured accepted length, where one is given) and `settled` False, so the
samples are kept and the next chance (the next run, idle time in `hetero serve`) adds to them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hetero.host.confidence import Estimate
from hetero.host.settings import PLAIN

# (depth, prompt index, tokens) -> (decode tokens/s, mean accepted length, None for plain decoding); depth 0 is plain
DecodeFn = Callable[[int, int, int], tuple[float, float | None]]
# (depth, mean accepted length) -> the MTP rate over plain decoding's that the acceptance model predicts, or None
ExpectedFn = Callable[[int, float], float | None]
TIE = 1.03  # a ratio whose interval lies within 3% of 1 either way: a tie, not worth measuring further
MAX_PAIRS = 60  # per depth, over every chance: past this, the interval is as narrow as this machine lets it get


def can_pay(mean_accepted_length: float | None) -> bool:
    """Whether a depth keeping this many tokens per verify pass could beat plain decoding by more than a tie. A
    round costs at least one plain step (its verify pass) and yields the accepted length L, so MTP runs at most L
    times plain's rate: at L <= `TIE` (a head that keeps almost no draft) it can win nothing worth measuring."""
    return mean_accepted_length is not None and mean_accepted_length > TIE


@dataclass
class Contest:
    """The pairs measured so far: per depth, each pair's ratio (depth tokens/s over plain's on the same prompt,
    measured back to back), its tokens/s and mean accepted length; plain's tokens/s of each pair."""

    depths: tuple[int, ...]
    ratios: dict[int, list[float]] = field(default_factory=dict)
    rates: dict[int, list[float]] = field(default_factory=dict)
    accepted: dict[int, list[float]] = field(default_factory=dict)
    plain: list[float] = field(default_factory=list)
    rounds: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        for d in self.depths:
            for samples in (self.ratios, self.rates, self.accepted):
                samples.setdefault(d, [])

    @property
    def pairs(self) -> int:
        """Pairs measured per depth."""
        return len(self.plain)

    def estimate(self, depth: int) -> Estimate:
        return Estimate.of(self.ratios[depth])

    def accepted_length(self, depth: int) -> float | None:
        return statistics.mean(self.accepted[depth]) if self.accepted[depth] else None

    def paying(self) -> list[int]:
        """The depths that had drafts accepted (only they can win)."""
        return [d for d in self.depths if can_pay(self.accepted_length(d))]

    def best(self) -> int | None:
        """The paying depth with the highest median ratio (None: none pays)."""
        paying = self.paying()
        return max(paying, key=lambda d: self.estimate(d).median) if paying else None

    def decided(self) -> bool:
        """Whether the samples settle it: no depth pays, the best one's interval excludes 1 or lies within `TIE`
        of it, every paying depth's lies below 1, or `MAX_PAIRS` are measured."""
        best = self.best()
        if best is None or self.pairs >= MAX_PAIRS:
            return self.pairs > 0
        e = self.estimate(best)
        return e.above(1.0) or e.within(1 / TIE, TIE) or all(self.estimate(d).below(1.0) for d in self.paying())

    def add(self, plain: float, measured: dict[int, tuple[float, float | None]]) -> None:
        """One pair per depth on one prompt: plain's tokens/s, and each depth's (tokens/s, accepted length)."""
        if plain <= 0 or any(tps <= 0 for tps, _ in measured.values()):
            return  # no tokens past the first (an EOS at once): nothing timed
        self.plain.append(plain)
        for d, (tps, accepted) in measured.items():
            self.rates[d].append(tps)
            self.ratios[d].append(tps / plain)
            self.accepted[d].append(1.0 if accepted is None else accepted)

    def to_dict(self) -> dict:
        return {"depths": list(self.depths), "plain": self.plain, "rounds": self.rounds, "seconds": self.seconds,
                **{k: {str(d): v for d, v in getattr(self, k).items()} for k in ("ratios", "rates", "accepted")}}

    @classmethod
    def from_dict(cls, d: dict) -> Contest:
        """A saved contest (`to_dict`); a damaged one raises (KeyError, TypeError, ValueError): start afresh."""
        depths = tuple(int(x) for x in d["depths"])
        got = {k: {int(x): [float(v) for v in d[k][str(x)]] for x in depths} for k in ("ratios", "rates", "accepted")}
        c = cls(depths, **got, plain=[float(v) for v in d["plain"]], rounds=int(d["rounds"]),
                seconds=float(d["seconds"]))
        if any(len(v) != len(c.plain) for k in got for v in got[k].values()):
            raise ValueError("a saved contest's samples do not pair up")
        return c


def play(decode: DecodeFn, contest: Contest, prompts: int, tokens: int, cap_s: float, least_rounds: int = 2,
         stop: Callable[[], bool] = lambda: False, clock: Callable[[], float] = time.perf_counter) -> Contest:
    """Measure rounds of pairs (every prompt, plain and every depth, the order alternating) into `contest` until
    it is `decided` after at least `least_rounds` rounds, `cap_s` seconds pass, or `stop()` says so (checked
    between prompts: a server's request arriving), or one round showed no depth keeping any draft. Warm each
    contender up before: the first decode of a depth compiles its shapes and ran at half speed."""
    start = clock()
    out_of_time = lambda: clock() - start >= cap_s or stop()  # noqa: E731
    while True:
        for p in range(prompts):
            order = [0, *contest.depths]
            if (contest.rounds + p) % 2:
                order.reverse()
            got = {d: decode(d, p, tokens) for d in order}
            contest.add(got.pop(0)[0], got)
            if out_of_time():
                break
        else:
            contest.rounds += 1
        hopeless = contest.rounds >= 1 and contest.best() is None  # no depth keeps drafts enough to pay
        if out_of_time() or contest.pairs >= MAX_PAIRS or hopeless or (contest.rounds >= least_rounds
                                                                         and contest.decided()):
            contest.seconds += clock() - start
            return contest


@dataclass(frozen=True)
class Verdict:
    """What a contest decided: the depth to decode at (or PLAIN), whether it is settled (beyond the noise, a tie,
    or measured as far as it goes) or is measured again at the next chance, and why, in one sentence."""

    depth: int | str
    settled: bool
    why: str


def ratio_text(e: Estimate) -> str:
    """'1.41x (95% interval 1.30-1.52x, 9 pairs)'."""
    pairs = f"{e.n} pair{'s' * (e.n != 1)}"
    if not e.known:
        return f"{e.median:.2f}x ({pairs}, too few for an interval)"
    return f"{e.median:.2f}x (95% interval {e.low:.2f}-{e.high:.2f}x, {pairs})"


def decide(contest: Contest, expected: ExpectedFn | None = None) -> Verdict:
    """The verdict of `contest` (module docstring); `expected` is the acceptance model that breaks a verdict inside
    the noise (else the measured median does)."""
    if not contest.pairs:
        return Verdict(contest.depths[0], False, "nothing was timed (every prompt ended at its first token)")
    best = contest.best()
    if best is None:
        return Verdict(PLAIN, True, f"almost no draft was accepted at depth {', '.join(map(str, contest.depths))} "
                                    f"(at most {max(contest.accepted_length(d) for d in contest.depths):.2f} tokens "
                                    "per pass): speculative decoding cannot pay")
    e, length = contest.estimate(best), contest.accepted_length(best)
    at = f"MTP at depth {best} decodes {ratio_text(e)} plain's tokens/s"
    if e.above(1.0):
        return Verdict(best, True, at)
    if all(contest.estimate(d).below(1.0) for d in contest.paying()):
        return Verdict(PLAIN, True, f"plain decoding is faster: {at}")
    predicted = expected(best, length) if expected is not None else None
    guess = e.median if predicted is None else predicted
    choice = best if guess > 1.0 else PLAIN
    by = ("the measured median" if predicted is None else
          f"the acceptance model ({length:.2f} tokens per pass predict {predicted:.2f}x)")
    keeps = f"keeps {'MTP at depth ' + str(best) if choice != PLAIN else 'plain decoding'} by {by}"
    if e.within(1 / TIE, TIE):
        return Verdict(choice, True, f"a tie: {at}, within {TIE - 1:.0%} either way; {keeps}")
    if contest.pairs >= MAX_PAIRS:
        return Verdict(choice, True, f"inside the noise after {contest.pairs} pairs, as far as this machine "
                                     f"measures: {at}; {keeps}")
    return Verdict(choice, False, f"inside the noise after {contest.pairs} pairs in {contest.seconds:.0f} s: {at}; "
                                  f"{keeps}, and measures again at the next run (or idle time in `hetero serve`)")
