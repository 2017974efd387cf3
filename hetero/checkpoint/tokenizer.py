"""Tokenizer: HF `tokenizer.json` via `tokenizers`, chat templates via sandboxed Jinja, streaming detokenization.

`Tokenizer.from_dir` reads a model directory the way transformers does (tokenizer.json, tokenizer_config.json,
chat_template.jinja) without importing transformers. `StreamingDetokenizer` turns a token stream into text
chunks that never end in half a UTF-8 character.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hetero.errors import HeteroError

_REPLACEMENT = "\ufffd"
# Cap on tokens held back waiting for a character to complete: only a model emitting garbage bytes reaches it,
# and flushing then keeps each add() O(1) instead of re-decoding an ever-growing window.
_MAX_PENDING = 128


def _one_line(exc: BaseException) -> str:
    """First line of an exception's message, so HeteroError messages stay one line."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config: a string, or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {name, template} (take "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class TemplateRaised(HeteroError):
    """The chat template itself refused its input (`raise_exception(message)`); `message` is the template's own."""

    def __init__(self, message: str) -> None:
        super().__init__(f"chat template refused the messages: {message}")
        self.message = message


def _raise_exception(message: str) -> None:
    raise TemplateRaised(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's override: Jinja's own tojson HTML-escapes, which would change the prompt
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _compile_template(source: str) -> jinja2.Template:
    return _environment().from_string(source)


class Tokenizer:
    """A HF fast tokenizer plus the bits of tokenizer_config the engine needs (special tokens, chat template)."""

    def __init__(self, tok: tokenizers.Tokenizer, chat_template: str | None = None,
                 eos_token: str | None = None, bos_token: str | None = None, source: str = "tokenizer") -> None:
        self._tok = tok
        self.chat_template = chat_template
        self.eos_token = eos_token
        self.bos_token = bos_token
        self._source = source  # named in errors, e.g. the model directory
        self._template: jinja2.Template | None = None
        self._plain: tokenizers.Tokenizer | None = None  # `encode_plain`'s copy

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load tokenizer.json, and tokenizer_config.json / chat_template.jinja when present, from a model dir."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise HeteroError(f"{tok_file} not found; the model directory needs a HF tokenizer.json")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise HeteroError(f"cannot parse {tok_file} ({_one_line(e)}); re-download or re-export it") from e

        config: dict[str, Any] = {}
        config_file = path / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise HeteroError(f"cannot parse {config_file} ({_one_line(e)}); fix or delete it") from e
            if not isinstance(config, dict):
                raise HeteroError(f"{config_file} is not a JSON object; fix or delete it")

        template = _pick_template(config.get("chat_template"))
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():  # newer HF exports keep the template here; it wins over tokenizer_config
            try:
                template = jinja_file.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise HeteroError(f"{jinja_file} is not UTF-8 text ({_one_line(e)}); fix or delete it") from e
        return cls(tok, chat_template=template, eos_token=_token_content(config.get("eos_token")),
                   bos_token=_token_content(config.get("bos_token")), source=str(path))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, adding no BOS/EOS; special tokens written literally map to their single ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` with special tokens written in it read as plain text (a message that quotes
        `<|image_pad|>` must not become an image slot): a copy of the tokenizer that splits them, made once."""
        if self._plain is None:
            plain = tokenizers.Tokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens included."""
        return self._tok.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        """Number of tokens including added/special ones (the model's embedding may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> set[int]:
        """Id of tokenizer_config's eos_token, if any; the engine adds config/generation_config ids."""
        tid = self.token_to_id(self.eos_token) if self.eos_token else None
        return {tid} if tid is not None else set()

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry (e.g. "<|im_end|>"), or None if absent."""
        return self._tok.token_to_id(token)

    @property
    def has_chat_template(self) -> bool:
        """Whether a chat template was found."""
        return bool(self.chat_template)

    @property
    def template_variables(self) -> frozenset[str]:
        """The variables the chat template reads from its caller (e.g. `enable_thinking`, `reasoning_effort`,
        `preserve_thinking`), from its Jinja syntax tree; empty without a template or when it does not parse."""
        if not self.chat_template:
            return frozenset()
        try:
            tree = _environment().parse(self.chat_template)
        except jinja2.TemplateError:
            return frozenset()  # apply_chat_template reports it
        return frozenset(jinja2.meta.find_undeclared_variables(tree))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None, **kwargs: Any) -> str:
        """Render `messages` to a prompt string with the model's Jinja chat template, as transformers would.

        `tools` (function definitions, as `hetero.tools.openai_tools` writes them) and keyword arguments (e.g.
        `enable_thinking=False`, `preserve_thinking=True`) reach the template as its variables.
        """
        if not self.chat_template:
            raise HeteroError(f"{self._source} has no chat template; run without --chat or add chat_template.jinja")
        if self._template is None:
            try:
                self._template = _compile_template(self.chat_template)
            except jinja2.TemplateError as e:
                raise HeteroError(f"chat template of {self._source} does not compile ({_one_line(e)}); "
                                  "fix chat_template.jinja") from e
        context = {"messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
                   "bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        try:
            return self._template.render(**context)
        except jinja2.TemplateError as e:
            raise HeteroError(f"chat template of {self._source} failed ({_one_line(e)}); "
                              "check the messages' roles and fields") from e

    def detokenizer(self) -> "StreamingDetokenizer":
        """A fresh streaming detokenizer over this tokenizer."""
        return StreamingDetokenizer(self)


class StreamingDetokenizer:
    """Incremental decode: add() returns only new, complete text; the chunks join to exactly decode(ids).

    Tokens since the last emission form a pending window. The window is decoded behind a prefix (the previously
    emitted window) and the prefix's text is subtracted, so decoders that strip a leading space at the start of
    a sequence (Metaspace, SentencePiece) still give the window its space. Text is emitted only when it does not
    end in U+FFFD, i.e. when no multibyte character is split across tokens.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._prefix: list[int] = []   # last emitted window: context for the next decode
        self._prefix_text = ""         # decode(self._prefix)
        self._pending: list[int] = []  # tokens not yet turned into emitted text
        self.text = ""                 # all text emitted so far

    def add(self, token_id: int) -> str:
        """Feed one token; return the newly printable text (possibly "")."""
        self._pending.append(token_id)
        new = self._tokenizer.decode(self._prefix + self._pending)
        # a shorter-or-equal decode means the window has no text yet (e.g. an empty token): keep waiting
        if len(new) <= len(self._prefix_text):
            return ""
        if new.endswith(_REPLACEMENT) and len(self._pending) < _MAX_PENDING:
            return ""
        return self._emit(new)

    def finalize(self) -> str:
        """Flush the pending tokens (their text may contain U+FFFD if the bytes really were invalid)."""
        if not self._pending:
            return ""
        new = self._tokenizer.decode(self._prefix + self._pending)
        if len(new) <= len(self._prefix_text):
            self._pending = []
            return ""
        return self._emit(new)

    def _emit(self, new: str) -> str:
        chunk = new[len(self._prefix_text):]
        decoded_window = self._tokenizer.decode(self._pending)
        self._prefix, self._pending = self._pending, []
        self._prefix_text = decoded_window
        self.text += chunk
        return chunk


def eos_ids(config_eos: Sequence[int], tokenizer: Tokenizer, path: Path) -> set[int]:
    """A checkpoint's EOS ids: config.json's (`config_eos`, the model args' eos_token_id), tokenizer_config's eos_token
    and generation_config.json's eos_token_id, merged."""
    ids = set(config_eos) | set(tokenizer.eos_token_ids)
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError:
            eos = None
        ids |= {eos} if isinstance(eos, int) else set(eos or [])
    return ids
