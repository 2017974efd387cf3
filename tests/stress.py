"""A stress harness for `hetero serve`: many real clients at once (the openai and anthropic SDKs, httpx for what
the SDKs will not send), on loopback, against a real server process. The checks are `stress_checks`.

A workload is a list of `Call`s drawn from one seed: each client sends its calls one after another (an agent
waits for its answer), after a gap drawn from [0, max_gap] s; each call is one of the four APIs (OpenAI chat and
completions, Responses, Anthropic Messages), streamed or whole, with a prompt of a drawn length (log-uniform from
1 token) and greedy decoding. Some calls cancel mid-stream (the client hangs up after the first text), some send
garbage (bad JSON, wrong types, unknown routes and models, broken schemas).

`solo` sends every call alone, one at a time, to a server of the same setting: its text is the greedy answer the
call must get under load, and its latency W the call's own work. `storm` sends them concurrently (while
`stress_checks.Monitor` reads /health and /metrics), and `stress_checks.judge` checks every call.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import anthropic
import httpx
import openai

KINDS = ("chat", "completion", "responses", "messages")
WORDS = ("alpha", "river", "stone", "garden", "signal", "copper", "window", "ladder", "orbit", "maple", "tunnel", "quiet")
TOKENS_PER_WORD = 3.0  # the bundled tokenizer on `text`'s words (measured: 1,293 tokens for 420 words in a chat)


@dataclass(frozen=True)
class Setting:
    """One server configuration under test."""

    name: str
    max_batch: int = 4
    wavefront: bool = True
    ane_fraction: float | None = None
    prefill_chunk: int = 512
    max_concurrent: int = 4
    prefix_cache_gb: float | None = None  # None: the server's default

    def args(self) -> list[str]:
        out = ["--max-batch", str(self.max_batch), "--prefill-chunk", str(self.prefill_chunk),
               "--max-concurrent", str(self.max_concurrent)]
        if self.ane_fraction is not None:
            out += ["--ane-fraction", str(self.ane_fraction)]
        if self.prefix_cache_gb is not None:
            out += ["--prefix-cache-max-gb", str(self.prefix_cache_gb)]
        return out


@dataclass
class Call:
    """One request of the workload."""

    index: int
    client: int
    kind: str  # one of KINDS
    stream: bool
    tokens: int  # the prompt's drawn length
    max_tokens: int
    action: str  # "answer", "cancel" or "garbage"
    gap: float  # seconds the client waits before sending it
    seed: int
    garbage: int = 0  # which of GARBAGE, for action "garbage"

    def text(self) -> str:
        """A prompt of about `tokens` tokens, unique to the call (its seed first)."""
        rng = random.Random(self.seed)
        words = max(0, math.ceil((self.tokens - 4) / TOKENS_PER_WORD))
        return f"{self.seed}: " + " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(words))


@dataclass
class Result:
    """What one call got."""

    index: int
    status: int | None = None  # the HTTP status (None: no answer: a stall, or the client gave up)
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    sent: float = 0.0  # perf_counter
    ended: float | None = None
    cancelled: bool = False
    error: str | None = None

    @property
    def latency(self) -> float | None:
        return None if self.ended is None else self.ended - self.sent


def draw(seed: int, calls: int, clients: int, max_tokens_prompt: int, max_gap: float = 1.0, cancel: float = 0.05,
         garbage: float = 0.05, max_new: int = 16) -> list[Call]:
    """A workload of `calls` calls over `clients` clients, prompts log-uniform in [1, max_tokens_prompt] tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(calls):
        u = rng.random()
        action = "cancel" if u < cancel else "garbage" if u < cancel + garbage else "answer"
        stream = action == "cancel" or rng.random() < 0.5
        tokens = max(1, round(math.exp(rng.uniform(0.0, math.log(max_tokens_prompt)))))
        out.append(Call(i, i % clients, rng.choice(KINDS), stream, tokens, rng.randint(1, max_new), action,
                        rng.uniform(0.0, max_gap), rng.randrange(1 << 30), rng.randrange(len(GARBAGE))))
    return out


