"""The XML call form of the Qwen3.5 / Qwen3.6 / Qwen3-Coder templates:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Values are bare text between the tags (the template writes '\\n' + value + '\\n'); only `</parameter>` ends a
value, so code that mentions `</function>` or `</tool_call>` survives. Values are typed by the tool's schema.
"""

from __future__ import annotations

from typing import Any

from hetero.tools.scan import CLOSE, MORE, Scan, bad, expect, skip_space
from hetero.tools.schema import coerce

FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"


def _tag_name(text: str, pos: int) -> tuple[str, int] | Scan:
    """NAME> at `pos`: (NAME, position after '>'), MORE if '>' has not arrived, bad if NAME is not one line."""
    close = text.find(">", pos)
    if close < 0:
        return bad(pos, "tag name") if "\n" in text[pos:] or "<" in text[pos:] else MORE
    name = text[pos:close].strip()
    if not name or "\n" in name or "<" in name:
        return bad(pos, "tag name")
    return name, close + 1


def _value(raw: str) -> str:
    """The value the template wrapped as '\\n' + value + '\\n'."""
    if raw.startswith("\n"):
        raw = raw[1:]
    return raw[:-1] if raw.endswith("\n") else raw


def scan_xml_call(text: str, params: dict[str, dict[str, Any]]) -> Scan:
    """Scan `text` (what follows <tool_call>) as one XML call; `params` maps tool names to parameter schemas."""
    pos = expect(text, skip_space(text, 0), FUNCTION)
    if not isinstance(pos, int):
        return pos or bad(skip_space(text, 0), "no <function=")
    found = _tag_name(text, pos)
    if isinstance(found, Scan):
        return found
    name, pos = found
    schemas = params.get(name, {})
    arguments: dict[str, Any] = {}
    while True:
        pos = skip_space(text, pos)
        if text.startswith(PARAMETER, pos):
            found = _tag_name(text, pos + len(PARAMETER))
            if isinstance(found, Scan):
                return found
            key, start = found
            end = text.find(END_PARAMETER, start)
            if end < 0:
                return MORE
            arguments[key] = coerce(_value(text[start:end]), schemas.get(key))
            pos = end + len(END_PARAMETER)
            continue
        after = expect(text, pos, END_FUNCTION)
        if after is None:
            partial = expect(text, pos, PARAMETER)
            return MORE if partial is MORE else bad(pos, "expected <parameter= or </function>")
        if after is MORE:
            return MORE
        pos = skip_space(text, after)
        end = expect(text, pos, CLOSE)
        if end is None:
            return bad(pos, "expected </tool_call>")
        if end is MORE:
            return MORE
        return Scan("ok", end=end, name=name, arguments=arguments)
