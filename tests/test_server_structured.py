"""OpenAI logprobs / top_logprobs and response_format through `hetero serve`, with the official SDK on loopback,
on the bundled model (its tokenizer is a real byte-level BPE, so JSON constraints and token bytes are real)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import openai
import pytest

import hetero

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person in JSON"}]


@pytest.fixture(scope="module")
def engine():
    return hetero.load()


def chat(oai, stream: bool = False, **kw):
    return oai.chat.completions.create(model="bundled", messages=ASK, max_tokens=24, stream=stream, **kw)


def streamed(chunks) -> tuple[str, list]:
    """Text and logprobs.content entries of a chat stream, joined."""
    text, entries = [], []
    for c in chunks:
        if not c.choices:
            continue
        ch = c.choices[0]
        text.append(ch.delta.content or "")
        if ch.logprobs is not None and ch.logprobs.content:
            entries.extend(ch.logprobs.content)
    return "".join(text), entries


def test_chat_logprobs_are_the_engines(engine, oai):
    r = chat(oai, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in content).decode() == r.choices[0].message.content
    direct = engine.generate(ASK[0]["content"], max_tokens=24, chat=True, mtp=False, logprobs=3)
    np.testing.assert_allclose([e.logprob for e in content], [x.logprob for x in direct.logprobs], atol=2e-3)
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert e.logprob <= tops[0] + 1e-6


def test_chat_stream_carries_the_same_logprobs(oai):
    whole = chat(oai, logprobs=True, top_logprobs=2)
    text, entries = streamed(chat(oai, stream=True, logprobs=True, top_logprobs=2))
    assert text == whole.choices[0].message.content
    assert [(e.token, e.bytes, round(e.logprob, 5)) for e in entries] == \
        [(e.token, e.bytes, round(e.logprob, 5)) for e in whole.choices[0].logprobs.content]
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_no_logprobs_unless_asked(oai):
    assert chat(oai).choices[0].logprobs is None
    r = chat(oai, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completion_logprobs_legacy_shape(oai, stream):
    r = oai.completions.create(model="bundled", prompt="def add(a, b):", max_tokens=16, logprobs=2, stream=stream)
    chunks = list(r) if stream else [r]
    tokens, lps, tops, offsets, text = [], [], [], [], ""
    for c in chunks:
        ch = c.choices[0]
        text += ch.text
        if ch.logprobs is not None:
            tokens += ch.logprobs.tokens
            lps += ch.logprobs.token_logprobs
            tops += ch.logprobs.top_logprobs
            offsets += ch.logprobs.text_offset
    assert "".join(tokens) == text and len(tokens) == len(lps) == len(tops) == len(offsets) == 16
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert all(0 < len(t) <= 2 and max(t.values()) >= lp - 1e-6 for t, lp in zip(tops, lps))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_json_schema_response_format(oai, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = oai.chat.completions.create(model="bundled", messages=ASK, max_tokens=60, response_format=fmt, stream=stream)
    text = streamed(r)[0] if stream else r.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_response_format(oai):
    r = oai.chat.completions.create(model="bundled", messages=ASK, max_tokens=30,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    text = oai.chat.completions.create(model="bundled", messages=ASK, max_tokens=24, response_format={"type": "text"})
    assert text.choices[0].message.content == chat(oai).choices[0].message.content  # "text": unconstrained


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("kw, param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": PERSON, "strict": 1}}},
     "response_format.json_schema.strict"),
])
def test_bad_values_are_a_400_before_any_stream(oai, kw, param, stream):
    with pytest.raises(openai.BadRequestError) as info:
        r = chat(oai, stream=stream, **kw)
        if stream:
            list(r)
    assert info.value.status_code == 400
    err = info.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_completion_logprobs_out_of_range(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="bundled", prompt="x", max_tokens=2, logprobs=21)
    assert info.value.body["param"] == "logprobs"
