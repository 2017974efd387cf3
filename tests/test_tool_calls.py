"""Tool calls and reasoning, model side: the parsers (both call formats, every split of the text, schema typing,
malformed calls), message / tools / tool_choice conversion, the Qwen3.6 template's rendering, and a tiny model
trained to call a tool, generating through `hetero.load(...).generate`."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_model import (
    FINAL_ANSWER, MATH_ANSWER, MATH_REASONING, MATH_REQUEST, ROME_ARGS, ROME_REQUEST, TEMPLATE, TOOLS, WEATHER_ARGS,
    WEATHER_REQUEST, WEATHER_RESULT, call_message, render,
)

import hetero
from hetero.errors import HeteroError
from hetero.tools import (
    CallArgs, CallEnd, CallStart, Reasoning, ReasoningSplitter, ReplyParser, Text, ToolCallParser, anthropic_messages,
    anthropic_tools, call_form, coerce, forced_prefix, normalize_choice, openai_messages, openai_tools, opens_reasoning,
    parse_reply, tool_parameters,
)

SCHEMA_TOOLS = [{
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
        "o": {"type": "object"}, "a": {"type": "array"}, "maybe": {"type": ["integer", "null"]},
        "any": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    }}},
}]

XML_CALL = ("<tool_call>\n<function=f>\n<parameter=s>\n007\n</parameter>\n<parameter=i>\n42\n</parameter>\n"
            "<parameter=n>\n2.5\n</parameter>\n<parameter=b>\nfalse\n</parameter>\n<parameter=o>\n{\"k\": [1, \"é\"]}\n"
            "</parameter>\n<parameter=a>\n[1, 2]\n</parameter>\n<parameter=extra>\n3\n</parameter>\n</function>\n"
            "</tool_call>")
XML_ARGS = {"s": "007", "i": 42, "n": 2.5, "b": False, "o": {"k": [1, "é"]}, "a": [1, 2], "extra": "3"}
JSON_CALL = '<tool_call>\n{"name": "g", "arguments": {"x": 1, "y": "ü</parameter>"}}\n</tool_call>'

SAMPLES = [
    "plain text with < and <tool and <think> inside",
    XML_CALL,
    JSON_CALL,
    "Let me check.\n\n" + XML_CALL + "\n" + JSON_CALL + "\n",
    "<think>\nweigh it\n</think>\n\nAnswer: <b>yes</b>",
    "before <tool_call>\n<function=f>\n<parameter=i>\nunterminated",
    "bad <tool_call> not a call </tool_call> after",
    '<tool_call>\n{"name": 3}\n</tool_call> then ' + JSON_CALL,
    "<tool_call>\n<function=f>\n<parameter=s>\ncode with </function> and </tool_call> inside\n</parameter>\n</function>\n</tool_call>",
]


def run(parser, pieces):
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def summary(events):
    """Events merged into comparable form: text and reasoning joined, calls without their random ids."""
    text = "".join(e.text for e in events if isinstance(e, Text))
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    calls = [(e.index, e.name, e.arguments) for e in events if isinstance(e, CallEnd)]
    return text, reasoning, calls


def check_call_events(events):
    """Each call: start, argument pieces joining to its arguments' JSON, end, with one id and in index order."""
    starts = [e for e in events if isinstance(e, CallStart)]
    ends = [e for e in events if isinstance(e, CallEnd)]
    assert [s.index for s in starts] == [e.index for e in ends] == list(range(len(ends)))
    for s, e in zip(starts, ends):
        assert s.id == e.id and s.id.startswith("call_") and s.name == e.name
        pieces = "".join(a.delta for a in events if isinstance(a, CallArgs) and a.index == s.index)
        assert json.loads(pieces) == e.arguments and pieces == json.dumps(e.arguments, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------------------------
# Parsers


def test_xml_call_typed_by_schema():
    reply = parse_reply(XML_CALL, tools=SCHEMA_TOOLS)
    assert reply.content == "" and len(reply.tool_calls) == 1
    call = reply.tool_calls[0]
    assert call.name == "f" and call.arguments == XML_ARGS
    assert json.loads(call.arguments_json) == XML_ARGS and call.id.startswith("call_")


def test_xml_values_keep_their_text_verbatim():
    multi = "line one\n  line two\n\n"
    text = f"<tool_call>\n<function=f>\n<parameter=s>\n{multi}\n</parameter>\n</function>\n</tool_call>"
    assert parse_reply(text, tools=SCHEMA_TOOLS).tool_calls[0].arguments == {"s": multi}
    reply = parse_reply(SAMPLES[-1], tools=SCHEMA_TOOLS)
    assert reply.tool_calls[0].arguments == {"s": "code with </function> and </tool_call> inside"}


def test_json_call_and_its_variants():
    reply = parse_reply(JSON_CALL)
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("g", {"x": 1, "y": "ü</parameter>"})]
    as_string = '<tool_call>\n{"name": "g", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
    assert parse_reply(as_string).tool_calls[0].arguments == {"x": 1}
    alias = '<tool_call>{"name": "g", "parameters": {"x": 2}}</tool_call>'
    assert parse_reply(alias).tool_calls[0].arguments == {"x": 2}
    assert parse_reply('<tool_call>\n{"name": "g"}\n</tool_call>').tool_calls[0].arguments == {}


