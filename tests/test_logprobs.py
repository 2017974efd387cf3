"""Per-token logprobs (hetero/decode/logprobs.py) on the bundled model: each one equals log_softmax of the model's logits
at that position, computed independently by one prefill over prompt + generated tokens, with MTP on and off."""

from __future__ import annotations

import numpy as np
import pytest

import hetero
from hetero.errors import HeteroError

TOP = 5
TOL = 2e-3  # verify / decode steps against one chunked prefill: fp32 rounding of different op orders


@pytest.fixture(scope="module")
def engine():
    return hetero.load()


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    return engine.encode_prompt("def fibonacci(n):", chat=False)


def reference(engine, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """log_softmax [len(tokens), V] of the rows the generated tokens were drawn from, from one prefill."""
    logits = engine.logits(prompt + tokens).astype(np.float64)
    lp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    return lp[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
@pytest.mark.parametrize("temperature", [0.0, 1.3], ids=["greedy", "sampled"])
def test_logprobs_are_the_raw_model_distribution(engine, prompt, mtp, temperature):
    """Before any warp: a sampled run reports the same raw log_softmax as a greedy one would."""
    r = engine.generate(prompt, max_tokens=40, mtp=mtp, temperature=temperature, top_p=0.9, seed=7, logprobs=TOP)
    assert len(r.logprobs) == len(r.tokens) > 10
    if mtp:
        assert r.stats["mtp"]["rounds"] > 0
    ref = reference(engine, prompt, r.tokens)
    got = np.array([x.logprob for x in r.logprobs])
    assert [x.token for x in r.logprobs] == r.tokens
    np.testing.assert_allclose(got, ref[np.arange(len(r.tokens)), r.tokens], atol=TOL)
    for i, x in enumerate(r.logprobs):
        ids = [t for t, _ in x.top]
        vals = np.array([v for _, v in x.top])
        assert len(x.top) == TOP and len(set(ids)) == TOP
        assert (np.diff(vals) <= 0).all(), "top_logprobs most likely first"
        np.testing.assert_allclose(vals, ref[i, ids], atol=TOL)
        # the top N are the N largest of the reference row (up to near-ties at the cut)
        assert vals[-1] >= np.sort(ref[i])[-TOP] - TOL
        if x.token in ids:
            assert x.logprob == pytest.approx(dict(x.top)[x.token], abs=1e-6)
        else:
            assert x.logprob <= vals[-1] + TOL
        if temperature == 0:
            assert ids[0] == x.token or x.top[0][1] - x.logprob < TOL  # greedy picks the top entry
        assert np.exp(vals).sum() <= 1 + 1e-4


def test_mtp_and_plain_report_the_same_logprobs(engine, prompt):
    plain = engine.generate(prompt, max_tokens=30, mtp=False, logprobs=3)
    spec = engine.generate(prompt, max_tokens=30, mtp=True, logprobs=3)
    assert spec.tokens == plain.tokens
    np.testing.assert_allclose([x.logprob for x in spec.logprobs], [x.logprob for x in plain.logprobs], atol=TOL)
    assert [[t for t, _ in x.top] for x in spec.logprobs] == [[t for t, _ in x.top] for x in plain.logprobs]


def test_zero_top_gives_only_the_chosen_token(engine, prompt):
    r = engine.generate(prompt, max_tokens=8, mtp=False, logprobs=0)
    assert len(r.logprobs) == len(r.tokens) and all(x.top == () for x in r.logprobs)
    assert engine.generate(prompt, max_tokens=8, mtp=False).logprobs is None


def test_on_logprob_streams_each_token_before_its_text(engine, prompt):
    events = []
    r = engine.generate(prompt, max_tokens=20, mtp=True, logprobs=1, on_logprob=lambda x: events.append(("lp", x)),
                        on_text=lambda s: events.append(("text", s)))
    assert [x for kind, x in events if kind == "lp"] == r.logprobs
    assert "".join(x for kind, x in events if kind == "text") == r.text
    assert events[0][0] == "lp"


@pytest.mark.parametrize("bad", [-1, 21, 2.5, True])
def test_top_out_of_range_is_a_user_error(engine, prompt, bad):
    with pytest.raises(HeteroError, match="logprobs"):
        engine.generate(prompt, max_tokens=2, mtp=False, logprobs=bad)


def test_token_bytes_join_to_the_text(engine, prompt):
    r = engine.generate(prompt, max_tokens=20, mtp=False)
    assert b"".join(engine.token_bytes(t) for t in r.tokens).decode("utf-8", "replace") == r.text
