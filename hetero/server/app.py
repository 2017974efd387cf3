"""OpenAI- and Anthropic-compatible HTTP server (Starlette on uvicorn) over one `Engine`.

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/messages (Anthropic), GET /v1/models, GET /health.
Up to `max_concurrent` requests generate at once, each on its own worker thread, taking round-robin turns on the
model (`hetero.turns`): one prefill chunk or one decode token per turn, so a new request starts while others
decode and none starves. With a split (`hetero serve --ane-fraction F`), one prompt at a time prefills through
the ANE + GPU pipeline, whose GPU lane lends its turn to the other requests while the ANE computes its share
(prompts arriving meanwhile prefill GPU-only). A client that disconnects cancels its generation; a bad request
gets a 4xx JSON error that names the field. Every response reports cached prompt tokens (OpenAI `usage.prompt_tokens_details.cached_tokens`,
Anthropic `usage.cache_read_input_tokens`) and engine stats in a `hetero` field.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hetero.engine import Engine
from hetero.errors import HeteroError, internal_error
from hetero.turns import LentTurns, Turns
from hetero.validate import FRACTION, MIN_P, NONNEG_INT, POSITIVE_INT, SEED, TOP_K, TOP_P, Bound

log = logging.getLogger("hetero.server")

MAX_STOPS = 16
MAX_JSON_DEPTH = 64  # deeper request bodies are refused; real ones nest a few levels (tool inputs a few more)
OPENAI_TEMPERATURE = Bound(0, 2)  # the APIs' documented ranges, inside the engine's own (finite, >= 0)
ANTHROPIC_TEMPERATURE = Bound(0, 1)


class RequestError(Exception):
    """A client mistake: HTTP `status`, one-line `message`, the offending field as `param`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class Cancelled(Exception):
    """The client went away; the generation stops where it is."""


@dataclass
class Started:
    """Streamed once, when the prefill begins: how many prompt tokens came from the prefix cache."""

    cached_tokens: int


# ----------------------------------------------------------------------------------------------------------
# Stop strings


class StopMatcher:
    """Cuts streamed text exactly where the first stop string begins; never emits any part of it.

    Text that could be the start of a stop string (a suffix of the text so far that is a prefix of a stop) is
    held back until the next piece decides, so stops that span token boundaries are still found.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped: str | None = None  # the stop string that matched

    def feed(self, piece: str) -> str:
        """Add generated text; returns what may be emitted now."""
        if self.stopped is not None:
            return ""
        self.held += piece
        hits = [(self.held.find(s), s) for s in self.stops if s in self.held]
        at = min(hits)[0] if hits else len(self.held)
        pending = self._pending(at)  # a stop that begins earlier may still complete: it would win
        if hits and pending is None:
            return self._cut(*min(hits))
        keep = at if pending is None else pending
        out, self.held = self.held[:keep], self.held[keep:]
        return out

    def flush(self) -> str:
        """The held-back text once generation has ended (up to the first stop string in it)."""
        if self.stopped is not None:
            return ""
        hits = [(self.held.find(s), s) for s in self.stops if s in self.held]
        if hits:
            return self._cut(*min(hits))
        out, self.held = self.held, ""
        return out

    def _pending(self, limit: int) -> int | None:
        """The first position before `limit` from which the held text is a proper prefix of a stop string."""
        for q in range(max(0, len(self.held) - max((len(s) for s in self.stops), default=0) + 1), limit):
            tail = self.held[q:]
            if any(len(tail) < len(s) and s.startswith(tail) for s in self.stops):
                return q
        return None

    def _cut(self, at: int, stop: str) -> str:
        self.stopped = stop
        out, self.held = self.held[:at], ""
        return out


# ----------------------------------------------------------------------------------------------------------
# Request parsing


@dataclass
class Job:
    """One validated generation request, independent of the API it came through."""

    ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stops: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    mtp: bool | None = None
    ane_fraction: float | None = None  # 0: this request prefills GPU-only; None: as the server is configured


def _number(body: dict, name: str, default: float, bound: Bound) -> float:
    """A number field within `bound` (absent or null: `default`)."""
    return float(_value(body, name, default, bound))


def _integer(body: dict, name: str, default: int | None, bound: Bound = NONNEG_INT) -> int | None:
    """An integer field within `bound` (an integer Bound; absent or null: `default`)."""
    return _value(body, name, default, bound)


def _value(body: dict, name: str, default, bound: Bound):
    v = body.get(name, default)
    if v is None:
        return default
    why = bound.problem(v)
    if why is not None:
        raise RequestError(400, f"'{name}' {why}", name)
    return v


def _boolean(body: dict, name: str, default: bool | None) -> bool | None:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(400, f"'{name}' must be true or false, got {type(v).__name__}", name)
    return v


def _stops(body: dict, name: str) -> list[str]:
    v = body.get(name)
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or len(v) > MAX_STOPS:
        raise RequestError(400, f"'{name}' must be a non-empty string or a list of at most {MAX_STOPS} of them", name)
    return v


def _text(content, where: str) -> str:
    """Message content (a string, or a list of parts / Anthropic blocks) -> plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(400, f"'{where}' must be a string or a list of content parts", where)
    out = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise RequestError(400, f"'{where}[{i}]' must be an object with a 'type'", f"{where}[{i}]")
        kind = part["type"]
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise RequestError(400, f"'{where}[{i}].text' must be a string", f"{where}[{i}].text")
            out.append(part["text"])
        elif kind == "tool_result":  # Anthropic: the tool's output, as text
            out.append(_text(part.get("content"), f"{where}[{i}].content"))
        elif kind == "tool_use":
            out.append(json.dumps({"name": part.get("name"), "input": part.get("input")}))
        else:
            raise RequestError(400, f"'{where}[{i}].type' {kind!r} is not supported (text only)", f"{where}[{i}].type")
    return "".join(out)


