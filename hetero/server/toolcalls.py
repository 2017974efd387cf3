"""Tool calls and reasoning in both chat APIs, between the requests and `hetero.tools`.

Request side: the messages (assistant calls, tool results, reasoning), `tools`, `tool_choice` and the template
switches (OpenAI `chat_template_kwargs` and `reasoning_effort`, Anthropic `thinking` -> `enable_thinking` and
`output_config.effort`: `hetero.server.thinking`; the contract's defaults such as `preserve_thinking`) go through the
checkpoint's chat template; a forced tool_choice appends the start of a call to the prompt
(`hetero.tools.choice`). Reply side: the generated text is split into reasoning, answer text and tool calls, for a
whole reply or piece by piece for a stream. Without a think block or calls in the output, the reply is the
generated text unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import logging
from typing import Any

from hetero.checkpoint.chat_contract import chat_contract
from hetero.errors import HeteroError
from hetero.server.images import ImageInputs, place_images
from hetero.server.requests import Parser, boolean, message_list
from hetero.server.refusals import RequestError, refusing
from hetero.server.thinking import effort_kwargs
from hetero.tools import (
    CallArgs, CallEnd, CallStart, Event, Reasoning, Reply, ReplyParser, Text, anthropic_messages, anthropic_tools,
    forced_prefix, normalize_choice, openai_messages, openai_tools,
)
from hetero.tools.call_grammar import call_grammar
from hetero.tools.choice import call_form

log = logging.getLogger("hetero.server")


@dataclass
class ChatReply:
    """How a chat job's output is parsed: what the template was given and what was forced after the prompt."""

    prompt: str  # the rendered prompt (it tells whether generation starts inside a think block)
    tools: list[dict] | None = None  # the tools the template saw, in its form
    forced: str = ""  # text appended to the prompt by tool_choice; the parser reads it as the reply's start
    parallel: bool = True  # False: only the first call is kept, and the generation ends with it
    mark: int | None = None  # prompt tokens before the generation prompt (`transcript_end`)
    only: str | None = None  # the function a tool_choice names: a call to another is returned as text
    grammar: str | None = None  # a forced call's grammar (`call_grammar`): the output is one valid call by construction
    images: list[str] = field(default_factory=list)  # where image parts were replaced by a placeholder
    vision: Any = None  # the prompt's images (an `ImagePrompt` over the expanded ids), for a model that reads them

    def parser(self) -> "ReplyStream":
        return ReplyStream(self)

    def parse(self, text: str) -> Reply:
        """The whole reply."""
        stream = self.parser()
        return Reply().add(stream.feed(text) + stream.finish())


class ReplyStream:
    """The generated text, piece by piece -> events (a call beyond the first is dropped unless parallel)."""

    def __init__(self, reply: ChatReply):
        self.reply = reply
        self._parser = ReplyParser(reply.prompt, reply.tools, parse_calls=bool(reply.tools), only=reply.only)
        self._pending = self._parser.feed(reply.forced) if reply.forced else []
        self.calls = 0

    def feed(self, piece: str) -> list[Event]:
        return self._keep(self._parser.feed(piece))

    def finish(self) -> list[Event]:
        return self._keep(self._parser.finish())

    def _keep(self, events: list[Event]) -> list[Event]:
        events, self._pending = self._pending + events, []
        out = []
        for e in events:
            if isinstance(e, (CallStart, CallArgs, CallEnd)) and e.index > 0 and not self.reply.parallel:
                continue
            self.calls += isinstance(e, CallEnd)
            out.append(e)
        return out


def checked_tools(convert, tools: Any) -> list[dict] | None:
    """`convert(tools)` (a list, or None), its HeteroError a 400 naming `tools`."""
    if tools is not None and not isinstance(tools, list):
        raise RequestError(400, "'tools' must be a list", "tools")
    with refusing("tools", "the tools cannot be read", prefix=False):
        return convert(tools)