def test_parallel_calls_text_before_and_template_whitespace_dropped():
    events = run(ToolCallParser(SCHEMA_TOOLS), [SAMPLES[3]])
    check_call_events(events)
    text, _, calls = summary(events)
    assert text == "Let me check."
    assert calls == [(0, "f", XML_ARGS), (1, "g", {"x": 1, "y": "ü</parameter>"})]


def test_text_that_could_open_a_call_is_held_back():
    parser = ToolCallParser()
    assert parser.feed("Hello <tool") == [Text("Hello")]
    assert parser.feed("box") == [Text(" <toolbox")]
    assert parser.feed("\n\n") == []  # trailing whitespace waits: it may precede a call
    assert parser.feed("<tool_call>") == []
    assert summary(parser.feed('{"name": "g", "arguments": {}}</tool_call>'))[2] == [(0, "g", {})]
    assert parser.finish() == []


@pytest.mark.parametrize("sample", SAMPLES)
def test_every_split_point_gives_the_same_result(sample):
    whole = summary(run(ReplyParser(tools=SCHEMA_TOOLS), [sample]))
    for cut in range(len(sample) + 1):
        events = run(ReplyParser(tools=SCHEMA_TOOLS), [sample[:cut], sample[cut:]])
        check_call_events(events)
        assert summary(events) == whole, cut
    per_char = run(ReplyParser(tools=SCHEMA_TOOLS), list(sample))
    check_call_events(per_char)
    assert summary(per_char) == whole


FRAGMENTS = ["<tool_call>", "</tool_call>", "<function=f>", "</function>", "<parameter=i>", "</parameter>",
             "<think>", "</think>", "\n", " ", "7", "x", "{", "}", '"name": "g"', '"arguments": {}', ",", "é", "<"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=24), st.lists(st.integers(0, 200), max_size=6))
def test_any_text_any_split_never_raises_and_agrees(fragments, cuts):
    text = "".join(fragments)
    whole = summary(run(ReplyParser(tools=SCHEMA_TOOLS), [text]))
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    events = run(ReplyParser(tools=SCHEMA_TOOLS), pieces)
    check_call_events(events)
    assert summary(events) == whole


def test_without_calls_the_text_comes_back_unchanged():
    text = "a <tool_call or <toolx> and trailing space  "
    assert summary(run(ToolCallParser(), list(text))) == (text, "", [])


@pytest.mark.parametrize("text, why", [
    ("x <tool_call> nope </tool_call>", "no <function="),
    ("<tool_call>\n<function=f>\n<parameter=i>\n1\n</parameter>\nstray\n</function></tool_call>", "expected <parameter="),
    ("<tool_call>\n<function=f>\n</function>\noops", "expected </tool_call>"),
    ('<tool_call>\n{"name": "g", "arguments": [1]}\n</tool_call>', "not an object"),
    ('<tool_call>\n{"name": "g", "arguments": {\n</tool_call>', "not valid JSON"),
    ("<tool_call>\n<function=f>\n<parameter=i>\n1", "ended inside"),
])
def test_malformed_calls_come_back_as_text_with_a_warning(text, why, caplog):
    with caplog.at_level(logging.WARNING, logger="hetero.tools"):
        reply = parse_reply(text, tools=SCHEMA_TOOLS)
    assert reply.tool_calls == [] and reply.content == text
    assert any(why in r.getMessage() for r in caplog.records)


