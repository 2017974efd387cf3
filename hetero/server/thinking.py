"""Reasoning effort and thinking budgets, as the three APIs send them, onto the checkpoint's chat contract.

Effort: OpenAI chat `reasoning_effort`, Responses `reasoning.effort` and Anthropic `output_config.effort` become
template variables by `ChatContract.effort` (the table in docs/server.md): `reasoning_effort` for a template that
reads it, else the `enable_thinking` switch (OpenAI routes; Anthropic's switch is `thinking`). A value the template
refuses is a 400 carrying the template's own message. Budget: Anthropic `thinking.budget_tokens` and OpenAI
`max_thinking_tokens` become the Job's `thinking_budget` (`hetero.tools.thinking_budget`), for a template with a think
block to close.
"""

from __future__ import annotations

from typing import Any

from hetero.checkpoint.chat_contract import EFFORTS, chat_contract, refusal
from hetero.server.requests import Parser
from hetero.server.refusals import RequestError, refusing
from hetero.validate import NONNEG_INT


def effort_kwargs(parser: Parser, name: Any, param: str, switch: bool = True) -> dict:
    """The template variables for an effort `name` sent as `param` (a 400 for a name the template refuses, or, on a
    template without effort levels, for a name outside EFFORTS)."""
    tokenizer = parser.engine.tokenizer
    contract = chat_contract(tokenizer)
    if not isinstance(name, str) or not contract.names_effort and name not in EFFORTS:
        raise RequestError(400, f"'{param}' must be one of {list(EFFORTS)}, got {name!r}", param)
    kwargs = contract.effort(name, switch)
    with refusing(param, "the chat template cannot render this effort"):
        refused = refusal(tokenizer, kwargs) if "reasoning_effort" in kwargs else None
    if refused is not None:
        raise RequestError(400, f"'{param}' {name!r}: the chat template refuses it: {refused}", param)
    return kwargs


def thinking_budget(parser: Parser, value: Any, param: str, strict: bool = True) -> int | None:
    """A thinking budget in tokens (None: absent), for a template whose think block can be closed. On a template
    without one it is a 400, or (not `strict`: Anthropic's `budget_tokens`, which `thinking: enabled` requires, so
    clients send it whatever the model) None."""
    if value is None:
        return None
    why = NONNEG_INT.problem(value)
    if why is not None:
        raise RequestError(400, f"'{param}' {why}", param)
    if chat_contract(parser.engine.tokenizer).think_close is None:
        if not strict:
            return None
        raise RequestError(400, f"'{param}': this model's chat template has no think block to close; leave it out",
                           param)
    return value
