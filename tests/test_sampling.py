"""Warping and sampling against an independent numpy reference."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero.decode.sampling import Sampler, SamplingParams, warp
from hetero.errors import HeteroError


def reference_probs(logits: np.ndarray, t: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The textbook definitions, one step at a time, in float64."""
    p = np.exp((logits - logits.max()) / t)
    p /= p.sum()
    if 0 < top_k < len(p):
        kth = np.sort(p)[-top_k]
        p = np.where(p >= kth, p, 0.0)
        p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = np.zeros_like(p, dtype=bool)
        mass = 0.0
        for i in order:  # smallest set of most likely tokens whose mass reaches top_p
            keep[i] = True
            mass += p[i]
            if mass >= top_p:
                break
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if min_p > 0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def matches_reference(ours: np.ndarray, logits: np.ndarray, t: float, top_k: int, top_p: float, min_p: float) -> bool:
    """`ours` (probabilities) equals the reference within 1e-4.

    One tolerance only: where the mass top-p sees reaches top_p within float32 rounding (1e-5), keeping or dropping
    the boundary token are both right, so the reference with top_p nudged to either side is accepted too. At
    top_p = 1.0 nothing is nudged: every token must match.
    """
    logits = logits.astype(np.float64)
    candidates = [top_p]
    if top_p < 1.0:
        seen = reference_probs(logits, t, top_k, 1.0, 0.0)  # what top-p filters: after temperature and top-k
        if np.isclose(np.cumsum(np.sort(seen)[::-1]), top_p, rtol=0, atol=1e-5).any():
            candidates += [top_p - 2e-5, min(top_p + 2e-5, 1.0)]
    return any(np.abs(ours - reference_probs(logits, t, top_k, p, min_p)).max() < 1e-4 for p in candidates)


@settings(max_examples=60, deadline=None, database=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    t=st.floats(0.3, 2.0),
    top_k=st.integers(0, 12),
    top_p=st.floats(0.3, 1.0),
    min_p=st.floats(0.0, 0.3),
)
def test_warp_matches_reference(seed, t, top_k, top_p, min_p):
    logits = np.random.default_rng(seed).normal(0, 2, 16).astype(np.float32)
    ours = np.exp(np.array(warp(mx.array(logits), SamplingParams(t, top_k, top_p, min_p))))
    assert matches_reference(ours, logits, t, top_k, top_p, min_p)


ACTIVE = {"temperature": 0.5, "top_k": 4, "top_p": 0.8, "min_p": 0.3}  # each removes or reshapes mass below
NEUTRAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


@pytest.mark.parametrize("ignores, top_p", [(k, p) for p in (1.0, 0.8) for k in ACTIVE if (k, p) != ("top_p", 1.0)])
def test_the_reference_check_fails_a_warp_that_ignores_a_parameter(ignores, top_p):
    """The check above can fail, at top_p = 1.0 too (where the old `isclose(cumsum, top_p)` escape was always
    true): a warp that drops the one parameter that matters here is caught."""
    logits = np.random.default_rng(3).permutation(np.linspace(2.0, -2.0, 16)).astype(np.float32)
    params = {**NEUTRAL, "top_p": top_p, ignores: ACTIVE[ignores]}
    broken = np.exp(np.array(warp(mx.array(logits), SamplingParams(**{**params, ignores: NEUTRAL[ignores]}))))
    right = np.exp(np.array(warp(mx.array(logits), SamplingParams(**params))))
    args = (params["temperature"], params["top_k"], params["top_p"], params["min_p"])
    assert matches_reference(right, logits, *args)
    assert not matches_reference(broken, logits, *args)


def test_greedy_is_one_hot_on_argmax():
    logits = mx.array([0.1, 3.0, -1.0, 2.9])
    probs = np.exp(np.array(warp(logits, SamplingParams())))
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert Sampler(SamplingParams())(logits).item() == 1


def test_seeded_sampler_repeats_and_seeds_differ():
    logits = mx.array(np.random.default_rng(0).normal(0, 1, (50,)).astype(np.float32))
    params = SamplingParams(temperature=1.0)

    def draw(seed: int) -> list[int]:
        sampler = Sampler(params, seed)
        return [sampler(logits).item() for _ in range(30)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_samples_follow_the_warped_distribution():
    """20,000 draws: total-variation distance to the warped distribution within sampling noise."""
    logits = mx.array([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=0.8, top_k=4)
    target = np.exp(np.array(warp(logits, params)))
    sampler = Sampler(params, seed=1)
    n = 20_000
    draws = np.array([sampler(mx.broadcast_to(logits, (n, 6))).tolist()]).ravel()
    freq = np.bincount(draws, minlength=6) / n
    # E[TV] <= 0.5 * sum sqrt(p(1-p)/n) ~ 0.006 here; 0.02 is > 3x that
    assert 0.5 * np.abs(freq - target).sum() < 0.02
    assert freq[4] == 0 and freq[5] == 0  # outside top-k: never drawn


@pytest.mark.parametrize(
    "kwargs, word", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top-p"), ({"top_k": -2}, "top-k"), ({"min_p": 1.0}, "min-p")]
)
def test_bad_parameters_are_user_errors(kwargs, word):
    with pytest.raises(HeteroError, match=word):
        SamplingParams(**kwargs)