def test_a_good_call_after_a_bad_one_is_still_parsed():
    reply = parse_reply(SAMPLES[7])
    assert reply.content.startswith('<tool_call>\n{"name": 3}\n</tool_call> then')
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("g", {"x": 1, "y": "ü</parameter>"})]


# ---------------------------------------------------------------------------------------------------------------
# Schema typing


@pytest.mark.parametrize("text, schema, expected", [
    ("42", {"type": "integer"}, 42),
    ("3.0", {"type": "integer"}, 3),
    ("3.5", {"type": "integer"}, "3.5"),
    ("-2.5e1", {"type": "number"}, -25.0),
    ("7", {"type": "number"}, 7),
    ("True", {"type": "boolean"}, True),
    ("no", {"type": "boolean"}, "no"),
    ("null", {"type": ["integer", "null"]}, None),
    ("5", {"type": ["integer", "null"]}, 5),
    ("5", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, 5),
    ("abc", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "abc"),
    ("007", {"type": "string"}, "007"),
    (' {"a": 1} ', {"type": "object"}, {"a": 1}),
    ("[1, 2]", {"type": "array"}, [1, 2]),
    ("{not json", {"type": "object"}, "{not json"),
    ("2", {"enum": [1, 2, 3]}, 2),
    ("x", None, "x"),
    ("12", {}, "12"),
])
def test_coerce(text, schema, expected):
    value = coerce(text, schema)
    assert value == expected and type(value) is type(expected)


def test_tool_parameters_reads_every_tools_form():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    forms = [{"type": "function", "function": {"name": "t", "parameters": schema}},
             {"name": "t", "parameters": schema}, {"name": "t", "input_schema": schema}]
    for form in forms:
        assert tool_parameters([form]) == {"t": {"a": {"type": "integer"}}}
    assert tool_parameters([{"name": "t"}, "junk"]) == {"t": {}}


# ---------------------------------------------------------------------------------------------------------------
# Reasoning


def test_opens_reasoning():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_reasoning("<|im_start|>assistant\n")


@pytest.mark.parametrize("start_inside, text, expected", [
    (True, "\nstep one\nstep two\n</think>\n\nThe answer.", ("The answer.", "step one\nstep two")),
    (True, "cut off while thinking\n", ("", "cut off while thinking")),
    (True, "\n</think>\n\nno thoughts", ("no thoughts", "")),
    (False, "<think>\nmine\n</think>\n\nok", ("ok", "mine")),
    (False, "Just text, <think> later stays text", ("Just text, <think> later stays text", "")),
    (False, "<thinking is not the tag", ("<thinking is not the tag", "")),
    (False, "\n  leading whitespace stays when nothing is split off", ("\n  leading whitespace stays when nothing is split off", "")),
])
def test_reasoning_split_at_every_point(start_inside, text, expected):
    for cut in range(len(text) + 1):
        splitter = ReasoningSplitter(start_inside)
        events = splitter.feed(text[:cut]) + splitter.feed(text[cut:]) + splitter.finish()
        assert summary(events)[:2] == expected, cut


def test_reply_parser_follows_the_prompt():
    thinking_prompt = render([{"role": "user", "content": "hi"}])
    plain_prompt = render([{"role": "user", "content": "hi"}], enable_thinking=False)
    assert parse_reply("hmm\n</think>\n\nhello", thinking_prompt).reasoning == "hmm"
    assert parse_reply("hello", plain_prompt).content == "hello"
    assert parse_reply("<think>x</think>y", reasoning=False).content == "<think>x</think>y"
    assert parse_reply(JSON_CALL, parse_calls=False).content == JSON_CALL


# ---------------------------------------------------------------------------------------------------------------
# Messages, tools and tool_choice


