"""Tool calls and reasoning through `hetero serve`, with the official OpenAI and Anthropic SDKs on loopback, on the
tiny model trained to call a tool (tests/tool_model.py): the full agent loop (request with tools -> tool call ->
tool result -> final answer), streaming and not, reasoning in both APIs' shapes, the prefix cache across tool
turns (also after a restart), and an agent framework from PyPI (pydantic-ai) running the loop."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from types import SimpleNamespace

import openai
import pytest
from pydantic_ai import Agent, Tool
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from test_server import LiveServer, cached_engine
from tool_model import (
    FINAL_ANSWER, MATH_ANSWER, MATH_REASONING, MATH_REQUEST, TOOLS, WEATHER_ARGS, WEATHER_REQUEST, WEATHER_RESULT,
    WEATHER_TOOL, render,
)

import hetero
from hetero.checkpoint.tokenizer import Tokenizer
from hetero.decode.options import DecodeOptions
from hetero.server.requests import Job
from hetero.server.runner import Runner
from hetero.server.toolcalls import ChatReply
from hetero.tools import CallEnd, CallStart

NAME = "get_weather"
ANTHROPIC_TOOLS = [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
                   for f in (t["function"] for t in TOOLS)]
WEATHER = [{"role": "user", "content": WEATHER_REQUEST}]
MATH = [{"role": "user", "content": MATH_REQUEST}]


@pytest.fixture(scope="module")
def engine(tool_model_dir):
    return hetero.load(str(tool_model_dir))


def openai_stream(oai, **kw):
    """A streamed chat completion, accumulated as an agent does: content, reasoning, tool calls by index."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id:
                assert call["id"] is None, "the id comes once, with the call's first piece"
                call["id"], call["name"] = piece.id, piece.function.name
            call["arguments"] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def test_openai_tool_loop(oai, model):
    first = oai.chat.completions.create(model=model, messages=WEATHER, tools=TOOLS, max_tokens=64)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == NAME and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == WEATHER_ARGS

    history = WEATHER + [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": WEATHER_RESULT}]
    final = oai.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=64)
    assert final.choices[0].message.content == FINAL_ANSWER and final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.tool_calls is None


def test_openai_tool_loop_streamed(oai, model):
    content, reasoning, calls, finish = openai_stream(oai, model=model, messages=WEATHER, tools=TOOLS, max_tokens=64)
    assert (content, reasoning, finish) == ("", "", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [(NAME, WEATHER_ARGS)]
    history = WEATHER + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": calls[0]["id"], "type": "function",
                         "function": {"name": NAME, "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": WEATHER_RESULT},
    ]
    content, _, calls, finish = openai_stream(oai, model=model, messages=history, tools=TOOLS, max_tokens=64)
    assert (content, calls, finish) == (FINAL_ANSWER, [], "stop")


def test_openai_sdk_stream_helper_collects_the_call(oai, model):
    with oai.chat.completions.stream(model=model, messages=WEATHER, tools=TOOLS, max_tokens=64) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == NAME and json.loads(call.function.arguments) == WEATHER_ARGS


def test_openai_reasoning_content(oai, model):
    message = oai.chat.completions.create(model=model, messages=MATH, tools=TOOLS, max_tokens=64).choices[0].message
    assert message.content == MATH_ANSWER and message.model_extra["reasoning_content"] == MATH_REASONING
    content, reasoning, calls, finish = openai_stream(oai, model=model, messages=MATH, tools=TOOLS, max_tokens=64)
    assert (content, reasoning, calls, finish) == (MATH_ANSWER, MATH_REASONING, [], "stop")


def test_openai_template_switches_reach_the_template(oai, model):
    def prompt_tokens(**kw):
        return oai.chat.completions.create(model=model, messages=MATH, tools=TOOLS, max_tokens=1, **kw).usage.prompt_tokens

    thinking = prompt_tokens()
    assert prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}}) > thinking  # + "\n\n</think>\n\n"
    assert prompt_tokens(tool_choice="none") < thinking  # no tools block in the system prompt


