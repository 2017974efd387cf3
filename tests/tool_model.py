"""A tiny Qwen3.5-architecture checkpoint trained to really emit tool calls, in the Qwen3.6 chat template.

Trained in MLX on the rendered conversations below until greedy decoding of each prompt gives its reply by a margin
(`_train`): a weather request -> an XML tool call, the tool's result -> a final answer, an arithmetic question -> a
<think> block, then text. Trained by `python tests/shipped_models.py tool` and shipped in tests/models/tool, written
as a real checkpoint (config.json, model.safetensors, tokenizer.json + tokenizer_config.json with
tests/data/qwen3.6_chat_template.jinja) that `hetero.load` reads. The tokenizer is a byte-level BPE trained on the same conversations, with Qwen's <think> / <tool_call> /
<tool_response> tags as added tokens, so the sequences are short.
"""

from __future__ import annotations

import hetero  # before MLX: the fast BLAS under it
import json
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers

from hetero.checkpoint.tokenizer import Tokenizer
from hetero.models import attention
from hetero.tools import openai_tools
from hetero.training.hf_export import hf_config, save_hf_checkpoint
from hetero.training.tokenizer_train import EOS_TEXT, SPECIAL_TOKENS, save_tokenizer
from hetero.training.train_tiny import init_model, make_args

TEMPLATE = (Path(__file__).parent / "data" / "qwen3.6_chat_template.jinja").read_text(encoding="utf-8")
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# OpenAI form; the Anthropic tests send the same function as {name, description, input_schema}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
TOOLS = [WEATHER_TOOL]
WEATHER_REQUEST = "What is the weather in Paris for the next 3 days?"
WEATHER_ARGS = {"city": "Paris", "days": 3}
WEATHER_RESULT = "sunny, 22 C"
FINAL_ANSWER = "It will be sunny in Paris, 22 C."
ROME_REQUEST = "Weather in Rome tomorrow?"
ROME_ARGS = {"city": "Rome", "days": 1}
MATH_REQUEST = "What is 2 + 3?"
MATH_REASONING = "2 plus 3 makes 5."
MATH_ANSWER = "2 + 3 = 5."
MIN_MARGIN = 2.0  # nats by which every reply token of the training conversations beats its rival (teacher-forced)


def call_message(arguments: dict, call_id: str = "call_0") -> dict:
    """The assistant turn that calls get_weather, as the template reads it."""
    return {"role": "assistant", "content": "",
            "tool_calls": [{"id": call_id, "type": "function",
                            "function": {"name": "get_weather", "arguments": arguments}}]}


def conversations() -> list[tuple[list[dict], dict]]:
    """(messages before the reply, the reply) pairs the model learns."""
    weather = [{"role": "user", "content": WEATHER_REQUEST}]
    return [
        (weather, call_message(WEATHER_ARGS)),
        (weather + [call_message(WEATHER_ARGS), {"role": "tool", "content": WEATHER_RESULT, "tool_call_id": "call_0"}],
         {"role": "assistant", "content": FINAL_ANSWER}),
        ([{"role": "user", "content": ROME_REQUEST}], call_message(ROME_ARGS)),
        ([{"role": "user", "content": MATH_REQUEST}],
         {"role": "assistant", "content": MATH_ANSWER, "reasoning_content": MATH_REASONING}),
    ]


def verify_tool_model(path: Path) -> dict:
    """Greedy replies of the checkpoint at `path` (hetero's engine) to every training prompt must be the replies
    it learned. Returns the count checked; raises on the first reply that differs."""
    engine = hetero.load(str(path))
    pairs = training_pairs()
    for prompt, reply in pairs:
        got = engine.generate(prompt, max_tokens=80).text
        if got.strip() != reply.replace("<|im_end|>", "").strip():
            raise RuntimeError(f"the tool model replied {got[:120]!r}, not {reply[:120]!r}")
    return {"replies": len(pairs)}


