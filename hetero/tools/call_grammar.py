"""A grammar for forced tool calls: what the model writes after `forced_prefix(choice, prompt, template)`.

With tool_choice `required` or a named function, decoding under `call_grammar(...)` (an llguidance Lark grammar)
gives exactly one call to a known function whose arguments are valid for that tool's JSON schema, then the
template's end of the call; the grammar accepts (lets EOS through) only there.

JSON form (Qwen2.5 / 3), after `{"name":` (required) or `{"name": "NAME", "arguments":` (named):

    ` "NAME", "arguments": ` (one alternative per tool)  <JSON for its schema>  `}\\n</tool_call>`

XML form (Qwen3.5 / 3.6), after `<function=` (required) or `<function=NAME` (named):

    `NAME>\\n`  then `<parameter=P>\\nVALUE\\n</parameter>\\n` per parameter  then `</function>\\n</tool_call>`

XML parameters come in the order of the schema's `properties`; a required one must appear, an optional one may
(at most once, in its place); parameters the schema does not list are never written. A value is typed as
hetero/tools/schema.py's `coerce` reads it back: a string is any text without `</parameter>` (minLength /
maxLength kept, `format` taken as an annotation, `pattern` refused); integers, numbers, booleans, null, objects
and arrays are JSON for their (sub)schema (llguidance's `%json`); enum / const values are the literals; anyOf /
oneOf / a type list is any of the alternatives; an untyped schema is free text. JSON is written as json.dumps
does (", " and ": ", no other whitespace); JSON strings without a pattern or format cannot contain the text that
would end the call early (`</tool_call>`, or `</parameter>` inside an XML value); an object that lists its
properties gets no others unless its schema sets additionalProperties; a `format` llguidance does not enforce is
dropped (jsonschema too takes formats as annotations).
"""

from __future__ import annotations

import json
import re
from typing import Any

from llguidance import LLMatcher, LLTokenizer

from hetero.errors import HeteroError
from hetero.tools.constrained import JSON_OPTIONS
from hetero.tools.schema import coerce

