"""Forced tool calls under hetero/tools/call_grammar.py, on the bundled model's real tokenizer.

Uniform sampling among the tokens the grammar's mask allows stands in for an untrained model (any allowed token
may be drawn): every such run must end in EOS with exactly one call the server's own parser reads, to an allowed
function, with arguments valid for the tool's JSON schema. The bundled model itself (untrained for tools) then
decodes under the grammar with MTP. String values are bounded (maxLength) so random text ends within the cap.
"""

from __future__ import annotations

import json
from pathlib import Path

import hetero  # before MLX (its BLAS)
import jsonschema
import numpy as np
import pytest

from hetero.decode.options import DecodeOptions
from hetero.decode.parts import RowParts
from hetero.decode.sampling import SamplingParams
from hetero.decode.solo import decode_tokens
from hetero.errors import HeteroError
from hetero.tools import ToolCallParser, forced_prefix
from hetero.tools.call_grammar import call_grammar
from hetero.tools.constrained import Constraint
from hetero.tools.events import CallEnd, Text

XML_TEMPLATE = (Path(__file__).parent / "data" / "qwen3.6_chat_template.jinja").read_text(encoding="utf-8")
JSON_TEMPLATE = None  # the bundled template: no <function=, so the JSON form
TEMPLATES = {"xml": XML_TEMPLATE, "json": JSON_TEMPLATE}
PROMPT = "<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n"


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": parameters}}


WEATHER = tool("get_weather", {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "detail": {"type": "boolean"},
        "scale": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "where": {"type": "array", "items": {"$ref": "#/$defs/place"}, "maxItems": 1},
        "label": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
    },
    "required": ["city", "days"],
    "$defs": {"place": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}},
                        "required": ["lat"]}},
})
SEARCH = tool("search", {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 8}, "limit": {"type": "integer", "minimum": 1,
                                                                          "maximum": 20}},
    "required": ["query"],
})
NOW = tool("now", {"type": "object", "properties": {}})
TOOLS = [WEATHER, SEARCH, NOW]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CASES = [(form, choice) for form in ("xml", "json") for choice in ("get_weather", "search", "required")]


@pytest.fixture(scope="module")
def engine():
    return hetero.load()


def grammar(engine, form: str, choice: str) -> str:
    return call_grammar(TOOLS, choice, form, engine.grammar_tokenizer())


def check_call(form: str, choice: str, text: str) -> tuple[str, dict]:
    """`text` (what followed the forced prefix) read by the server's parser: exactly one call to an allowed
    function, arguments valid for its schema; returns (name, arguments)."""
    named = choice != "required"
    parser = ToolCallParser(TOOLS, only=choice if named else None)
    events = parser.feed(forced_prefix(choice, PROMPT, TEMPLATES[form]) + text) + parser.finish()
    calls = [e for e in events if isinstance(e, CallEnd)]
    assert len(calls) == 1 and not [e for e in events if isinstance(e, Text)], (text, events)
    call = calls[0]
    assert call.name == choice if named else call.name in SCHEMAS, call.name
    jsonschema.validate(call.arguments, SCHEMAS[call.name])
    return call.name, call.arguments


def uniform_run(engine, g: str, seed: int, cap: int = 400) -> tuple[list[int], bool]:
    """Tokens drawn uniformly among those the mask allows, until EOS (not included) or `cap`."""
    rng = np.random.default_rng(seed)
    c = Constraint(engine.grammar_tokenizer(), g, engine.eos_ids)
    out: list[int] = []
    for _ in range(cap):
        t = int(rng.choice(np.flatnonzero(c.mask())))
        c.advance(t)
        if t in engine.eos_ids:
            return out, True
        out.append(t)
    return out, False


@pytest.mark.parametrize("form, choice", CASES)
def test_uniform_sampling_always_gives_one_valid_call(engine, form, choice):
    g = grammar(engine, form, choice)
    names = set()
    for seed in range(30):
        tokens, ended = uniform_run(engine, g, seed)
        text = engine.tokenizer.decode(tokens)
        assert ended, (seed, text)
        name, _ = check_call(form, choice, text)
        names.add(name)
    if choice == "required":
        assert len(names) > 1, names  # the choice among the tools is really open


