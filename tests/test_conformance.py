"""The conformance harness's share of the suite (`conformance_checks.py`): for every architecture hetero loads, a
fixed number of draws from its config space (`conformance_space.py`, sized `SMALL`) under the session's hypothesis
seed, so each run explores configs the last did not. Each draw is written by transformers and checked on the whole
path: logits at every position against transformers (in float64), greedy tokens, chunked prefill, cached decode,
MTP against plain, and a repeated pass bitwise equal to the first. `python bench/conformance.py --draws N` sweeps
the full space (`FULL`), the split included.

A failing draw's message holds its JSON: `python bench/conformance.py --replay '<json>'` runs it again."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import conformance_checks as cc
from conformance_space import ARCHITECTURES, SMALL, split_draw, strategy

DRAWS = 10  # per architecture and run
SPLIT_DRAWS = 4  # per run, of any architecture (each exports its programs: seconds)


def failure(draw, result) -> str:
    return f"{draw.arch} draw failed {result.failures}: {json.dumps(draw.to_json())} errors {result.errors}"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("conformance")


@pytest.mark.parametrize("arch", ARCHITECTURES)
@settings(max_examples=DRAWS, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_draw_matches_transformers_on_every_path(arch, data, root):
    """Logits within 1e-4 of transformers' at every position, the same greedy tokens, chunked prefill and cached
    decode on the same logits, MTP's tokens the plain ones, and nothing stateful: for every draw (the vision
    tower's: its embeddings, and the logits and greedy tokens of a prompt with an image)."""
    draw = data.draw(strategy(arch, SMALL), label="draw")
    result = cc.run_draw(draw, root)
    assert result.refused_as_expected(draw), f"{draw.arch} refused {result.refused}: {json.dumps(draw.to_json())}"
    assert result.ok, failure(draw, result)


@settings(max_examples=SPLIT_DRAWS, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_drawn_split_passes_verify_and_stays_engaged(data, root):
    """A few draws per run (architecture, dtype and massive activations drawn too): the split at fraction 0.5
    passes `--verify`, decodes the GPU-only tokens, and with outliers keeps the effective fraction of its shapes.
    bench/conformance.py runs 100 per architecture in each dtype."""
    arch = data.draw(st.sampled_from(ARCHITECTURES), label="arch")
    draw = data.draw(split_draw(arch, SMALL), label="draw")
    result = cc.run_draw(draw, root, (draw.dtype,), numerics=False)
    assert result.refused_as_expected(draw), f"{draw.arch} refused {result.refused}: {json.dumps(draw.to_json())}"
    assert result.ok, failure(draw, result)
