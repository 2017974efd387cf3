"""The OpenAI Responses API, output side: a response object, or its stream of events.

A stream sends `response.created` and `response.in_progress` when the prefill begins, then one output item per
kind of output as it comes, in order: a `reasoning` item (`response.output_item.added`, `response.content_part.added`,
`response.reasoning_text.delta`..., `response.reasoning_text.done`, `response.content_part.done`,
`response.output_item.done`), a `message` item (the same with `response.output_text.delta` / `.done`) and one
`function_call` item per call (`response.output_item.added`, `response.function_call_arguments.delta`...,
`response.function_call_arguments.done`, `response.output_item.done`), then `response.completed` (or
`response.incomplete` when max_output_tokens cut it). A failure after the stream began is an `error` event and
`response.failed`. Every event carries its `sequence_number`, every item event its `item_id` and `output_index`.
"""

from __future__ import annotations

import json
import time
import uuid

from hetero.server.common import Output, sse
from hetero.server.openai import error_body
from hetero.server.requests import Job
from hetero.server.refusals import RequestError
from hetero.server.responses import ResponseContext
from hetero.server.runner import Outcome, Started
from hetero.tools import CallArgs, CallEnd, CallStart, Event, Reasoning, Text


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class ResponsesOutput(Output):
    """One response: `body` for a plain request, `start` / `text` / `finish` for the stream."""

    prefix, error_event = "resp_", "error"
    error_body = staticmethod(error_body)

    def __init__(self, model: str, job: Job):
        super().__init__(model, job)
        self.ctx: ResponseContext = job.context
        self.created = int(time.time())
        self.seq = 0
        self.items: list[dict] = []  # finished output items, in order
        self.open: dict | None = None  # the item being streamed
        self.replies = job.reply.parser()
        self.reasoning = ""  # all reasoning text, for the usage's reasoning_tokens

    # ---- the response object

    def response(self, status: str, usage: dict | None = None, error: dict | None = None,
                 incomplete: str | None = None) -> dict:
        e = self.ctx.echo
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                "status": status, "output": list(self.items), "usage": usage, "error": error,
                "incomplete_details": {"reason": incomplete} if incomplete else None, **e}

    def usage(self, o: Outcome) -> dict:
        prompt, cached, completion = o.usage
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": min(completion, self.ctx.count_tokens(self.reasoning))},
                "total_tokens": prompt + completion}

    def final(self, o: Outcome) -> dict:
        """The finished response (stored unless `store: false`)."""
        cut = o.finish == "length"
        out = {**self.response("incomplete" if cut else "completed", self.usage(o),
                               incomplete="max_output_tokens" if cut else None), "hetero": o.stats}
        if self.ctx.store is not None:
            self.ctx.store.put(self.id, self.ctx.conversation + self.items)
        return out

    def body(self, o: Outcome) -> dict:
        self.events(self.replies.feed(o.text) + self.replies.finish())
        self.close()
        if not self.items:  # an empty reply is an empty message, as a stream sends it
            self.open_item("message")
            self.close()
        return self.final(o)

    # ---- the stream

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(data, kind)

    def start(self, s: Started) -> list[str]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def text(self, piece: str) -> list[str]:
        return self.events(self.replies.feed(piece))

    def finish(self, o: Outcome) -> list[str]:
        sent = self.events(self.replies.finish()) + self.close()
        if not self.items:
            sent += self.open_item("message") + self.close()
        done = self.final(o)
        return sent + [self.event("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                                  response=done)]

    def stream_error(self, e: RequestError) -> list[str]:
        code = "server_error" if e.status >= 500 else "invalid_prompt"
        self.close()
        return [self.event("error", code=e.code or code, message=e.message, param=e.param),
                self.event("response.failed", response=self.response("failed", error={"code": code,
                                                                                        "message": e.message}))]

    # ---- output items

    def where(self) -> dict:
        return {"item_id": self.open["item"]["id"], "output_index": len(self.items)}

    def open_item(self, kind: str, call: CallStart | None = None) -> list[str]:
        """Start an output item of `kind` (reasoning, message, function_call); returns its opening events."""
        if kind == "function_call":
            item = {"id": _id("fc_"), "type": "function_call", "status": "in_progress", "call_id": call.id,
                    "name": call.name, "arguments": ""}
        elif kind == "message":
            item = {"id": _id("msg_"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        else:
            item = {"id": _id("rs_"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
        self.open = {"kind": kind, "item": item, "text": ""}
        sent = [self.event("response.output_item.added", output_index=len(self.items), item=dict(item))]
        if kind != "function_call":
            sent.append(self.event("response.content_part.added", **self.where(), content_index=0,
                                   part=self.part("")))
        return sent

    def part(self, text: str) -> dict:
        if self.open["kind"] == "message":
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "reasoning_text", "text": text}

    def close(self) -> list[str]:
        """Finish the open item (if any); returns its closing events."""
        if self.open is None:
            return []
        kind, item, text = self.open["kind"], self.open["item"], self.open["text"]
        sent = []
        if kind == "function_call":
            item["arguments"] = text
            sent.append(self.event("response.function_call_arguments.done", **self.where(), name=item["name"],
                                   arguments=text))
        else:
            done = "response.output_text.done" if kind == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if kind == "message" else {}
            sent.append(self.event(done, **self.where(), content_index=0, text=text, **extra))
            sent.append(self.event("response.content_part.done", **self.where(), content_index=0,
                                   part=self.part(text)))
            item["content"] = [self.part(text)]
        item["status"] = "completed"
        sent.append(self.event("response.output_item.done", output_index=len(self.items), item=item))
        self.items.append(item)
        self.open = None
        return sent

    def events(self, events: list[Event]) -> list[str]:
        """Parsed reply events -> Responses stream events (items open and close as the kind of output changes)."""
        sent: list[str] = []
        for e in events:
            if isinstance(e, (Reasoning, Text)):
                kind = "reasoning" if isinstance(e, Reasoning) else "message"
                if self.open is None or self.open["kind"] != kind:
                    sent += self.close() + self.open_item(kind)
                self.open["text"] += e.text
                if kind == "reasoning":
                    self.reasoning += e.text
                    sent.append(self.event("response.reasoning_text.delta", **self.where(), content_index=0,
                                           delta=e.text))
                else:
                    sent.append(self.event("response.output_text.delta", **self.where(), content_index=0,
                                           delta=e.text, logprobs=[]))
            elif isinstance(e, CallStart):
                sent += self.close() + self.open_item("function_call", e)
            elif isinstance(e, CallArgs) and self.open is not None and self.open["kind"] == "function_call":
                self.open["text"] += e.delta
                sent.append(self.event("response.function_call_arguments.delta", **self.where(), delta=e.delta))
            elif isinstance(e, CallEnd) and self.open is not None and self.open["kind"] == "function_call":
                self.open["text"] = json.dumps(e.arguments, ensure_ascii=False)  # the pieces joined, exactly
                sent += self.close()
        return sent
