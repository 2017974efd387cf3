"""The OpenAI Responses API (POST /v1/responses) live on loopback, on the tiny model trained to call a tool
(tests/tool_model.py): every streamed event validated against the openai SDK's own event types, plain responses
parsed by the SDK, function-call round trips through `previous_response_id` and through explicit items, and a
request shaped as Codex CLI sends it."""

from __future__ import annotations

import json
import logging
import typing
from types import SimpleNamespace

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from tool_model import (
    FINAL_ANSWER, MATH_ANSWER, MATH_REASONING, MATH_REQUEST, TOOLS, WEATHER_ARGS, WEATHER_REQUEST, WEATHER_RESULT,
)

import hetero
from hetero.server.requests import Parser
from hetero.server.responses import ResponseStore, parse_responses

# the SDK's event class for each `type` (the union's members, each with a one-value Literal type field)
EVENTS = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
          for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
FUNCTION_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses form: name at the top
NAME = "get_weather"


@pytest.fixture(scope="module")
def engine(tool_model_dir):
    return hetero.load(str(tool_model_dir))


def raw_events(server, body: dict) -> list:
    """POST a streamed request; every `data:` line validated as one of the SDK's event types (strictly: an unknown
    type or a missing field fails), checked against its `event:` line."""
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name and name in EVENTS, name
                event = EVENTS[name].model_validate(data)  # strictly, not as the SDK's lenient construct
                events.append(event)
    return events


