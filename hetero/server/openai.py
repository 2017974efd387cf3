"""The OpenAI API: POST /v1/chat/completions and /v1/completions.

`parse_chat` / `parse_completion` read a request into a Job (a new request option goes there, onto a Job
field); `ChatOutput` / `CompletionOutput` shape its generation into the response: `choice` for a plain
response, `start` / `text` / `finish` for the chunks of a stream, `piece` for one chunk's choice.
"""

from __future__ import annotations

import time

from hetero.server.common import Output, sse
from hetero.server.requests import Job, Parser, RequestError, messages, one_choice, stops, stream_options
from hetero.server.runner import Outcome, Started

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


def error_body(e: RequestError) -> dict:
    """OpenAI's error object: message, type, param, code."""
    kind = {401: "authentication_error", 404: "not_found_error"}.get(e.status, "invalid_request_error")
    kind = "server_error" if e.status >= 500 else kind
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.code}}


def parse_chat(parser: Parser, body: dict) -> Job:
    """A chat completions request -> its Job (the messages through the chat template)."""
    parser.model(body)
    msgs = messages(body, CHAT_ROLES)
    for m in msgs:
        m["role"] = "system" if m["role"] == "developer" else m["role"]
    one_choice(body)
    ids = parser.chat(msgs)
    job = parser.job(body, ids, "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens")
    job.stops = stops(body, "stop")
    stream_options(body, job)
    return job


def parse_completion(parser: Parser, body: dict) -> Job:
    """A completions request (`prompt` a string or token ids) -> its Job."""
    parser.model(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise RequestError(400, "'prompt' must be a string, a list with one string, or a list of token ids", "prompt")
    if not isinstance(prompt, (str, list)):
        raise RequestError(400, "'prompt' is required: a string or a list of token ids", "prompt")
    one_choice(body)
    job = parser.job(body, parser.encode(prompt, "prompt"), "max_tokens")
    job.stops = stops(body, "stop")
    stream_options(body, job)
    return job


def usage(o: Outcome) -> dict:
    prompt, cached, completion = o.usage
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class ChatOutput(Output):
    """A chat completion, or its `chat.completion.chunk` stream."""

    prefix, object, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"
    error_body = staticmethod(error_body)

    def __init__(self, model: str, job: Job):
        super().__init__(model, job)
        self.created = int(time.time())

    def choice(self, o: Outcome) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": o.text}, "finish_reason": o.finish,
                "logprobs": None}

    def piece(self, text: str | None, finish: str | None = None) -> dict:
        """One stream chunk's choice: a text delta, or (with `finish`) the last, empty one."""
        return {"index": 0, "delta": {"content": text} if finish is None else {}, "finish_reason": finish,
                "logprobs": None}

    def chunk(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": choices}

    def body(self, o: Outcome) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [self.choice(o)], "usage": usage(o), "hetero": o.stats}

    def start(self, s: Started) -> list[str]:
        return [sse(self.chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                                 "logprobs": None}]))]

    def text(self, piece: str) -> list[str]:
        return [sse(self.chunk([self.piece(piece)]))]

    def finish(self, o: Outcome) -> list[str]:
        last = self.chunk([self.piece(None, o.finish)])
        last["hetero"] = o.stats
        events = [sse(last)]
        if self.job.include_usage:
            events.append(sse({**self.chunk([]), "usage": usage(o)}))
        return events + [sse("[DONE]")]


class CompletionOutput(ChatOutput):
    """A text completion, or its stream of `text_completion` chunks."""

    prefix, object, chunk_object = "cmpl-", "text_completion", "text_completion"

    def choice(self, o: Outcome) -> dict:
        return {"index": 0, "text": o.text, "finish_reason": o.finish, "logprobs": None}

    def piece(self, text: str | None, finish: str | None = None) -> dict:
        return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

    def start(self, s: Started) -> list[str]:
        return []  # no role chunk in the completions API
