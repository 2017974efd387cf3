"""A checkpoint's chat contract, read from its own chat template: the switches it names (`enable_thinking`,
`reasoning_effort`, `preserve_thinking`), the reasoning-effort levels it accepts, and how it closes a think block.

Nothing here is written per model. The variables come from the template's syntax tree; the effort levels from
rendering a one-message conversation at each effort name the APIs use (a name the template refuses with
`raise_exception` is not one of its levels); the closing text from an assistant turn with reasoning rendered by
the template (what it writes between the reasoning and the answer, e.g. `\\n</think>\\n\\n`), or else from what
`enable_thinking=False` adds to the generation prompt. `effort(name)` maps an API's effort name onto the
template's levels (the table in docs/server.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from hetero.checkpoint.tokenizer import TemplateRaised, Tokenizer
from hetero.errors import HeteroError

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # every API's effort names, least first
THINKING_OFF = ("none", "minimal")  # a template without effort levels: these turn its enable_thinking off
PROBE = [{"role": "user", "content": "hi"}]
_REASONING, _ANSWER = "hetero-probe-reasoning", "hetero-probe-answer"  # markers found again in a rendering


@dataclass(frozen=True)
class ChatContract:
    """What one chat template accepts: `variables` it reads, the `levels` of EFFORTS it takes as `reasoning_effort`
    (least first; empty when it names no such variable), and `think_close`, the text that closes its think block
    (None: it has none)."""

    variables: frozenset[str]
    levels: tuple[str, ...] = ()
    think_close: str | None = None

    @property
    def names_effort(self) -> bool:
        """Whether the template reads `reasoning_effort`."""
        return "reasoning_effort" in self.variables

    def defaults(self) -> dict:
        """Template variables every request gets unless it sets them: `preserve_thinking` on where the template
        names it (Qwen3.8's contract: earlier turns keep their reasoning, so the next prompt extends the last)."""
        return {"preserve_thinking": True} if "preserve_thinking" in self.variables else {}

    def effort(self, name: str, switch: bool = True) -> dict:
        """The template variables for an API's effort `name`.

        A template that reads `reasoning_effort` gets `name` when it is one of its levels; otherwise `none` turns
        its `enable_thinking` off (where it names that switch), and any other name of EFFORTS takes the nearest
        level (a tie goes to the higher one). A name outside EFFORTS reaches the template as sent: the template
        judges it (`refusal`). A template without `reasoning_effort` gets `enable_thinking` off for THINKING_OFF and
        on for the rest when `switch` (the OpenAI routes), nothing otherwise (Anthropic: `thinking` is the switch).
        """
        if not self.names_effort:
            return {"enable_thinking": name not in THINKING_OFF} if switch else {}
        if name in self.levels or name not in EFFORTS or not self.levels:
            return {"reasoning_effort": name}
        if name == "none" and "enable_thinking" in self.variables:
            return {"enable_thinking": False}
        return {"reasoning_effort": nearest(name, self.levels)}


def nearest(name: str, levels: tuple[str, ...]) -> str:
    """The level of `levels` (names of EFFORTS) closest to `name` on the EFFORTS scale; a tie goes up."""
    at = EFFORTS.index(name)
    return min(levels, key=lambda level: (abs(EFFORTS.index(level) - at), -EFFORTS.index(level)))


@lru_cache(maxsize=16)
def chat_contract(tokenizer: Tokenizer) -> ChatContract:
    """The contract of `tokenizer`'s chat template (read once per tokenizer); an empty one without a template."""
    if not tokenizer.has_chat_template:
        return ChatContract(frozenset())
    variables = tokenizer.template_variables
    levels = ()
    if "reasoning_effort" in variables:
        levels = tuple(name for name in EFFORTS if refusal(tokenizer, {"reasoning_effort": name}) is None)
    return ChatContract(variables, levels, think_close(tokenizer))


def refusal(tokenizer: Tokenizer, template_kwargs: dict) -> str | None:
    """The template's own message when it refuses `template_kwargs` (its `raise_exception`) on a one-message
    conversation; None when it renders, or fails for another reason (the real request's rendering reports that)."""
    try:
        tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, **template_kwargs)
    except TemplateRaised as e:
        return e.message
    except HeteroError:
        return None
    return None


def think_close(tokenizer: Tokenizer) -> str | None:
    """The text the template closes a think block with: what it writes between an assistant turn's reasoning and
    its answer, else what `enable_thinking=False` adds to the generation prompt; None if neither shows one."""
    turn = PROBE + [{"role": "assistant", "content": _ANSWER, "reasoning_content": _REASONING}]
    try:
        text = tokenizer.apply_chat_template(turn, add_generation_prompt=False, preserve_thinking=True)
        start = text.find(_REASONING)
        end = text.find(_ANSWER, start + len(_REASONING)) if start >= 0 else -1
        if end >= 0 and text[start + len(_REASONING) : end].strip():
            return text[start + len(_REASONING) : end]
    except HeteroError:
        pass
    try:
        on = tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, enable_thinking=True)
        off = tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, enable_thinking=False)
    except HeteroError:
        return None
    return off[len(on) :] if off.startswith(on) and off[len(on) :].strip() else None