@pytest.mark.parametrize("form", ["xml", "json"])
def test_eos_only_after_the_call_ends(engine, form):
    ending = "\n</parameter>\n</function>\n</tool_call>" if form == "xml" else "}\n</tool_call>"
    body = ">\n<parameter=query>\nab" if form == "xml" else ' {"query": "ab"}'
    c = Constraint(engine.grammar_tokenizer(), grammar(engine, form, "search"), engine.eos_ids)
    eos = sorted(engine.eos_ids)
    ids = engine.tokenizer.encode(body + ending)
    for t in ids:
        assert not c.mask()[eos].any()
        c.advance(t)
    assert c.mask()[eos].all() and c.mask().sum() == len(eos)  # the call is complete: EOS and nothing else


def accepts(engine, g: str, text: str) -> bool:
    c = Constraint(engine.grammar_tokenizer(), g, engine.eos_ids)
    ids = engine.tokenizer.encode(text)
    return c.extend(ids) == len(ids) and bool(c.mask()[min(engine.eos_ids)])


REJECTED = {
    "xml": [
        (">\n<parameter=query>\nab\n</parameter>\n</function>\n</tool_call>", "get_weather", "the named one only"),
        ("nope>\n</function>\n</tool_call>", "required", "an unknown function"),
        ("search>\n<parameter=limit>\n3\n</parameter>\n</function>\n</tool_call>", "required", "no required query"),
        ("search>\n<parameter=query>\nab\n</parameter>\n<parameter=page>\n2\n</parameter>\n</function>\n"
         "</tool_call>", "required", "an undeclared parameter"),
        ("search>\n<parameter=query>\nab\n</parameter>\n<parameter=limit>\n99\n</parameter>\n</function>\n"
         "</tool_call>", "required", "limit above its maximum"),
        ("search>\n<parameter=limit>\n3\n</parameter>\n<parameter=query>\nab\n</parameter>\n</function>\n"
         "</tool_call>", "required", "parameters out of the schema's order"),
    ],
    "json": [
        (' "nope", "arguments": {}}\n</tool_call>', "required", "an unknown function"),
        (' {"limit": 3}}\n</tool_call>', "search", "no required query"),
        (' {"query": "a", "page": 2}}\n</tool_call>', "search", "an undeclared property"),
        (' {"query":"ab"}}\n</tool_call>', "search", "whitespace unlike json.dumps"),
        (' "search", "arguments": {"query": "a</tool_call>"}}\n</tool_call>', "required", "the end tag in a string"),
    ],
}
ACCEPTED = {
    "xml": [("search>\n<parameter=query>\nab\n</parameter>\n</function>\n</tool_call>", "required"),
            (">\n<parameter=query>\na</para\n</parameter>\n<parameter=limit>\n3\n</parameter>\n</function>\n"
             "</tool_call>", "search"),
            ("now>\n</function>\n</tool_call>", "required")],
    "json": [(' "search", "arguments": {"query": "ab", "limit": 3}}\n</tool_call>', "required"),
             (' {"query": "a</tool"}}\n</tool_call>', "search")],
}


@pytest.mark.parametrize("form", ["xml", "json"])
def test_the_grammar_refuses_what_is_not_a_valid_call(engine, form):
    for text, choice in ACCEPTED[form]:
        assert accepts(engine, grammar(engine, form, choice), text), text
        check_call(form, choice, text)
    for text, choice, why in REJECTED[form]:
        assert not accepts(engine, grammar(engine, form, choice), text), why


def test_xml_string_values_cannot_hold_the_closing_tag(engine):
    free = tool("echo", {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})
    g = call_grammar([free], "echo", "xml", engine.grammar_tokenizer())
    assert not accepts(engine, g, ">\n<parameter=text>\na</parameter>b\n</parameter>\n</function>\n</tool_call>")
    text = ">\n<parameter=text>\n<b>x</b>\n</function>\n\n</parameter>\n</function>\n</tool_call>"
    assert accepts(engine, g, text)
    parser = ToolCallParser([free], only="echo")
    events = parser.feed(forced_prefix("echo", PROMPT, XML_TEMPLATE) + text) + parser.finish()
    assert [e.arguments for e in events if isinstance(e, CallEnd)] == [{"text": "<b>x</b>\n</function>\n"}]


