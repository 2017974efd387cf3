"""JSON-constrained decoding (hetero/tools/constrained.py) on the bundled model: outputs parse and validate, greedy MTP
equals greedy plain decoding token for token, and sampled MTP follows constrained plain decoding's exact law.

The statistical check uses the bound of tests/test_speculative.py: for m draws, E[TV] <= 1/(2m) sum_y
sqrt(m P(y) (1 - P(y))) and McDiarmid adds sqrt(ln(1/FAIL) / (2m)), FAIL = 1e-6.
"""

from __future__ import annotations

import json
import math

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

import hetero
from hetero.decode.options import DecodeOptions
from hetero.decode.parts import RowParts
from hetero.decode.prefill import prefill
from hetero.decode.sampling import SamplingParams, warp
from hetero.decode.solo import decode_tokens
from hetero.decode.solo import decode_tokens
from hetero.errors import HeteroError
from hetero.tools.constrained import Constraint
from test_speculative import clone_cache

FAIL = 1e-6

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "admin"],
    "additionalProperties": False,
}
COLOUR = {"enum": ["red", "green", "blue", "yellow"]}
NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4}
NESTED = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                   "size": {"enum": ["S", "M", "L"]}},
    "required": ["tags", "size"],
    "additionalProperties": False,
}
SCHEMAS = {"object": PERSON, "enum": COLOUR, "array": NUMBERS, "nested": NESTED}


@pytest.fixture(scope="module")
def engine():
    return hetero.load()


def ask(engine, what: str) -> list[int]:
    return engine.encode_prompt(f"Answer in JSON: {what}", chat=True)


def constraint(engine, schema: dict | None) -> Constraint:
    return Constraint(engine.grammar_tokenizer(), engine.json_grammar(schema), engine.eos_ids)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_greedy_output_validates_and_mtp_equals_plain(engine, name):
    schema = SCHEMAS[name]
    prompt = ask(engine, name)
    plain = engine.generate(prompt, max_tokens=120, mtp=False, json_schema=schema)
    spec = engine.generate(prompt, max_tokens=120, mtp=True, json_schema=schema)
    assert plain.stats["finish_reason"] == "stop", plain.text
    jsonschema.validate(json.loads(plain.text), schema)
    assert spec.tokens == plain.tokens
    assert spec.stats["mtp"]["rounds"] > 0


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_sampled_outputs_validate_under_mtp(engine, name):
    schema = SCHEMAS[name]
    prompt = ask(engine, name)
    finished = 0
    for seed in range(4):  # seeded: each run is the same every time
        r = engine.generate(prompt, max_tokens=120, mtp=True, json_schema=schema, temperature=1.0, seed=seed)
        assert constraint(engine, schema).extend(r.tokens) == len(r.tokens), seed  # the grammar allowed every token
        if r.stats["finish_reason"] == "stop":
            jsonschema.validate(json.loads(r.text), schema)
            finished += 1
        else:  # a sampled string may run to max_tokens: then it is a prefix of a valid value (above), cut at the limit
            assert r.stats["finish_reason"] == "length" and len(r.tokens) == 120, seed
    assert finished, "no seed closed its JSON: the check above validated prefixes only"


def test_json_object_gives_an_object(engine):
    """The bundled model writes long keys: 40 tokens is a prefix of an object, the same with MTP on and off; the
    matcher accepted every token of it (a JSON value's prefix), and EOS was never allowed before it closed."""
    prompt = ask(engine, "anything")
    plain = engine.generate(prompt, max_tokens=40, mtp=False, json_object=True)
    spec = engine.generate(prompt, max_tokens=40, mtp=True, json_object=True)
    assert plain.text.startswith("{") and spec.tokens == plain.tokens
    c = constraint(engine, None)
    assert all(engine.tokenizer.decode([int(t)]).startswith("{") for t in np.flatnonzero(c.mask()))
    assert c.extend(plain.tokens) == len(plain.tokens)
    assert not c.mask()[sorted(engine.eos_ids)].any()  # unfinished: no EOS yet


def test_constrained_logprobs_stay_raw(engine):
    """The constraint masks what is sampled, not what logprobs report (the raw model distribution)."""
    prompt = ask(engine, "colour")
    r = engine.generate(prompt, max_tokens=20, mtp=True, json_schema=COLOUR, logprobs=2)
    logits = engine.logits(prompt + r.tokens).astype(np.float64)
    lp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    rows = lp[len(prompt) - 1 : len(prompt) - 1 + len(r.tokens)]
    np.testing.assert_allclose([x.logprob for x in r.logprobs], rows[np.arange(len(r.tokens)), r.tokens], atol=2e-3)


# ----------------------------------------------------------------------------------------------------------
# The Constraint itself


def test_eos_only_where_the_json_is_complete(engine):
    c = constraint(engine, NUMBERS)
    eos = sorted(engine.eos_ids)
    text_ids = engine.tokenizer.encode("[1, 2]")
    for t in text_ids:
        assert not c.mask()[eos].any()
        c.advance(t)
    assert c.mask()[eos].all()  # every EOS id, not only the one the matcher knows
    c.advance(eos[-1])
    assert c.ended and c.mask()[eos].all() and c.mask().sum() == len(eos)
    with pytest.raises(RuntimeError, match="not allowed"):
        c.advance(text_ids[0])


