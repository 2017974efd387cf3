"""`hetero serve` stopping on SIGTERM / SIGINT while a long reply streams (hetero/server/stopping.py): a real server
process on loopback, real SDK clients streaming from the bundled model with EOS suppressed (logit_bias), a real
signal. The client must see a final event in its API's shape, the process must be gone within 5 s, and a server
restarted on the same session cache must serve what a cold server would."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest

ROOT = Path(__file__).resolve().parents[1]
NO_EOS = {"0": -100, "2": -100}  # the bundled model's EOS ids: the reply runs to max_tokens
LONG = 30000
EXIT_S = 5.0
LONG_PROMPT = "the quick brown fox jumps over the lazy dog. " * 250  # ~2.5K tokens: seconds of prefill on a CPU


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`hetero serve` on the bundled model in a subprocess, on a free loopback port, with `session` as its cache."""

    def __init__(self, session: Path):
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "hetero", "serve", "--port", str(self.port),
                                      "--session-cache", str(session)], cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        self.kill()
        raise AssertionError("hetero serve was not healthy within 120 s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0)

    def wait(self, after: float) -> float:
        """Seconds from `after` (a monotonic time) until the process is gone (at most 15)."""
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("hetero serve still running 15 s after the signal") from None
        return time.monotonic() - after

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def session(tmp_path) -> Path:
    return tmp_path / "sessions"


def openai_chat(server: Server, seen: list) -> None:
    stream = server.openai().chat.completions.create(
        model="bundled", messages=[{"role": "user", "content": "Tell me a long story"}], max_tokens=LONG,
        stream=True, logit_bias=NO_EOS)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            seen.append(chunk.choices[0].delta.content)


def anthropic_prefilling(server: Server, seen: list) -> None:
    """A long prompt (~2.5K tokens: seconds of prefill on this CPU), signalled while it prefills: the stream has
    begun (message_start, appended as 20 markers) and no token is out yet (Anthropic has no logit_bias to hold
    EOS back, so the stop is tested where it cuts a prefill)."""
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    with client.messages.stream(model="bundled", max_tokens=LONG,
                                messages=[{"role": "user", "content": LONG_PROMPT}]) as stream:
        for event in stream:
            seen.extend(["<start>"] * 20 if event.type == "message_start" else [])


class Failed(Exception):
    """A Responses stream's final `response.failed` event (the SDK yields it instead of raising)."""


def responses_prefilling(server: Server, seen: list) -> None:
    """As `anthropic_prefilling`, through the Responses API (it has no logit_bias either)."""
    stream = server.openai().responses.create(model="bundled", input=LONG_PROMPT, max_output_tokens=LONG, stream=True)
    for event in stream:
        seen.extend(["<start>"] * 20 if event.type == "response.created" else [])
        if event.type == "response.failed":
            raise Failed(event.response.error.message)


def stream_then_signal(server: Server, client, signals: list[int]) -> tuple[float, list[str], BaseException | None]:
    """Stream a long reply with `client`; once 20 pieces are in, send `signals` (back to back). Returns the seconds
    from the first signal to the process's exit, the text seen, and what the client raised at the end."""
    seen: list[str] = []
    raised: list[BaseException | None] = [None]

    def run() -> None:
        try:
            client(server, seen)
        except BaseException as e:  # noqa: BLE001 (what the client raised is the test's subject)
            raised[0] = e

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while len(seen) < 20 and reader.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(seen) >= 20, f"the stream did not get going: {raised[0]!r}"
    t0 = time.monotonic()
    for sig in signals:
        server.proc.send_signal(sig)
    took = server.wait(t0)
    reader.join(10)
    assert not reader.is_alive(), "the client still waits after the server exited"
    return took, seen, raised[0]


@pytest.mark.parametrize("sig, client, error", [
    (signal.SIGTERM, openai_chat, openai.APIError),
    (signal.SIGINT, anthropic_prefilling, anthropic.APIStatusError),
    (signal.SIGTERM, responses_prefilling, Failed),
], ids=["sigterm-chat", "sigint-anthropic-prefill", "sigterm-responses-prefill"])
def test_signal_ends_stream_with_an_error_event_and_exits_within_5s(session, sig, client, error):
    server = Server(session)
    try:
        took, seen, raised = stream_then_signal(server, client, [sig])
    finally:
        server.kill()
    assert took < EXIT_S, f"exited {took:.1f} s after {sig.name}"
    assert server.proc.returncode == 0, server.proc.stdout.read()
    # the SDK raised on the stream's final error event (a cut socket is an APIConnectionError / a parse error)
    assert isinstance(raised, error) and not isinstance(raised, (openai.APIConnectionError,
                                                                 anthropic.APIConnectionError)), repr(raised)
    assert "shutting down" in str(raised)
    assert len(seen) < LONG
    assert "Traceback" not in server.proc.stdout.read()


def test_second_signal_exits_at_once(session):
    """The first SIGTERM starts the graceful stop; a request whose body is still arriving holds that stop open
    (uvicorn waits for every request in flight, here until the grace period's exit at 4 s), so the SIGINT sent once
    the stop has begun meets a stopping server: it must end the process at once with its own status. (Signals sent
    back to back raced: a stop that finished first left nothing for the second to do.)"""
    server = Server(session)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(server.proc.stdout), daemon=True).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as held:
            held.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{")  # 1 of 1000 bytes: the request stays in flight
            time.sleep(0.5)  # the server has taken the request in
            server.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while not any("SIGTERM: stopping" in line for line in lines) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert any("SIGTERM: stopping" in line for line in lines), lines
            assert server.proc.poll() is None  # still stopping: the held request keeps it open
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGINT)
            took = server.wait(t0)
            held.settimeout(5)
            try:  # the socket went away with the process: the client is not left waiting
                assert held.recv(1) == b""
            except ConnectionResetError:
                pass
    finally:
        server.kill()
    assert took < 1.0, f"exited {took:.1f} s after the second signal"
    assert server.proc.returncode == 128 + signal.SIGINT, lines
    time.sleep(0.2)  # the reader thread takes in the last line
    assert any("SIGINT again: exiting now" in line for line in lines), lines


