"""The Anthropic API: POST /v1/messages.

`parse_messages` reads a request into a Job (a new request option goes there, onto a Job field);
`MessagesOutput` shapes its generation into a message, or into the stream of events the Anthropic SDK expects
(message_start, ping, then per block content_block_start, content_block_delta..., content_block_stop, then
message_delta, message_stop).
"""

from __future__ import annotations

from hetero.server.common import Output, sse
from hetero.server.requests import ANTHROPIC_TEMPERATURE, Job, Parser, RequestError, number, stops
from hetero.server.runner import Outcome, Started
from hetero.server.toolcalls import AnthropicBlocks, anthropic_chat, anthropic_content

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
    job.temperature = number(body, "temperature", 0.0, ANTHROPIC_TEMPERATURE)
    job.stops = stops(body, "stop_sequences")
    return job


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

    def text(self, piece: str) -> list[str]:
        return [sse(e, e["type"]) for e in self.blocks.events(self.replies.feed(piece))]

    def finish(self, o: Outcome) -> list[str]:
        blocks = self.blocks.events(self.replies.finish()) + self.blocks.end()
        delta = {"stop_reason": stop_reason(o, self.replies.calls), "stop_sequence": o.stop}
        return [sse(e, e["type"]) for e in blocks] + [
            sse({"type": "message_delta", "delta": delta, "usage": usage(o), "hetero": o.stats}, "message_delta"),
            sse({"type": "message_stop"}, "message_stop")]
