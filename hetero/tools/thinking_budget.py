"""A thinking budget: once a think block has taken its tokens, the block is closed the way the chat template
closes it, and the answer follows.

`ThinkingBudget` follows one generation token by token, as a grammar's `Constraint` does, and has its interface
(`apply`, `advance`, `extend`, `ended`, `recent_masks`, `rollback`), so the decoders mask with it wherever they mask
with a grammar: the first token, every MTP draft and every verify position. A drafted token past the budget is
therefore never thinking: the draft head and the verify row both allow only the closing tokens there, and
speculative decoding keeps plain decoding's output exactly.

The block's budget counts its tokens after the open tag, the closing text's included: with budget B and a closing
text of c tokens (e.g. `\\n</think>\\n\\n`, from `hetero.checkpoint.chat_contract.think_close`) the closing text is forced after
B - c thinking tokens, so the think block ends by its B-th token. A model that closes the block itself earlier
(its text shows the closing tag) is left alone. Generation starts inside the block when the prompt opens it
(Qwen3.5 / 3.6 / 3.8), else the block counts from an open tag the output starts with; an output that starts with
anything else is an answer and is never touched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from hetero.errors import HeteroError
from hetero.tools.reasoning import OPEN
from hetero.tools.token_gate import TokenGate

_KEEP = 32  # states kept behind the newest position: a verify pass reads at most MAX_DEPTH + 1 of them


@dataclass(frozen=True)
class _State:
    """Where the output stands after some tokens: `phase` is "start" (it may still open a block), "thinking",
    "closing" (writing the closing text), "answer" or "ended" (past EOS); `spent` counts thinking tokens, `written`
    closing tokens, `head` the output's tokens while it may still open a block."""

    phase: str
    spent: int = 0
    written: int = 0
    head: tuple[int, ...] = ()


class ThinkingBudget(TokenGate):
    """Masks one generation so its think block takes at most `budget` tokens, closed by `close_ids`."""

    def __init__(self, budget: int, close_ids: Sequence[int], close_tag: str, opened: bool,
                 decode: Callable[[list[int]], str], eos_ids: set[int], vocab_size: int):
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise HeteroError(f"a thinking budget must be a whole number of tokens (0 or more), got {budget!r}")
        if not close_ids or not close_tag:
            raise HeteroError("a thinking budget needs the chat template's closing text for its think block")
        self.budget, self.close_ids, self.close_tag = budget, list(close_ids), close_tag
        self.decode = decode
        self.eos_ids = np.array(sorted(eos_ids), dtype=np.int64)
        self.vocab_size = vocab_size
        self.length = 0  # tokens consumed
        self._tokens: list[int] = []  # every token consumed
        self._states = {0: self._settle(_State("thinking") if opened else _State("start"))}
        self._free = np.ones(vocab_size, dtype=bool)
        self._masks: dict[tuple[str, int], np.ndarray] = {}

    # the Constraint interface

    def mask(self) -> np.ndarray:
        """bool [V]: the tokens allowed after everything consumed so far."""
        return self._mask_of(self._states[self.length])

    @property
    def ended(self) -> bool:
        """An EOS was consumed: nothing but EOS may follow."""
        return self._states[self.length].phase == "ended"

    def apply(self, logits: mx.array) -> mx.array:
        """logits [V] -> the same with disallowed tokens at -inf (unchanged while the output is free)."""
        state = self._states[self.length]
        if state.phase not in ("closing", "ended"):
            return logits
        return mx.where(mx.array(self._mask_of(state)), logits, -mx.inf)

    def recent_masks(self, n: int) -> mx.array:
        """bool [n, V]: the masks at the last n states (the current one last)."""
        return mx.array(np.stack([self._mask_of(self._states[self.length - n + 1 + i]) for i in range(n)]))

    def advance(self, token: int) -> None:
        """Consume one token; it must be allowed (a bug otherwise: every token decoded here was masked)."""
        state = self._states[self.length]
        if not self._mask_of(state)[token]:
            raise RuntimeError(f"thinking budget: token {token} is not allowed in phase {state.phase}")
        self._tokens.append(token)
        self.length += 1
        self._states[self.length] = self._next(state, token)
        if len(self._states) > 2 * _KEEP:
            self._states = {n: s for n, s in self._states.items() if n > self.length - _KEEP}

    def rollback(self, n: int) -> None:
        """Forget the last n consumed tokens (rejected drafts)."""
        for length in range(self.length - n + 1, self.length + 1):
            self._states.pop(length, None)
        self.length -= n
        del self._tokens[len(self._tokens) - n :]

    # the state machine

    def _mask_of(self, state: _State) -> np.ndarray:
        if state.phase == "closing":
            key = ("closing", state.written)
            if key not in self._masks:
                only = np.zeros(self.vocab_size, dtype=bool)
                only[self.close_ids[state.written]] = True
                self._masks[key] = only
            return self._masks[key]
        if state.phase == "ended":
            if ("ended", 0) not in self._masks:
                only = np.zeros(self.vocab_size, dtype=bool)
                only[self.eos_ids] = True
                self._masks[("ended", 0)] = only
            return self._masks[("ended", 0)]
        return self._free

    def _settle(self, state: _State) -> _State:
        """A thinking state whose budget leaves room only for the closing text starts closing."""
        if state.phase == "thinking" and state.spent + len(self.close_ids) >= self.budget:
            return _State("closing")
        return state

    def _next(self, state: _State, token: int) -> _State:
        if state.phase == "ended" or token in self.eos_ids:
            return _State("ended")
        if state.phase == "closing":
            written = state.written + 1
            return _State("answer") if written == len(self.close_ids) else _State("closing", written=written)
        if state.phase == "thinking":
            if self.close_tag in self.decode(self._tokens[-len(self.close_tag) :]):  # the model closed it itself
                return _State("answer")
            return self._settle(_State("thinking", spent=state.spent + 1))
        if state.phase == "start":
            head = state.head + (token,)
            text = self.decode(list(head)).lstrip()
            if text.startswith(OPEN):
                return self._settle(_State("thinking"))
            return _State("start", head=head) if OPEN.startswith(text) else _State("answer")
        return state  # answer: free to the end
