"""What both APIs share: the served state, the key check, the body limit, one path from a parsed Job to a
response (plain JSON or server-sent events) and one path for errors.

An API route is `endpoint(state, parse, Output)`: `parse(parser, body) -> Job` reads the request (on a worker
thread), and `Output` is that API's per-request output shaper, fed by `respond`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from hetero.engine import Engine
from hetero.errors import HeteroError, internal_error
from hetero.server.requests import Job, Parser, parse_body
from hetero.server.refusals import RequestError
from hetero.server.runner import Cancelled, Outcome, Runner, Started, TokenLogprobs, shutting_down

log = logging.getLogger("hetero.server")

USAGE = "hetero.usage"  # the ASGI scope key where a finished request leaves its Outcome for the access log
KEEPALIVE_S = 5.0  # a stream silent this long (a long prefill, a call being parsed) gets a keep-alive event
WARNING_HEADER = "x-hetero-warning"  # what the server changed in a request (an image replaced by a placeholder)


@dataclass
class State:
    """What every route shares."""

    engine: Engine
    runner: Runner
    parser: Parser
    names: set[str]  # the model names requests may send
    api_key: str | None
    max_body: int  # bytes

    @property
    def model(self) -> str:
        """The name responses report."""
        return sorted(self.names)[0]


class Output:
    """One request's output shaper: how its generation becomes one API's response.

    For a stream, `respond` calls `start` once when the prefill begins, `text` with each piece of generated text
    (stop strings already cut) and `finish` with the Outcome; each returns the server-sent events to send. A
    plain request gets `body(outcome)`. Parsers of the generated text (tool calls, reasoning) belong here: they
    see every piece in order and may hold text back until it is decided; what they need from the request rides
    on the Job.
    """

    prefix = "req_"  # of the response id
    error_event: str | None = None  # the SSE event name an error travels under once a stream has begun

    def __init__(self, model: str, job: Job):
        self.model, self.job = model, job
        self.id = self.prefix + uuid.uuid4().hex[:24]

    @staticmethod
    def error_body(e: RequestError) -> dict:
        """The API's JSON error object for `e`."""
        raise NotImplementedError

    @classmethod
    def error(cls, e: RequestError) -> JSONResponse:
        return JSONResponse(cls.error_body(e), status_code=e.status)

    def body(self, o: Outcome) -> dict:
        raise NotImplementedError

    def start(self, s: Started) -> list[str]:
        return []

    def text(self, piece: str) -> list[str]:
        raise NotImplementedError

    def logprob(self, item: TokenLogprobs) -> list[str]:
        """A token's logprobs, streamed just before its text (a job that asked for them): by default held by no one."""
        return []

    def finish(self, o: Outcome) -> list[str]:
        raise NotImplementedError

    def keepalive(self) -> list[str]:
        """What a silent stream sends every KEEPALIVE_S seconds: an SSE comment, which clients skip."""
        return [": keep-alive\n\n"]

    def stream_error(self, e: RequestError) -> list[str]:
        """The events that carry an error once a stream has begun (the SDKs raise on them)."""
        return [sse(self.error_body(e), self.error_event)]


def wants_anthropic(request: Request) -> bool:
    """Whether a request speaks Anthropic's API: a /v1/messages path, an `anthropic-version` header, or an
    `x-api-key` without an OpenAI `Authorization: Bearer`."""
    h = request.headers
    bearer = h.get("authorization", "").lower().startswith("bearer ")
    return request.url.path.startswith("/v1/messages") or "anthropic-version" in h or ("x-api-key" in h and not bearer)


def sse(data: dict | str, event: str | None = None) -> str:
    """One server-sent event (`data` a JSON object, or raw text such as OpenAI's `[DONE]`)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def failure(e: Exception, rid: str) -> RequestError:
    """What a failed generation tells the client: a HeteroError is the request's fault (400), anything else a
    bug (500, logged with its traceback under the request id)."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, HeteroError):
        return RequestError(400, str(e))
    log.error("request %s failed", rid, exc_info=e)
    return RequestError(500, f"internal error in request {rid}: {internal_error(e)} (the server log has the traceback)",
                        None, "internal_error")