def test_rollback_restores_the_state_and_its_masks(engine):
    c = constraint(engine, PERSON)
    ids = engine.tokenizer.encode('{"name": "Al", "age": 3')
    masks = []
    for t in ids:
        masks.append(c.mask().copy())
        c.advance(t)
    c.rollback(4)
    assert c.length == len(ids) - 4
    np.testing.assert_array_equal(c.mask(), masks[len(ids) - 4])
    c.advance(ids[len(ids) - 4])
    assert np.array_equal(c.recent_masks(2), np.stack(masks[len(ids) - 4 : len(ids) - 2]))
    fresh = constraint(engine, PERSON)  # the masks are the matcher's, not leftovers of the rolled-back path
    for t in ids[: len(ids) - 3]:
        fresh.advance(t)
    np.testing.assert_array_equal(fresh.mask(), c.mask())


def test_rollback_over_an_eos(engine):
    c = constraint(engine, COLOUR)
    ids = engine.tokenizer.encode('"red"')
    for t in ids:
        c.advance(t)
    eos = min(engine.eos_ids)
    c.advance(eos)
    c.advance(eos)  # a bonus token after an accepted EOS draft
    c.rollback(3)
    assert not c.ended and c.length == len(ids) - 1
    assert c.mask()[ids[-1]] and not c.mask()[eos]


def test_extend_stops_at_the_first_illegal_token(engine):
    c = constraint(engine, COLOUR)
    legal = engine.tokenizer.encode('"blue"')
    assert c.extend(legal + engine.tokenizer.encode("x")) == len(legal)
    assert c.length == len(legal)


@pytest.mark.parametrize("schema, match", [
    ({"type": "foo"}, "foo"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"type": "string", "pattern": "(unclosed"}, "JSON schema"),
    ([1, 2], "must be an object"),
])
def test_a_schema_the_library_rejects_is_a_user_error(engine, schema, match):
    with pytest.raises(HeteroError, match=match):
        engine.generate("x", max_tokens=4, mtp=False, json_schema=schema)


# ----------------------------------------------------------------------------------------------------------
# Sampled MTP has constrained plain decoding's law

LAW_PARAMS = SamplingParams(temperature=1.0)
DRAWS = {False: 120, True: 240}  # plain (the harness's control), MTP; every draw is seeded, ~40 ms each
PRUNE = 1e-7  # paths less likely than this are one "other" outcome of the exact law (22 prefills, ~1 s)


def exact_law(engine, prompt: list[int], schema: dict, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(output tokens) of constrained plain decoding: every legal path, each step's masked + warped distribution
    from a fresh prefill of prompt + path (independent of the decoders' caches)."""
    law: dict[tuple[int, ...], float] = {}

    def walk(path: list[int], prob: float) -> None:
        c = constraint(engine, schema)
        for t in path:
            c.advance(t)
        logits, _ = prefill(engine.model, prompt + path, engine.model.make_cache())
        p = np.exp(np.array(warp(c.apply(logits[-1]), params), dtype=np.float64))
        for t in np.flatnonzero(p):
            q = prob * p[t]
            if q < PRUNE:
                law[("other",)] = law.get(("other",), 0.0) + q
            elif int(t) in engine.eos_ids:
                law[tuple(path)] = law.get(tuple(path), 0.0) + q
            else:
                walk(path + [int(t)], q)

    walk([], 1.0)
    return law


def tv_against(law: dict, outcomes: list[tuple]) -> tuple[float, float]:
    m = len(outcomes)
    keys = list(law)
    index = {k: i for i, k in enumerate(keys)}
    counts = np.zeros(len(keys) + 1)
    for o in outcomes:
        counts[index.get(o, len(keys))] += 1  # an outcome outside the law's support counts fully against it
    p = np.append(np.array([law[k] for k in keys]), 0.0)
    dist = 0.5 * np.abs(counts / m - p).sum()
    bound = np.sqrt(m * p * (1 - p)).sum() / (2 * m) + math.sqrt(math.log(1 / FAIL) / (2 * m))
    return dist, bound


def draw(engine, prompt, schema, mtp: bool, seed: int, cache, hidden) -> tuple[int, ...]:
    """One constrained generation from a copy of the prefilled prompt[:-1] (only the last prompt token runs)."""
    parts = RowParts(cache=clone_cache(cache), skip=len(prompt) - 1, carry=hidden,
                     constraint=constraint(engine, schema))
    return tuple(decode_tokens(engine.model, prompt, DecodeOptions(16, LAW_PARAMS, seed), engine.eos_ids,
                               3 if mtp else 0, parts))


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_sampled_constrained_output_follows_the_exact_law(engine, mtp):
    prompt = ask(engine, "colour")
    law = exact_law(engine, prompt, COLOUR, LAW_PARAMS)
    assert len(law) >= 4 and abs(sum(law.values()) - 1) < 1e-6
    cache = engine.model.make_cache()
    _, hidden = prefill(engine.model, prompt[:-1], cache, mtp=True)
    outcomes = [draw(engine, prompt, COLOUR, mtp, seed, cache, hidden[-1:]) for seed in range(DRAWS[mtp])]
    assert all(json.loads(engine.tokenizer.decode(list(o))) in COLOUR["enum"] for o in outcomes)
    dist, bound = tv_against(law, outcomes)
    assert dist <= bound, f"TV {dist:.4f} > bound {bound:.4f}"
