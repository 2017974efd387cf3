"""The statistics behind every measured default (hetero/host/confidence.py) and the draft-depth contest
(hetero/decode/depth_contest.py), with the measured rates injected: the real `play` and `decide` run on a scripted
decoder and clock, so what they conclude from a given noise is exact and no test depends on this machine's timing.

The noise drawn here is the kind a shared machine makes: a few percent of jitter on every sample, and bursts in
which another process takes the core and one side of a pair runs at a fraction of its speed."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hetero.decode.depth_contest import MAX_PAIRS, TIE, Contest, decide, play
from hetero.host.confidence import LEVEL, MIN_SAMPLES, Estimate, median_rank, repeat
from hetero.host.settings import PLAIN


def coverage(n: int, k: int) -> float:
    """P(k-th smallest < median < k-th largest) for n samples of a continuous law."""
    return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n


@given(st.integers(1, 300))
def test_the_median_interval_is_the_narrowest_with_95_percent_coverage(n):
    k = median_rank(n)
    if n < MIN_SAMPLES:
        assert k is None
        return
    assert coverage(n, k) >= LEVEL and (k + 1 > n // 2 or coverage(n, k + 1) < LEVEL)


def test_six_samples_are_the_fewest_with_an_interval():
    assert median_rank(5) is None and median_rank(6) == 1 and coverage(6, 1) == pytest.approx(1 - 2 / 64)


def test_the_interval_covers_the_true_median_of_bursty_noise_at_least_95_percent_of_the_time():
    """Samples of ratio 1.4 with 5% jitter, a fifth of them hit by a burst (one side at 0.3-0.9 of its speed):
    over 2000 seeded draws of 12 samples, the interval holds the noise's true median in at least 95% of them."""
    rng = np.random.default_rng(0)

    def draw(n):
        x = 1.4 * np.exp(0.05 * rng.standard_normal(n))
        hit = rng.random(n) < 0.2
        slow = rng.uniform(0.3, 0.9, n)
        side = rng.random(n) < 0.5  # the burst slows the depth (ratio falls) or plain (ratio rises)
        return np.where(hit, np.where(side, x * slow, x / slow), x)

    truth = float(np.median(draw(2_000_000)))
    held = [Estimate.of(list(draw(12))) for _ in range(2000)]
    assert np.mean([e.low <= truth <= e.high for e in held]) >= LEVEL


def test_an_estimate_maps_through_a_falling_function_with_its_ends_swapped():
    e = Estimate.of([1.0, 2.0, 2.0, 3.0, 4.0, 5.0])
    assert (e.median, e.low, e.high, e.n) == (2.5, 1.0, 5.0, 6)
    rate = e.scaled(lambda s: 10 / s)
    assert (rate.median, rate.low, rate.high) == (4.0, 2.0, 10.0)
    assert e.above(0.5) and not e.above(1.0) and e.below(6) and e.within(1, 5) and not e.within(1.5, 5)


def test_repeat_samples_until_narrow_enough_or_out_of_time():
    values = iter([1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 5.0, 1.0, 1.0, 1.0])
    e, seen = repeat(lambda: next(values), enough=lambda e: e.spread() is not None and e.spread() < 0.05)
    assert len(seen) == MIN_SAMPLES and e.low == 0.98 and e.high == 1.02
    now = [0.0]

    def one_second() -> float:  # each sample takes a second on the clock
        now[0] += 1.0
        return 1.0 + 0.5 * (now[0] % 2)

    e, seen = repeat(one_second, enough=lambda e: False, cap_s=3.5, clock=lambda: now[0])
    assert len(seen) == MIN_SAMPLES  # past the cap: stops once the least samples are in
    e, seen = repeat(one_second, enough=lambda e: False, cap_s=1e9, most=9, clock=lambda: now[0])
    assert len(seen) == 9


class Scripted:
    """A decoder with rates drawn from a seeded noise model, on a clock it advances by each decode's time; it
    records the order of its calls. `ratio` is MTP's true speed over plain's, `accepted` the mean accepted length."""

    def __init__(self, ratio, seed=0, jitter=0.03, burst=0.0, accepted=2.5, plain_tps=200.0):
        self.rng, self.ratio, self.jitter, self.burst = np.random.default_rng(seed), ratio, jitter, burst
        self.accepted, self.plain_tps, self.now, self.calls = accepted, plain_tps, 0.0, []

    def __call__(self, depth, prompt, tokens):
        tps = self.plain_tps * (self.ratio if depth else 1.0) * math.exp(self.jitter * self.rng.standard_normal())
        if self.rng.random() < self.burst:
            tps *= self.rng.uniform(0.3, 0.9)
        self.now += tokens / tps
        self.calls.append((depth, prompt))
        return tps, (self.accepted if depth else None)

    def clock(self):
        return self.now


def contest_of(decoder, cap_s=20.0, depths=(3,), **kw):
    return play(decoder, Contest(depths), 3, 64, cap_s, clock=decoder.clock, **kw)


