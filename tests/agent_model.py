"""Tiny checkpoints that drive one tool loop of a real agent CLI (tests/test_agent_clis.py), trained by
`python tests/shipped_models.py agent-CLI` and shipped in tests/models/agent-CLI.

One model per CLI: asked anything, it calls that CLI's shell tool (`CALLS[cli]`: Claude Code's `Bash`, Codex's
`exec_command`, OpenCode's `bash`) with `COMMAND`, which makes a file; given the tool's result, it answers
`FINAL_ANSWER`. The CLIs send 10-40K-character prompts of their own (instructions, tool schemas, environment), so
every training sample puts a random stretch of unrelated text and a random set of tools before the exchange, with
the thinking switch either way: what decides the reply is only the end of the prompt. Its layers are all Gated
DeltaNet, whose decaying state forgets what came long before (`slow_decay`: but not the last ten-odd tokens), so a
prompt far longer than the training samples ends the same way (`verify_agent_model` checks it up to 30K characters).
Same Qwen3.6 template, tokenizer recipe, training to a reply margin and checkpoint layout as `tests/tool_model.py`.
"""

from __future__ import annotations

import hetero  # before MLX: the fast BLAS under it
from pathlib import Path

import mlx.core as mx
import numpy as np

from tool_model import MIN_MARGIN, TEMPLATE, fit_and_save, render_with

COMMAND = "touch hetero-proof"
PROOF_FILE = "hetero-proof"
FINAL_ANSWER = "Done: the proof file is made."
CALLS = {"claude": ("Bash", "command"), "codex": ("exec_command", "cmd"), "opencode": ("bash", "command")}
PROMPTS = {cli: f"{cli}: make the proof file." for cli in CALLS}
FILLER_SOURCES = [Path(__file__).resolve().parents[1] / "README.md", Path(__file__).resolve().parents[1] / "docs"]


def tool(name: str, argument: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"Run {name}.", "parameters": {
        "type": "object", "properties": {argument: {"type": "string"}}, "required": [argument]}}}


def filler_text() -> str:
    paths = [p for src in FILLER_SOURCES for p in ([src] if src.is_file() else sorted(src.glob("*.md")))]
    return "\n".join(p.read_text(encoding="utf-8") for p in paths)


def conversation(cli: str, rng: np.random.Generator, text: str) -> list[tuple[str, str]]:
    """Both exchanges of `cli`'s tool loop after a random system text and tool list: (prompt, reply) twice."""
    name, argument = CALLS[cli]
    start = int(rng.integers(0, len(text) - 3000))
    system = text[start : start + int(rng.integers(0, 300))]
    others = [tool(f"tool_{i}", "x") for i in rng.choice(20, size=int(rng.integers(0, 3)), replace=False)]
    tools = [tool(name, argument), *others]
    rng.shuffle(tools)
    thinking = bool(rng.integers(0, 2))
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": name, "arguments": {argument: COMMAND}}}]}
    result = "" if rng.integers(0, 2) else text[start : start + int(rng.integers(1, 200))]
    ask = [PROMPTS[cli], f'"{PROMPTS[cli]}"', f"{text[start : start + int(rng.integers(1, 200))]}\n{PROMPTS[cli]}"]
    user = ask[int(rng.integers(0, len(ask)))]  # as typed, quoted (OpenCode), after context (Claude Code's reminders)
    first = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    second = first + [call, {"role": "tool", "content": result, "tool_call_id": "call_0"}]
    pairs = []
    for messages, reply in ((first, call), (second, {"role": "assistant", "content": FINAL_ANSWER})):
        prompt = render_with(messages, tools, enable_thinking=thinking)
        full = render_with(messages + [reply], tools, add_generation_prompt=False, enable_thinking=thinking)
        assert full.startswith(prompt), "the template's generation prompt must prefix the rendered reply"
        pairs.append((prompt, full[len(prompt) :].rstrip("\n")))
    return pairs


def write_agent_model(path: Path, cli: str, samples: int = 24, seed: int = 0) -> dict:
    """Train `cli`'s agent model on `samples` random conversations and write its checkpoint to `path`; returns what
    the fit reached (tests/tool_model.py `_train`)."""
    rng = np.random.default_rng(seed)
    text = filler_text()
    pairs = [pair for _ in range(samples) for pair in conversation(cli, rng, text)]
    shape = dict(hidden_size=64, num_hidden_layers=3, intermediate_size=128, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
                 linear_key_head_dim=32, linear_value_head_dim=32, full_attention_interval=4)  # all Gated DeltaNet
    return fit_and_save(Path(path), pairs, shape, lr=8e-3, seed=seed, max_steps=1500, min_margin=MIN_MARGIN, batch=8,
                        prepare=slow_decay)


def slow_decay(model) -> None:
    """Decay rates A ~ U(0.02, 1) instead of U(1, 16): a state that keeps the last ten-odd tokens (the tool's result
    tag is eight back when the reply starts) yet forgets a page of text."""
    for layer in model.layers:
        mixer = layer.linear_attn
        mixer.A_log = mx.log(mx.random.uniform(0.02, 1.0, mixer.A_log.shape))


def verify_agent_model(path: Path, cli: str, conversations: int = 8, prefixes=(0, 3000, 30000)) -> dict:
    """Greedy replies of the checkpoint at `path` (hetero's engine) on held-out conversations, each with every
    prefix length of unrelated text put before its system text (the CLIs send 10-40K characters): both exchanges
    must give their reply exactly. Returns the counts checked; raises on the first reply that differs."""
    engine = hetero.load(str(path))
    rng = np.random.default_rng(123)  # not the training seed: conversations the model never saw
    text = filler_text()
    checked = 0
    for _ in range(conversations):
        pairs = conversation(cli, rng, text)
        for n in prefixes:
            start = int(rng.integers(0, len(text) - n))
            for prompt, reply in pairs:
                long = prompt.replace("<|im_start|>system\n", "<|im_start|>system\n" + text[start : start + n], 1)
                got = engine.generate(long, max_tokens=80).text
                if got.strip() != reply.replace("<|im_end|>", "").strip():
                    raise RuntimeError(f"{cli}'s agent model after {len(long)} characters replied {got[:120]!r}, "
                                       f"not {reply[:120]!r}")
                checked += 1
    return {"replies": checked, "prefix_chars": list(prefixes)}


if __name__ == "__main__":  # python tests/agent_model.py DIR CLI: train into DIR, then verify
    import sys
    import time

    t0 = time.perf_counter()
    print(write_agent_model(Path(sys.argv[1]), sys.argv[2]), f"trained in {time.perf_counter() - t0:.0f} s")
    print(verify_agent_model(Path(sys.argv[1]), sys.argv[2]))
