"""What coding agents send beyond the SDK examples, live on loopback with the official SDKs, on the tiny tool model
(its chat template is Qwen3.6's, which refuses system messages after the first turn): a request shaped as Claude
Code sends it, count_tokens, the Anthropic models page, model aliases, images in a text-only conversation, unknown
routes in each API's error shape, keep-alives while a stream is silent, a trailing assistant message continued,
sampling defaults from generation_config.json and a 400 for the fields the engine does not implement yet."""

from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace

import anthropic
import httpx
import openai
import numpy as np
import pytest
from test_server import LiveServer
from tool_model import WEATHER_REQUEST, WEATHER_RESULT

import hetero
from hetero.errors import HeteroError
from hetero.server import ServerSettings, common
from hetero.server.defaults import sampling_defaults
from hetero.server.requests import Parser
from hetero.server.toolcalls import SYSTEM_AS_USER, anthropic_chat
from hetero.tools.messages import IMAGE_PLACEHOLDER

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01", "x-api-key": "none"}


@pytest.fixture(scope="module")
def engine(tool_model_dir):
    return hetero.load(str(tool_model_dir))


@pytest.fixture(scope="module")
def server(engine):
    live = LiveServer(engine, model_alias=("claude-*=" + engine.name,))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def strict(engine):
    live = LiveServer(engine, reject_images=True)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def model(engine):
    return engine.name


def claude_code_tools(n: int = 14) -> list[dict]:
    return [{"name": f"Tool{i}", "description": f"tool number {i}", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
        "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}} for i in range(n)]


def test_claude_code_shaped_request_streams(server, claude):
    system = [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Environment: linux."},
              {"type": "text", "text": "Be concise.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": WEATHER_REQUEST,
                                              "cache_control": {"type": "ephemeral"}}]},
                {"role": "system", "content": "The user's working directory is /tmp."},
                {"role": "user", "content": "Go on."}]
    stream = claude.beta.messages.create(
        model="claude-sonnet-4-5-20250929", system=system, messages=messages, tools=claude_code_tools(),
        thinking={"type": "adaptive"}, max_tokens=32000, stream=True, metadata={"user_id": "user_abc_session_1"},
        betas=["claude-code-20250219", "interleaved-thinking-2025-05-14", "context-management-2025-06-27"],
        extra_body={"output_config": {"effort": "medium"},
                    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}})
    kinds = []
    with stream:
        for event in stream:  # each parsed into the SDK's event types
            kinds.append(event.type)
            if event.type == "message_start":
                assert event.message.model == "claude-sonnet-4-5-20250929"  # the name asked, not the served one
            if event.type == "content_block_delta":
                break  # the reply has begun: a 32000-token answer is not this test's business
    assert kinds[0] == "message_start" and kinds[-2:] == ["content_block_start", "content_block_delta"]


def test_a_system_message_mid_conversation_is_rendered_where_it_stands(engine):
    parser = Parser(engine, {engine.name})
    body = {"system": "S0", "max_tokens": 4, "messages": [
        {"role": "user", "content": "U1"}, {"role": "system", "content": "S1"}, {"role": "user", "content": "U2"}]}
    ids, reply = anthropic_chat(parser, body)
    prompt = reply.prompt
    # Qwen3.6's template refuses a late system message: it becomes a user turn in its place
    assert prompt.index("S0") < prompt.index("U1") < prompt.index(SYSTEM_AS_USER + "S1") < prompt.index("U2")
    bundled = hetero.load(None)  # its template places system messages anywhere
    _, reply = anthropic_chat(Parser(bundled, {"m"}), body)
    assert "U1<|im_end|>\n<|im_start|>system\nS1<|im_end|>\n<|im_start|>user\nU2" in reply.prompt


def test_count_tokens_equals_the_prompt_tokens_reported(claude, model):
    kw = {"model": model, "system": [{"type": "text", "text": "count me", "cache_control": {"type": "ephemeral"}}],
          "messages": [{"role": "user", "content": "How many tokens is this? " + str(time.time())}],
          "tools": claude_code_tools(3), "thinking": {"type": "disabled"}}
    counted = claude.messages.count_tokens(**kw).input_tokens
    reply = claude.messages.create(max_tokens=1, **kw)
    assert counted == reply.usage.input_tokens + reply.usage.cache_read_input_tokens > 20


