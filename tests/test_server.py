"""The HTTP server against the official OpenAI and Anthropic SDKs, live on loopback, on a tiny random model."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import uvicorn
from hypothesis import example, given, settings
from hypothesis import strategies as st

import hetero
from hetero.caches.prefix import PrefixCache
from hetero.caches.session import SessionStore
from hetero.decode.options import DecodeOptions
from hetero.server import StopMatcher, create_app
from tiny_checkpoint import write_tiny_model

MAX_CONTEXT = 1024


class LiveServer:
    """uvicorn serving `engine` on a free loopback port in a background thread."""

    def __init__(self, engine, api_key: str | None = None, split=None, **app_kw):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = create_app(engine, api_key=api_key, split=split, prefill_chunk=64, **app_kw)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def openai(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def anthropic(self, key: str = "none") -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", max_context=MAX_CONTEXT)


def cached_engine(model_dir: Path, store_dir: Path | None):
    engine = hetero.load(model_dir)
    engine.prefix_cache = PrefixCache(store=SessionStore(store_dir) if store_dir is not None else None)
    return engine


@pytest.fixture(scope="module")
def cold(model_dir):
    """A server without any prefix cache: the reference answers."""
    server = LiveServer(hetero.load(model_dir))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def warm(model_dir, tmp_path_factory):
    server = LiveServer(cached_engine(model_dir, tmp_path_factory.mktemp("sessions")))
    yield server
    server.stop()


SYSTEM = "You are a coding agent. Answer with code."
TOOL_RESULT = "def add(a, b):\n    return a + b\n" * 6


def transcript(turns: int) -> list[dict]:
    """A coding-agent session that grows by a tool result and a reply each turn."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Read the file add.py"}]
    for t in range(turns):
        msgs += [{"role": "assistant", "content": f"reading step {t}"}, {"role": "user", "content": TOOL_RESULT + f"# {t}"}]
    return msgs


def model_name(server: LiveServer) -> str:
    return server.openai().models.list().data[0].id


def ask(server: LiveServer, messages: list[dict], max_tokens: int = 12, **kw):
    return server.openai().chat.completions.create(model=model_name(server), messages=messages,
                                                   max_tokens=max_tokens, **kw)


def test_models_and_health(warm):
    models = warm.openai().models.list()
    assert len(models.data) == 1
    health = httpx.get(warm.url + "/health").json()
    assert health["status"] == "ok" and health["max_context"] == MAX_CONTEXT