def test_openai_messages():
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "weather "}, {"type": "text", "text": "please"}]},
        {"role": "assistant", "content": None, "reasoning_content": "look it up",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    assert openai_messages(messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather please"},
        {**call_message(WEATHER_ARGS, "call_1"), "reasoning_content": "look it up"},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    with pytest.raises(HeteroError, match="not valid JSON"):
        openai_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}])
    with pytest.raises(HeteroError, match="image_url"):
        openai_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_anthropic_messages():
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "use the tool", "signature": "x"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 3}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": True},
            {"type": "text", "text": "and tomorrow?"}]},
    ]
    assert anthropic_messages(messages, system=[{"type": "text", "text": "Be brief."}]) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {**call_message(WEATHER_ARGS, "toolu_1"), "content": "Checking.", "reasoning_content": "use the tool"},
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: boom", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "and tomorrow?"},
    ]
    with pytest.raises(HeteroError, match="tool_use"):
        anthropic_messages([{"role": "user", "content": [{"type": "tool_use", "name": "f", "input": {}}]}])


def test_tools_from_both_apis_render_alike():
    fn = TOOLS[0]["function"]
    anthropic = [{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}]
    assert anthropic_tools(anthropic) == openai_tools(TOOLS) == TOOLS
    assert openai_tools([]) is None and anthropic_tools(None) is None
    assert openai_tools([{"type": "function", "function": {"name": "bare"}}])[0]["function"]["parameters"] == {
        "type": "object", "properties": {}}
    with pytest.raises(HeteroError, match="tools\\[0\\]"):
        openai_tools([{"type": "code_interpreter"}])


def test_tool_choice():
    tools = openai_tools(TOOLS)
    assert normalize_choice(None, tools) == "auto" and normalize_choice("auto", None) is None
    assert normalize_choice({"type": "none"}, []) is None
    assert normalize_choice("none", tools) == "none" and normalize_choice({"type": "any"}, tools) == "required"
    assert normalize_choice({"type": "function", "function": {"name": "get_weather"}}, tools) == "get_weather"
    assert normalize_choice({"type": "tool", "name": "get_weather"}, tools) == "get_weather"
    with pytest.raises(HeteroError, match="not among the tools"):
        normalize_choice({"type": "tool", "name": "nope"}, tools)
    for bad in ("sometimes", {"type": "function", "function": {"name": 3}}, {"type": "function", "function": "f"}, 7):
        for with_tools in (tools, None):  # checked whether or not the request has tools
            with pytest.raises(HeteroError, match="not understood"):
                normalize_choice(bad, with_tools)
    with pytest.raises(HeteroError, match="has no tools"):
        normalize_choice("required", None)

    thinking = render([{"role": "user", "content": "hi"}])
    assert call_form(TEMPLATE) == "xml" and call_form("{{ '<tool_call>' }}") == "json"
    assert forced_prefix("auto", thinking, TEMPLATE) == ""
    assert forced_prefix("get_weather", thinking, TEMPLATE) == "\n</think>\n\n<tool_call>\n<function=get_weather"
    assert forced_prefix("required", "x<think>\n\n</think>\n\n", TEMPLATE) == "<tool_call>\n<function="
    assert forced_prefix("g", "", None) == '<tool_call>\n{"name": "g", "arguments":'
    assert forced_prefix("required", "", None) == '<tool_call>\n{"name":'
    # the prefix is parsed as part of the reply: a forced call's text completes to a call
    prefix = forced_prefix("get_weather", thinking, TEMPLATE)
    rest = ">\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    reply = parse_reply(prefix + rest, thinking, TOOLS)
    assert reply.reasoning == "" and [(c.name, c.arguments) for c in reply.tool_calls] == [("get_weather", WEATHER_ARGS)]


# ---------------------------------------------------------------------------------------------------------------
# The Qwen3.6 template through hetero's Jinja environment