def test_models_list_in_each_apis_shape(claude, oai, model):
    page = claude.models.list()
    assert [(m.id, m.type) for m in page.data] == [(model, "model")] and page.data[0].display_name == model
    assert page.first_id == page.last_id == model and page.has_more is False
    assert claude.models.retrieve(model).id == model
    assert [m.id for m in oai.models.list().data] == [model]


def test_model_alias_answers_under_the_name_asked(claude, oai, model):
    reply = claude.messages.create(model="claude-haiku-4-5", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert reply.model == "claude-haiku-4-5"
    assert oai.chat.completions.create(model="claude-x", max_tokens=1,
                                       messages=[{"role": "user", "content": "hi"}]).model == "claude-x"
    with pytest.raises(openai.NotFoundError, match="--model-alias"):
        oai.chat.completions.create(model="gpt-4o", max_tokens=1, messages=[{"role": "user", "content": "hi"}])


def test_model_alias_settings_are_checked(engine):
    with pytest.raises(HeteroError, match="PATTERN=NAME"):
        ServerSettings(model_alias=("claude-*",))
    with pytest.raises(HeteroError, match="not served here"):
        LiveServer(engine, model_alias=("claude-*=other",))


def test_images_become_a_placeholder_with_a_warning(server, claude, model, caplog):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    with_image = [{"role": "user", "content": [{"type": "text", "text": WEATHER_REQUEST}]},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                     "input": {"city": "Paris", "days": 3}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                "content": [{"type": "text", "text": WEATHER_RESULT}, image]}, image]}]
    as_text = json.loads(json.dumps(with_image).replace(json.dumps(image), json.dumps(
        {"type": "text", "text": IMAGE_PLACEHOLDER})))
    counted = [claude.messages.count_tokens(model=model, messages=m).input_tokens for m in (with_image, as_text)]
    assert counted[0] == counted[1]
    with caplog.at_level(logging.WARNING, logger="hetero.server"):
        raw = claude.messages.with_raw_response.create(model=model, max_tokens=1, messages=with_image)
    assert "2 image(s) omitted" in raw.headers["x-hetero-warning"] and raw.parse().usage.output_tokens == 1
    assert sum("image(s) omitted" in r.getMessage() for r in caplog.records) == 1
    chat = [{"role": "user", "content": [{"type": "text", "text": "see"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG}}]}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": model, "messages": chat, "max_tokens": 1})
    assert r.status_code == 200 and "1 image(s) omitted" in r.headers["x-hetero-warning"]
    items = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64," + PNG}]}]
    r = httpx.post(server.url + "/v1/responses", json={"model": model, "input": items, "max_output_tokens": 1})
    assert r.status_code == 200 and "x-hetero-warning" in r.headers


def test_reject_images_keeps_the_400(strict, model):
    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG}}]}]
    with pytest.raises(openai.BadRequestError, match="text only"):
        strict.openai().chat.completions.create(model=model, messages=chat, max_tokens=1)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    with pytest.raises(anthropic.BadRequestError, match="text only"):
        strict.anthropic().messages.create(model=model, max_tokens=1, messages=[{"role": "user", "content": [image]}])


