"""`hetero serve` across ranks: `mlx.launch -n 2` on loopback, rank 0 serving HTTP on the pipelined engine, rank 1
serving rank 0; the official OpenAI and Anthropic SDKs over real HTTP against one process on the bundled model.

One server start is shared by the module (starting ranks is the cost); the last test shuts it down. Prefill runs in
chunks of 16 tokens so the prompts' prefill is pipelined and the prefix cache has chunk-edge checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import anthropic
import httpx
import jsonschema
import numpy as np
import openai
import pytest

import hetero
from test_distributed import PROMPT, ROOT, Launch, _free_port

CHUNK = 16
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = "Describe a person in JSON"


class Served:
    """The launched ranks, rank 0's URL and pid, and the one-process references computed while they start."""

    def __init__(self):
        self.port = _free_port(1)
        self.launch = Launch(2, [sys.executable, "-m", "hetero", "serve", "--port", str(self.port), "--prefill-chunk",
                                 str(CHUNK), "--dist-timeout", "30"])
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            self._start()
        except BaseException:
            kill_all(self.launch)
            raise

    def _start(self) -> None:
        """Compute the references, then wait for rank 0's server."""
        self.single = single = hetero.load()  # the whole model in this process, while the ranks load their shares
        run = dict(prefill_chunk=CHUNK, draft_depth=3, use_prefix_cache=False)
        self.greedy = single.generate(PROMPT, max_tokens=24, **run)
        self.json = single.generate(ASK, chat=True, max_tokens=40, json_schema=PERSON, **run)
        self.logprobs = single.generate(ASK, chat=True, max_tokens=12, logprobs=3, **run)
        self.plain = single.generate(ASK, chat=True, max_tokens=40, json_schema=PERSON, logprobs=2, mtp=False,
                                     prefill_chunk=CHUNK, use_prefix_cache=False)
        self.launch.wait_for("serving HTTP]", 60)
        err = self.launch.wait_for("serving rank 0]", 60)
        self.rank0 = int(err.split("[hetero rank 0/2 pid ")[1].split(":")[0])
        self.rank1 = int(err.split("[hetero rank 1/2 pid ")[1].split(":")[0])
        end = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < end, self.launch.err.decode()[-2000:]
                time.sleep(0.1)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()


@pytest.fixture(scope="module")
def served():
    s = Served()
    yield s
    if s.launch.proc.poll() is None:  # (the last test did not run)
        kill_all(s.launch)
    s.launch.finish(10)


def kill_all(launch: Launch) -> None:
    """SIGKILL the launcher's ranks, then the launcher (killed first, it would leave them running)."""
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) == launch.proc.pid:
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(launch.proc.pid, signal.SIGKILL)


def chat(served: Served, **kw):
    return served.openai().chat.completions.create(model="bundled", messages=[{"role": "user", "content": ASK}], **kw)


def test_greedy_completion_is_the_one_process_output(served):
    """MTP on (depth 3), greedy: the pipelined server's completion is one process's, and its stats say so."""
    r = served.openai().completions.create(model="bundled", prompt=PROMPT, max_tokens=24, temperature=0,
                                           extra_body={"mtp": True})
    assert r.choices[0].text == served.greedy.text
    stats = r.model_extra["hetero"]
    assert stats["generated_tokens"] == len(served.greedy.tokens) and stats["pipeline"]["ranks"] == 2
    assert stats["mtp"] == served.greedy.stats["mtp"] and stats["mtp"]["rounds"] > 0


def test_penalties_apply_on_the_last_rank_as_in_one_process(served):
    """logit_bias and the repetition penalties travel with the pipelined request and are applied by the last rank's
    stepper: the completion is the one-process completion with the same fields, and differs from the plain one."""
    fields = dict(logit_bias={str(served.greedy.tokens[1]): -100.0}, presence_penalty=1.5, frequency_penalty=0.5,
                  repetition_penalty=1.3)
    alone = served.single.generate(PROMPT, max_tokens=24, mtp=True, draft_depth=3, use_prefix_cache=False, prefill_chunk=CHUNK,
                                   **{**fields, "logit_bias": {served.greedy.tokens[1]: -100.0}})
    r = served.openai().completions.create(model="bundled", prompt=PROMPT, max_tokens=24, temperature=0,
                                           extra_body={"mtp": True, "repetition_penalty": 1.3},
                                           logit_bias=fields["logit_bias"], presence_penalty=1.5,
                                           frequency_penalty=0.5)
    assert r.choices[0].text == alone.text != served.greedy.text