def check_sequence(events) -> None:
    """Sequence numbers count from 0; every item event names an item that was added and not yet done."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    open_items = {}
    for e in events:
        if e.type == "response.output_item.added":
            open_items[e.item.id] = e.output_index
        elif hasattr(e, "item_id"):
            assert open_items.get(e.item_id) == e.output_index, f"{e.type} for an item not open"
        if e.type == "response.output_item.done":
            assert open_items.pop(e.item.id) == e.output_index
    assert not open_items


def test_stream_of_reasoning_and_text_matches_the_sdk_types(server, model, oai):
    events = raw_events(server, {"model": model, "input": MATH_REQUEST, "tools": FUNCTION_TOOLS,
                                 "max_output_tokens": 64})
    check_sequence(events)
    kinds = [e.type for e in events]
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta"]
    assert kinds[-1] == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert (reasoning.strip(), text, done.text) == (MATH_REASONING, MATH_ANSWER, MATH_ANSWER)
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == MATH_ANSWER
    plain = oai.responses.create(model=model, input=MATH_REQUEST, tools=FUNCTION_TOOLS, max_output_tokens=64)
    assert plain.output_text == text and final.usage.output_tokens == plain.usage.output_tokens


def test_stream_of_a_function_call_matches_the_sdk_types(server, model):
    events = raw_events(server, {"model": model, "input": WEATHER_REQUEST, "tools": FUNCTION_TOOLS,
                                 "max_output_tokens": 64})
    check_sequence(events)
    (added,) = [e for e in events if e.type == "response.output_item.added"]
    assert added.item.type == "function_call" and added.item.name == NAME
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(args) == json.loads(done.arguments) == WEATHER_ARGS
    (item,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert item.call_id == added.item.call_id and item.status == "completed"
    assert events[-1].type == "response.completed"


def test_plain_response_parses_in_the_sdk_with_usage(oai, model, server):
    r = oai.responses.create(model=model, input=MATH_REQUEST, tools=FUNCTION_TOOLS, max_output_tokens=64)
    assert r.status == "completed" and r.output_text == MATH_ANSWER and r.model == model
    reasoning = r.output[0]
    assert reasoning.type == "reasoning" and reasoning.content[0].text.strip() == MATH_REASONING
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens > 0
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    raw = httpx.post(server.url + "/v1/responses", json={"model": model, "input": "hi", "max_output_tokens": 2}).json()
    cut = Response.model_validate(raw)  # strictly, not as the SDK's lenient construct
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_function_call_round_trip_through_previous_response_id(oai, model):
    first = oai.responses.create(model=model, input=WEATHER_REQUEST, tools=FUNCTION_TOOLS, max_output_tokens=64)
    (call,) = first.output
    assert call.type == "function_call" and call.name == NAME and json.loads(call.arguments) == WEATHER_ARGS
    final = oai.responses.create(model=model, previous_response_id=first.id, tools=FUNCTION_TOOLS, max_output_tokens=64,
                                 input=[{"type": "function_call_output", "call_id": call.call_id,
                                         "output": WEATHER_RESULT}])
    assert final.output_text == FINAL_ANSWER and final.previous_response_id == first.id


def test_function_call_round_trip_through_explicit_items(oai, model):
    first = oai.responses.create(model=model, input=WEATHER_REQUEST, tools=FUNCTION_TOOLS, max_output_tokens=64,
                                 store=False)
    (call,) = first.output
    items = [{"role": "user", "content": [{"type": "input_text", "text": WEATHER_REQUEST}]},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": WEATHER_RESULT}]
    final = oai.responses.create(model=model, input=items, tools=FUNCTION_TOOLS, max_output_tokens=64)
    assert final.output_text == FINAL_ANSWER
    with pytest.raises(openai.NotFoundError, match="not stored"):  # store: false kept nothing
        oai.responses.create(model=model, previous_response_id=first.id, input="x", max_output_tokens=2)


def test_unknown_previous_response_id_is_a_404_naming_the_field(server, model):
    r = httpx.post(server.url + "/v1/responses", json={"model": model, "input": "x", "previous_response_id": "resp_0"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["param"] == "previous_response_id" and "resp_0" in error["message"]


def test_codex_shaped_request_completes(server, model, caplog):
    body = {
        "model": model, "instructions": "You are a coding agent.", "stream": True, "store": False,
        "input": [{"type": "message", "role": "developer",
                   "content": [{"type": "input_text", "text": "sandbox: none"}]},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": WEATHER_REQUEST}]}],
        "tools": FUNCTION_TOOLS + [{"type": "web_search"}, {"type": "custom", "name": "apply_patch", "format": {}}],
        "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "abc", "client_metadata": {"x": "y"},
        "max_output_tokens": 48,
    }
    with caplog.at_level(logging.WARNING, logger="hetero.server"):
        events = raw_events(server, body)
    check_sequence(events)
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.tools[0].name == NAME and len(events[-1].response.tools) == 1


def test_reasoning_effort_sets_the_thinking_switch(oai, model):
    def prompt_tokens(**kw) -> int:
        return oai.responses.create(model=model, input=MATH_REQUEST, max_output_tokens=1, **kw).usage.input_tokens

    default = prompt_tokens()
    assert prompt_tokens(reasoning={"effort": "high"}) == default
    assert prompt_tokens(reasoning={"effort": "none"}) > default  # the template closes an empty think block


def test_text_format_json_schema_becomes_the_json_constraint(engine):
    parser = Parser(engine, {"m"})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "out", "schema": schema}}}
    assert parse_responses(ResponseStore())(parser, body).options.json_schema == schema
    job = parse_responses(ResponseStore())(parser, {**body, "text": {"format": {"type": "json_object"}}})
    assert job.options.json_object and job.options.json_schema is None


def test_bad_items_are_400s_naming_the_item(server, model):
    cases = [({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input[0].role"),
             ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name"),
             ({"input": 3}, "input"), ({"input": "x", "previous_response_id": 5}, "previous_response_id"),
             ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning.effort")]
    for extra, param in cases:
        r = httpx.post(server.url + "/v1/responses", json={"model": model, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_store_is_bounded():
    store = ResponseStore(size=2)
    for i in range(3):
        store.put(f"r{i}", [SimpleNamespace(i=i)])
    assert store.get("r0") is None and store.get("r2") is not None