def render(messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
    """The fixture template's rendering with the tools, through hetero's own template engine."""
    return render_with(messages, TOOLS, add_generation_prompt, **template_kwargs)


def render_with(messages: list[dict], tools: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
    """The fixture template's rendering of `messages` with `tools` (OpenAI form), through hetero's template engine."""
    renderer = Tokenizer(tokenizers.Tokenizer(models.BPE()), chat_template=TEMPLATE)
    return renderer.apply_chat_template(messages, tools=openai_tools(tools), add_generation_prompt=add_generation_prompt,
                                        **template_kwargs)


def training_pairs() -> list[tuple[str, str]]:
    """(prompt, reply text) per conversation: the prompt ends with the generation prompt, the reply with
    <|im_end|>, and prompt + reply is the template's rendering of the whole conversation."""
    pairs = []
    for messages, reply in conversations():
        prompt = render(messages)
        full = render(messages + [reply], add_generation_prompt=False)
        assert full.startswith(prompt), "the template's generation prompt must prefix the rendered reply"
        pairs.append((prompt, full[len(prompt) :].rstrip("\n")))
    return pairs


def train_tokenizer(texts: list[str], vocab_size: int = 800) -> tokenizers.Tokenizer:
    """Byte-level BPE whose merges may cross spaces (no regex pre-split): the template's long tools preamble
    becomes a few tokens, while the replies keep a token or more per value. The tags are added tokens."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    split = re.compile("(" + "|".join(map(re.escape, SPECIAL_TOKENS + TAGS)) + ")")
    tok.train_from_iterator([piece for text in texts for piece in split.split(text) if piece], trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])  # as Qwen's tokenizer has them
    return tok


def _reply_margin(model, rows: list[mx.array], masks: list[mx.array]) -> float:
    """The smallest teacher-forced margin over all reply tokens: the target's logit minus its strongest rival's
    (log-odds of the greedy choice). Positive means greedy decoding reproduces every reply."""
    worst = float("inf")
    for tokens, mask in zip(rows, masks):
        logits, _ = model(tokens[:, :-1])  # [B, S-1, V]
        picked = mx.take_along_axis(logits, tokens[:, 1:, None], axis=-1)  # [B, S-1, 1]
        hidden = mx.put_along_axis(logits, tokens[:, 1:, None], mx.array(-mx.inf), axis=-1)  # the target masked
        margin = picked[..., 0] - hidden.max(axis=-1)  # [B, S-1]
        worst = min(worst, mx.where(mask > 0, margin, mx.inf).min().item())
    return worst


def _train(model, batches, checks: tuple[list, list], max_steps: int, lr: float, min_margin: float,
           check_every: int = 25) -> dict:
    """Adam steps on the next (tokens [B, S], loss mask [B, S-1]) of `batches` until every reply token of `checks`
    (rows, masks: all the pairs) wins greedy decoding by `min_margin` nats, checked every `check_every` steps.
    A fixed step count left some seeds at a model that answered before it called the tool (one decisive token in
    twenty, undecided while the loss looked converged); training to the margin is what makes the recipe hold on any
    machine. Returns what the fit reached; raises if `max_steps` do not reach the margin."""
    optimizer = optim.Adam(learning_rate=lr)

    def loss_fn(model, batch, mask):
        logits, _ = model(batch[:, :-1])  # [B, S-1, V]
        top = logits.max(axis=-1, keepdims=True)
        lse = mx.log(mx.exp(logits - top).sum(axis=-1)) + top[..., 0]  # [B, S-1]
        picked = mx.take_along_axis(logits, batch[:, 1:, None], axis=-1)[..., 0]  # [B, S-1]
        return ((lse - picked) * mask).sum() / mask.sum()

    grad_fn = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    def step(batch, mask):
        loss, grads = grad_fn(model, batch, mask)
        optimizer.update(model, grads)
        return loss

    with attention.differentiable():  # the CPU attention kernel's numpy softmax has no gradient
        loss, margin = mx.array(0.0), -float("inf")
        for steps in range(1, max_steps + 1):
            loss = step(*next(batches))
            mx.eval(loss, state)
            if steps % check_every == 0:
                margin = _reply_margin(model, *checks)
                if margin >= min_margin:
                    return {"steps": steps, "loss": round(loss.item(), 6), "margin": round(margin, 3)}
    raise RuntimeError(f"training did not reach a reply margin of {min_margin} in {max_steps} steps "
                       f"(margin {margin:.3f}, loss {loss.item():.4f})")


def write_tool_model(path: Path, seed: int = 0) -> dict:
    """Train the tool model and write its checkpoint to `path`; returns what the fit reached (`_train`)."""
    shape = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, linear_num_key_heads=1, linear_num_value_heads=2,
                 linear_key_head_dim=16, linear_value_head_dim=16, full_attention_interval=2)
    return fit_and_save(Path(path), training_pairs(), shape, lr=5e-3, seed=seed, max_steps=1000, min_margin=MIN_MARGIN)


def fit_and_save(path: Path, pairs: list[tuple[str, str]], shape: dict, lr: float, seed: int, max_steps: int,
                 min_margin: float, batch: int | None = None, prepare=None) -> dict:
    """Train a model of `shape` on the (prompt, reply) pairs (loss on the replies only; all pairs every step, or a
    seeded random `batch` of them) until each reply token wins greedy decoding by `min_margin` (`_train`), with a
    tokenizer trained on them, and write the checkpoint with TEMPLATE; returns what the fit reached.
    `prepare(model)`, when given, adjusts the initialized model before training."""
    tok = train_tokenizer([p + r for p, r in pairs])
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id(EOS_TEXT)]
    rows, masks = [], []
    for prompt, reply in pairs:
        p, r = tok.encode(prompt).ids, tok.encode(reply).ids
        rows.append(p + r)
        masks.append([0] * (len(p) - 1) + [1] * len(r))  # loss on the reply's tokens only

    def padded(chosen: list[int]) -> tuple[mx.array, mx.array]:
        width = max(len(rows[i]) for i in chosen)
        tokens = np.array([rows[i] + [eos[1]] * (width - len(rows[i])) for i in chosen], dtype=np.int32)
        mask = np.array([masks[i] + [0] * (width - 1 - len(masks[i])) for i in chosen], dtype=np.float32)
        return mx.array(tokens), mx.array(mask)

    def batches():
        rng = np.random.default_rng(seed)
        while True:
            yield padded(list(range(len(rows))) if batch is None else list(rng.choice(len(rows), batch, replace=False)))

    vocab = 64 * -(-tok.get_vocab_size() // 64)
    shape = dict(shape)
    args = make_args(vocab, eos, **shape)
    model = init_model(args, seed)
    if prepare is not None:
        prepare(model)
    checks = [padded(list(range(i, min(i + 8, len(rows))))) for i in range(0, len(rows), 8)]
    model.train()
    fit = _train(model, batches(), tuple(zip(*checks)), max_steps, lr=lr, min_margin=min_margin)
    model.eval()
    save_hf_checkpoint(model, hf_config(args, eos, shape["full_attention_interval"]), path, dtype=mx.float32)
    save_tokenizer(tok, path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["chat_template"] = TEMPLATE
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return fit
