"""The OpenAI API: POST /v1/chat/completions and /v1/completions.

`parse_chat` / `parse_completion` read a request into a Job (a new decode option goes there, into the Job's
options); `ChatOutput` / `CompletionOutput` shape its generation into the response: `choice` for a plain
response, `start` / `text` / `finish` for the chunks of a stream, `piece` for one chunk's choice.
"""

from __future__ import annotations

import time

from hetero.decode.logprobs import MAX_TOP_LOGPROBS
from hetero.server.common import Output, sse
from hetero.server.refusals import RequestError, refusing
from hetero.server.requests import Job, Parser, boolean, integer, messages, one_choice, stops, stream_options
from hetero.server.runner import Outcome, Started, TokenLogprobs
from hetero.server.thinking import thinking_budget
from hetero.server.toolcalls import openai_chat, openai_deltas, openai_finish, openai_message
from hetero.tools import Event, Reply
from hetero.validate import Bound

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


def error_body(e: RequestError) -> dict:
    """OpenAI's error object: message, type, param, code."""
    kind = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error"}.get(
        e.status, "invalid_request_error")
    kind = "server_error" if e.status >= 500 else kind
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.code}}


def parse_chat(parser: Parser, body: dict) -> Job:
    """A chat completions request -> its Job (the messages through the chat template)."""
    parser.model(body)
    messages(body, CHAT_ROLES, parser.image_places(check=True))  # roles and content checked (toolcalls converts them)
    penalties = parser.penalties(body)
    one_choice(body)
    ids, reply = openai_chat(parser, body)
    job = parser.job(body, ids, "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens")
    job.reply = reply
    job.set(penalties=penalties,
            thinking_budget=thinking_budget(parser, body.get("max_thinking_tokens"), "max_thinking_tokens"))
    job.stops = stops(body, "stop")
    stream_options(body, job)
    parse_chat_logprobs(body, job)
    parse_response_format(parser, body, job)
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
    parser.refuse(body, "suffix")
    penalties = parser.penalties(body)
    one_choice(body)
    job = parser.job(body, parser.encode(prompt, "prompt"), "max_tokens")
    job.set(penalties=penalties)
    job.echo = bool(boolean(body, "echo", False))
    job.stops = stops(body, "stop")
    stream_options(body, job)
    job.set(logprobs=integer(body, "logprobs", None, TOP_LOGPROBS))
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
        self.pending_logprobs: list[TokenLogprobs] = []  # streamed tokens whose text has not gone out yet
        self.replies = job.reply.parser() if job.reply is not None else None  # a stream's reasoning / calls
        self._parsed: Reply | None = None

    def choice(self, o: Outcome) -> dict:
        return {"index": 0, "message": self.message(o), "finish_reason": self.finish_reason(o),
                "logprobs": self.logprobs_field(o.logprobs)}

    def piece(self, text: str | None, finish: str | None = None) -> dict:
        """One stream chunk's choice: a text delta, or (with `finish`) the last, empty one."""
        return {"index": 0, "delta": {"content": text} if finish is None else {}, "finish_reason": finish,
                "logprobs": self.take_logprobs() if finish is None else None}

    def logprob(self, item: TokenLogprobs) -> list[str]:
        self.pending_logprobs.append(item)  # goes out with the next text piece (a token may have no text alone)
        return []

    def take_logprobs(self) -> dict | None:
        """The logprobs of the tokens since the last text piece, for the chunk that carries this one."""
        items, self.pending_logprobs = self.pending_logprobs, []
        return self.logprobs_field(items if self.job.options.logprobs is not None else None)

    def logprobs_field(self, items: list[TokenLogprobs] | None) -> dict | None:
        return None if items is None else {"content": [chat_logprob(x) for x in items], "refusal": None}

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
        if self.replies is not None:
            return self.reply_chunks(self.replies.feed(piece))
        return [sse(self.chunk([self.piece(piece)]))]

    def finish(self, o: Outcome) -> list[str]:
        flushed = self.reply_chunks(self.replies.finish()) if self.replies is not None else []
        last = self.chunk([self.piece(None, self.finish_reason(o))])
        last["hetero"] = o.stats
        events = flushed + [sse(last)]
        if self.job.include_usage:
            events.append(sse({**self.chunk([]), "usage": usage(o)}))
        return events + [sse("[DONE]")]

    # reasoning and tool calls (hetero.server.toolcalls): a chat job's reply is parsed, a completion's is not

    def message(self, o: Outcome) -> dict:
        if self.job.reply is None:
            return {"role": "assistant", "content": o.text}
        return openai_message(self.parsed(o))

    def parsed(self, o: Outcome) -> Reply:
        """The whole reply of a plain request (one Outcome per request: parsed once)."""
        if self._parsed is None:
            self._parsed = self.job.reply.parse(o.text)
        return self._parsed

    def finish_reason(self, o: Outcome) -> str:
        if self.job.reply is None:
            return o.finish
        return openai_finish(o.finish, self.replies.calls if self.job.stream else len(self.parsed(o).tool_calls))

    def reply_chunks(self, events: list[Event]) -> list[str]:
        """A stream's parsed events as chunks (the pending logprobs ride on the first)."""
        return [sse(self.chunk([{**self.piece(None), "delta": delta}])) for delta in openai_deltas(events)]