def test_streaming_equals_non_streaming_and_reports_usage(cold):
    msgs = transcript(1)
    full = ask(cold, msgs)
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    assert full.usage.completion_tokens == full.model_extra["hetero"]["generated_tokens"]
    stream = cold.openai().chat.completions.create(
        model=model_name(cold), messages=msgs, max_tokens=12, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_second_turn_is_cached_and_matches_a_cold_server(warm, cold):
    first = ask(warm, transcript(2))
    second = ask(warm, transcript(3))
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.model_extra["hetero"]["cached_tokens"] == second.usage.prompt_tokens_details.cached_tokens
    assert second.choices[0].message.content == ask(cold, transcript(3)).choices[0].message.content
    assert first.choices[0].message.content == ask(cold, transcript(2)).choices[0].message.content


def test_completions_and_exact_stop_strings(cold):
    client = cold.openai()
    prompt = "def add(a, b):\n"
    base = client.completions.create(model=model_name(cold), prompt=prompt, max_tokens=24).choices[0].text
    assert len(base) > 6
    stop = base[3:6]  # a stop inside the text (it may span tokens)
    cut = base[: base.index(stop)]
    plain = client.completions.create(model=model_name(cold), prompt=prompt, max_tokens=24, stop=[stop])
    assert plain.choices[0].text == cut and plain.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=model_name(cold), prompt=prompt, max_tokens=24, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut


def test_a_one_token_prompt_is_answered_with_the_prefix_cache_on(warm, cold):
    """Regression: a 1-token prompt left the MTP layer's K/V empty and the prefix cache's capture answered 500."""
    body = {"model": model_name(warm), "prompt": "x", "max_tokens": 2}
    r = httpx.post(warm.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 1
    assert r.json()["choices"][0]["text"] == httpx.post(cold.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    again = warm.openai().completions.create(model=body["model"], prompt="x", max_tokens=2, extra_body={"mtp": False})
    assert again.choices[0].text == r.json()["choices"][0]["text"]


@settings(max_examples=60, deadline=None)
@given(text=st.text("ab\n", max_size=30), cuts=st.lists(st.integers(0, 30), max_size=6),
       stops=st.lists(st.text("ab\n", min_size=1, max_size=4), min_size=1, max_size=3))
@example(text="\naa", cuts=[2], stops=["a", "\naa"])  # 'a' completes first, but '\naa' begins earlier and wins
def test_stop_matcher_cuts_where_the_first_stop_begins(text, cuts, stops):
    edges = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    m = StopMatcher(stops)
    out = "".join(m.feed(text[a:b]) for a, b in zip(edges, edges[1:])) + m.flush()
    first = min((text.find(s) for s in stops if s in text), default=-1)
    assert out == (text[:first] if first >= 0 else text)


def test_anthropic_messages_stream_and_not(warm, cold):
    msgs = transcript(4)
    system, rest = msgs[0]["content"], msgs[1:]
    name = model_name(warm)
    client = warm.anthropic()
    ask(warm, msgs[:-2])  # a shorter transcript primes the cache
    msg = client.messages.create(model=name, system=system, messages=rest, max_tokens=12)
    reference = ask(cold, msgs).choices[0].message.content
    assert msg.content[0].text == reference
    assert msg.usage.cache_read_input_tokens > 0
    total = msg.model_extra["hetero"]["prompt_tokens"]
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == total
    assert msg.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(model=name, system=system, messages=rest, max_tokens=12) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == reference and final.usage.output_tokens == msg.usage.output_tokens
    assert final.usage.cache_read_input_tokens > 0


def test_restart_restores_from_disk_and_ignores_a_damaged_file(model_dir, cold, tmp_path, caplog):
    first = LiveServer(cached_engine(model_dir, tmp_path))
    ask(first, transcript(5))
    first.stop()
    restarted = LiveServer(cached_engine(model_dir, tmp_path))  # a new process would see exactly these files
    again = ask(restarted, transcript(6))
    restarted.stop()
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == ask(cold, transcript(6)).choices[0].message.content

    for f in tmp_path.glob("*/*.safetensors"):  # flip bytes in the middle of every tensor file
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="hetero.caches.session")
    damaged = LiveServer(cached_engine(model_dir, tmp_path))
    answer = ask(damaged, transcript(6))
    damaged.stop()
    assert answer.usage.prompt_tokens_details.cached_tokens == 0
    assert answer.choices[0].message.content == again.choices[0].message.content
    assert "damaged" in caplog.text


def test_bad_requests_get_4xx_naming_the_field_and_the_server_keeps_serving(model_dir):
    server = LiveServer(hetero.load(model_dir), api_key="sekrit")
    try:
        name = model_name_with_key(server)
        url, auth = server.url + "/v1/chat/completions", {"Authorization": "Bearer sekrit"}
        good = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

        r = httpx.post(url, content=b"{not json", headers=auth)
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = httpx.post(url, json={**good, "temperature": "hot"}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        r = httpx.post(url, json={**good, "max_tokens": 1.5}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = httpx.post(url, json={**good, "messages": [{"role": "user", "content": 3}]}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
        r = httpx.post(url, json={**good, "ane_fraction": 0.5}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "ane_fraction"
        with pytest.raises(openai.NotFoundError) as e:
            server.openai("sekrit").chat.completions.create(model="nope", messages=good["messages"], max_tokens=2)
        assert e.value.body["param"] == "model"
        with pytest.raises(openai.AuthenticationError):
            server.openai("wrong").chat.completions.create(model=name, messages=good["messages"], max_tokens=2)
        assert httpx.post(url, json=good).status_code == 401
        with pytest.raises(openai.BadRequestError) as e:
            server.openai("sekrit").chat.completions.create(
                model=name, messages=[{"role": "user", "content": "x " * 2000}], max_tokens=2)
        assert e.value.body["code"] == "context_length_exceeded" and "context window" in e.value.body["message"]
        r = httpx.post(server.url + "/v1/messages", json={"model": name, "messages": good["messages"]},
                       headers={"x-api-key": "sekrit"})  # Anthropic requires max_tokens
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in r.json()["error"]["message"]
        with pytest.raises(anthropic.NotFoundError):
            server.anthropic("sekrit").messages.create(model="nope", messages=good["messages"], max_tokens=2)

        ok = server.openai("sekrit").chat.completions.create(
            model=name, messages=good["messages"], max_tokens=2, extra_body={"mtp": False, "ane_fraction": 0})
        assert ok.choices[0].message.content is not None and ok.model_extra["hetero"].get("mtp") is None
    finally:
        server.stop()


def model_name_with_key(server: LiveServer) -> str:
    return server.openai("sekrit").models.list().data[0].id


def test_eight_concurrent_clients_get_their_single_client_answers(warm):
    prompts = [[{"role": "user", "content": f"client {i}: " + "x = 1\n" * i}] for i in range(8)]
    alone = [ask(warm, p).choices[0].message.content for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: ask(warm, p).choices[0].message.content, prompts))
    assert together == alone


def test_client_disconnect_cancels_generation(cold):
    before = httpx.get(cold.url + "/health").json()["requests"]
    body = {"model": model_name(cold), "prompt": "import os\n", "max_tokens": MAX_CONTEXT - 16, "stream": True}
    with httpx.stream("POST", cold.url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the first token arrived; hang up
    deadline = time.time() + 20
    while httpx.get(cold.url + "/health").json()["requests"]["cancelled"] == before["cancelled"]:
        assert time.time() < deadline, "the generation was not cancelled"
        time.sleep(0.05)
    assert ask(cold, transcript(0)).choices[0].message.content is not None  # and the server still serves


def complete(server: LiveServer, prompt: str, max_tokens: int, **extra) -> str:
    out = server.openai().completions.create(model=model_name(server), prompt=prompt, max_tokens=max_tokens,
                                             extra_body=extra or None)
    return out.choices[0].text


LONG_PROMPT = "import os\nimport sys\n"
SHORT_PROMPT = "def f(x):\n    return x\n" * 20


def interleaved(server: LiveServer, long_tokens: int, **short_extra) -> tuple[str, str]:
    """Stream a long generation; once its first token is in, send a short request. Returns (long text, short
    text)."""
    pieces = []
    stream = server.openai().completions.create(model=model_name(server), prompt=LONG_PROMPT, max_tokens=long_tokens,
                                                stream=True, extra_body={"ane_fraction": 0})
    with ThreadPoolExecutor(1) as pool:
        short = None
        for chunk in stream:
            pieces.append(chunk.choices[0].text if chunk.choices else "")
            if short is None:
                short = pool.submit(complete, server, SHORT_PROMPT, 8, **short_extra)
        return "".join(pieces), short.result()


def wait_for_company(turns, patience: float = 0.5) -> None:
    """Between its decode tokens, the job holding the turn waits up to `patience` s for another job to join the ring,
    until one has. The tiny model's 300 tokens take a fraction of a second: on a busy machine the long generation
    could end before the short request (sent when the client reads the long one's first chunk) reached the server,
    and the short one then ran alone. This only slows the first job until the second is in line; the hand-over and
    the answers are the server's own."""
    joined = threading.Event()
    pass_turn = turns.pass_turn

    def waiting_pass_turn(job, prefilling: bool = False) -> None:
        if not prefilling and not joined.is_set():
            end = time.monotonic() + patience
            while turns.others(job) == 0 and time.monotonic() < end:
                time.sleep(0.002)
            if turns.others(job) > 0:
                joined.set()
        pass_turn(job, prefilling)

    turns.pass_turn = waiting_pass_turn


def test_a_request_arriving_mid_generation_finishes_first_and_both_stay_exact(model_dir):
    """Requests take turns on the model: a short request sent while a long one streams is answered before the long
    one ends (no waiting in line), and each answer equals the one it gets alone."""
    server = LiveServer(hetero.load(model_dir))
    try:
        long_alone, short_alone = complete(server, LONG_PROMPT, 300), complete(server, SHORT_PROMPT, 8)
        assert len(server.openai().completions.create(model=model_name(server), prompt=LONG_PROMPT, max_tokens=300)
                   .choices[0].text) > 100  # really a long generation (no early EOS)
        assert httpx.get(server.url + "/health").json()["requests"]["turn_handovers"] == 0  # one at a time so far
        wait_for_company(server.app.state.runner.turns)
        long_text, short_text = interleaved(server, 300)
        assert long_text == long_alone and short_text == short_alone
        # the server's own record, not the client's reading speed (how many long chunks the client had read when
        # the short answer was in depends on its threads' scheduling): the turn passed between the two requests
        # mid-generation, which a short request waiting in line would never cause (it would run alone)
        assert httpx.get(server.url + "/health").json()["requests"]["turn_handovers"] > 0
    finally:
        server.stop()


def test_split_server_prefills_through_the_pipeline_and_lends_its_turns(model_dir):
    """`hetero serve --ane-fraction`: prompts prefill through the ANE + GPU split (greedy answers equal GPU-only
    ones), a generation streaming meanwhile keeps its exact output, and other fractions are refused by name."""
    from hetero.pipeline import configure

    engine = hetero.load(model_dir)
    server = LiveServer(engine, split=configure(engine, 0.5, 64))
    try:
        prompt = SHORT_PROMPT * 2
        gpu_only = complete(server, prompt, 12, ane_fraction=0)
        health = httpx.get(server.url + "/health").json()
        assert health["requests"]["split_prefills"] == 0 and health["ane"]["requested_fraction"] == 0.5
        assert complete(server, prompt, 12) == gpu_only
        assert httpx.get(server.url + "/health").json()["requests"]["split_prefills"] == 1

        long_alone, short_alone = complete(server, LONG_PROMPT, 300, ane_fraction=0), complete(server, SHORT_PROMPT, 8)
        long_text, short_text = interleaved(server, 300)
        assert long_text == long_alone and short_text == short_alone
        assert httpx.get(server.url + "/health").json()["requests"]["split_prefills"] == 3

        with pytest.raises(openai.BadRequestError) as e:
            complete(server, prompt, 2, ane_fraction=0.3)
        assert e.value.body["param"] == "ane_fraction" and "0.5" in e.value.body["message"]
    finally:
        server.stop()


def test_split_server_keeps_the_cache_promises(model_dir):
    """With the split on: a cold prompt reports no cached tokens (its tokens were prefilled, not restored), the
    split checkpoints its chunk edges, so the same prompt again is restored from the prefix cache instead of split
    again, and answers the same."""
    from hetero.pipeline import configure

    engine = cached_engine(model_dir, None)
    server = LiveServer(engine, split=configure(engine, 0.5, 64))
    try:
        prompt = SHORT_PROMPT * 2
        n = len(engine.tokenizer.encode(prompt))
        assert n > 3 * 64  # several chunks
        client, name = server.openai(), model_name(server)
        cold = client.completions.create(model=name, prompt=prompt, max_tokens=8)
        assert cold.usage.prompt_tokens == n and cold.usage.prompt_tokens_details.cached_tokens == 0
        assert httpx.get(server.url + "/health").json()["requests"]["split_prefills"] == 1
        again = client.completions.create(model=name, prompt=prompt, max_tokens=8)
        # the split prefilled all but the last token and checkpointed where it stopped: only that token runs again
        assert again.usage.prompt_tokens_details.cached_tokens == n - 1
        assert httpx.get(server.url + "/health").json()["requests"]["split_prefills"] == 1  # restored, not split
        assert again.choices[0].text == cold.choices[0].text
    finally:
        server.stop()


def test_ane_fraction_zero_serves_without_a_split(model_dir):
    from hetero.server.app import server_split

    engine = hetero.load(model_dir)
    assert server_split(engine, 0, 64) is None and server_split(engine, None, 64) is None
    assert server_split(engine, 0.5, 64).requested_fraction == 0.5


WORKER_THREAD_RUN = """
import threading, hetero
engine = hetero.load()
def work():
    engine.generate("def f(x):", max_tokens=8, mtp=True)
    engine.generate("import os\\n" * 40, max_tokens=4, mtp=False, prefill_chunk=64)
t = threading.Thread(target=work)
t.start()
t.join()
print("done")
"""


def test_model_work_on_worker_threads_exits_cleanly():
    """The server and the pipeline run the model on worker threads; MLX 0.32 aborts at exit after an
    `mx.compile`d function ran on one (half the runs, measured), so three clean exits in a row are required."""
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", WORKER_THREAD_RUN], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-400:]


# ----------------------------------------------------------------------------------------------------------
# Hygiene: default max_tokens, tokenization off the event loop, body limit, access log, key, exposure warning


def test_a_request_without_max_tokens_gets_the_default_capped_by_the_window(model_dir):
    server = LiveServer(hetero.load(model_dir), default_max_tokens=7)
    try:
        client, name = server.openai(), model_name(server)
        plain = client.completions.create(model=name, prompt=LONG_PROMPT)  # no max_tokens
        assert plain.usage.completion_tokens == 7 and plain.choices[0].finish_reason == "length"
        assert plain.choices[0].text == complete(server, LONG_PROMPT, 7)
        chat = client.chat.completions.create(model=name, messages=transcript(0))
        assert chat.usage.completion_tokens <= 7
        assert chat.choices[0].message.content == ask(server, transcript(0), max_tokens=7).choices[0].message.content
    finally:
        server.stop()
    server = LiveServer(hetero.load(model_dir))  # the default 4096 is more than the 1024-token window
    try:
        ids = (hetero.load(model_dir).tokenizer.encode(LONG_PROMPT) * MAX_CONTEXT)[: MAX_CONTEXT - 5]
        near_full = server.openai().completions.create(model=model_name(server), prompt=ids)
        assert near_full.usage.prompt_tokens == MAX_CONTEXT - 5 and near_full.usage.completion_tokens <= 5
    finally:
        server.stop()


def test_a_1mb_prompt_being_tokenized_does_not_stall_other_clients(model_dir, monkeypatch):
    """The chat template and the tokenizer run off the event loop. The 1 MB prompt enters the real tokenizer through
    a gate that opens once /health and a short completion have been answered: off the loop they are answered
    meanwhile; on the loop the gate would hold the loop itself and they would come only after it (the order of
    events is the evidence, not a clock)."""
    engine = hetero.load(model_dir)
    server = LiveServer(engine)
    real, entered, answered, events = engine.tokenizer.encode, threading.Event(), threading.Event(), []

    def encode(text: str) -> list[int]:
        if len(text) < 500_000:
            return real(text)
        entered.set()
        answered.wait(10)
        ids = real(text)
        events.append("big prompt tokenized")
        return ids

    monkeypatch.setattr(engine.tokenizer, "encode", encode)
    try:
        big = {"model": model_name(server), "max_tokens": 2,
               "messages": [{"role": "user", "content": "def add(a, b):\n" * 70_000}]}  # 1 MB of text
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, server.url + "/v1/chat/completions", json=big, timeout=120)
            assert entered.wait(60)
            assert httpx.get(server.url + "/health", timeout=60).json()["status"] == "ok"
            events.append("health")
            assert complete(server, SHORT_PROMPT, 4) is not None
            events.append("short completion")
            answered.set()
            r = pending.result()
        assert events == ["health", "short completion", "big prompt tokenized"]
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        answered.set()
        server.stop()


def test_a_body_over_the_limit_is_a_413_in_each_apis_error_shape(model_dir):
    server = LiveServer(hetero.load(model_dir), max_body_mb=1 / 16)  # 64 KiB
    try:
        name = model_name(server)
        huge = [{"role": "user", "content": "x" * 100_000}]
        with pytest.raises(openai.APIStatusError) as e:
            server.openai().chat.completions.create(model=name, messages=huge, max_tokens=2)
        assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"
        assert "--max-body-mb" in e.value.body["message"]
        with pytest.raises(anthropic.APIStatusError) as e:
            server.anthropic().messages.create(model=name, messages=huge, max_tokens=2)
        assert e.value.status_code == 413 and e.value.body["error"]["type"] == "request_too_large"

        def chunked():  # no Content-Length: the bytes are counted as they arrive
            body = json.dumps({"model": name, "messages": huge, "max_tokens": 2}).encode()
            for i in range(0, len(body), 8192):
                yield body[i: i + 8192]

        r = httpx.post(server.url + "/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
        assert "content-length" not in r.request.headers
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:  # announces 100 MB, sends none
            s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100000000\r\n\r\n")
            answer = b""  # answered from the header alone, without waiting for the body
            while b"request_too_large" not in answer and (more := s.recv(65536)):
                answer += more
        assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer

        assert ask(server, transcript(0)).choices[0].message.content is not None  # a body under the limit is served
    finally:
        server.stop()


ACCESS = re.compile(r'^127\.0\.0\.1:\d+ "(\w+) (\S+)" (\d+)'
                    r'(?: prompt_tokens=(\d+) cached_tokens=(\d+) completion_tokens=(\d+) ttft=\d+\.\d{3}s)? \d+\.\d{3}s$')


def test_every_request_gets_an_access_log_line(model_dir, caplog):
    caplog.set_level(logging.INFO, logger="hetero.access")
    server = LiveServer(hetero.load(model_dir))
    try:
        name = model_name(server)
        plain = server.openai().completions.create(model=name, prompt="def add", max_tokens=3)
        chunks = list(server.openai().chat.completions.create(
            model=name, messages=transcript(0), max_tokens=3, stream=True, stream_options={"include_usage": True}))
        missing = httpx.post(server.url + "/v1/messages", json={"model": "nope", "max_tokens": 2, "messages": []})
        assert missing.status_code == 404
        cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
        expected = [
            ("GET", "/v1/models", "200", None, None, None),
            ("POST", "/v1/completions", "200", str(plain.usage.prompt_tokens), "0", str(plain.usage.completion_tokens)),
            ("POST", "/v1/chat/completions", "200", str(chunks[-1].usage.prompt_tokens), str(cached),
             str(chunks[-1].usage.completion_tokens)),
            ("POST", "/v1/messages", "404", None, None, None),
        ]
        deadline = time.time() + 20  # a line is written once its response has ended, which the client may see first
        while True:
            lines = [r.getMessage() for r in caplog.records if r.name == "hetero.access"]
            if len(lines) >= len(expected) or time.time() > deadline:
                break
            time.sleep(0.02)
        assert [ACCESS.match(line).groups() for line in lines] == expected, lines
    finally:
        server.stop()


def test_a_wrong_or_undecodable_key_is_401(model_dir):
    server = LiveServer(hetero.load(model_dir), api_key="sekrit")
    try:
        for key in (b"sekri", b"sekrit!", b"\xe9\xff", b""):  # compared as bytes: no 500 on a non-ASCII header
            r = httpx.get(server.url + "/v1/models", headers={"x-api-key": key})
            # x-api-key without a Bearer is Anthropic's header: Anthropic's error shape (its error.type as OpenAI's)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", key
        assert httpx.get(server.url + "/v1/models", headers={"x-api-key": "sekrit"}).status_code == 200
    finally:
        server.stop()


@pytest.mark.parametrize("args, warned", [(["--host", "0.0.0.0"], True), (["--host", "0.0.0.0", "--api-key", "k"], False),
                                          ([], False)])
def test_serving_beyond_loopback_without_a_key_warns(tmp_path, args, warned):
    (tmp_path / "config.json").write_text("[]")  # the model fails to load after the bind: the process ends there
    env = {k: v for k, v in os.environ.items() if k != "HETERO_API_KEY"}
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        port = str(s.getsockname()[1])  # free on every address
    out = subprocess.run([sys.executable, "-m", "hetero", "serve", *args, "--port", port, "--model", str(tmp_path),
                          "--no-session-cache"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1 and "must hold a JSON object" in out.stderr, out.stderr
    assert ("without --api-key" in out.stderr) == warned, out.stderr


def test_a_stream_hands_the_event_loop_everything_emitted_since_its_last_wake(model_dir):
    """The job's pieces reach the event loop in lists, one wake-up per list, not one per token: while the event
    loop is busy, all that the job emits meanwhile (its text, then its Outcome) comes as one list, in order, and the
    lists joined are the generation's whole text."""
    import asyncio

    from hetero.server.requests import Job
    from hetero.server.runner import Outcome, Runner, Started

    engine = hetero.load(model_dir)
    ids = engine.encode_prompt("the stream of pieces")
    expected = engine.generate(ids, max_tokens=24, mtp=False, use_prefix_cache=False).text
    runner = Runner(engine, max_concurrent=1)

    async def read() -> list[list]:
        stream = runner.stream(Job(ids, DecodeOptions(24, mtp=False)))
        lists = [await stream.__anext__()]  # Started (and whatever came with it)
        # the event loop is busy (blocked here) while the job runs to its end: its one worker takes this no-op only
        # once the job's Future is done and its callbacks (the Outcome's hand-off) have run
        runner.pool.submit(lambda: None).result(timeout=120)
        lists += [batch async for batch in stream]
        return lists

    lists = asyncio.run(read())
    assert isinstance(lists[0][0], Started)
    assert len(lists) == 2, [len(b) for b in lists]  # the whole rest in one hand-off
    assert isinstance(lists[-1][-1], Outcome)
    text = "".join(x for b in lists for x in b if isinstance(x, str))
    assert text == lists[-1][-1].text == expected
    assert sum(isinstance(x, str) for x in lists[1]) > 1  # many pieces in the one list