def check_key(state: State, request: Request) -> None:
    """With an API key set, `Authorization: Bearer KEY` or `x-api-key: KEY` (compared in constant time)."""
    if state.api_key is None:
        return
    auth = request.headers.get("authorization", "")
    given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
    if given is None or not hmac.compare_digest(given.encode("utf-8", "surrogatepass"), state.api_key.encode("utf-8", "surrogatepass")):
        raise RequestError(401, "missing or wrong API key (send Authorization: Bearer KEY)", None, "invalid_api_key")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 past `limit` bytes: by its Content-Length before reading, else as it arrives."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        parts.append(chunk)
    return b"".join(parts)


def _too_large(limit: int) -> RequestError:
    return RequestError(413, f"the request body is larger than this server's limit of {limit / 2**20:g} MB; send "
                        "less, or start the server with a larger --max-body-mb", None, "request_too_large")


def endpoint(state: State, parse: Callable[[Parser, dict], Job], output: type[Output]
             ) -> Callable[[Request], Awaitable[Response]]:
    """A generation route: key, body, `parse` (off the event loop: a large prompt's template and tokenization
    would stall every other client), then `respond` through a new `output`."""

    async def handle(request: Request) -> Response:
        try:
            check_key(state, request)
            if state.runner.stopping.is_set():
                raise shutting_down()
            raw = await read_body(request, state.max_body)
            job = await anyio.to_thread.run_sync(lambda: parse(state.parser, parse_body(raw)))
        except RequestError as e:
            return output.error(e)
        return await respond(state.runner, request, job, output(job.model or state.model, job))

    return handle


async def respond(runner: Runner, request: Request, job: Job, out: Output) -> Response:
    """Run `job` and answer through `out`: one JSON body, or a stream that starts once the job has (a failure
    before that is a 4xx/5xx, not a 200 that breaks off); 499 when the client went away first. What the server
    changed in the request (`job.warnings`, images replaced) is logged once and sent in the x-hetero-warning header."""
    headers = warn(job, out.id)
    if not job.stream:
        try:
            o = await runner.complete(job, request)
        except Cancelled:
            return Response(status_code=499)
        except Exception as e:
            return out.error(failure(e, out.id))
        request.scope[USAGE] = o
        return JSONResponse(out.body(o), headers=headers)
    try:
        items = await runner.stream_started(job, request)
    except Exception as e:
        return out.error(failure(e, out.id))
    if items is None:
        return Response(status_code=499)

    def encode(item) -> list[str]:
        if isinstance(item, Started):
            return out.start(item)
        if isinstance(item, str):
            return out.text(item)
        if isinstance(item, TokenLogprobs):
            return out.logprob(item)
        request.scope[USAGE] = item
        return out.finish(item)

    async def events() -> AsyncIterator[str]:
        try:
            async for batch in paced(items):  # what the job emitted since the last batch: one write for all of it
                sent = out.keepalive() if batch is None else [event for item in batch for event in encode(item)]
                if sent:
                    yield "".join(sent)
        except Exception as e:  # headers are sent: the error travels as an event (the SDKs raise on it)
            for event in out.stream_error(failure(e, out.id)):
                yield event

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def warn(job: Job, rid: str) -> dict[str, str]:
    """Log what the server changed in `job`'s request (once) and return the response headers that say it."""
    notes = list(job.warnings)
    images = job.reply.images if job.reply is not None else []
    if images:
        notes.append(f"{len(images)} image(s) omitted ({', '.join(images[:3])}{', ...' if len(images) > 3 else ''}): "
                     "this model reads text only; a text placeholder stands in their place")
    if not notes:
        return {}
    for note in notes:
        log.warning("request %s: %s", rid, note)
    return {WARNING_HEADER: "; ".join(notes).encode("ascii", "replace").decode("ascii")}


async def paced(items: AsyncIterator) -> AsyncIterator:
    """`items`, with None in between whenever KEEPALIVE_S seconds (read at each wait, so tests can lower it)
    pass without one. Closing this iterator closes `items` (which cancels the job)."""
    it = items.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait([pending], timeout=KEEPALIVE_S)
            if not done:
                yield None
                continue
            head, pending = pending, None
            try:
                item = head.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()  # runs the stream's own cleanup inside it
            await asyncio.wait([pending])
        await it.aclose()
