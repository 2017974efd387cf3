"""What every per-token gate on generation shares: a grammar's `Constraint` and a `ThinkingBudget` both mask the
next token from the tokens consumed so far, and both consume a run of drafted tokens the same way."""

from __future__ import annotations


class TokenGate:
    """Base of a gate with `mask()` (allowed next tokens), `advance(token)` and `ended`."""

    def extend(self, tokens: list[int]) -> int:
        """Consume the allowed prefix of `tokens` (point-mass drafts), computing the mask before each; returns how
        many were consumed. An EOS ends the prefix: nothing after it is decoded."""
        for n, t in enumerate(tokens):
            if self.ended or not self.mask()[t]:
                return n
            self.advance(t)
        return len(tokens)