def _agent_transcript():
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": WEATHER_REQUEST},
        {"role": "assistant", "content": "", "reasoning_content": "need the tool",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "days": 3, "opts": {"u": "C"}, "l": [1]}}},
                        {"type": "function", "function": {"name": "get_weather", "arguments": ROME_ARGS}}]},
        {"role": "tool", "content": WEATHER_RESULT},
        {"role": "tool", "content": "rain"},
    ]


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"preserve_thinking": True}])
def test_template_renders_as_transformers_does(kwargs):
    from transformers.utils.chat_template_utils import render_jinja_template

    ours = render(_agent_transcript(), **kwargs)
    theirs = render_jinja_template([_agent_transcript()], tools=openai_tools(TOOLS), chat_template=TEMPLATE,
                                   add_generation_prompt=True, **kwargs)[0][0]
    assert ours == theirs


def test_template_renders_tools_calls_and_results():
    prompt = render(_agent_transcript())
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools\n") and system.endswith("</IMPORTANT>\n\nYou are terse.")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in system
    assert ("<|im_start|>assistant\n<think>\nneed the tool\n</think>\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            '<parameter=opts>\n{"u": "C"}\n</parameter>\n<parameter=l>\n[1]\n</parameter>\n</function>\n</tool_call>\n'
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>") in prompt
    assert prompt.endswith("<|im_start|>user\n<tool_response>\nsunny, 22 C\n</tool_response>\n<tool_response>\nrain\n"
                           "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert render(_agent_transcript(), enable_thinking=False).endswith("assistant\n<think>\n\n</think>\n\n")


def test_template_calls_parse_back_to_their_arguments():
    messages = _agent_transcript()[:3]
    prompt = render(messages[:2])
    full = render(messages, add_generation_prompt=False)
    reply = parse_reply(full[len(prompt) :].split("<|im_end|>")[0], prompt, TOOLS)
    assert reply.reasoning == "need the tool" and reply.content == ""
    assert [c.arguments for c in reply.tool_calls] == [
        {"city": "Paris", "days": 3, "opts": '{"u": "C"}', "l": "[1]"}, ROME_ARGS]  # untyped in the schema: strings


def test_template_refusals_are_hetero_errors():
    with pytest.raises(HeteroError, match="No user query"):
        render([{"role": "system", "content": "only a system prompt"}])


# ---------------------------------------------------------------------------------------------------------------
# The trained tool model, end to end through hetero.load(...).generate


@pytest.fixture(scope="module")
def engine(tool_model_dir):
    return hetero.load(str(tool_model_dir))


def _generate(engine, messages):
    prompt = engine.tokenizer.apply_chat_template(messages, tools=openai_tools(TOOLS))
    pieces = []
    result = engine.generate(prompt, max_tokens=64, on_text=pieces.append)
    streamed = ReplyParser(prompt, TOOLS)
    events = run(streamed, pieces)
    check_call_events(events)
    reply = parse_reply(result.text, prompt, TOOLS)
    assert summary(events)[:2] == (reply.content, reply.reasoning)
    assert [(e.name, e.arguments) for e in events if isinstance(e, CallEnd)] == [
        (c.name, c.arguments) for c in reply.tool_calls]
    return reply


def test_tool_model_checkpoint_uses_the_fixture_template(engine):
    assert engine.tokenizer.chat_template == TEMPLATE
    assert engine.tokenizer.encode("<tool_call>") == [engine.tokenizer.token_to_id("<tool_call>")]


def test_tool_model_calls_the_tool_then_answers(engine):
    user = {"role": "user", "content": WEATHER_REQUEST}
    reply = _generate(engine, [user])
    assert reply.content == "" and reply.reasoning == ""
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("get_weather", WEATHER_ARGS)]

    result = {"role": "tool", "content": WEATHER_RESULT, "tool_call_id": reply.tool_calls[0].id}
    final = _generate(engine, [user, call_message(reply.tool_calls[0].arguments), result])
    assert (final.content, final.tool_calls) == (FINAL_ANSWER, [])

    rome = _generate(engine, [{"role": "user", "content": ROME_REQUEST}])
    assert [(c.name, c.arguments) for c in rome.tool_calls] == [("get_weather", ROME_ARGS)]


def test_tool_model_thinks_then_answers(engine):
    reply = _generate(engine, [{"role": "user", "content": MATH_REQUEST}])
    assert (reply.reasoning, reply.content, reply.tool_calls) == (MATH_REASONING, MATH_ANSWER, [])