def render(parser: Parser, msgs: list[dict], tools: list[dict] | None, choice: Any, template_kwargs: dict,
           parallel: bool, continue_final: bool = False, images=None) -> tuple[list[int], ChatReply]:
    """Template messages and tools -> the prompt's token ids and how to parse the reply. With `continue_final`
    (a conversation ending with an assistant message that has text) the prompt ends inside that message, so the
    reply continues its text instead of opening a new turn. `images` (an `ImageInputs` that collected the
    messages' images) puts each image's tokens where the template placed it: the ids come back expanded."""
    tokenizer = parser.engine.tokenizer
    with refusing("tool_choice", "the tool_choice cannot be read", prefix=False):
        mode = normalize_choice(choice, tools)
    shown = tools if mode not in (None, "none") else None
    template_kwargs = {**chat_contract(tokenizer).defaults(), **template_kwargs}
    with refusing("messages", "the chat template cannot render the conversation", prefix=False):
        msgs = renderable(tokenizer, msgs, shown, template_kwargs)
        prompt = continued(tokenizer, msgs, shown, template_kwargs) if continue_final else \
            tokenizer.apply_chat_template(msgs, tools=shown, add_generation_prompt=True, **template_kwargs)
    reading = isinstance(images, ImageInputs) and bool(images.images)
    encode = images.encode if reading else tokenizer.encode  # with images: their slots -> their tokens
    forced = forced_prefix(mode, prompt, tokenizer.chat_template)
    ids = parser.encode(encode(prompt + forced), "messages")
    mark = None if continue_final else transcript_end(tokenizer, msgs, shown, template_kwargs, prompt, ids, encode)
    vision = None
    if reading:
        ids, vision, mark = place_images(parser.engine, images, prompt, ids, mark)
        prompt = images.substitute(prompt)
    only = mode if mode not in (None, "auto", "none", "required") else None
    grammar = None
    if forced:  # required or a named function: decoded under the call's grammar, valid by construction
        with refusing("tools", f"tool_choice {mode!r}: the tool's schema cannot be compiled", prefix=False):
            try:
                grammar = call_grammar(shown, mode, call_form(tokenizer.chat_template),
                                       parser.engine.grammar_tokenizer())
            except HeteroError as e:
                raise RequestError(400, f"tool_choice {mode!r}: {e}", "tools") from None
    return ids, ChatReply(prompt, shown, forced, parallel, mark, only, grammar=grammar, vision=vision)


SYSTEM_AS_USER = "[system message]\n"  # heads a later system message the template refuses to place mid-conversation


def renderable(tokenizer, msgs: list[dict], tools: list[dict] | None, template_kwargs: dict) -> list[dict]:
    """`msgs` as the template accepts them. System messages after the first turn (Claude Code sends them; Codex's
    developer items follow its instructions) stay where they stand when the template renders them there; a template
    that refuses them (Qwen: "System message must be at the beginning") gets the leading run of system messages
    joined into one, and each later one as a user turn headed SYSTEM_AS_USER."""
    if not any(m.get("role") == "system" for m in msgs[1:]):
        return msgs
    try:
        tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, **template_kwargs)
        return msgs
    except HeteroError:
        pass
    lead = 0
    while lead < len(msgs) and msgs[lead].get("role") == "system":
        lead += 1
    head = [{"role": "system", "content": "\n\n".join(m["content"] for m in msgs[:lead])}] if lead else []
    rest = [{"role": "user", "content": SYSTEM_AS_USER + m["content"]} if m.get("role") == "system" else m
            for m in msgs[lead:]]
    log.info("the chat template refuses system messages after the first turn: %d sent as user turns",
             sum(m.get("role") == "system" for m in msgs[lead:]))
    return head + rest


def continued(tokenizer, msgs: list[dict], tools: list[dict] | None, template_kwargs: dict) -> str:
    """The prompt that ends inside the final (assistant) message, right after its text: the conversation rendered
    whole, cut after the last place that text appears (the template's end-of-turn marker and what follows go)."""
    full = tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=False, **template_kwargs)
    final = msgs[-1]["content"].rstrip()  # Qwen templates trim a message's text
    at = full.rfind(final)
    if not final or at < 0:
        raise HeteroError("the final assistant message cannot be continued: the chat template does not write its "
                          "text as sent; end the conversation with a user message")
    return full[: at + len(final)]


def transcript_end(tokenizer, msgs: list[dict], tools: list[dict] | None, template_kwargs: dict, prompt: str,
                   ids: list[int], encode=None) -> int | None:
    """Tokens of the conversation rendered without the generation prompt, when they prefix the prompt's `ids`
    (else None). The next turn renders this turn's reply after exactly these tokens (Qwen templates write
    `<|im_start|>assistant\\n<think>\\n` as the generation prompt but an empty think block before a call in
    the history), so a checkpoint here is the longest one both turns share."""
    try:
        head = tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=False, **template_kwargs)
    except HeteroError:
        return None
    if not head or len(head) >= len(prompt) or not prompt.startswith(head):
        return None
    head_ids = (encode or tokenizer.encode)(head)
    return len(head_ids) if ids[: len(head_ids)] == head_ids else None


def openai_chat(parser: Parser, body: dict) -> tuple[list[int], ChatReply]:
    """An OpenAI chat request's messages, tools, tool_choice, parallel_tool_calls and chat_template_kwargs."""
    images = parser.image_places()
    with refusing("messages", "the messages cannot be read", prefix=False):
        msgs = openai_messages(body["messages"], images)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise RequestError(400, "'chat_template_kwargs' must be an object of template variables", "chat_template_kwargs")
    kwargs = {k: v for k, v in kwargs.items() if k not in ("messages", "tools", "add_generation_prompt")}
    if body.get("reasoning_effort") is not None:  # the template's own variables, sent as such, win
        kwargs = {**effort_kwargs(parser, body["reasoning_effort"], "reasoning_effort"), **kwargs}
    tools = checked_tools(openai_tools, body.get("tools"))
    parallel = bool(boolean(body, "parallel_tool_calls", True))
    ids, reply = render(parser, msgs, tools, body.get("tool_choice"), kwargs, parallel, images=images)
    reply.images = images or []
    return ids, reply