def test_tool_choice(oai, claude, model):
    none = oai.chat.completions.create(model=model, messages=WEATHER, tools=TOOLS, tool_choice="none", max_tokens=16)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason != "tool_calls"
    named = {"type": "function", "function": {"name": NAME}}
    forced = oai.chat.completions.create(model=model, messages=MATH, tools=TOOLS, tool_choice=named, max_tokens=48)
    (call,) = forced.choices[0].message.tool_calls  # the arithmetic question, answered with the forced call
    assert call.function.name == NAME and forced.choices[0].finish_reason == "tool_calls"
    required = oai.chat.completions.create(model=model, messages=MATH, tools=TOOLS, tool_choice="required",
                                           max_tokens=48)
    assert [c.function.name for c in required.choices[0].message.tool_calls] == [NAME]
    with claude.messages.stream(model=model, messages=MATH, tools=ANTHROPIC_TOOLS, max_tokens=48,
                                tool_choice={"type": "tool", "name": NAME}) as stream:
        message = stream.get_final_message()
    assert [(b.type, b.name) for b in message.content] == [("tool_use", NAME)] and message.stop_reason == "tool_use"


def test_a_call_cut_off_by_max_tokens_comes_back_as_text(oai, model):
    cut = oai.chat.completions.create(model=model, messages=WEATHER, tools=TOOLS, max_tokens=8)
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith("<tool_call>")
    content, _, calls, finish = openai_stream(oai, model=model, messages=WEATHER, tools=TOOLS, max_tokens=8)
    assert (content, calls, finish) == (choice.message.content, [], "length")


