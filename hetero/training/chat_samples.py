"""Chat-format training samples for the bundled model, made from the standard library's own docstrings and code.

Each sample is one ChatML conversation rendered exactly as the bundled chat template renders it
(`<|im_start|>role\\n...<|im_end|>\\n`), so that the model learns where an assistant reply starts and, above all,
that it ends with `<|im_end|>` within a few hundred tokens. The questions ask what a function does (answered by its
docstring's first paragraph), ask for a function (answered by its source in a fenced block), or greet; some carry a
system prompt, some are two turns long. Everything is drawn from a seeded generator, so the same corpus and seed
give the same samples.
"""

from __future__ import annotations

import ast
import random
import textwrap
from dataclasses import dataclass
from typing import Iterable, Iterator

MAX_SOURCE_CHARS = 900  # a reply of at most ~300 tokens in the bundled tokenizer
MAX_DOC_CHARS = 500

SYSTEM_PROMPTS = [
    "You are a helpful coding assistant.",
    "You are a coding agent. Answer briefly.",
    "You are an assistant for Python programmers. Keep answers short and exact.",
    "You help the user with their code. Use the tools you are given when they help.",
]
GREETINGS = [
    ("Say hello.", "Hello! How can I help with your code?"),
    ("Hello", "Hello! What are you working on?"),
    ("hi", "Hi! What can I do for you?"),
    ("Thanks!", "You're welcome."),
    ("Are you there?", "Yes. What do you need?"),
    ("Reply with one word.", "Done."),
]
EXPLAIN = [
    "What does `{name}` do?",
    "Explain `{module}.{name}`.",
    "What is {name} in {module} for?",
    "Briefly, what does the {kind} {name} do?",
]
WRITE = [
    "Write a Python {kind} `{name}`: {summary}",
    "Show me the code of `{module}.{name}`.",
    "Implement {name}. {summary}",
]


@dataclass(frozen=True)
class Definition:
    """One documented function or class of a module: its names, docstring summary and source."""

    module: str
    name: str
    kind: str  # "function" or "class"
    summary: str
    source: str


def definitions(module: str, source: str) -> Iterator[Definition]:
    """The documented top-level and nested functions and classes of one module's source (unparsable files: none)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.name.startswith("__"):
            continue
        summary = " ".join(doc.split("\n\n")[0].split())[:MAX_DOC_CHARS]
        code = ast.get_source_segment(source, node)
        if not summary or code is None:
            continue
        code = textwrap.dedent(" " * node.col_offset + code)
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        yield Definition(module, node.name, kind, summary, code)


def documented(modules: Iterable[tuple[str, str]]) -> list[Definition]:
    """Every documented definition of the (module name, source) pairs, in order."""
    return [d for module, source in modules for d in definitions(module, source)]


def render(messages: list[tuple[str, str]]) -> str:
    """ChatML as the bundled template writes it: one `<|im_start|>role\\ncontent<|im_end|>\\n` per message."""
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)


def exchange(d: Definition, rng: random.Random) -> tuple[str, str]:
    """One (question, answer) pair about a definition: explain it, or write it when its source is short enough."""
    fields = dict(name=d.name, module=d.module, kind=d.kind, summary=d.summary)
    if len(d.source) <= MAX_SOURCE_CHARS and rng.random() < 0.5:
        return rng.choice(WRITE).format(**fields), f"```python\n{d.source.rstrip()}\n```"
    return rng.choice(EXPLAIN).format(**fields), f"`{d.name}`: {d.summary}"


def conversations(modules: Iterable[tuple[str, str]], seed: int = 0) -> list[str]:
    """Rendered conversations from (module name, source) pairs: one or two exchanges each, some with a system prompt."""
    rng = random.Random(seed)
    pool = documented(modules)
    rng.shuffle(pool)
    out = []
    for i, d in enumerate(pool):
        messages = [("system", rng.choice(SYSTEM_PROMPTS))] if rng.random() < 0.6 else []
        if i % 10 == 0:
            messages += list(zip(("user", "assistant"), rng.choice(GREETINGS)))
        messages += list(zip(("user", "assistant"), exchange(d, rng)))
        if rng.random() < 0.25:
            messages += list(zip(("user", "assistant"), exchange(rng.choice(pool), rng)))
        out.append(render(messages))
    return out


TITLE_SYSTEM = ("Generate a concise, sentence-case title (3-7 words) for the conversation. "
                'Reply with JSON: {"title": "..."}')


def title_requests(modules: Iterable[tuple[str, str]], seed: int = 0, count: int = 400) -> list[str]:
    """Rendered title requests, as agents send them in the background: a conversation's first question, answered
    with a short JSON title (so a reply constrained to a JSON schema closes its string and its object)."""
    rng = random.Random(seed)
    pool = documented(modules)
    out = []
    for d in rng.sample(pool, min(count, len(pool))):
        question, _ = exchange(d, rng)
        title = f"{'Code of' if question.startswith(('Write', 'Show', 'Implement')) else 'About'} {d.name}"
        out.append(render([("system", TITLE_SYSTEM), ("user", question), ("assistant", f'{{"title": "{title}"}}')]))
    return out
