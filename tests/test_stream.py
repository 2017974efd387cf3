"""Engine.stream(request): the events every front end consumes, and the request object validated where it enters."""

from __future__ import annotations

import itertools

import pytest

import hetero
from hetero.errors import HeteroError


@pytest.fixture(scope="module")
def engine() -> hetero.Engine:
    return hetero.load()


def events_of(engine, **kw) -> list:
    return list(engine.stream(hetero.GenerationRequest("def parse(line):", **kw)))


@pytest.mark.parametrize("mtp", [False, True])
def test_events_come_in_order_and_say_what_generate_returns(engine, mtp):
    """Prefilled once, then one Token per generated token, then Finished; their ids and text are generate's."""
    events = events_of(engine, max_tokens=24, mtp=mtp, use_prefix_cache=False)
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "Prefilled" and kinds[-1] == "Finished" and set(kinds[1:-1]) == {"Token"}
    result = engine.generate("def parse(line):", max_tokens=24, mtp=mtp, use_prefix_cache=False)
    tokens = [e for e in events if isinstance(e, hetero.Token)]
    assert [t.id for t in tokens] == result.tokens
    assert "".join(t.text for t in tokens) + events[-1].text == result.text
    assert events[0].prompt_tokens == result.stats["prompt_tokens"] == events[-1].stats["prompt_tokens"]
    assert events[-1].stats["generated_tokens"] == len(tokens)


def test_stop_ends_the_generation_at_the_token_just_yielded(engine):
    events = engine.stream(hetero.GenerationRequest("def parse(line):", max_tokens=40, mtp=True,
                                                    use_prefix_cache=False))
    seen = list(itertools.islice(events, 6))  # Prefilled and five tokens
    final = events.send(hetero.STOP)
    assert isinstance(final, hetero.Finished) and final.finish_reason == "stop"
    assert final.stats["generated_tokens"] == sum(isinstance(e, hetero.Token) for e in seen) == 5
    with pytest.raises(StopIteration):
        next(events)


def test_a_closed_stream_leaves_the_prefix_cache_at_the_committed_state(engine):
    """Closing mid-generation checkpoints what was committed: the conversation's next prompt (this one, the tokens
    seen, then more) restores it and decodes the cold run's tokens."""
    from hetero.caches.prefix import PrefixCache

    prompt = engine.encode_prompt("import os\nimport sys\n\n\ndef main(argv):\n")
    engine.prefix_cache = PrefixCache()
    try:
        events = engine.stream(hetero.GenerationRequest(prompt, max_tokens=30, mtp=True))
        seen = [e.id for e in itertools.islice(events, 8) if isinstance(e, hetero.Token)]
        events.close()
        follow_up = prompt + seen + engine.encode_prompt("\n    return 0\n")
        again = engine.generate(follow_up, max_tokens=12, mtp=True)
        assert again.stats["cached_tokens"] >= len(prompt)
        cold = engine.generate(follow_up, max_tokens=12, mtp=True, use_prefix_cache=False)
        assert again.tokens == cold.tokens
    finally:
        engine.prefix_cache = None


@pytest.mark.parametrize("kw, message", [
    (dict(max_tokens="8"), "max_tokens must be an integer"),
    (dict(prefill_chunk=0), "--prefill-chunk must be a positive integer"),
    (dict(draft_depth=0), "--draft-depth"),
    (dict(logprobs=21), "logprobs"),
    (dict(json_object=True, grammar="start: \"x\""), "one of json_schema, json_object or grammar"),
    (dict(presence_penalty=3), "presence_penalty"),
])
def test_a_bad_request_is_one_line_where_it_is_made(kw, message):
    with pytest.raises(HeteroError, match=message) as e:
        hetero.GenerationRequest("x", **kw)
    assert "\n" not in str(e.value)