def test_non_ascii_names_quotes_and_typed_literals(engine):
    odd = tool('wé"x', {"type": "object", "properties": {"città": {"enum": ["Zürich", 'a"b', 3, True]}},
                        "required": ["città"]})
    g = call_grammar([odd, NOW], "required", "json", engine.grammar_tokenizer())
    text = ' "wé\\"x", "arguments": {"città": "Zürich"}}\n</tool_call>'
    assert accepts(engine, g, text)
    odd["function"]["name"] = "wé"
    g = call_grammar([odd], "wé", "xml", engine.grammar_tokenizer())
    for literal, value in [("Zürich", "Zürich"), ('a"b', 'a"b'), ("3", 3), ("true", True)]:
        text = f">\n<parameter=città>\n{literal}\n</parameter>\n</function>\n</tool_call>"
        assert accepts(engine, g, text), literal
        parser = ToolCallParser([odd], only="wé")
        events = parser.feed(forced_prefix("wé", PROMPT, XML_TEMPLATE) + text) + parser.finish()
        assert [e.arguments for e in events if isinstance(e, CallEnd)] == [{"città": value}]
    assert not accepts(engine, g, ">\n<parameter=città>\nZurich\n</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("form", ["xml", "json"])
def test_formats_llguidance_lacks_are_annotations(engine, form):
    paths = tool("read", {"type": "object", "properties": {"path": {"type": "string", "format": "path"},
                                                           "n": {"type": "integer", "format": "int32"}}})
    g = call_grammar([paths], "read", form, engine.grammar_tokenizer())
    text = (">\n<parameter=path>\n/a b\n</parameter>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>"
            if form == "xml" else ' {"path": "/a b", "n": 3}}\n</tool_call>')
    assert accepts(engine, g, text)


@pytest.mark.parametrize("tools, choice, form, match", [
    ([tool("f", {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$"}}})], "f", "xml",
     "pattern"),
    ([tool("f", {"anyOf": [{"type": "object"}]})], "f", "xml", "top-level anyOf"),
    ([tool("f", {"type": "object", "properties": {"p": {"$ref": "#/$defs/p"}}, "$defs": {"p": {"type": "integer"}}})],
     "f", "xml", r"\$ref"),
    ([tool("f", {"type": "object", "properties": {"n": {"const": 5}}})], "f", "xml", "no value"),
    ([tool("f", {"type": "object", "properties": {"a b>": {"type": "string"}}})], "f", "xml", "cannot be written"),
    ([tool("f", {"type": "object", "required": ["x"]})], "f", "xml", "not among its properties"),
    ([tool("f", {"type": "array"})], "f", "json", "type object"),
    ([tool("f", {"type": "object", "properties": {"x": {"type": "strin"}}})], "f", "json", "cannot force"),
    ([NOW, tool("g", {"type": "object", "properties": {"x": {"type": "strin"}}})], "required", "json", "'g'"),
    ([NOW], "other", "json", "not among the tools"),
])
def test_an_unsupported_schema_is_a_one_line_error(engine, tools, choice, form, match):
    with pytest.raises(HeteroError, match=match) as info:
        call_grammar(tools, choice, form, engine.grammar_tokenizer())
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("form, choice", [("xml", "required"), ("json", "get_weather")])
def test_the_bundled_model_calls_validly_under_mtp(engine, form, choice):
    """The real engine: the bundled model (never trained on calls), sampled at temperature 1 with MTP depth 3,
    decodes under the grammar; each seed gives a valid call within 200 tokens."""
    g = grammar(engine, form, choice)
    ids = engine.encode_prompt(PROMPT + forced_prefix(choice, PROMPT, TEMPLATES[form]))
    for seed in range(3):
        constraint = Constraint(engine.grammar_tokenizer(), g, engine.eos_ids)
        tokens = list(decode_tokens(engine.model, ids, DecodeOptions(200, SamplingParams(1.0), seed), engine.eos_ids, 3,
                                    RowParts(constraint=constraint)))
        assert len(tokens) < 200, seed  # ended by EOS
        check_call(form, choice, engine.tokenizer.decode(tokens))


def test_forced_calls_through_the_server_are_valid_every_time():
    """`hetero serve` on the bundled model (untrained for tools), sampled at temperature 1 with MTP: tool_choice
    `required` and a named function come back, every time, as exactly one call to an allowed tool whose arguments
    validate against its schema (the server decodes them under call_grammar, after the forced prefix)."""
    from test_server import LiveServer

    server = LiveServer(hetero.load())
    try:
        oai = server.openai()
        model = oai.models.list().data[0].id
        for seed, choice in [(s, c) for s in range(3) for c in ("required", {"type": "function",
                                                                               "function": {"name": "search"}})]:
            out = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "weather?"}],
                                              tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed,
                                              max_tokens=160, extra_body={"mtp": True})
            calls = out.choices[0].message.tool_calls
            assert out.choices[0].finish_reason == "tool_calls" and len(calls) == 1, out.choices[0]
            name = calls[0].function.name
            assert name == "search" or choice == "required"
            jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[name])
    finally:
        server.stop()
