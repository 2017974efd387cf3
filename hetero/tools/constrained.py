"""Constrained decoding: JSON Schema / JSON objects through llguidance's token-level matcher.

A `Constraint` follows one generation: `mask()` is the set of tokens the grammar allows next (EOS only where the
matcher accepts), `advance` consumes a token, `rollback` forgets the last n (rejected drafts). Decoding masks the
target logits with it before warping, so a constrained run samples from warp(masked logits) at every position;
speculative rounds mask every verify position given the prefix plus the drafts before it, and mask the draft
head too, so constrained MTP has exactly constrained plain decoding's output distribution.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer

from hetero.errors import HeteroError
from hetero.tools.token_gate import TokenGate

# json.dumps' separators and no free whitespace: a model cannot pad the output with spaces until max_tokens
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}  # response_format json_object
_KEEP = 32  # masks kept behind the newest position: a verify pass reads at most MAX_DEPTH + 1 of them


def grammar_tokenizer(tokenizer_json: Path, vocab_size: int, eos_ids: set[int]) -> LLTokenizer:
    """llguidance's view of the vocabulary, built from the checkpoint's tokenizer.json (once per engine).

    `vocab_size` is the model's (its embedding may have more rows than the tokenizer has tokens: those rows are
    never allowed); the smallest EOS id stands for all of them inside the matcher.
    """
    if not eos_ids:
        raise HeteroError("constrained decoding needs an EOS token id (config.json, generation_config.json or "
                          "tokenizer_config.json name none)")
    try:
        return LLTokenizer(tokenizer_json.read_text(encoding="utf-8"), n_vocab=vocab_size, eos_token=min(eos_ids))
    except ValueError as e:
        raise HeteroError(f"constrained decoding cannot use {tokenizer_json}: {e}") from e


def json_schema_grammar(schema: dict, tokenizer: LLTokenizer) -> str:
    """A JSON Schema (a dict) -> an llguidance grammar, checked; HeteroError names what the schema gets wrong."""
    if not isinstance(schema, dict):
        raise HeteroError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise HeteroError(f"invalid JSON schema: {e}") from e
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise HeteroError(f"unsupported JSON schema: {messages[0]}")
    return grammar


class Constraint(TokenGate):
    """A grammar matcher over one generation's output tokens, with per-position masks cached for verify passes."""

    def __init__(self, tokenizer: LLTokenizer, grammar: str, eos_ids: set[int]):
        self.matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            first = (self.matcher.get_error().strip().splitlines() or ["it does not compile"])[0]
            raise HeteroError(f"the output grammar (a JSON schema's, a forced call's or one given) is refused: {first}")
        self.vocab_size = tokenizer.vocab_size
        self.eos = tokenizer.eos_token  # the matcher's one EOS id
        self.eos_ids = np.array(sorted(eos_ids), dtype=np.int64)
        self._bits = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)  # llguidance's bitmask layout
        self.length = 0  # tokens consumed
        self.past_eos = 0  # EOS tokens at the end of what was consumed (the matcher never saw them)
        self._masks: dict[int, np.ndarray] = {}  # length -> mask [V] at that state

    def mask(self) -> np.ndarray:
        """bool [V]: the tokens allowed after everything consumed so far (every EOS id only where it may end)."""
        cached = self._masks.get(self.length)
        if cached is not None:
            return cached
        if self.ended:  # past an EOS only the (never decoded) position after it is asked for: EOS again
            allowed = np.zeros(self.vocab_size, dtype=bool)
            allowed[self.eos_ids] = True
        else:
            self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size].view(bool)  # [V]
            allowed[self.eos_ids] = allowed[self.eos]
        self._masks[self.length] = allowed
        if len(self._masks) > 2 * _KEEP:
            self._masks = {n: m for n, m in self._masks.items() if n > self.length - _KEEP}
        return allowed

    @property
    def ended(self) -> bool:
        """An EOS was consumed: nothing but EOS may follow."""
        return self.past_eos > 0

    def apply(self, logits: mx.array) -> mx.array:
        """logits [V] -> the same with disallowed tokens at -inf (the mask at the current state)."""
        return mx.where(mx.array(self.mask()), logits, -mx.inf)

    def recent_masks(self, n: int) -> mx.array:
        """bool [n, V]: the masks at the last n states (the current one last), as a verify pass over the last n-1
        consumed tokens needs them; the earlier ones were computed when those tokens were proposed."""
        self.mask()
        return mx.array(np.stack([self._masks[self.length - n + 1 + i] for i in range(n)]))

    def advance(self, token: int) -> None:
        """Consume one token; it must be allowed (a bug otherwise: every token decoded here was masked).

        An EOS stays out of the matcher (llguidance does not count it as a token when rolling back): it only marks
        the constraint ended, which a rollback over it undoes."""
        if token in self.eos_ids:
            if not self.mask()[token]:
                raise RuntimeError(f"constraint: EOS {token} before the JSON is complete")
            self.past_eos += 1
        elif self.ended or not self.matcher.consume_token(token):
            raise RuntimeError(f"constraint: token {token} is not allowed here ({self.matcher.get_error()})")
        self.length += 1

    def rollback(self, n: int) -> None:
        """Forget the last n consumed tokens (rejected drafts)."""
        if n == 0:
            return
        eos = min(n, self.past_eos)
        if n > eos and not self.matcher.rollback(n - eos):
            raise RuntimeError(f"constraint: cannot roll back {n} tokens ({self.matcher.get_error()})")
        for length in range(self.length - n + 1, self.length + 1):
            self._masks.pop(length, None)
        self.length -= n
        self.past_eos -= eos
