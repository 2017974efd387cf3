"""The Anthropic API: POST /v1/messages (also `?beta=true`, as Claude Code sends it) and /v1/messages/count_tokens.

`parse_messages` reads a request into a Job (a new request option goes there, onto a Job field);
`MessagesOutput` shapes its generation into a message, or into the stream of events the Anthropic SDK expects
(message_start, ping, then per block content_block_start, content_block_delta..., content_block_stop, then
message_delta, message_stop; a `ping` whenever the stream is silent, e.g. during a long prefill).

Accepted without effect, as the engine has nothing to do with them: `metadata` (a user id for the provider's abuse
tracking), `context_management` (server-side clearing of old tool results: this server renders the conversation
the client sends, whole), `output_config.effort` on a template without `reasoning_effort` (`thinking` is its switch),
`cache_control` on blocks (the prefix cache needs no hints) and the `anthropic-beta` headers.
`output_config.format` with a JSON schema constrains the output as OpenAI's `response_format` does.
"""

from __future__ import annotations

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hetero.server.common import Output, State, check_key, read_body, sse
from hetero.server.openai import parse_response_format
from hetero.server.requests import ANTHROPIC_TEMPERATURE, Job, Parser, number, parse_body, stops
from hetero.server.refusals import RequestError
from hetero.server.runner import Outcome, Started
from hetero.server.thinking import thinking_budget
from hetero.server.toolcalls import AnthropicBlocks, anthropic_chat, anthropic_content

# by status; any other 4xx is an invalid_request_error
ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large"}


def error_body(e: RequestError) -> dict:
    """Anthropic's error object: a type and a message (which names the field)."""
    kind = "api_error" if e.status >= 500 else ERROR_TYPES.get(e.status, "invalid_request_error")
    message = e.message if e.param is None or e.param in e.message else f"{e.param}: {e.message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def parse_messages(parser: Parser, body: dict) -> Job:
    """A messages request -> its Job (`system` and the messages through the chat template; max_tokens required)."""
    parser.model(body)
    ids, reply = anthropic_chat(parser, body)
    job = parser.job(body, ids, "max_tokens", required_max=True)
    job.reply = reply
    job.set(temperature=number(body, "temperature", parser.defaults["temperature"], ANTHROPIC_TEMPERATURE))
    job.stops = stops(body, "stop_sequences")
    output_config(parser, body, job)
    thinking = body.get("thinking")  # (its type was checked with the messages)
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        job.set(thinking_budget=thinking_budget(parser, thinking.get("budget_tokens"), "thinking.budget_tokens",
                                                strict=False))
    return job


def output_config(parser: Parser, body: dict, job: Job) -> None:
    """`output_config`: `effort` (read with the messages: `hetero.server.thinking`), `format`
    `{"type": "json_schema", "schema": {...}}` constrains the output to that schema."""
    config = body.get("output_config")
    if config is None:
        return
    if not isinstance(config, dict):
        raise RequestError(400, "'output_config' must be an object (effort, format)", "output_config")
    fmt = config.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise RequestError(400, "'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}",
                           "output_config.format")
    spec = {"name": "output", "schema": fmt.get("schema")}
    try:
        parse_response_format(parser, {"response_format": {"type": "json_schema", "json_schema": spec}}, job)
    except RequestError as e:
        raise RequestError(400, e.message.replace("response_format.json_schema.schema", "output_config.format.schema"),
                           "output_config.format.schema") from None


def count_tokens(state: State):
    """POST /v1/messages/count_tokens: the prompt's real token count, `{"input_tokens": N}`: the request rendered
    exactly as /v1/messages renders it (max_tokens not needed), so N is the prompt tokens that route then reports."""

    async def handle(request: Request) -> Response:
        try:
            check_key(state, request)
            body = parse_body(await read_body(request, state.max_body))

            def count() -> int:
                state.parser.model(body)
                return len(anthropic_chat(state.parser, body)[0])

            n = await anyio.to_thread.run_sync(count)
        except RequestError as e:
            return MessagesOutput.error(e)
        return JSONResponse({"input_tokens": n})

    return handle


def models_page(names: list[str]) -> dict:
    """GET /v1/models in Anthropic's shape (one page holding every served name)."""
    data = [{"type": "model", "id": n, "display_name": n, "created_at": "1970-01-01T00:00:00Z"} for n in names]
    return {"data": data, "has_more": False, "first_id": names[0] if names else None,
            "last_id": names[-1] if names else None}


def usage(o: Outcome) -> dict:
    prompt, cached, completion = o.usage
    # Anthropic convention: input_tokens counts only the prompt tokens that were not read from the cache
    return {"input_tokens": prompt - cached, "output_tokens": completion, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def stop_reason(o: Outcome, calls: int = 0) -> str:
    if o.stop is not None:
        return "stop_sequence"
    return ("tool_use" if calls else "end_turn") if o.finish == "stop" else "max_tokens"


class MessagesOutput(Output):
    """A message (thinking, text and tool_use blocks), or its event stream (blocks open as their output comes)."""

    prefix, error_event = "msg_", "error"
    error_body = staticmethod(error_body)

    def __init__(self, model: str, job: Job):
        super().__init__(model, job)
        self.replies = job.reply.parser()
        self.blocks = AnthropicBlocks()

    def message(self, content: list[dict], stop: str | None, stop_sequence: str | None, use: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop, "stop_sequence": stop_sequence, "usage": use}

    def body(self, o: Outcome) -> dict:
        reply = self.job.reply.parse(o.text)
        return {**self.message(anthropic_content(reply), stop_reason(o, len(reply.tool_calls)), o.stop, usage(o)),
                "hetero": o.stats}

    def start(self, s: Started) -> list[str]:
        cached = s.cached_tokens  # message_start waits for the restore to report cached tokens
        use = {"input_tokens": len(self.job.ids) - cached, "output_tokens": 0, "cache_read_input_tokens": cached,
               "cache_creation_input_tokens": 0}
        return [sse({"type": "message_start", "message": self.message([], None, None, use)}, "message_start"),
                sse({"type": "ping"}, "ping")]

    def keepalive(self) -> list[str]:
        return [sse({"type": "ping"}, "ping")]

    def text(self, piece: str) -> list[str]:
        return [sse(e, e["type"]) for e in self.blocks.events(self.replies.feed(piece))]

    def finish(self, o: Outcome) -> list[str]:
        blocks = self.blocks.events(self.replies.finish()) + self.blocks.end()
        delta = {"stop_reason": stop_reason(o, self.replies.calls), "stop_sequence": o.stop}
        return [sse(e, e["type"]) for e in blocks] + [
            sse({"type": "message_delta", "delta": delta, "usage": usage(o), "hetero": o.stats}, "message_delta"),
            sse({"type": "message_stop"}, "message_stop")]