def test_a_stream_delivers_the_same_text_in_pieces(served):
    sent = time.monotonic()
    chunks = served.openai().completions.create(model="bundled", prompt=PROMPT, max_tokens=24, temperature=0,
                                                stream=True)
    pieces, times = [], []
    for c in chunks:
        if c.choices and c.choices[0].text:
            pieces.append(c.choices[0].text)
            times.append(time.monotonic())
    assert "".join(pieces) == served.greedy.text
    # as the rounds commit, not one block at the end: many pieces, spread over the decoding's time. Measured against
    # the request's own time, whatever the machine's speed: 23 of 24 tokens' decoding lies between the first piece and
    # the last, a few prefill chunks before; pieces held back and sent together would arrive within one read's time.
    assert len(pieces) >= 8 and times[-1] - times[0] > 0.02 * (times[-1] - sent)


def test_json_schema_output_is_valid_and_the_one_process_output(served):
    """Constrained on the last rank (the request carries the grammar): valid JSON, identical to one process."""
    r = chat(served, max_tokens=40, response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON}})
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert text == served.json.text and r.choices[0].finish_reason == "stop"


def test_logprobs_are_the_one_process_logprobs(served):
    """Computed on the last rank from the verify pass's rows and sent to rank 0 after each COMMIT."""
    r = chat(served, max_tokens=12, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    want = served.logprobs.logprobs
    assert r.choices[0].message.content == served.logprobs.text and len(content) == len(want)
    np.testing.assert_allclose([e.logprob for e in content], [x.logprob for x in want], atol=1e-4)
    for e, x in zip(content, want):
        np.testing.assert_allclose([t.logprob for t in e.top_logprobs], [lp for _, lp in x.top], atol=1e-4)
        assert [bytes(t.bytes) for t in e.top_logprobs] == [served.single.token_bytes(t) for t, _ in x.top]


def test_plain_decoding_with_json_and_logprobs(served):
    """`mtp: false`: the last rank's plain loop masks and records as `generate_tokens` does."""
    r = chat(served, max_tokens=40, response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON}}, logprobs=True, top_logprobs=2, extra_body={"mtp": False})
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert text == served.plain.text
    assert r.model_extra["hetero"].get("mtp") is None
    np.testing.assert_allclose([e.logprob for e in r.choices[0].logprobs.content],
                               [x.logprob for x in served.plain.logprobs], atol=1e-4)


def test_anthropic_messages(served):
    client = anthropic.Anthropic(base_url=served.url, api_key="none", max_retries=0, timeout=60)
    msg = client.messages.create(model="bundled", max_tokens=12, messages=[{"role": "user", "content": ASK}])
    assert msg.content[0].text == served.logprobs.text and msg.usage.output_tokens == len(served.logprobs.tokens)


