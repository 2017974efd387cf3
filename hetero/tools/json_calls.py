"""The JSON call form of the Qwen2.5 / Qwen3 (Hermes-style) templates:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The call is complete at its </tool_call>; arguments are JSON already (a JSON string holding an object, which
some models write, is read as that object).
"""

from __future__ import annotations

import json

from hetero.tools.scan import CLOSE, MORE, Scan, bad, skip_space


def scan_json_call(text: str) -> Scan:
    """Scan `text` (what follows <tool_call>) as one JSON call."""
    start = skip_space(text, 0)
    if start == len(text):
        return MORE
    if text[start] != "{":
        return bad(start, "expected a JSON object")
    close = text.find(CLOSE, start)
    if close < 0:
        return MORE
    try:
        call = json.loads(text[start:close])
    except ValueError:
        return bad(close, "not valid JSON")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return bad(close, "no function name")
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return bad(close, "arguments are not JSON")
    if not isinstance(arguments, dict):
        return bad(close, "arguments are not an object")
    return Scan("ok", end=close + len(CLOSE), name=call["name"], arguments=arguments)
