"""GET /metrics (hetero/server/metrics.py): the text parses with prometheus_client's own parser, the counters grow by
exactly a request's tokens (as the response's usage reports them), the live gauges follow the server, and the API
key covers the page unless --metrics-public. Real servers on loopback (tests/test_server.py's LiveServer) on the tiny
random model, real SDK clients."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import hetero
from hetero.caches.prefix import PrefixCache
from hetero.caches.session import SessionStore
from test_server import LiveServer
from tiny_checkpoint import write_tiny_model

NO_EOS = {"2": -100}  # the tiny model's EOS id


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", max_context=1024)
    engine = hetero.load(path)
    engine.prefix_cache = PrefixCache(store=SessionStore(tmp_path_factory.mktemp("sessions")))
    live = LiveServer(engine, max_concurrent=1, served_name="tiny")  # one worker: a second request waits, as the gauge must show
    yield live
    live.stop()


def scrape(server: LiveServer, **headers) -> dict[str, float]:
    """Every sample of /metrics as {'name{label="v",...}': value} (labels sorted, model_name left out)."""
    response = httpx.get(server.url + "/metrics", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def grew(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_counters_grow_by_exactly_a_requests_tokens(server):
    client = server.openai()
    messages = [{"role": "user", "content": "def add(a, b): return a + b and then some more words"}]
    before = scrape(server)
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=7, logit_bias=NO_EOS,
                                           extra_body={"mtp": True})
    mid = scrape(server)
    u = first.usage
    assert grew(before, mid, "vllm:prompt_tokens_total") == u.prompt_tokens
    assert grew(before, mid, "vllm:generation_tokens_total") == u.completion_tokens == 7
    assert grew(before, mid, "vllm:prompt_tokens_cached_total") == u.prompt_tokens_details.cached_tokens
    assert grew(before, mid, 'vllm:request_success_total{finished_reason="length"}') == 1
    for h in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_time_per_output_token_seconds", "vllm:request_queue_time_seconds"):
        assert grew(before, mid, h + "_count") == 1, h
    assert mid["vllm:e2e_request_latency_seconds_sum"] >= mid["vllm:time_to_first_token_seconds_sum"]
    # MTP: what was drafted and accepted, per position, and the tokens each verify pass emitted
    drafted = grew(before, mid, "vllm:spec_decode_num_draft_tokens_total")
    accepted = grew(before, mid, "vllm:spec_decode_num_accepted_tokens_total")
    assert grew(before, mid, "vllm:spec_decode_num_drafts_total") > 0 and 0 <= accepted <= drafted
    per_pos = sum(grew(before, mid, k) for k in mid if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == accepted
    assert 0 < grew(before, mid, "hetero:mtp_emitted_tokens_total") <= u.completion_tokens

    # the same conversation again, streamed: its prompt resumes from the prefix cache
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, logit_bias=NO_EOS,
                                            stream=True, stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None][-1]
    after = scrape(server)
    assert usage.prompt_tokens_details.cached_tokens > 0
    assert grew(mid, after, "vllm:prompt_tokens_total") == usage.prompt_tokens
    assert grew(mid, after, "vllm:prompt_tokens_cached_total") == usage.prompt_tokens_details.cached_tokens
    assert grew(mid, after, "vllm:generation_tokens_total") == usage.completion_tokens == 5
    assert grew(mid, after, "hetero:prefix_cache_hits_total") == 1
    assert after["hetero:prefix_cache_bytes"] > 0 and after["hetero:session_cache_bytes"] > 0
    assert after["hetero:session_cache_entries"] >= 1
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0


def test_running_and_waiting_gauges_follow_the_requests(server):
    """One worker (max_concurrent 1): a long reply runs, a second request waits for it."""
    client = server.openai()
    seen, done = [], []

    def long_reply(tokens: int) -> None:
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=tokens, logit_bias=NO_EOS, stream=True,
                                                extra_body={"mtp": False})
        for chunk in stream:
            seen.append(chunk)
        done.append(tokens)

    first = threading.Thread(target=long_reply, args=(900,))
    first.start()
    deadline = time.time() + 30
    while not seen:
        assert time.time() < deadline
        time.sleep(0.01)
    second = threading.Thread(target=long_reply, args=(2,))
    second.start()
    while (m := scrape(server))["vllm:num_requests_waiting"] < 1 and not done:
        time.sleep(0.005)
    assert not done, "the long reply ended before the second request was seen waiting"
    assert m["vllm:num_requests_running"] == 1 and m["vllm:num_requests_waiting"] == 1
    first.join(60)
    second.join(60)
    m = scrape(server)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0


@pytest.mark.parametrize("public", [False, True])
def test_the_api_key_covers_metrics_unless_public(tmp_path, public):
    engine = hetero.load(write_tiny_model(tmp_path / "model", max_context=256))
    live = LiveServer(engine, api_key="sekrit", metrics_public=public, served_name="tiny")
    try:
        bare = httpx.get(live.url + "/metrics")
        keyed = httpx.get(live.url + "/metrics", headers={"Authorization": "Bearer sekrit"})
        wrong = httpx.get(live.url + "/metrics", headers={"Authorization": "Bearer nope"})
        assert keyed.status_code == 200 and "vllm:num_requests_running" in keyed.text
        if public:
            assert bare.status_code == 200 and wrong.status_code == 200
        else:
            assert bare.status_code == 401 and wrong.status_code == 401
            assert "API key" in bare.json()["error"]["message"]
        assert httpx.get(live.url + "/v1/models").status_code == 401  # the API itself stays behind the key
    finally:
        live.stop()
