"""Request parsing shared by both APIs: the body's JSON, field checks, and the `Parser` that turns a request
into a `Job` (the prompt's token ids and its decode options).

Each API module (`openai.py`, `anthropic.py`) has one `parse_*` function per route built from these pieces;
that function is where a request's options are read. A decode option (sampling, a constraint, logprobs, penalties)
goes into the job's `DecodeOptions` (`Job.set`), which travels whole to the engine; what shapes the prompt or the
output (tools rendered into the prompt, stop strings, streaming) is a field of `Job`, which the Runner and the API's
output shaper read.
Parsing runs on a worker thread (the chat template and the tokenizer are slow on a large prompt).
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from typing import Any

from hetero.decode.options import DecodeOptions, decode_options
from hetero.decode.penalties import PENALTY_NAMES, Penalties
from hetero.decode.sampling import SamplingParams
from hetero.engine import Engine
from hetero.errors import HeteroError
from hetero.server.defaults import refuse_unimplemented, sampling_defaults
from hetero.server.images import ImageInputs
from hetero.server.refusals import RequestError, refusing
from hetero.tools.messages import IMAGE_PARTS, take_image
from hetero.validate import FRACTION, MIN_P, NONNEG_INT, POSITIVE_INT, SEED, TOP_K, TOP_P, Bound

MAX_STOPS = 16
MAX_JSON_DEPTH = 64  # deeper request bodies are refused; real ones nest a few levels (tool inputs a few more)
DEFAULT_MAX_TOKENS = 4096  # an OpenAI request without max_tokens: a long answer, not the rest of a 256K window
OPENAI_TEMPERATURE = Bound(0, 2)  # the APIs' documented ranges, inside the engine's own (finite, >= 0)
ANTHROPIC_TEMPERATURE = Bound(0, 1)


@dataclass
class Job:
    """One validated generation request, independent of the API it came through."""

    ids: list[int]
    options: DecodeOptions = field(default_factory=DecodeOptions)  # max_tokens, sampling, seed, mtp, logprobs, ...
    stops: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ane_fraction: float | None = None  # 0: this request prefills GPU-only; None: as the server is configured
    reply: Any = None  # chat routes: a `hetero.server.toolcalls.ChatReply`, how the output splits into reasoning / text / calls
    model: str | None = None  # the model name the request asked for (replies report it; an alias stays itself)
    warnings: list[str] = field(default_factory=list)  # sent back in the x-hetero-warning header, and logged
    context: Any = None  # what one API's output shaper needs from its request (Responses: the input items, the store)
    echo: bool = False  # completions: the prompt comes back before the reply (with its logprobs when asked)

    def set(self, **named) -> None:
        """Set decode options by name (`decode.options.decode_options`: temperature, logprobs, json_schema, ...)."""
        self.options = decode_options(self.options, **named)


# ----------------------------------------------------------------------------------------------------------
# Fields


def number(body: dict, name: str, default: float, bound: Bound) -> float:
    """A number field within `bound` (absent or null: `default`)."""
    return float(_value(body, name, default, bound))


def integer(body: dict, name: str, default: int | None, bound: Bound = NONNEG_INT) -> int | None:
    """An integer field within `bound` (an integer Bound; absent or null: `default`)."""
    return _value(body, name, default, bound)


def _value(body: dict, name: str, default, bound: Bound):
    v = body.get(name, default)
    if v is None:
        return default
    why = bound.problem(v)
    if why is not None:
        raise RequestError(400, f"'{name}' {why}", name)
    return v


def boolean(body: dict, name: str, default: bool | None) -> bool | None:
    """A true/false field (absent or null: `default`)."""
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(400, f"'{name}' must be true or false, got {type(v).__name__}", name)
    return v


def stops(body: dict, name: str) -> list[str]:
    """Stop strings: one string or a list of at most MAX_STOPS non-empty ones."""
    v = body.get(name)
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or len(v) > MAX_STOPS:
        raise RequestError(400, f"'{name}' must be a non-empty string or a list of at most {MAX_STOPS} of them", name)
    return v


def content_text(content, where: str, images: list[str] | None = None) -> str:
    """Message content (a string, or a list of text parts) -> plain text; image parts become the placeholder
    (their places appended to `images`), or are refused when `images` is None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(400, f"'{where}' must be a string or a list of content parts", where)
    out = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise RequestError(400, f"'{where}[{i}]' must be an object with a 'type'", f"{where}[{i}]")
        kind = part["type"]
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise RequestError(400, f"'{where}[{i}].text' must be a string", f"{where}[{i}].text")
            out.append(part["text"])
        elif kind in IMAGE_PARTS and images is not None:
            out.append(take_image(images, part, f"{where}[{i}]"))
        else:
            why = "this model reads text only" if kind in IMAGE_PARTS else "text only"
            raise RequestError(400, f"'{where}[{i}].type' {kind!r} is not supported ({why})", f"{where}[{i}].type")
    return "".join(out)


