"""A request's decode options pass whole: one `DecodeOptions` from the API (the library's keywords, the server's
parser, the CLI's flags, a pipelined request's JSON) to the row, and nothing on the way unpacks it again."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hetero
from hetero.decode.depth import MAX_DEPTH
from hetero.decode.loop import DecodeLoop, Seat
from hetero.decode.options import SAMPLING_NAMES, DecodeOptions, decode_options
from hetero.decode.parts import RowParts
from hetero.decode.penalties import PENALTY_NAMES, Penalties
from hetero.decode.rows import Row
from hetero.decode.sampling import SamplingParams
from hetero.decode.solo import batch_generate, decode_tokens
from hetero.decode.state import start
from hetero.decode.stepper import Batch
from hetero.distributed.request import Request
from hetero.errors import HeteroError
from hetero.server.requests import Job

OPTION_NAMES = {f.name for f in dataclasses.fields(DecodeOptions)}
PART_NAMES = {f.name for f in dataclasses.fields(RowParts)}
PUBLIC_NAMES = OPTION_NAMES | set(SAMPLING_NAMES) | set(PENALTY_NAMES) | {"chunk", "penalizer"}

sampling = st.builds(SamplingParams, st.sampled_from([0.0, 0.5, 1.3]), st.integers(0, 50),
                     st.sampled_from([1.0, 0.9, 0.25]), st.sampled_from([0.0, 0.05]))
penalties = st.builds(Penalties, st.floats(-2, 2), st.floats(-2, 2), st.floats(0.01, 2),
                      st.dictionaries(st.integers(0, 10**5), st.floats(-100, 100), max_size=4))
constraint = st.one_of(st.just({}), st.fixed_dictionaries({"json_object": st.just(True)}),
                       st.fixed_dictionaries({"grammar": st.just('start: "x"')}),
                       st.fixed_dictionaries({"json_schema": st.just({"type": "object"})}))
options = st.builds(
    lambda c, **kw: DecodeOptions(**kw, **c), constraint, max_tokens=st.integers(-5, 10**6), sampling=sampling,
    seed=st.one_of(st.none(), st.integers(0, 2**31 - 1)), penalties=penalties, prefill_chunk=st.integers(1, 4096),
    mtp=st.sampled_from([None, True, False]), draft_depth=st.one_of(st.none(), st.integers(1, MAX_DEPTH)),
    copy=st.booleans(), logprobs=st.one_of(st.none(), st.integers(0, 20)),
    thinking_budget=st.one_of(st.none(), st.integers(0, 10**4)))


@settings(max_examples=60, deadline=None)
@given(options)
def test_options_cross_the_ranks_whole(o):
    """A pipelined request carries its options as JSON and every rank reads back the same object."""
    request = Request("generate", [1, 2], o, depth=2, eos=[0], max_context=64, marks=[1], stoppable=True)
    assert Request.from_json(json.loads(json.dumps(request.to_json()))) == request


def by_name(o: DecodeOptions) -> dict:
    """`o` as the keyword arguments `engine.generate` takes (sampling and penalties by their public names)."""
    return {**{f: getattr(o, f) for f in OPTION_NAMES - {"sampling", "penalties"}}, **dataclasses.asdict(o.sampling),
            **{public: getattr(o.penalties, field) for public, field in PENALTY_NAMES.items()}}


@settings(max_examples=60, deadline=None)
@given(options, options, st.data())
def test_named_options_land_where_the_object_holds_them(o, other, data):
    """`GenerationRequest(prompt, **names)` (as `engine.generate(**names)`) builds the object given whole; with
    `options=` too, each name replaces that one value (a sampling or penalty name its part) and nothing else."""
    assert hetero.GenerationRequest([1], **by_name(o)).options == o
    request = hetero.GenerationRequest([1], options=o)
    assert all(getattr(request, name) == getattr(o, name) for name in OPTION_NAMES)  # read off the request
    free = sorted(set(by_name(o)) - {"json_schema", "json_object", "grammar"})  # (one constraint at a time)
    names = {k: by_name(other)[k] for k in data.draw(st.sets(st.sampled_from(free), max_size=5), label="names")}
    expected = o
    for k, v in names.items():
        if k in SAMPLING_NAMES:
            expected = dataclasses.replace(expected, sampling=dataclasses.replace(expected.sampling, **{k: v}))
        elif k in PENALTY_NAMES:
            part = dataclasses.replace(expected.penalties, **{PENALTY_NAMES[k]: v})
            expected = dataclasses.replace(expected, penalties=part)
        else:
            expected = dataclasses.replace(expected, **{k: v})
    assert hetero.GenerationRequest([1], options=o, **names).options == expected


def test_an_unknown_or_misplaced_option_is_one_line():
    with pytest.raises(HeteroError, match="^unknown generation argument 'tempreature'; see hetero.GenerationRequest"):
        hetero.GenerationRequest("x", tempreature=0.5)
    with pytest.raises(HeteroError, match="presence_penalty must be a number in"):
        decode_options(DecodeOptions(), presence_penalty=9)
    with pytest.raises(HeteroError, match="seed"):
        DecodeOptions(seed=-1)
    with pytest.raises(TypeError, match="by position"):
        hetero.GenerationRequest("x", 8, SamplingParams(), 3)


@pytest.mark.parametrize("fn", [decode_tokens, batch_generate, start, Batch.join, Batch.prefilled, Batch.row,
                                DecodeLoop.generate_tokens, Seat.decode_tokens])
def test_no_step_between_the_api_and_the_row_unpacks_the_options(fn):
    """Every function from the engine down to the row takes `DecodeOptions` and `RowParts` whole: none names one of
    their fields (or the penalizer's and sampler's inputs) as a parameter, so a new option is its field and the one
    place that reads it."""
    params = set(inspect.signature(fn).parameters)
    assert not params & (PUBLIC_NAMES - {"penalizer"} | PART_NAMES), fn.__qualname__
    assert {"options", "parts"} & params or fn is batch_generate


@pytest.mark.parametrize("holder", [Row, Job, Request])
def test_nothing_that_carries_the_options_copies_their_fields(holder):
    """The row, the server's job and a pipelined request hold the options whole, never field by field (and the row
    its parts whole)."""
    fields = {f.name for f in dataclasses.fields(holder)}
    assert "options" in fields and not fields & (OPTION_NAMES | set(SAMPLING_NAMES) | set(PENALTY_NAMES))
    assert holder is not Row or ("parts" in fields and not fields & PART_NAMES)