def test_a_cancelled_stream_ends_on_every_rank_and_leaves_them_in_step(served):
    """A client gone mid-stream: rank 0 answers the next commit with STOP and every rank ends the request there
    (2000 tokens would take a minute here); the next request is answered as one process answers it."""
    before = served.health()["requests"]["cancelled"]
    arrivals, sent = [], time.monotonic()
    with httpx.stream("POST", served.url + "/v1/completions", timeout=60, json={
            "model": "bundled", "prompt": PROMPT, "max_tokens": 2000, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                arrivals.append(time.monotonic())
                if len(arrivals) == 9:
                    break  # nine pieces in: the client goes away
    left = time.monotonic()
    # The job is counted as cancelled once the engine's generate has returned, i.e. every rank ended the request.
    # It must end within a few rounds, not after the ~1990 tokens it had left: measured in this very request's own
    # time per piece (a piece is at most a token's text), so the bound holds on a machine of any speed. Counted from
    # the request's start, prefill included: an upper bound even if this client, descheduled, read pieces in a burst.
    per_piece = (arrivals[-1] - sent) / 9
    while served.health()["requests"]["cancelled"] == before:
        assert time.monotonic() - left < 300, "the cancelled request never ended"  # a hang guard only
        time.sleep(0.02)
    assert time.monotonic() - left < 400 * per_piece
    assert served.health()["requests"]["cancelled"] == before + 1
    r = served.openai().completions.create(model="bundled", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == served.greedy.text


def test_a_client_gone_during_prefill_is_held_until_the_ranks_are_done(served):
    """The server's cancellation raised inside rank 0's prefill is held (the ranks finish the prefill and stop at
    the first token), then counted as cancelled; the next request is answered as one process answers it."""
    before = served.health()["requests"]["cancelled"]
    # A stream's headers go out once its prefill has begun (the first of its ~110 chunks of 16 tokens is done) and
    # the completions API sends nothing more before the first token: leaving right at the headers, with no text
    # read, leaves during the prefill by the order of events, not by a guess at how long it takes.
    with httpx.stream("POST", served.url + "/v1/completions", timeout=60, json={
            "model": "bundled", "prompt": "x = 1\n" * 300, "max_tokens": 2000, "stream": True}) as gone:
        assert gone.status_code == 200
    r = served.openai().completions.create(model="bundled", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == served.greedy.text
    assert served.health()["requests"]["cancelled"] == before + 1


def test_a_stop_string_ends_the_request_on_every_rank(served):
    stop = served.greedy.text[12:18]
    r = served.openai().completions.create(model="bundled", prompt=PROMPT, max_tokens=2000, temperature=0, stop=[stop],
                                           extra_body={"mtp": True})
    assert r.choices[0].text == served.greedy.text[: served.greedy.text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    # it ended at the stop string, not after 2000 tokens: no more than the greedy reference's 24 tokens were decoded
    # (the round that crossed the stop commits at most depth + 1 = 4 tokens, all within the reference's first 24)
    assert r.usage.completion_tokens <= len(served.greedy.tokens)


def test_a_repeated_prompt_resumes_from_every_ranks_prefix_cache(served):
    for _ in range(2):  # (the first may already be warm from the tests above)
        r = served.openai().completions.create(model="bundled", prompt=PROMPT, max_tokens=24, temperature=0)
        assert r.choices[0].text == served.greedy.text
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % CHUNK == 0  # restored at a chunk edge all ranks checkpointed
    assert served.health()["prefix_cache"]["hits"] > 0


def test_refused_options_get_one_line():
    """What has no pipelined form fails at startup in one line (before the ranks even connect)."""
    env = {**os.environ, "MLX_RANK": "0", "MLX_HOSTFILE": os.devnull}
    proc = subprocess.run([sys.executable, "-m", "hetero", "serve", "--max-batch", "4", "--ane-fraction", "0.5",
                           "--session-cache", "/tmp/x"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "hetero: error: --ane-fraction, --max-batch above 1, --session-cache: not available when serving across "
        "ranks (mlx.launch); leave them out (each rank keeps its prefix cache in RAM)"], proc.stderr


def test_stopping_rank_0_ends_the_other_ranks(served):
    """Ctrl-C on rank 0: the server stops, tells rank 1 to stop, and the launch ends cleanly (runs last)."""
    os.kill(served.rank0, signal.SIGINT)
    _, err = served.launch.finish(30)
    assert served.launch.proc.returncode == 0
    for pid in (served.rank0, served.rank1):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "Traceback" not in err and "hetero: error" not in err, err[-2000:]


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("target", ["launcher", "rank 0"])
def test_sigterm_mid_stream_stops_every_rank_with_a_final_event(target):
    """SIGTERM while a long stream generates, sent to mlx.launch (`docker stop`, `kill PID`: it dies without passing
    it on, which left every rank serving) or to rank 0 (whose SIGTERM once killed it at once through its watchdog):
    the client's stream ends with the shutting-down error event, and every rank is gone within 5 s."""
    port = _free_port(1)
    launch = Launch(2, [sys.executable, "-m", "hetero", "serve", "--port", str(port), "--dist-timeout", "30"])
    try:
        launch.wait_for("serving HTTP]", 120)  # rank 0's line, then rank 1's: each names its pid
        err = launch.wait_for("serving rank 0]", 60)
        ranks = [int(err.split(f"[hetero rank {r}/2 pid ")[1].split(":")[0]) for r in (0, 1)]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        end = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < end, launch.err.decode()[-2000:]
                time.sleep(0.1)
        stream = client.completions.create(model="bundled", prompt=PROMPT, max_tokens=30000, stream=True,
                                           logit_bias={"0": -100, "2": -100})  # EOS suppressed: it runs on
        texts = []
        with pytest.raises(openai.APIError) as final:
            for event in stream:
                texts.append(event.choices[0].text)
                if len(texts) == 20:
                    os.kill(launch.proc.pid if target == "launcher" else ranks[0], signal.SIGTERM)
                    signalled = time.monotonic()
        assert "shutting down" in str(final.value) and not isinstance(final.value, openai.APIConnectionError)
        while not all(_pid_gone(pid) for pid in ranks):
            assert time.monotonic() - signalled < 5.0, f"ranks still running 5 s after SIGTERM to {target}"
            time.sleep(0.05)
    finally:
        kill_all(launch)
        launch.finish(10)
