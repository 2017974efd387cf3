"""Typing a tool call's XML parameter values by the tool's JSON schema.

The XML call form writes every value as bare text (`<parameter=days>\n3\n</parameter>`); the tool's schema says
whether that is the integer 3 or the string "3". Values that do not read as their declared type, parameters the
schema does not name and schemas without a type stay strings, verbatim.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger(__name__)


def tool_parameters(tools: list[dict] | None) -> dict[str, dict[str, Any]]:
    """{function name: {parameter name: its JSON schema}} from OpenAI-style (`{"type": "function", "function":
    {...}}`), bare function (`{"name", "parameters"}`) or Anthropic (`{"name", "input_schema"}`) tool lists."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        name = fn.get("name")
        schema = fn.get("parameters", fn.get("input_schema"))
        if isinstance(name, str):
            props = schema.get("properties") if isinstance(schema, dict) else None
            out[name] = props if isinstance(props, dict) else {}
    return out


def _types(schema: Any) -> list[str]:
    """The JSON types a schema allows, in its own order (`type` as a string or list, or its anyOf / oneOf)."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    found: list[str] = []
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            found += [k for k in _types(option) if k not in found]
    if not found and isinstance(schema.get("enum"), list):  # an untyped enum: the types of its values
        names = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}
        found = list(dict.fromkeys(names.get(type(v), "string") for v in schema["enum"]))
    return found


def _as(kind: str, text: str) -> tuple[bool, Any]:
    """(ok, value): `text` read as JSON type `kind`."""
    stripped = text.strip()
    if kind == "string":
        return True, text
    if kind == "null":
        return stripped.lower() in ("null", "none"), None
    if kind == "boolean":
        low = stripped.lower()
        return (low in ("true", "false")), low == "true"
    if kind in ("integer", "number", "object", "array"):
        try:
            value = json.loads(stripped)
        except ValueError:
            return False, None
        if kind == "integer":
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            return isinstance(value, int) and not isinstance(value, bool), value
        if kind == "number":
            return isinstance(value, (int, float)) and not isinstance(value, bool), value
        return isinstance(value, dict if kind == "object" else list), value
    return False, None


def coerce(text: str, schema: Any) -> Any:
    """One parameter's text as the type its schema declares (first type that reads), else the text itself."""
    kinds = _types(schema)
    for kind in sorted(kinds, key=lambda k: k == "string"):  # a string fits anything: try it last
        ok, value = _as(kind, text)
        if ok:
            return value
    if kinds and "string" not in kinds:
        log.warning("tool parameter %r is not a valid %s; passing it on as a string", text[:80], "/".join(kinds))
    return text