def _messages(body: dict, roles: set[str]) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RequestError(400, f"'messages[{i}]' must be an object", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in roles:
            raise RequestError(400, f"'messages[{i}].role' must be one of {sorted(roles)}, got {role!r}", f"messages[{i}].role")
        out.append({"role": role, "content": _text(m.get("content"), f"messages[{i}].content")})
    return out


def parse_body(raw: bytes) -> dict:
    """A request body -> its JSON object, refusing what no engine should see: bad JSON, NaN/Infinity, nesting
    deeper than MAX_JSON_DEPTH, strings that are not valid Unicode (lone surrogates)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise RequestError(400, f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)", None,
                           "invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and ints longer than Python parses
        raise RequestError(400, f"the request body is not valid JSON ({e})", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object", None)
    _check_tree(body)
    return body


def _no_constant(name: str):
    raise RequestError(400, f"the request body is not valid JSON: {name} is not a JSON number", None, "invalid_json")


def _check_tree(body: dict) -> None:
    """Walk the parsed body (iteratively: no recursion limit to hit) for depth and for unencodable strings."""
    stack = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestError(400, f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)", None,
                               "invalid_json")
        if isinstance(value, str):
            _check_unicode(value, path or "body")
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_unicode(k, f"a key in {path or 'the body'}")
                stack.append((v, f"{path}.{k}" if path else k, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


def _check_unicode(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(400, f"'{where}' is not valid Unicode: it holds a lone surrogate ({text[e.start]!a}) at "
                           f"character {e.start}; send UTF-8 text", where) from None


class Parser:
    """Turns request bodies into Jobs for one engine (its name, tokenizer and context window)."""

    def __init__(self, engine: Engine, model_names: set[str], split_fraction: float = 0.0):
        self.engine = engine
        self.model_names = model_names
        self.split_fraction = split_fraction  # the server's --ane-fraction (0: GPU-only)

    def model(self, body: dict) -> None:
        name = body.get("model")
        if not isinstance(name, str):
            raise RequestError(400, "'model' is required and must be a string", "model")
        if name not in self.model_names:
            raise RequestError(404, f"model {name!r} is not served here; GET /v1/models lists {sorted(self.model_names)}",
                               "model", "model_not_found")

    def encode(self, prompt: str | list[int], param: str) -> list[int]:
        try:
            ids = self.engine.encode_prompt(prompt)
        except HeteroError as e:
            code = "context_length_exceeded" if "context window" in str(e) else None
            raise RequestError(400, str(e), param, code) from None
        return ids

    def common(self, body: dict, ids: list[int], max_name: str, required_max: bool = False) -> Job:
        fraction = None
        if body.get("ane_fraction") is not None:
            fraction = _number(body, "ane_fraction", 0.0, FRACTION)
            served = self.split_fraction
            if fraction not in (0.0, served):
                how = f"{served:g} (its --ane-fraction)" if served else "0 (start it with --ane-fraction F to split)"
                raise RequestError(400, f"'ane_fraction' {fraction:g}: this server splits prefill at {how}; send that, "
                                   "0 for GPU-only, or leave it out", "ane_fraction")
        room = self.engine.max_context - len(ids)
        if required_max and body.get(max_name) is None:
            raise RequestError(400, f"'{max_name}' is required", max_name)
        max_tokens = _integer(body, max_name, room, POSITIVE_INT)
        mtp = _boolean(body, "mtp", None)
        if mtp and not self.engine.model.has_mtp:
            raise RequestError(400, "'mtp': this model has no MTP head", "mtp")
        return Job(
            ids=ids, max_tokens=min(max_tokens, room), temperature=_number(body, "temperature", 0.0, OPENAI_TEMPERATURE),
            top_p=_number(body, "top_p", 1.0, TOP_P), top_k=_integer(body, "top_k", 0, TOP_K),
            min_p=_number(body, "min_p", 0.0, MIN_P), seed=_integer(body, "seed", None, SEED),
            stream=bool(_boolean(body, "stream", False)), mtp=mtp, ane_fraction=fraction,
        )

    def openai_chat(self, body: dict) -> Job:
        self.model(body)
        messages = _messages(body, {"system", "developer", "user", "assistant", "tool"})
        for m in messages:
            m["role"] = "system" if m["role"] == "developer" else m["role"]
        if _integer(body, "n", 1, POSITIVE_INT) != 1:
            raise RequestError(400, "'n' must be 1: one choice per request", "n")
        try:
            text = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except HeteroError as e:
            raise RequestError(400, str(e), "messages") from None
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        job = self.common(body, self.encode(text, "messages"), name)
        job.stops = _stops(body, "stop")
        self._stream_options(body, job)
        return job

    def openai_completion(self, body: dict) -> Job:
        self.model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestError(400, "'prompt' must be a string, a list with one string, or a list of token ids", "prompt")
        if not isinstance(prompt, (str, list)):
            raise RequestError(400, "'prompt' is required: a string or a list of token ids", "prompt")
        if _integer(body, "n", 1, POSITIVE_INT) != 1:
            raise RequestError(400, "'n' must be 1: one choice per request", "n")
        job = self.common(body, self.encode(prompt, "prompt"), "max_tokens")
        job.stops = _stops(body, "stop")
        self._stream_options(body, job)
        return job

    def anthropic(self, body: dict) -> Job:
        self.model(body)
        messages = _messages(body, {"user", "assistant"})
        system = body.get("system")
        if system is not None:
            messages.insert(0, {"role": "system", "content": _text(system, "system")})
        try:
            text = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except HeteroError as e:
            raise RequestError(400, str(e), "messages") from None
        job = self.common(body, self.encode(text, "messages"), "max_tokens", required_max=True)
        job.temperature = _number(body, "temperature", 0.0, ANTHROPIC_TEMPERATURE)
        job.stops = _stops(body, "stop_sequences")
        return job

    @staticmethod
    def _stream_options(body: dict, job: Job) -> None:
        opts = body.get("stream_options")
        if opts is None:
            return
        if not isinstance(opts, dict):
            raise RequestError(400, "'stream_options' must be an object", "stream_options")
        job.include_usage = bool(_boolean(opts, "include_usage", False))


# ----------------------------------------------------------------------------------------------------------
# Running jobs


@dataclass
class Outcome:
    """What a finished job reports to every API's formatter."""

    text: str
    stats: dict
    stop: str | None  # the stop string that ended it
    finish: str  # "stop" (EOS or a stop string) or "length"

    @property
    def usage(self) -> tuple[int, int, int]:
        """(prompt tokens, cached prompt tokens, completion tokens)."""
        s = self.stats
        return s["prompt_tokens"], s["cached_tokens"], s["generated_tokens"]


class Runner:
    """Runs up to `max_concurrent` jobs at once, each on a worker thread, taking round-robin turns on the model."""

    def __init__(self, engine: Engine, split=None, max_concurrent: int = 4, prefill_chunk: int = 512):
        if max_concurrent < 1:
            raise HeteroError(f"--max-concurrent must be at least 1, got {max_concurrent}")
        self.engine, self.split = engine, split  # split: a configured `hetero.pipeline.PipelineRun` or None
        self.prefill_chunk = prefill_chunk
        self.pool = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="hetero-gen")
        self.turns = Turns()
        self._split_free = threading.Lock()  # one prompt at a time goes through the ANE + GPU split
        self.finished = 0
        self.cancelled = 0  # jobs stopped because their client went away
        self.split_prefills = 0

    def run(self, job: Job, emit: Callable[[str | Started], None], cancelled: threading.Event) -> Outcome:
        """In a worker thread: wait for a turn, generate, pass text through the stop matcher to `emit`."""
        ticket = object()
        self.turns.enter(ticket)
        try:
            outcome = self._run(job, emit, cancelled, ticket)
        except Cancelled:
            self.cancelled += 1
            raise
        finally:
            self.turns.leave(ticket)
        self.finished += 1
        return outcome

    def _prefill_with(self, job: Job, ticket: object):
        """The split prefill for this job when the server has one, the job did not opt out and it is free."""
        if self.split is None or job.ane_fraction == 0.0:
            return None

        def split_prefill(ids: list[int]):
            if not self._split_free.acquire(blocking=False):  # another prompt is in the split: GPU-only
                return self.engine.model.make_cache(), 0, None
            try:
                self.split.prepare(ids)
                out = self.split.prefill_with(ids, decode=LentTurns(self.turns, ticket))
                self.split_prefills += 1
                return out
            finally:
                self._split_free.release()

        return split_prefill

    def _run(self, job: Job, emit: Callable[[str | Started], None], cancelled: threading.Event, ticket: object) -> Outcome:
        if cancelled.is_set():
            raise Cancelled()
        matcher = StopMatcher(job.stops)
        parts: list[str] = []
        started = []

        def on_text(piece: str) -> None:
            out = matcher.feed(piece)
            if out:
                parts.append(out)
                emit(out)

        def progress(done: int, total: int) -> None:
            if not started:  # the prefill covers only what the prefix cache did not restore
                started.append(True)
                emit(Started(len(job.ids) - total))
            if cancelled.is_set():
                raise Cancelled()
            self.turns.pass_turn(ticket)  # after every prefill chunk

        def should_stop() -> bool:
            self.turns.pass_turn(ticket)  # after every token
            return matcher.stopped is not None or cancelled.is_set()

        result = self.engine.generate(
            job.ids, max_tokens=job.max_tokens, temperature=job.temperature, top_k=job.top_k, top_p=job.top_p,
            min_p=job.min_p, seed=job.seed, mtp=job.mtp, prefill_chunk=self.prefill_chunk, on_text=on_text, progress=progress,
            should_stop=should_stop, prefill_with=self._prefill_with(job, ticket),
        )
        if cancelled.is_set():
            raise Cancelled()  # cut short by the client, not finished
        tail = matcher.flush()
        if tail:
            parts.append(tail)
            emit(tail)
        finish = "stop" if matcher.stopped is not None else result.stats["finish_reason"]
        stats = {k: v for k, v in result.stats.items() if k != "model"}
        return Outcome("".join(parts), stats, matcher.stopped, finish)

    async def complete(self, job: Job, request: Request) -> Outcome:
        """Run to the end; a client that disconnects meanwhile cancels the job."""
        cancelled = threading.Event()
        fut = asyncio.wrap_future(self.pool.submit(self.run, job, lambda _: None, cancelled))
        while not fut.done():
            await asyncio.wait([fut], timeout=0.25)
            if not fut.done() and await request.is_disconnected():
                cancelled.set()
        return fut.result()

    async def stream(self, job: Job) -> AsyncIterator[str | Started | Outcome]:
        """Started, text pieces as they come, then the Outcome; closing the iterator (client gone) cancels the job."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def emit(piece: str | Started) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, piece)

        fut = self.pool.submit(self.run, job, emit, cancelled)
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(queue.put_nowait, f))
        try:
            while True:
                item = await queue.get()
                if isinstance(item, (str, Started)):
                    yield item
                    continue
                yield item.result()
                return
        finally:
            cancelled.set()

    async def stream_started(self, job: Job, request: Request) -> AsyncIterator[str | Started | Outcome] | None:
        """`stream(job)` once its first item is in, so that a job failing before it generates anything fails
        before the response's first byte (a 4xx/5xx, not a 200 that breaks off). None: the client went away."""
        items = self.stream(job)
        first = asyncio.ensure_future(items.__anext__())
        while not first.done():
            await asyncio.wait([first], timeout=0.25)
            if not first.done() and await request.is_disconnected():
                first.cancel()  # closes the stream, which cancels the job
                await asyncio.wait([first])
                return None
        head = first.result()  # the job's own exception, when it failed first

        async def chained() -> AsyncIterator[str | Started | Outcome]:
            try:
                yield head
                async for item in items:
                    yield item
            finally:
                await items.aclose()  # now, not at garbage collection: closing the stream is what cancels the job

        return chained()