class CompletionOutput(ChatOutput):
    """A text completion, or its stream of `text_completion` chunks."""

    prefix, object, chunk_object = "cmpl-", "text_completion", "text_completion"
    text_offset = 0  # characters of completion text the logprobs reported so far (the legacy `text_offset`)

    def choice(self, o: Outcome) -> dict:
        echo = o.echo.text if o.echo is not None else ""
        logprobs = o.logprobs if o.echo is None or o.logprobs is None else (o.echo.logprobs or []) + o.logprobs
        return {"index": 0, "text": echo + o.text, "finish_reason": o.finish, "logprobs": self.logprobs_field(logprobs)}

    def piece(self, text: str | None, finish: str | None = None) -> dict:
        return {"index": 0, "text": text or "", "finish_reason": finish,
                "logprobs": self.take_logprobs() if finish is None else None}

    def logprobs_field(self, items: list[TokenLogprobs] | None) -> dict | None:
        """The legacy completions shape: parallel lists of tokens, their logprobs, top {token: logprob} and offsets."""
        if items is None:
            return None
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for x in items:
            token = token_text(x.token)
            out["tokens"].append(token)
            out["token_logprobs"].append(x.logprob)
            out["top_logprobs"].append(None if x.top is None else {token_text(t): lp for t, lp in x.top})
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(token)
        return out

    def start(self, s: Started) -> list[str]:
        """No role chunk in the completions API; an `echo` request's prompt goes out first, with its logprobs."""
        if s.echo is None:
            return []
        logprobs = self.logprobs_field(s.echo.logprobs) if self.job.options.logprobs is not None else None
        return [sse(self.chunk([{"index": 0, "text": s.echo.text, "finish_reason": None, "logprobs": logprobs}]))]


# ----------------------------------------------------------------------------------------------------------
# logprobs and response_format

TOP_LOGPROBS = Bound(0, MAX_TOP_LOGPROBS, integer=True)


def parse_chat_logprobs(body: dict, job: Job) -> None:
    """Chat `logprobs: true` and `top_logprobs: N` (0..20, only with logprobs) -> the job's logprobs."""
    wanted = boolean(body, "logprobs", False)
    top = integer(body, "top_logprobs", None, TOP_LOGPROBS)
    if top is not None and not wanted:
        raise RequestError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    job.set(logprobs=(top or 0) if wanted else None)


def parse_response_format(parser: Parser, body: dict, job: Job) -> None:
    """`response_format`: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}; the schema is compiled here, so one the grammar library rejects is a 400."""
    fmt = body.get("response_format")
    if fmt is None:
        return
    kinds = "'text', 'json_object' or 'json_schema'"
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise RequestError(400, f"'response_format' must be an object with a 'type': {kinds}", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return
    if kind == "json_object":
        job.set(json_object=True)
        return
    if kind != "json_schema":
        raise RequestError(400, f"'response_format.type' must be {kinds}, got {kind!r}", "response_format.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError(400, "'response_format.json_schema' must be an object with 'name' and 'schema'",
                           "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= 64 or not all(c.isascii() and (c.isalnum() or c in "_-")
                                                                       for c in name):
        raise RequestError(400, "'response_format.json_schema.name' must be 1-64 characters of a-z, A-Z, 0-9, _ "
                           "and -", "response_format.json_schema.name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):  # constrained either way
        raise RequestError(400, "'response_format.json_schema.strict' must be true or false",
                           "response_format.json_schema.strict")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise RequestError(400, "'response_format.json_schema.schema' must be a JSON Schema object",
                           "response_format.json_schema.schema")
    with refusing("response_format.json_schema.schema", "the JSON schema cannot be compiled", prefix=False):
        parser.engine.json_grammar(schema)
    job.set(json_schema=schema)


def token_text(b: bytes) -> str:
    """A token's text as logprobs show it (a piece of a multi-byte character shows as U+FFFD; `bytes` has it all)."""
    return b.decode("utf-8", errors="replace")


def chat_logprob(x: TokenLogprobs) -> dict:
    """One entry of a chat choice's `logprobs.content`."""
    return {"token": token_text(x.token), "logprob": x.logprob, "bytes": list(x.token),
            "top_logprobs": [{"token": token_text(t), "logprob": lp, "bytes": list(t)} for t, lp in x.top]}