class Server:
    """`python -m hetero serve` in a process of its own (a stalled server is killed, never waited on)."""

    def __init__(self, setting: Setting, log: Path, model: str | None = None, env: dict | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "hetero", "serve", "--port", str(self.port), "--no-session-cache",
               *setting.args(), *(["--model", model] if model else [])]
        env = {**os.environ, "HETERO_PREFILL_WAVEFRONT": "1" if setting.wavefront else "0", **(env or {})}
        self.log = log
        self.proc = subprocess.Popen(cmd, env=env, cwd=log.parent, stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.time() + 300  # a first split exports nothing at start; the kernels may build once
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hetero serve exited at start:\n{log.read_text()[-3000:]}")
            try:
                httpx.get(self.url + "/health", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if time.time() > deadline:
                    self.stop()
                    raise RuntimeError("hetero serve did not start") from None
                time.sleep(0.1)
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# Garbage: (method, path, body bytes or a JSON-able object, expected status class). Each names a decoder the
# server runs on client bytes: the body's JSON, the fields' types, the model name, JSON schemas, the routes. (Images
# are tests/test_image_fuzz.py's: the bundled model reads text only, and puts a placeholder in an image's place.)
GARBAGE = [
    ("POST", "/v1/chat/completions", b"{\"model\": \"m\", \"messages\": [", 400),
    ("POST", "/v1/chat/completions", b"\xff\xfe\x00garbage\x80", 400),
    ("POST", "/v1/chat/completions", [1, 2, 3], 400),
    ("POST", "/v1/chat/completions", {"model": "MODEL", "messages": "hi"}, 400),
    ("POST", "/v1/chat/completions", {"model": "MODEL", "messages": [{"role": "user", "content": 7}]}, 400),
    ("POST", "/v1/chat/completions", {"model": "MODEL", "max_tokens": "lots",
                                      "messages": [{"role": "user", "content": "hi"}]}, 400),
    ("POST", "/v1/chat/completions", {"model": "nobody", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("POST", "/v1/chat/completions", {"model": "MODEL", "messages": [{"role": "user", "content": "hi"}],
                                      "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "x", "schema": {"type": 5}}}}, 400),
    ("POST", "/v1/completions", {"model": "MODEL", "prompt": {"x": 1}}, 400),
    ("POST", "/v1/completions", {"model": "MODEL", "prompt": "hi", "max_tokens": 2, "logit_bias": {"x": 1}}, 400),
    ("POST", "/v1/completions", {"model": "MODEL", "prompt": "hi", "temperature": -3}, 400),
    ("POST", "/v1/responses", {"model": "MODEL", "input": 12}, 400),
    ("POST", "/v1/messages", {"model": "MODEL", "messages": [{"role": "user", "content": "hi"}]}, 400),
    ("POST", "/v1/messages", {"model": "MODEL", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"name": "f", "input_schema": {"type": 5}}],
                              "tool_choice": {"type": "tool", "name": "f"}}, 400),
    ("POST", "/v1/chat/completions", {"model": "MODEL", "messages": [{"role": "user", "content": "hi"}],
                                      "response_format": {"type": "json_schema", "json_schema": {
                                          "name": "x", "schema": {"$ref": "#/nowhere"}}}}, 400),
    ("POST", "/v1/nowhere", {"model": "MODEL"}, 404),
    ("GET", "/v1/chat/completions", None, 405),
]


def send(base: str, model: str, call: Call, timeout: float) -> Result:
    """Send one call as its kind's client does; never raises."""
    res = Result(call.index, sent=time.perf_counter())
    try:
        if call.action == "garbage":
            _garbage(base, model, call, res, timeout)
        elif call.kind == "messages":
            _messages(base, model, call, res, timeout)
        else:
            _openai(base, model, call, res, timeout)
    except (openai.APIStatusError, anthropic.APIStatusError) as e:
        res.status, res.error = e.status_code, str(e)[:300]
    except Exception as e:  # noqa: BLE001  (a client error: the call has no answer)
        res.error = f"{type(e).__name__}: {e}"[:300]
    if res.status is not None:
        res.ended = time.perf_counter()
    return res


def _garbage(base: str, model: str, call: Call, res: Result, timeout: float) -> None:
    method, path, body, _ = GARBAGE[call.garbage]
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).replace('"MODEL"', json.dumps(model)).encode()
    r = httpx.request(method, base + path, content=body, timeout=timeout,
                      headers={"content-type": "application/json", "anthropic-version": "2023-06-01"}
                      if path.startswith("/v1/messages") else {"content-type": "application/json"})
    res.status, res.text = r.status_code, r.text[:300]


def _openai(base: str, model: str, call: Call, res: Result, timeout: float) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="stress", max_retries=0, timeout=timeout)
    text, common = call.text(), {"model": model, "temperature": 0.0, "stream": call.stream}
    usage = {"stream_options": {"include_usage": True}} if call.stream else {}
    if call.kind == "chat":
        out = client.chat.completions.create(messages=[{"role": "user", "content": text}], max_tokens=call.max_tokens,
                                             **common, **usage)
    elif call.kind == "completion":
        out = client.completions.create(prompt=text, max_tokens=call.max_tokens, **common, **usage)
    else:
        out = client.responses.create(input=text, max_output_tokens=call.max_tokens, **common)
    if not call.stream:
        res.status = 200
        if call.kind == "responses":
            res.text, usage = out.output_text, out.usage
            res.prompt_tokens, res.completion_tokens = usage.input_tokens, usage.output_tokens
        else:
            res.text = out.choices[0].message.content if call.kind == "chat" else out.choices[0].text
            res.prompt_tokens, res.completion_tokens = out.usage.prompt_tokens, out.usage.completion_tokens
        return
    pieces = []
    with out, _deadline(out, timeout):
        for event in out:
            piece, usage = _openai_event(call.kind, event)
            if usage is not None:
                res.prompt_tokens, res.completion_tokens = usage
            if piece:
                pieces.append(piece)
                if call.action == "cancel":
                    res.cancelled = True
                    break
    res.status, res.text = 200, "".join(pieces)


@contextmanager
def _deadline(stream, seconds: float) -> Iterator[None]:
    """Close `stream` from another thread once `seconds` have passed, and raise TimeoutError then: the SDKs'
    timeouts are per read, and a stream fed only keep-alives (a stalled request) would be read forever."""
    fired = threading.Event()
    timer = threading.Timer(seconds, lambda: (fired.set(), stream.close()))
    timer.start()
    try:
        yield
    except Exception:
        if not fired.is_set():
            raise
    finally:
        timer.cancel()
    if fired.is_set():
        raise TimeoutError(f"no answer within {seconds:g} s")


def _openai_event(kind: str, event) -> tuple[str, tuple[int, int] | None]:
    """(text in a streamed event, (prompt, completion) tokens if it reports usage)."""
    if kind == "responses":
        if event.type == "response.output_text.delta":
            return event.delta, None
        if event.type in ("response.completed", "response.incomplete"):  # (incomplete: it ran to max_output_tokens)
            u = event.response.usage
            return "", (u.input_tokens, u.output_tokens)
        return "", None
    usage = (event.usage.prompt_tokens, event.usage.completion_tokens) if event.usage else None
    if not event.choices:
        return "", usage
    c = event.choices[0]
    return (c.delta.content if kind == "chat" else c.text) or "", usage


def _messages(base: str, model: str, call: Call, res: Result, timeout: float) -> None:
    client = anthropic.Anthropic(base_url=base, api_key="stress", max_retries=0, timeout=timeout)
    args = {"model": model, "max_tokens": call.max_tokens, "extra_body": {"temperature": 0.0},  # (not in this SDK)
            "messages": [{"role": "user", "content": call.text()}]}
    if not call.stream:
        out = client.messages.create(**args)
        res.status = 200
        res.text = "".join(b.text for b in out.content if b.type == "text")
        res.prompt_tokens, res.completion_tokens = out.usage.input_tokens, out.usage.output_tokens
        return
    pieces = []
    with client.messages.stream(**args) as stream, _deadline(stream, timeout):
        for piece in stream.text_stream:
            pieces.append(piece)
            if piece and call.action == "cancel":
                res.cancelled = True
                break
        if not res.cancelled:
            usage = stream.get_final_message().usage
            res.prompt_tokens, res.completion_tokens = usage.input_tokens, usage.output_tokens
    res.status, res.text = 200, "".join(pieces)


def solo(server: Server, calls: list[Call], timeout: float = 900.0) -> dict[int, Result]:
    """Every call that reaches the model, sent alone (a cancel in full: its whole work is what it could cost)."""
    out = {}
    for c in calls:
        if c.action != "garbage":
            whole = Call(**{**asdict(c), "action": "answer"})
            out[c.index] = send(server.url, server.model, whole, timeout)
    return out


def storm(server: Server, calls: list[Call], timeout: float) -> dict[int, Result]:
    """Each client's calls in order, every client at once; a call still open at `timeout` has no answer."""
    by_client: dict[int, list[Call]] = {}
    for c in calls:
        by_client.setdefault(c.client, []).append(c)
    out: dict[int, Result] = {}

    def client(mine: list[Call]) -> None:
        for c in mine:
            time.sleep(c.gap)
            out[c.index] = send(server.url, server.model, c, timeout)

    threads = [threading.Thread(target=client, args=(mine,), daemon=True) for mine in by_client.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