def anthropic_chat(parser: Parser, body: dict) -> tuple[list[int], ChatReply]:
    """An Anthropic messages request's system, messages, tools, tool_choice and thinking.

    `thinking: {"type": "enabled"}` / `{"type": "disabled"}` set the template's enable_thinking; `adaptive` (the
    model decides) and no `thinking` leave the checkpoint's own default (Qwen3.5 / 3.6 think by default);
    `output_config.effort` reaches a template that reads `reasoning_effort` (`ChatContract.effort`). A
    conversation that ends with an assistant message with text is continued, not answered in a new turn."""
    images = parser.image_places()
    try:
        with refusing("messages", "the messages cannot be read", prefix=False):
            msgs = anthropic_messages(message_list(body, {"user", "assistant", "system"}), body.get("system"), images)
    except RequestError as e:
        if e.message.startswith("system"):
            e.param = "system"
        raise
    kwargs = {}
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise RequestError(400, "'thinking' must be {\"type\": \"enabled\" | \"disabled\" | \"adaptive\", ...}",
                               "thinking")
        if thinking["type"] != "adaptive":
            kwargs["enable_thinking"] = thinking["type"] == "enabled"
    config = body.get("output_config")
    if isinstance(config, dict) and config.get("effort") is not None:  # (anthropic.output_config checks the rest)
        kwargs = {**effort_kwargs(parser, config["effort"], "output_config.effort", switch=False), **kwargs}
    tools = checked_tools(anthropic_tools, body.get("tools"))
    choice = body.get("tool_choice")
    parallel = not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True)
    last = msgs[-1]
    continue_final = last["role"] == "assistant" and bool(last["content"].strip()) and not last.get("tool_calls")
    ids, reply = render(parser, msgs, tools, choice, kwargs, parallel, continue_final, images)
    reply.images = images or []
    return ids, reply


# ----------------------------------------------------------------------------------------------------------
# OpenAI shapes


def openai_message(reply: Reply) -> dict:
    """A chat completion's `message`: content (None beside calls when empty), reasoning_content, tool_calls."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or (None if reply.tool_calls else "")}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments_json}} for c in reply.tool_calls]
    return message


def openai_finish(finish: str, calls: int) -> str:
    """`tool_calls` when the model ended its turn with calls."""
    return "tool_calls" if calls and finish == "stop" else finish


def openai_deltas(events: list[Event]) -> list[dict]:
    """Stream events -> chat.completion.chunk deltas."""
    out = []
    for e in events:
        if isinstance(e, Text):
            out.append({"content": e.text})
        elif isinstance(e, Reasoning):
            out.append({"reasoning_content": e.text})
        elif isinstance(e, CallStart):
            out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                        "function": {"name": e.name, "arguments": ""}}]})
        elif isinstance(e, CallArgs):
            out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.delta}}]})
    return out


# ----------------------------------------------------------------------------------------------------------
# Anthropic shapes


def tool_use_id(call_id: str) -> str:
    """Anthropic's id style for the same call."""
    return "toolu_" + call_id.removeprefix("call_")


def anthropic_content(reply: Reply) -> list[dict]:
    """A message's content blocks: thinking, text (also when the reply is empty), tool_use."""
    blocks: list[dict] = []
    if reply.reasoning:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content or not reply.tool_calls:
        blocks.append({"type": "text", "text": reply.content})
    blocks += [{"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": c.arguments}
               for c in reply.tool_calls]
    return blocks


class AnthropicBlocks:
    """Stream events -> content_block_start / _delta / _stop dicts, one block per kind of output, in order."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking", "text", or the call index of an open tool_use block

    def _switch(self, kind: str, block: dict) -> list[dict]:
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def events(self, events: list[Event]) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if isinstance(e, Reasoning):
                if self.open != "thinking":
                    out += self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": e.text}))
            elif isinstance(e, Text):
                if self.open != "text":
                    out += self._switch("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif isinstance(e, CallStart):
                out += self._switch(f"call {e.index}", {"type": "tool_use", "id": tool_use_id(e.id), "name": e.name,
                                                        "input": {}})
            elif isinstance(e, CallArgs):
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.delta}))
            elif isinstance(e, CallEnd):
                out += self.close()
        return out

    def end(self) -> list[dict]:
        """Close the last block; a reply with none gets one empty text block."""
        if self.index < 0:
            return self._switch("text", {"type": "text", "text": ""}) + self.close()
        return self.close()