@pytest.mark.parametrize("kw, param", [
    ({"tools": {"name": "x"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": NAME, "arguments": "{bad"}}]}]},
     "messages"),
    ({"extra_body": {"chat_template_kwargs": ["enable_thinking"]}}, "chat_template_kwargs"),
])
def test_openai_bad_tool_requests_are_400(oai, model, kw, param):
    kw = {"messages": WEATHER, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, max_tokens=4, **kw)
    assert e.value.body["param"] == param


def test_anthropic_tool_loop(claude, model):
    first = claude.messages.create(model=model, messages=WEATHER, tools=ANTHROPIC_TOOLS, max_tokens=64)
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert use.type == "tool_use" and use.name == NAME and use.input == WEATHER_ARGS and use.id.startswith("toolu_")
    history = WEATHER + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": WEATHER_RESULT}]},
    ]
    final = claude.messages.create(model=model, messages=history, tools=ANTHROPIC_TOOLS, max_tokens=64)
    assert final.stop_reason == "end_turn" and [(b.type, b.text) for b in final.content] == [("text", FINAL_ANSWER)]


def test_anthropic_tool_loop_streamed(claude, model):
    with claude.messages.stream(model=model, messages=WEATHER, tools=ANTHROPIC_TOOLS, max_tokens=64) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_message()
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert (use.type, use.name, use.input) == ("tool_use", NAME, WEATHER_ARGS)
    history = WEATHER + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": WEATHER_RESULT}]}]},
    ]
    with claude.messages.stream(model=model, messages=history, tools=ANTHROPIC_TOOLS, max_tokens=64) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == FINAL_ANSWER and final.stop_reason == "end_turn"


def test_anthropic_thinking_blocks(claude, model):
    message = claude.messages.create(model=model, messages=MATH, tools=ANTHROPIC_TOOLS, max_tokens=64)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", MATH_REASONING), ("text", MATH_ANSWER)]
    with claude.messages.stream(model=model, messages=MATH, tools=ANTHROPIC_TOOLS, max_tokens=64) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert (final.content[0].thinking, final.content[1].text) == (MATH_REASONING, MATH_ANSWER)
    # thinking disabled reaches the template: an empty think block is written into the prompt
    off = claude.messages.create(model=model, messages=MATH, tools=ANTHROPIC_TOOLS, max_tokens=1,
                                 thinking={"type": "disabled"})
    on = claude.messages.create(model=model, messages=MATH, tools=ANTHROPIC_TOOLS, max_tokens=1,
                                thinking={"type": "enabled", "budget_tokens": 1024})
    assert off.usage.input_tokens + off.usage.cache_read_input_tokens > on.usage.input_tokens + on.usage.cache_read_input_tokens


def test_parallel_tool_calls_false_keeps_the_first_call():
    two = ("<tool_call>\n<function=a>\n</function>\n</tool_call>\n<tool_call>\n<function=b>\n</function>\n</tool_call>")
    tools = [{"type": "function", "function": {"name": n, "parameters": {}}} for n in "ab"]
    assert [c.name for c in ChatReply("", tools).parse(two).tool_calls] == ["a", "b"]
    stream = ChatReply("", tools, parallel=False).parser()
    events = [e for ch in two for e in stream.feed(ch)] + stream.finish()
    assert [e.name for e in events if isinstance(e, (CallStart, CallEnd))] == ["a", "a"] and stream.calls == 1


def test_parallel_tool_calls_false_ends_the_generation_at_the_first_call():
    two = "<tool_call>\n<function=a>\n</function>\n</tool_call>\n<tool_call>\n<function=b>\n</function>\n</tool_call>"
    tools = [{"type": "function", "function": {"name": n, "parameters": {}}} for n in "ab"]

    class Writer:  # an engine that writes `two` a character per token, as long as should_stop lets it
        def generate(self, ids, on_text, should_stop, **kw):
            n = 0
            for n, ch in enumerate(two, 1):
                on_text(ch)
                if should_stop():
                    break
            return SimpleNamespace(stats={"finish_reason": "stop", "prompt_tokens": 1, "cached_tokens": 0,
                                          "generated_tokens": n})

    def run(parallel: bool):
        job = Job(ids=[0], options=DecodeOptions(99), reply=ChatReply("", tools, parallel=parallel))
        return Runner(Writer()).run(job, lambda _: None, threading.Event())

    assert run(True).text == two
    one = run(False)
    assert one.text == two[: two.index("</tool_call>") + len("</tool_call>")] and one.finish == "stop"
    assert [c.name for c in ChatReply("", tools, parallel=False).parse(one.text).tool_calls] == ["a"]


def test_a_call_to_another_function_than_the_named_tool_choice_is_text(caplog):
    call = "<tool_call>\n<function=b>\n</function>\n</tool_call>"
    tools = [{"type": "function", "function": {"name": n, "parameters": {}}} for n in "ab"]
    assert [c.name for c in ChatReply("", tools).parse(call).tool_calls] == ["b"]
    caplog.set_level(logging.WARNING, logger="hetero.tools.calls")
    wrong = ChatReply("", tools, forced="<tool_call>\n<function=", only="a")
    reply = wrong.parse(call.removeprefix(wrong.forced))
    assert reply.tool_calls == [] and reply.content == call and "tool_choice names 'a'" in caplog.text
    assert [c.name for c in ChatReply("", tools, only="b").parse(call).tool_calls] == ["b"]


# ----------------------------------------------------------------------------------------------------------
# The prefix cache across tool turns: turn N's prompt up to its generation prompt is turn N+1's cached prefix


def transcript_end(tool_model_dir, messages: list[dict]) -> int:
    """Tokens of `messages` rendered (with the tools) without the generation prompt."""
    tokenizer = Tokenizer.from_dir(tool_model_dir)
    return len(tokenizer.encode(render(messages, add_generation_prompt=False)))


def test_openai_tool_turn_reads_the_last_prompt_from_the_cache_also_after_a_restart(tool_model_dir, oai, model,
                                                                                      tmp_path):
    first_dir, restart_dir = tmp_path / "sessions", tmp_path / "restart"
    warm = LiveServer(cached_engine(tool_model_dir, first_dir))
    try:
        client = warm.openai()
        first = client.chat.completions.create(model=model, messages=WEATHER, tools=TOOLS, max_tokens=64)
        shutil.copytree(first_dir, restart_dir)  # the disk as a restart after turn 1 finds it
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        (call,) = first.choices[0].message.tool_calls
        history = WEATHER + [first.choices[0].message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": call.id, "content": WEATHER_RESULT}]
        chunks = list(client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=64,
                                                     stream=True, stream_options={"include_usage": True}))
    finally:
        warm.stop()
    mark = transcript_end(tool_model_dir, WEATHER)
    assert 0 < mark < first.usage.prompt_tokens
    cold = oai.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=64)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == mark
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cold.choices[0].message.content

    restarted = LiveServer(cached_engine(tool_model_dir, restart_dir))
    try:
        again = restarted.openai().chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=64)
    finally:
        restarted.stop()
    assert again.usage.prompt_tokens_details.cached_tokens == mark
    assert again.choices[0].message.content == cold.choices[0].message.content == FINAL_ANSWER


