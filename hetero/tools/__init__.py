"""Structured tool calls and reasoning, the model-facing half: no server code here.

    prompt = tokenizer.apply_chat_template(openai_messages(body["messages"]), tools=openai_tools(body["tools"]))
    parser = ReplyParser(prompt, tools)          # feed(text piece) -> events, finish() -> the rest
    reply = parse_reply(generated_text, prompt, tools)   # .content, .reasoning, .tool_calls

Events: Text, Reasoning, CallStart(index, id, name), CallArgs(index, delta: JSON text), CallEnd(index, id,
name, arguments). Formats: the XML form of the Qwen3.5 / 3.6 templates and the JSON-in-<tool_call> form of
earlier Qwen templates; XML values are typed by the tool's JSON schema.
"""

from hetero.tools.calls import ToolCallParser
from hetero.tools.choice import call_form, forced_prefix, normalize_choice
from hetero.tools.events import CallArgs, CallEnd, CallStart, Event, Reasoning, Text, ToolCall, new_call_id
from hetero.tools.messages import anthropic_messages, anthropic_tools, openai_messages, openai_tools
from hetero.tools.reasoning import ReasoningSplitter, opens_reasoning
from hetero.tools.reply import Reply, ReplyParser, parse_reply
from hetero.tools.schema import coerce, tool_parameters

__all__ = [
    "CallArgs", "CallEnd", "CallStart", "Event", "Reasoning", "ReasoningSplitter", "Reply", "ReplyParser", "Text",
    "ToolCall", "ToolCallParser", "anthropic_messages", "anthropic_tools", "call_form", "coerce", "forced_prefix",
    "new_call_id", "normalize_choice", "openai_messages", "openai_tools", "opens_reasoning", "parse_reply",
    "tool_parameters",
]