def test_a_clear_winner_is_settled_in_two_rounds_and_pairs_alternate_their_order():
    d = Scripted(1.4)
    c = contest_of(d)
    assert c.rounds == 2 and c.pairs == 6
    assert d.calls[:4] == [(0, 0), (3, 0), (3, 1), (0, 1)]  # plain first on prompt 0, the depth first on prompt 1
    v = decide(c)
    assert v.depth == 3 and v.settled and "1.4" in v.why and "95% interval" in v.why


@settings(max_examples=60, deadline=None)
@given(ratio=st.one_of(st.floats(0.5, 0.85), st.floats(1.15, 2.0)), jitter=st.floats(0.0, 0.08),
       burst=st.floats(0.0, 0.25), seed=st.integers(0, 2**31))
def test_the_verdict_takes_the_faster_side_through_jitter_and_bursts(ratio, jitter, burst, seed):
    """Whatever the noise draws, a side 15% faster or more wins; settled or not (the acceptance model, given the
    true ratio here, breaks a verdict inside the noise), and within the time cap."""
    d = Scripted(ratio, seed, jitter, burst)
    c = contest_of(d)
    v = decide(c, expected=lambda depth, length: ratio)
    assert v.depth == (3 if ratio > 1 else PLAIN)
    assert d.now <= 20.0 + 3 * 64 / 50  # at most one pair past the cap


def test_a_tie_is_settled_as_a_tie_and_keeps_the_acceptance_models_choice():
    d = Scripted(1.0, jitter=0.005)
    c = contest_of(d, cap_s=60.0)
    e = c.estimate(3)
    assert e.within(1 / TIE, TIE)
    for predicted, depth in ((1.2, 3), (0.9, PLAIN)):
        v = decide(c, expected=lambda *_: predicted)
        assert v.settled and v.depth == depth and "a tie" in v.why


def test_inside_the_noise_the_verdict_is_unsettled_and_the_acceptance_model_decides():
    d = Scripted(1.05, seed=3, jitter=0.4)
    c = contest_of(d, cap_s=4.0)
    assert c.estimate(3).low < 1 < c.estimate(3).high
    v = decide(c, expected=lambda depth, length: 1.3 if length > 2 else 0.9)
    assert not v.settled and v.depth == 3 and "acceptance model (2.50 tokens per pass predict 1.30x)" in v.why
    assert decide(c).why.count("measured median") == 1  # no model: the median decides


def test_a_depth_whose_drafts_were_never_accepted_never_wins():
    d = Scripted(1.8, accepted=1.0)  # the clock says faster, but every draft was rejected
    v = decide(contest_of(d), expected=lambda *_: 2.0)
    assert v.depth == PLAIN and v.settled and "almost no draft was accepted" in v.why
    d = Scripted(1.8, accepted=1.02)  # 2% more tokens per pass: at most 1.02x, whatever the rounds cost
    c = contest_of(d)
    assert c.rounds == 1 and decide(c).depth == PLAIN  # one round shows it: no more measuring


def test_the_best_paying_depth_wins_among_several():
    class Depths(Scripted):
        def __call__(self, depth, prompt, tokens):
            self.ratio = {0: 1.0, 1: 1.2, 2: 1.5, 3: 1.3}[depth]
            self.accepted = 1.0 + 0.6 * depth
            return super().__call__(depth, prompt, tokens)

    c = contest_of(Depths(1.0), depths=(1, 2, 3))
    assert decide(c).depth == 2 and set(c.ratios) == {1, 2, 3}


def test_samples_accumulate_over_chances_and_survive_a_round_trip():
    d = Scripted(1.05, seed=5, jitter=0.4)
    first = contest_of(d, cap_s=3.0)
    again = play(d, Contest.from_dict(first.to_dict()), 3, 64, 3.0, clock=d.clock)
    assert again.pairs > first.pairs and again.ratios[3][: first.pairs] == first.ratios[3]
    with pytest.raises((KeyError, ValueError, TypeError)):
        Contest.from_dict({**first.to_dict(), "plain": first.plain[:-1]})  # samples that do not pair up


def test_a_contest_stops_at_its_pair_limit_and_a_stop_request():
    d = Scripted(1.0, seed=1, jitter=0.5)
    c = contest_of(d, cap_s=1e9)
    assert c.pairs == MAX_PAIRS and decide(c).settled
    d = Scripted(1.0, seed=1, jitter=0.5)
    c = contest_of(d, stop=lambda: len(d.calls) >= 4)
    assert c.pairs == 2  # stopped between prompts, after the pair that was running


def test_nothing_timed_is_no_verdict():
    c = play(lambda depth, p, n: (0.0, None), Contest((3,)), 3, 64, 20.0)  # every prompt ended at once
    v = decide(c)
    assert c.pairs == 0 and not v.settled and v.depth == 3 and "nothing was timed" in v.why