def test_anthropic_tool_turn_reads_the_last_prompt_from_the_cache(tool_model_dir, claude, model):
    mtp = {"extra_body": {"mtp": True}}  # speculative decoding on: its checkpoints resume from the mark too
    warm = LiveServer(cached_engine(tool_model_dir, None))
    try:
        client = warm.anthropic()
        first = client.messages.create(model=model, messages=WEATHER, tools=ANTHROPIC_TOOLS, max_tokens=64, **mtp)
        assert first.usage.cache_read_input_tokens == 0
        (use,) = first.content
        history = WEATHER + [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": WEATHER_RESULT}]},
        ]
        with client.messages.stream(model=model, messages=history, tools=ANTHROPIC_TOOLS, max_tokens=64,
                                    **mtp) as stream:
            started = next(e for e in stream if e.type == "message_start")
            final = stream.get_final_message()
    finally:
        warm.stop()
    mark = transcript_end(tool_model_dir, WEATHER)
    assert started.message.usage.cache_read_input_tokens == final.usage.cache_read_input_tokens == mark
    cold = claude.messages.create(model=model, messages=history, tools=ANTHROPIC_TOOLS, max_tokens=64)
    assert cold.usage.cache_read_input_tokens == 0
    assert final.usage.input_tokens + mark == cold.usage.input_tokens
    assert [b.text for b in final.content] == [b.text for b in cold.content] == [FINAL_ANSWER]


# ----------------------------------------------------------------------------------------------------------
# An agent framework from PyPI


def test_pydantic_ai_agent_runs_the_tool_loop(tool_model_dir, model):
    """pydantic-ai's chat-completions model against `hetero serve`: the agent calls the tool, reads its result,
    answers; its second request reads the first one's prompt from the prefix cache."""
    warm = LiveServer(cached_engine(tool_model_dir, None))
    calls = []

    def get_weather(city: str, days: int) -> str:
        calls.append((city, days))
        return WEATHER_RESULT

    # the tool with the schema the tiny model was trained on (pydantic-ai derives a strict one from the signature by
    # default, whose rendering the 2-layer model never saw and answers with other arguments)
    function = WEATHER_TOOL["function"]
    tool = Tool.from_schema(get_weather, function["name"], function["description"], function["parameters"])
    agent = Agent(OpenAIChatModel(model, provider=OpenAIProvider(base_url=warm.url + "/v1", api_key="none")),
                  tools=[tool])

    try:
        result = agent.run_sync(WEATHER_REQUEST)
    finally:
        warm.stop()
    assert calls == [(WEATHER_ARGS["city"], WEATHER_ARGS["days"])] and result.output == FINAL_ANSWER
    responses = [m for m in result.all_messages() if m.kind == "response"]
    assert [[p.part_kind for p in r.parts] for r in responses] == [["tool-call"], ["text"]]
    assert responses[1].usage.cache_read_tokens > 0