END_CALL = "</tool_call>"
END_PARAM = "</parameter>"
CLOSE_VALUE = "\n" + END_PARAM + "\n"  # after an XML value, as the template writes it
XML_TAIL = "</function>\n"  # then END_CALL
JSON_TAIL = "}\n"  # then END_CALL
XTEXT = r"XTEXT: /(?s:.*)/ & ~/(?s:.*)<\/parameter>(?s:.*)/"  # text without </parameter>
FORMATS = {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"}  # llguidance's
_NOT_DATA = ("enum", "const", "default", "examples")  # schema keys whose values are data, not schemas
_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # keys whose values map names to schemas


def call_grammar(tools: list[dict], choice: str, form: str, tokenizer: LLTokenizer) -> str:
    """The grammar (checked against `tokenizer`) of the rest of a forced call: `choice` is "required" (any of the
    tools) or a function name, `form` "xml" or "json". HeteroError (one line) for what it cannot express."""
    table = _functions(tools)
    if choice == "required":
        names = list(table)
    elif choice in table:
        names = [choice]
    else:
        raise HeteroError(f"tool_choice names {choice!r}, which is not among the tools")
    if not names:
        raise HeteroError("a forced tool call needs at least one tool")
    if form not in ("xml", "json"):
        raise HeteroError(f"unknown tool call form {form!r} (xml or json)")
    named = choice != "required"
    build = _xml_call if form == "xml" else _json_call
    end = _end_tag(tokenizer)
    rules = [r for i, name in enumerate(names) for r in build(i, name, table[name], named, end)]
    lark = "start: " + " | ".join(f"call_{i}" for i in range(len(names))) + "\n" + "\n".join(rules) + "\n"
    if form == "xml":  # the string terminals the values use, each with its closing tag
        texts = sorted(set(re.findall(r"\bTEXT_\w+", lark)))
        lark += XTEXT + "\n" + "".join(f"{t}: {_text_terminal(t)}\n" for t in texts)
    error = _check(lark, tokenizer)
    if error and len(names) > 1:  # name the tool at fault
        bad = next((n for n in names if _check_one(n, table, form, tokenizer)), names[0])
        error = f"{bad!r}: {error}"
    if error:
        raise HeteroError(f"cannot force a call to this tool schema: {error}")
    return LLMatcher.grammar_from_lark(lark)


def _functions(tools: list[dict]) -> dict[str, dict]:
    """{name: parameters schema} from OpenAI-shaped tools ({"type": "function", "function": {...}}) or bare ones."""
    table: dict[str, dict] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise HeteroError(f"a tool without a function name: {json.dumps(tool)[:80]}")
        schema = fn.get("parameters", fn.get("input_schema"))
        if schema is None:
            schema = {"type": "object", "properties": {}}
        if not isinstance(schema, dict):
            raise HeteroError(f"tool {name!r}: its parameters must be a JSON schema object")
        table[name] = schema
    return table


def _check(lark: str, tokenizer: LLTokenizer) -> str:
    """'' if the Lark grammar compiles for this tokenizer, else the first line of llguidance's complaint."""
    try:
        grammar = LLMatcher.grammar_from_lark(lark)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    except (ValueError, TypeError) as e:
        is_error, messages = True, [str(e)]
    return (messages[0].strip().splitlines() or ["invalid grammar"])[0] if is_error else ""


def _check_one(name: str, table: dict[str, dict], form: str, tokenizer: LLTokenizer) -> bool:
    """Whether one tool's own grammar fails (to say which tool of a `required` list is at fault)."""
    try:
        call_grammar([{"name": name, "parameters": table[name]}], name, form, tokenizer)
    except HeteroError:
        return True
    return False


def _end_tag(tokenizer: LLTokenizer) -> str:
    """The call's closing tag in the grammar: the token id where the tokenizer holds `</tool_call>` as one special
    (added) token, as Qwen's do (llguidance matches such a token only by its id, never by its text), else the text."""
    ids = tokenizer.tokenize_str(END_CALL)
    if len(ids) == 1 and tokenizer.is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return _lit(END_CALL)


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _json_call(i: int, name: str, schema: dict, named: bool, end: str) -> list[str]:
    """Rules of one JSON-form call: the name (unless the prefix has it) and its arguments."""
    kind = schema.get("type", "object")
    if kind != "object":
        raise HeteroError(f"tool {name!r}: its parameters schema must be of type object, not {kind!r}")
    schema = _guard({**schema, "type": "object"}, END_CALL)
    head = " " if named else f" {json.dumps(name, ensure_ascii=False)}, \"arguments\": "
    return [f"call_{i}: {_lit(head)} %json {_json_schema(schema)} {_lit(JSON_TAIL)} {end}"]


def _json_schema(schema: dict) -> str:
    """A schema for `%json`, with json.dumps' separators and no free whitespace."""
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def _xml_call(i: int, name: str, schema: dict, named: bool, end: str) -> list[str]:
    """Rules of one XML-form call: `NAME>\\n`, its parameters in the schema's order, the end tags."""
    _tag_name(name, "function")
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
    for key in ("$ref", "anyOf", "oneOf", "allOf", "not", "patternProperties"):
        if key in schema:
            raise HeteroError(f"tool {name!r}: a top-level {key} in its parameters has no XML call form")
    props = schema.get("properties") or {}
    required = schema.get("required") or []
    if not isinstance(props, dict) or not isinstance(required, list):
        raise HeteroError(f"tool {name!r}: properties must be an object and required a list")
    missing = [r for r in required if r not in props]
    if missing:
        raise HeteroError(f"tool {name!r}: required parameter {missing[0]!r} is not among its properties")
    rules, seq = [], []
    for j, (param, sub) in enumerate(props.items()):
        _tag_name(param, f"tool {name!r}'s parameter")
        alts = _xml_values(sub, defs, f"{name}.{param}")
        if not alts:
            raise HeteroError(f"tool {name!r}: parameter {param!r} has no value an XML call can write")
        rule = f"p_{i}_{j}"
        rules.append(f"{rule}: {_lit('<parameter=' + param + '>' + chr(10))} ({' | '.join(alts)})")
        seq.append(rule if param in required else rule + "?")
    head = ">\n" if named else name + ">\n"
    return [f"call_{i}: {_lit(head)} {' '.join(seq)} {_lit(XML_TAIL)} {end}"] + rules


def _xml_values(schema: dict, defs: dict, where: str) -> list[str]:
    """Lark alternatives for one XML value followed by its closing tag, as `coerce` reads the value back."""
    if not isinstance(schema, dict) or "$ref" in schema:  # coerce does not follow a $ref: it would read text
        raise HeteroError(f"{where}: an XML parameter's schema must be an object without $ref")
    if "const" in schema or "enum" in schema:  # the literals that coerce reads back as themselves
        values = [schema["const"]] if "const" in schema else list(schema["enum"] or [])
        texts = {v if isinstance(v, str) else json.dumps(v, ensure_ascii=False): v for v in values}
        return [_lit(t + CLOSE_VALUE) for t, v in texts.items() if END_PARAM not in t and _same(coerce(t, schema), v)]
    options = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(options, list):
        rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
        return [a for o in options for a in _xml_values({**rest, **o} if isinstance(o, dict) else o, defs, where)]
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else ["string"]
    alts = []
    for kind in kinds:
        if kind == "string":
            alts.append(_xml_text(schema, where))
        else:
            sub = _guard({**schema, "type": kind, **defs}, END_PARAM)
            alts.append(f"%json {_json_schema(sub)} {_lit(CLOSE_VALUE)}")
    return alts


def _xml_text(schema: dict, where: str) -> str:
    """A string value as bare text: anything without `</parameter>`, within the schema's length bounds."""
    if "pattern" in schema:
        raise HeteroError(f"{where}: a string pattern has no XML call form here")
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if not isinstance(low, int) or not (high is None or isinstance(high, int)):
        raise HeteroError(f"{where}: minLength / maxLength must be integers")
    return f"TEXT_{low}_{'N' if high is None else high}"  # N: no upper bound


def _text_terminal(name: str) -> str:
    """The definition of TEXT_<min>_<max>: text without </parameter>, of that length, and the closing tag."""
    low, high = name.split("_")[1:]
    high = "" if high == "N" else high
    bound = "" if low == "0" and not high else f" & /(?s:.{{{low},{high}}})/"
    return f"(XTEXT{bound}) {_lit(CLOSE_VALUE)}"


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON Schema's enum compares them (1 is not true, 1.0 is 1)."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _tag_name(name: str, what: str) -> None:
    """A name the XML form can write as `<function=NAME>` / `<parameter=NAME>` and read back as itself."""
    if not name or name != name.strip() or any(c in name for c in "<>\n"):
        raise HeteroError(f"{what} name {name!r} cannot be written in the XML call form")


def _guard(schema: Any, word: str) -> Any:
    """A copy of a schema in which every plain JSON string (no pattern, format, enum or const) excludes `word`,
    and an object that lists its properties has no others unless it says so (additionalProperties)."""
    if isinstance(schema, list):
        return [_guard(s, word) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _NOT_DATA else {n: _guard(s, word) for n, s in v.items()} if k in _MAPS and
           isinstance(v, dict) else _guard(v, word) for k, v in schema.items()}
    kind = schema.get("type")
    if out.get("format") not in FORMATS:  # an annotation, as jsonschema takes it: llguidance would refuse it
        out.pop("format", None)
    if (kind == "string" or isinstance(kind, list) and "string" in kind) and not any(
            k in out for k in ("pattern", "format", "enum", "const")):
        out["pattern"] = _avoiding(word)
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _avoiding(word: str) -> str:
    """A regex of the strings that do not contain `word` (whose first character occurs only at its start):
    any character but that first one, or a proper prefix of `word` broken off by a character that does not
    continue it; a run of such prefixes may also end the string."""
    first = re.escape(word[0])
    prefixes = [word[:j] for j in range(1, len(word))]
    broken = "|".join(re.escape(p) + "[^" + first + re.escape(word[j]) + "]" for j, p in enumerate(prefixes, 1))
    runs = "(?:" + "|".join(re.escape(p) for p in prefixes) + ")*"
    return f"^(?:[^{first}]|{runs}(?:{broken}))*{runs}$"