def test_restart_on_the_same_session_cache_serves_fresh_state(session):
    chat = dict(model="bundled", max_tokens=12, logit_bias=NO_EOS, temperature=0)
    finished = [{"role": "user", "content": "What is the capital of France? Answer briefly, please."}]
    server = Server(session)
    try:
        cold = server.openai().chat.completions.create(messages=finished, **chat)  # an empty cache: computed
        _, seen, raised = stream_then_signal(server, openai_chat, [signal.SIGTERM])
    finally:
        server.kill()
    assert isinstance(raised, openai.APIError)
    leftovers = [p.name for p in session.rglob("*") if ".tmp." in p.name]
    assert leftovers == []  # nothing half-written
    manifests = list(session.rglob("*.json"))
    assert manifests and all(json.loads(m.read_text())["n"] > 0 for m in manifests)

    again = Server(session)
    try:
        warm = again.openai().chat.completions.create(messages=finished, **chat)
        resumed = again.openai().chat.completions.create(
            messages=[{"role": "user", "content": "Tell me a long story"}], **chat)
    finally:
        again.proc.send_signal(signal.SIGTERM)
        again.wait(time.monotonic())
    assert warm.usage.prompt_tokens_details.cached_tokens > 0  # the finished turn's checkpoint came from disk
    assert warm.choices[0].message.content == cold.choices[0].message.content
    # the interrupted prompt, greedy again: the start of what the interrupted stream had sent
    assert "".join(seen).startswith(resumed.choices[0].message.content)


def test_a_first_use_export_stops_between_programs(tmp_path, monkeypatch):
    """A split server's first prompt exports its Core ML programs (minutes for a large model). The server's stop
    ends that export after the program being written (the job gets the 503 shutting-down error, so its stream ends
    with a final event), and the unfinished export, which has no manifest, is never read: the next start exports
    it whole."""
    import hetero
    from hetero.coreml.manifest import MANIFEST
    from hetero.pipeline import configure
    from hetero.server.requests import RequestError
    from hetero.server.runner import JobSplit, Runner

    monkeypatch.setenv("HETERO_HOME", str(tmp_path))
    engine = hetero.load()
    ids = engine.encode_prompt(LONG_PROMPT[:400], False)
    runner = Runner(engine, split=configure(engine, 0.5, 64))
    written = []
    real = runner.refuse_if_stopping

    def stop_after_two() -> None:  # the signal arrives while the second program is written
        written.append(1)
        if len(written) == 2:
            runner.stop()
        real()

    monkeypatch.setattr(runner, "refuse_if_stopping", stop_after_two)
    with pytest.raises(RequestError) as stopped:
        JobSplit(runner, object()).prefill(ids)
    assert stopped.value.status == 503 and len(written) == 2
    assert not list(tmp_path.rglob(MANIFEST))
    fresh = configure(engine, 0.5, 64)
    fresh.prepare(ids)
    (manifest,) = tmp_path.rglob(MANIFEST)
    assert len(json.loads(manifest.read_text())["programs"]) > 2