# ----------------------------------------------------------------------------------------------------------
# HTTP


def _failure(e: Exception, rid: str) -> RequestError:
    """What a failed generation tells the client: a HeteroError is the request's fault (400), anything else a
    bug (500, logged with its traceback under the request id)."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, HeteroError):
        return RequestError(400, str(e))
    log.error("request %s failed", rid, exc_info=e)
    return RequestError(500, f"internal error in request {rid}: {internal_error(e)} (the server log has the traceback)",
                        None, "internal_error")


def _openai_error(e: RequestError) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(e.status, "invalid_request_error")
    kind = "server_error" if e.status >= 500 else kind
    return JSONResponse({"error": {"message": e.message, "type": kind, "param": e.param, "code": e.code}},
                        status_code=e.status)


def _anthropic_error(e: RequestError) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(e.status, "invalid_request_error")
    kind = "api_error" if e.status >= 500 else kind
    message = e.message if e.param is None or e.param in e.message else f"{e.param}: {e.message}"
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=e.status)


async def _unhandled(request: Request, e: Exception) -> Response:
    """Starlette's last resort: a JSON 500 in the API's own error shape, naming a request id for the log."""
    failure = _failure(e, "req_" + uuid.uuid4().hex[:24])
    return _anthropic_error(failure) if request.url.path.startswith("/v1/messages") else _openai_error(failure)


def _sse(data: dict, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n"


def _openai_usage(o: Outcome) -> dict:
    prompt, cached, completion = o.usage
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _anthropic_usage(o: Outcome) -> dict:
    prompt, cached, completion = o.usage
    # Anthropic convention: input_tokens counts only the prompt tokens that were not read from the cache
    return {"input_tokens": prompt - cached, "output_tokens": completion, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def _anthropic_stop(o: Outcome) -> str:
    return "stop_sequence" if o.stop is not None else ("end_turn" if o.finish == "stop" else "max_tokens")


def create_app(
    engine: Engine, api_key: str | None = None, model_names: set[str] | None = None, split=None, max_concurrent: int = 4,
    prefill_chunk: int = 512,
) -> Starlette:
    """The ASGI app serving `engine`; with `api_key`, /v1 routes need `Authorization: Bearer KEY` or `x-api-key`.

    `split` (a `hetero.pipeline.PipelineRun`) prefills prompts through the ANE + GPU pipeline; up to
    `max_concurrent` requests generate at once, taking turns on the model.
    """
    names = model_names or {engine.name}
    runner = Runner(engine, split, max_concurrent, prefill_chunk)
    parser = Parser(engine, names, split.requested_fraction if split is not None else 0.0)
    primary = sorted(names)[0]

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
        if given != api_key:
            raise RequestError(401, "missing or wrong API key (send Authorization: Bearer KEY)", None, "invalid_api_key")

    async def body_of(request: Request) -> dict:
        check_key(request)
        return parse_body(await request.body())

    async def started(job: Job, request: Request, error: Callable[[Exception], Response]) -> AsyncIterator | Response:
        """A stream's items once its job has started, or the response to send instead: `error(e)` when it failed
        before its first byte, 499 when the client left."""
        try:
            items = await runner.stream_started(job, request)
        except Exception as e:
            return error(e)
        return Response(status_code=499) if items is None else items

    async def chat_completions(request: Request) -> Response:
        try:
            job = parser.openai_chat(await body_of(request))
        except RequestError as e:
            return _openai_error(e)
        return await _openai(request, job, chat=True)

    async def completions(request: Request) -> Response:
        try:
            job = parser.openai_completion(await body_of(request))
        except RequestError as e:
            return _openai_error(e)
        return await _openai(request, job, chat=False)

    async def _openai(request: Request, job: Job, chat: bool) -> Response:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not job.stream:
            try:
                o = await runner.complete(job, request)
            except Cancelled:
                return Response(status_code=499)
            except Exception as e:
                return _openai_error(_failure(e, rid))
            choice = ({"index": 0, "message": {"role": "assistant", "content": o.text}, "finish_reason": o.finish,
                       "logprobs": None} if chat else
                      {"index": 0, "text": o.text, "finish_reason": o.finish, "logprobs": None})
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": primary,
                                 "choices": [choice], "usage": _openai_usage(o), "hetero": o.stats})

        def chunk(delta: str | None, finish: str | None = None, role: bool = False) -> dict:
            if chat:
                d = ({"role": "assistant", "content": ""} if role else {"content": delta}) if finish is None else {}
                c = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
            else:
                c = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            return {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created, "model": primary,
                    "choices": [c]}

        items = await started(job, request, lambda e: _openai_error(_failure(e, rid)))
        if isinstance(items, Response):
            return items

        async def events() -> AsyncIterator[str]:
            if chat:
                yield _sse(chunk(None, role=True))
            try:
                async for item in items:
                    if isinstance(item, Started):
                        continue
                    if isinstance(item, str):
                        yield _sse(chunk(item))
                        continue
                    last = chunk(None, item.finish)
                    last["hetero"] = item.stats
                    yield _sse(last)
                    if job.include_usage:
                        yield _sse({"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                                    "model": primary, "choices": [], "usage": _openai_usage(item)})
            except Exception as e:  # headers are sent: the error travels as an event (the SDKs raise on it)
                yield _sse(json.loads(bytes(_openai_error(_failure(e, rid)).body)))
                return
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def messages(request: Request) -> Response:
        try:
            job = parser.anthropic(await body_of(request))
        except RequestError as e:
            return _anthropic_error(e)
        mid = "msg_" + uuid.uuid4().hex[:24]
        if not job.stream:
            try:
                o = await runner.complete(job, request)
            except Cancelled:
                return Response(status_code=499)
            except Exception as e:
                return _anthropic_error(_failure(e, mid))
            return JSONResponse({
                "id": mid, "type": "message", "role": "assistant", "model": primary,
                "content": [{"type": "text", "text": o.text}], "stop_reason": _anthropic_stop(o),
                "stop_sequence": o.stop, "usage": _anthropic_usage(o), "hetero": o.stats,
            })

        items = await started(job, request, lambda e: _anthropic_error(_failure(e, mid)))
        if isinstance(items, Response):
            return items

        async def events() -> AsyncIterator[str]:
            try:
                async for event in anthropic_events():
                    yield event
            except Exception as e:  # headers are sent: Anthropic's stream carries errors as an `error` event
                yield _sse(json.loads(bytes(_anthropic_error(_failure(e, mid)).body)), "error")

        async def anthropic_events() -> AsyncIterator[str]:
            async for item in items:
                if isinstance(item, Started):  # message_start waits for the restore to report cached tokens
                    cached = item.cached_tokens
                    yield _sse({"type": "message_start", "message": {
                        "id": mid, "type": "message", "role": "assistant", "model": primary, "content": [],
                        "stop_reason": None, "stop_sequence": None,
                        "usage": {"input_tokens": len(job.ids) - cached, "output_tokens": 0,
                                  "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}}},
                        "message_start")
                    yield _sse({"type": "content_block_start", "index": 0,
                                "content_block": {"type": "text", "text": ""}}, "content_block_start")
                    yield _sse({"type": "ping"}, "ping")
                elif isinstance(item, str):
                    yield _sse({"type": "content_block_delta", "index": 0,
                                "delta": {"type": "text_delta", "text": item}}, "content_block_delta")
                else:
                    yield _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
                    yield _sse({"type": "message_delta",
                                "delta": {"stop_reason": _anthropic_stop(item), "stop_sequence": item.stop},
                                "usage": _anthropic_usage(item), "hetero": item.stats}, "message_delta")
                    yield _sse({"type": "message_stop"}, "message_stop")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request: Request) -> Response:
        try:
            check_key(request)
        except RequestError as e:
            return _openai_error(e)
        return JSONResponse({"object": "list", "data": [
            {"id": n, "object": "model", "created": 0, "owned_by": "hetero"} for n in sorted(names)]})

    async def health(request: Request) -> Response:
        pc = engine.prefix_cache
        return JSONResponse({"status": "ok", "model": primary, "max_context": engine.max_context,
                             "prefix_cache": pc.stats() if pc is not None else None,
                             "requests": {"finished": runner.finished, "cancelled": runner.cancelled,
                                          "split_prefills": runner.split_prefills, "turn_handovers": runner.turns.handovers},
                             "ane": runner.split.ane_block() if runner.split is not None else None})

    return Starlette(routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ], exception_handlers={Exception: _unhandled})


def serve(
    model: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    session_cache: str | None = None,
    session_cache_max_gb: float = 16.0,
    no_session_cache: bool = False,
    prefix_cache_max_gb: float = 2.0,
    served_name: str | None = None,
    ane_fraction: str | None = None,
    prefill_chunk: int = 512,
    max_concurrent: int = 4,
) -> None:
    """Load the model, attach the RAM prefix cache (and the disk session cache), and serve until interrupted.

    `ane_fraction` (a number in [0, 1] or "auto") prefills through the ANE + GPU split, as `hetero run` does.
    """
    import uvicorn

    import hetero
    from hetero.prefix_cache import PrefixCache

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sock = bind(host, port)  # before the model loads: a port in use fails at once, not after a minute of loading
    try:
        store = None if no_session_cache else open_session_store(session_cache, session_cache_max_gb)
        engine = hetero.load(model)
        engine.prefix_cache = PrefixCache(int(prefix_cache_max_gb * 1024**3), store=store)
        names = {engine.name} | ({served_name} if served_name else set())
        split = None
        if ane_fraction is not None:
            from hetero.pipeline import auto_fraction, configure

            if ane_fraction == "auto":
                split = auto_fraction(engine, prefill_chunk)
            else:
                try:
                    split = configure(engine, float(ane_fraction), prefill_chunk)
                except ValueError:
                    raise HeteroError(f"--ane-fraction {ane_fraction!r}: give a number in [0, 1] or 'auto'") from None
        app = create_app(engine, api_key, names, split, max_concurrent, prefill_chunk)
    except BaseException:
        sock.close()
        raise
    where = f"session cache {store.root} ({len(store.entries)} entries)" if store else "no session cache"
    print(f"hetero: serving {sorted(names)} on http://{host}:{port} ({where})", flush=True)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).run(sockets=[sock])


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), or a one-line HeteroError saying why not (port in use, bad address)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise HeteroError(f"--host {host!r} is not an address this machine can bind ({e}); try 127.0.0.1 or 0.0.0.0") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a port in TIME_WAIT is free
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise HeteroError(f"port {port} on {host} is in use (another server running?); stop it or pass --port N") from None
        raise HeteroError(f"cannot listen on {host}:{port}: {e.strerror}; pass another --host or --port") from None
    sock.set_inheritable(True)
    return sock


def open_session_store(root: str | None, max_gb: float):
    """The on-disk session cache at `root` (None: the default place), refused in one line when it cannot be a directory."""
    from hetero.session_store import SessionStore, default_dir

    path = Path(root).expanduser() if root is not None else default_dir()
    if path.exists() and not path.is_dir():
        raise HeteroError(f"--session-cache {path} is a file, not a directory; pass a directory (created when missing) "
                          "or --no-session-cache")
    try:
        return SessionStore(path, int(max_gb * 1024**3))
    except OSError as e:
        raise HeteroError(f"cannot use {path} as the session cache ({e.strerror or e}); pass another --session-cache DIR "
                          "or --no-session-cache") from None