def test_unknown_routes_and_methods_in_each_apis_error_shape(oai, claude):
    with pytest.raises(openai.NotFoundError) as e:
        oai.get("/nothing", cast_to=object)
    assert e.value.body["type"] == "not_found_error" and "/v1/nothing" in e.value.body["message"]
    with pytest.raises(openai.APIStatusError) as e:
        oai.delete("/chat/completions", cast_to=object)
    assert e.value.status_code == 405 and "POST" in e.value.body["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.get("/v1/nothing", cast_to=object)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.APIStatusError) as e:
        claude.get("/v1/messages", cast_to=object)
    assert e.value.status_code == 405 and e.value.body["error"]["message"].startswith("GET is not allowed")


@pytest.fixture
def slow_first_token(engine, monkeypatch):
    """Every generation pauses 0.6 s after its first prefill chunk (a long prefill), keep-alives every 0.1 s."""
    monkeypatch.setattr(common, "KEEPALIVE_S", 0.1)
    generate = engine.generate

    def slow(*args, progress=None, **kw):
        def paused(done: int, total: int) -> None:
            progress(done, total)
            if done <= 64:
                time.sleep(0.6)

        return generate(*args, progress=paused, **kw)

    monkeypatch.setattr(engine, "generate", slow)


def raw_stream(url: str, body: dict, headers: dict | None = None) -> list[str]:
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        return list(r.iter_lines())


def test_keepalives_while_the_first_token_waits(server, model, slow_first_token):
    msgs = [{"role": "user", "content": "hi"}]
    lines = raw_stream(server.url + "/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 2})
    data = [i for i, line in enumerate(lines) if line.startswith("data: ")]
    assert lines[data[0]:data[1]].count(": keep-alive") >= 3  # after the role chunk, before the first token's
    lines = raw_stream(server.url + "/v1/messages", {"model": model, "messages": msgs, "max_tokens": 2},
                       ANTHROPIC_HEADERS)
    start = lines.index("event: content_block_start")
    assert lines[:start].count("event: ping") >= 4  # message_start's own ping, then the keep-alives
    events = list(server.anthropic().messages.create(model=model, messages=msgs, max_tokens=2, stream=True))
    assert events[-1].type == "message_stop"  # the SDK reads the pings as events of their own


def test_a_trailing_assistant_message_is_continued(claude, oai, model, engine):
    head = "def add(a, b):\n    return"
    msgs = [{"role": "user", "content": "Write add."}, {"role": "assistant", "content": head}]
    reply = claude.messages.create(model=model, max_tokens=6, messages=msgs, thinking={"type": "disabled"})
    _, rendered = anthropic_chat(Parser(engine, {model}), {"messages": msgs, "thinking": {"type": "disabled"}})
    assert rendered.prompt.endswith(head)  # no end of turn, no new assistant turn opened
    same = oai.completions.create(model=model, prompt=rendered.prompt, max_tokens=6)
    assert reply.content[0].text == same.choices[0].text


def test_sampling_defaults_come_from_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2}))
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
    engine = SimpleNamespace(path=tmp_path, max_context=100, model=SimpleNamespace(has_mtp=False))
    parser = Parser(engine, {"m"})
    job = parser.job({"model": "m"}, [1, 2], "max_tokens")
    s = job.options.sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.6, 0.95, 20)
    assert parser.job({"model": "m", "temperature": 0, "top_k": 0}, [1], "max_tokens").options.sampling.temperature == 0
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert sampling_defaults(tmp_path)["temperature"] == 0.0  # greedy, as transformers reads the file
    assert sampling_defaults(tmp_path / "absent")["temperature"] == 0.0


@pytest.mark.parametrize("route, field, value", [("completions", "suffix", "}")])
def test_unimplemented_fields_are_a_400_naming_them(oai, model, route, field, value):
    call = oai.chat.completions.create if route == "chat" else oai.completions.create
    body = {"messages": [{"role": "user", "content": "hi"}]} if route == "chat" else {"prompt": "hi"}
    with pytest.raises(openai.BadRequestError) as e:
        call(model=model, max_tokens=1, **body, extra_body={field: value})
    assert e.value.body["param"] == field and field in e.value.body["message"]
    neutral = {"suffix": ""}[field]
    assert call(model=model, max_tokens=1, **body, extra_body={field: neutral}).usage.completion_tokens == 1


@pytest.mark.parametrize("route, field, value", [
    ("chat", "presence_penalty", 2.5), ("chat", "frequency_penalty", -3), ("chat", "repetition_penalty", 0),
    ("chat", "logit_bias", {"5": 101}), ("completions", "logit_bias", {"99999999": 1}),
    ("completions", "logit_bias", {"not-an-id": 1}), ("completions", "presence_penalty", "high")])
def test_penalties_out_of_range_are_a_400_naming_them(oai, model, route, field, value):
    call = oai.chat.completions.create if route == "chat" else oai.completions.create
    body = {"messages": [{"role": "user", "content": "hi"}]} if route == "chat" else {"prompt": "hi"}
    with pytest.raises(openai.BadRequestError) as e:
        call(model=model, max_tokens=1, **body, extra_body={field: value})
    assert e.value.body["param"] == field and "\n" not in e.value.body["message"]