def message_list(body: dict, roles: set[str]) -> list[dict]:
    """The `messages` list: non-empty, each an object whose role is one of `roles`."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError(400, "'messages' must be a non-empty list", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RequestError(400, f"'messages[{i}]' must be an object", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in roles:
            raise RequestError(400, f"'messages[{i}].role' must be one of {sorted(roles)}, got {role!r}", f"messages[{i}].role")
    return msgs


def messages(body: dict, roles: set[str], images: list[str] | None = None) -> list[dict]:
    """The `messages` list as {role, content text} dicts, each role one of `roles` (images: see content_text)."""
    return [{"role": m["role"], "content": content_text(m.get("content"), f"messages[{i}].content", images)}
            for i, m in enumerate(message_list(body, roles))]


def stream_options(body: dict, job: Job) -> None:
    """OpenAI `stream_options.include_usage`: a last chunk with the usage."""
    opts = body.get("stream_options")
    if opts is None:
        return
    if not isinstance(opts, dict):
        raise RequestError(400, "'stream_options' must be an object", "stream_options")
    job.include_usage = bool(boolean(opts, "include_usage", False))


def one_choice(body: dict) -> None:
    """OpenAI `n`: only 1 is served."""
    if integer(body, "n", 1, POSITIVE_INT) != 1:
        raise RequestError(400, "'n' must be 1: one choice per request", "n")


# ----------------------------------------------------------------------------------------------------------
# The body


def parse_body(raw: bytes) -> dict:
    """A request body -> its JSON object, refusing what no engine should see: bad JSON, NaN/Infinity, nesting
    deeper than MAX_JSON_DEPTH, strings that are not valid Unicode (lone surrogates)."""
    with refusing("body", "the request body is not valid JSON", "invalid_json", prefix=False):
        try:
            body = json.loads(raw, parse_constant=_no_constant)
        except RecursionError:
            raise RequestError(400, f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)", None,
                               "invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object", None)
    _check_tree(body)
    return body


def _no_constant(name: str):
    raise RequestError(400, f"the request body is not valid JSON: {name} is not a JSON number", None, "invalid_json")


def _check_tree(body: dict) -> None:
    """Walk the parsed body (iteratively: no recursion limit to hit) for depth and for unencodable strings."""
    stack = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestError(400, f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)", None,
                               "invalid_json")
        if isinstance(value, str):
            _check_unicode(value, path or "body")
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_unicode(k, f"a key in {path or 'the body'}")
                stack.append((v, f"{path}.{k}" if path else k, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


def _check_unicode(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(400, f"'{where}' is not valid Unicode: it holds a lone surrogate ({text[e.start]!a}) at "
                           f"character {e.start}; send UTF-8 text", where) from None


# ----------------------------------------------------------------------------------------------------------
# The parser


class Parser:
    """Turns request bodies into Jobs for one engine (its name, tokenizer and context window)."""

    def __init__(self, engine: Engine, model_names: set[str], split_fraction: float = 0.0,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, aliases: tuple[tuple[str, str], ...] = (),
                 reject_images: bool = False, allow_local_images: bool = False,
                 max_image_bytes: int = 20 * 2**20):
        if default_max_tokens < 1:
            raise HeteroError(f"--default-max-tokens must be at least 1, got {default_max_tokens}")
        self.engine = engine
        self.model_names = model_names
        self.split_fraction = split_fraction  # the server's --ane-fraction (0: GPU-only)
        self.default_max_tokens = default_max_tokens
        self.aliases = aliases  # (fnmatch pattern, served name): `hetero serve --model-alias PATTERN=NAME`
        self.reject_images = reject_images  # `--reject-images`: an image part is a 400, not a placeholder
        self.allow_local_images = allow_local_images  # `--allow-local-images`: image parts may name local files
        self.max_image_bytes = max_image_bytes  # `--max-image-mb`: a larger image is a 400
        self.defaults = sampling_defaults(engine.path)  # what a request that omits a sampling field gets

    def model(self, body: dict) -> str:
        """The `model` the request names: a served name or one an alias pattern matches (404 otherwise)."""
        name = body.get("model")
        if not isinstance(name, str):
            raise RequestError(400, "'model' is required and must be a string", "model")
        if name not in self.model_names and not any(fnmatch.fnmatchcase(name, p) for p, _ in self.aliases):
            aliases = f" or a name matching {[p for p, _ in self.aliases]}" if self.aliases else ""
            raise RequestError(404, f"model {name!r} is not served here; GET /v1/models lists {sorted(self.model_names)}"
                               f"{aliases}; send one of those or start the server with --model-alias PATTERN=NAME",
                               "model", "model_not_found")
        return name

    def image_places(self, check: bool = False) -> list[str] | None:
        """What message conversion hands image parts to: for a checkpoint with a vision tower an `ImageInputs`,
        which reads them (with `check`, a pass that only checks the messages' shape, a throwaway list); else a list
        of the places of image parts it replaced by a placeholder, or None under --reject-images (an image part is
        then refused)."""
        reads = getattr(self.engine, "vision", None) is not None
        if reads and check:
            return []
        if reads:
            return ImageInputs(self.engine.vision, self.engine.tokenizer, self.allow_local_images, self.max_image_bytes)
        return None if self.reject_images else []

    def penalties(self, body: dict) -> Penalties:
        """presence_penalty, frequency_penalty, repetition_penalty and logit_bias (vLLM's semantics, exact under MTP:
        `hetero.decode.penalties`), checked one by one so a 400 names the field; logit_bias ids against the vocabulary."""
        given = {}
        for name, arg in PENALTY_NAMES.items():
            if body.get(name) is None:
                continue
            with refusing(name, "not a valid value"):
                Penalties(**{arg: body[name]})
            given[arg] = body[name]
        penalties = Penalties(**given)
        with refusing("logit_bias", "not a valid logit_bias", prefix=False):
            penalties.check_vocab(self.engine.model.args.vocab_size)
        return penalties

    def refuse(self, body: dict, *names: str) -> None:
        """A 400 naming the first of `names` the body sets to a value the engine does not implement yet."""
        refused = refuse_unimplemented(body, names)
        if refused is not None:
            raise RequestError(400, refused[1], refused[0], "unsupported_parameter")

    def encode(self, prompt: str | list[int], param: str) -> list[int]:
        """Prompt text or token ids -> token ids that fit the context window (a 400 naming `param` if not)."""
        with refusing(param, "the prompt cannot be tokenized", prefix=False):
            try:
                return self.engine.encode_prompt(prompt)
            except HeteroError as e:
                code = "context_length_exceeded" if "context window" in str(e) else None
                raise RequestError(400, str(e), param, code) from None

    def job(self, body: dict, ids: list[int], max_name: str, required_max: bool = False) -> Job:
        """The Job for `ids` with the fields both APIs share (max tokens, sampling, seed, stream, extensions).

        A request without `max_name` gets `default_max_tokens` (capped by the room left in the window)."""
        fraction = None
        if body.get("ane_fraction") is not None:
            fraction = number(body, "ane_fraction", 0.0, FRACTION)
            served = self.split_fraction
            if fraction not in (0.0, served):
                how = f"{served:g} (its --ane-fraction)" if served else "0 (start it with --ane-fraction F to split)"
                raise RequestError(400, f"'ane_fraction' {fraction:g}: this server splits prefill at {how}; send that, "
                                   "0 for GPU-only, or leave it out", "ane_fraction")
        room = self.engine.max_context - len(ids)
        if required_max and body.get(max_name) is None:
            raise RequestError(400, f"'{max_name}' is required", max_name)
        max_tokens = integer(body, max_name, self.default_max_tokens, POSITIVE_INT)
        mtp = boolean(body, "mtp", None)
        if mtp and not self.engine.model.has_mtp:
            raise RequestError(400, "'mtp': this model has no MTP head", "mtp")
        d = self.defaults
        sampling = SamplingParams(
            temperature=number(body, "temperature", d["temperature"], OPENAI_TEMPERATURE),
            top_k=integer(body, "top_k", d["top_k"], TOP_K), top_p=number(body, "top_p", d["top_p"], TOP_P),
            min_p=number(body, "min_p", d["min_p"], MIN_P))
        options = DecodeOptions(min(max_tokens, room), sampling, integer(body, "seed", None, SEED), mtp=mtp)
        return Job(ids=ids, options=options, stream=bool(boolean(body, "stream", False)), ane_fraction=fraction,
                   model=body.get("model") if isinstance(body.get("model"), str) else None)