def test_penalties_and_logit_bias_reach_the_decoder(oai, model, engine):
    """Over HTTP through the real SDK: a +100 logit_bias makes the greedy answer that token, a -100 one bans the
    token greedy decoding picks first, and a strong frequency penalty changes a reply that repeats itself (the
    stepper's penalties are checked for exactness in tests/test_penalties.py)."""
    forced = engine.tokenizer.encode(" sunny")[0]
    out = oai.completions.create(model=model, prompt=WEATHER_REQUEST, max_tokens=3, logit_bias={str(forced): 100})
    assert out.choices[0].text == engine.tokenizer.decode([forced] * 3)
    plain = oai.completions.create(model=model, prompt=WEATHER_REQUEST, max_tokens=6, logprobs=0)
    first = engine.tokenizer.encode(plain.choices[0].text)[0]
    banned = oai.completions.create(model=model, prompt=WEATHER_REQUEST, max_tokens=6, logit_bias={str(first): -100})
    assert engine.tokenizer.encode(banned.choices[0].text)[:1] != [first]
    # A bias that makes one token win the first two steps, the second by 1.0: presence and frequency penalties of 2
    # take 4.0 off it at the second step, so the penalized reply must differ there.
    ids = engine.encode_prompt(WEATHER_REQUEST)
    l1 = engine.logits(ids)[-1]
    g = int(l1.argmax())
    l2 = engine.logits(ids + [g])[-1]
    margin = lambda row: row[g] - np.delete(row, g).max()  # noqa: E731  (how far g leads the rest)
    bias = float(1.0 - margin(l2))
    assert margin(l1) + bias > 0.5, "the bias that leads step 2 by 1.0 must keep step 1 too: pick another prompt"
    biased = {str(g): bias}
    plain2 = oai.completions.create(model=model, prompt=WEATHER_REQUEST, max_tokens=2, logit_bias=biased)
    penalized = oai.completions.create(model=model, prompt=WEATHER_REQUEST, max_tokens=2, logit_bias=biased,
                                       presence_penalty=2.0, frequency_penalty=2.0)
    assert engine.tokenizer.encode(plain2.choices[0].text) == [g, g]
    assert engine.tokenizer.encode(penalized.choices[0].text)[0] == g
    assert engine.tokenizer.encode(penalized.choices[0].text)[1:2] != [g]


def test_echo_returns_the_prompt_and_its_logprobs(oai, model, engine):
    """`echo` puts the prompt before the reply, streamed or not; with `logprobs` each prompt token carries its logprob
    under the raw model given the tokens before it (the first has none), then the reply's own."""
    ids = engine.encode_prompt(WEATHER_REQUEST)
    plain = oai.completions.create(model=model, prompt=WEATHER_REQUEST, max_tokens=4)
    echoed = oai.completions.create(model=model, prompt=WEATHER_REQUEST, max_tokens=4, echo=True, logprobs=2)
    assert echoed.choices[0].text == WEATHER_REQUEST + plain.choices[0].text
    lp = echoed.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + echoed.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    logits = engine.logits(ids).astype(np.float64)  # [S, V]
    reference = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(reference[i - 1, ids[i]], abs=1e-4)
        assert len(lp.top_logprobs[i]) == 2 and max(lp.top_logprobs[i].values()) >= lp.token_logprobs[i] - 1e-6
    assert "".join(lp.tokens) == echoed.choices[0].text
    pieces = [c.choices[0].text for c in oai.completions.create(model=model, prompt=WEATHER_REQUEST, max_tokens=4,
                                                                   echo=True, stream=True) if c.choices]
    assert pieces[0] == WEATHER_REQUEST and "".join(pieces) == echoed.choices[0].text


def test_serve_flags_reach_the_settings():
    from hetero.cli.main import build_parser

    args = build_parser().parse_args(["serve", "--model-alias", "claude-*=m", "--model-alias", "gpt-?=m",
                                      "--reject-images"])
    settings = ServerSettings.from_args(args)
    assert settings.aliases == (("claude-*", "m"), ("gpt-?", "m")) and settings.reject_images
    plain = ServerSettings.from_args(build_parser().parse_args(["serve"]))
    assert plain.aliases == () and not plain.reject_images
