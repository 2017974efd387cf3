"""A tiny random Qwen3.5 checkpoint (MTP head included) that ships a chat template written like Qwen3.8-27B's
(tests/data/qwen3.8_like_chat_template.jinja: reasoning_effort levels low / medium / xhigh, anything else refused by
the template; preserve_thinking; generation opens a <think> block) and Qwen3.8's sampler defaults in
generation_config.json (temperature 1.0, top-p 0.95, top-k 20).

Its tokenizer is a byte-level BPE with Qwen's tags (<think>, </think>, ...) as added tokens, as Qwen's has them.
With random weights the greedy reply of THINK_PROMPT never closes its think block by itself within a few hundred
tokens (the tests check it), so a thinking budget is what closes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from tiny_checkpoint import TEXT, random_weights, tiny_config
from tool_model import train_tokenizer

from hetero.models.qwen3_5 import Model, ModelArgs
from hetero.training.tokenizer_train import save_tokenizer

TEMPLATE = (Path(__file__).parent / "data" / "qwen3.8_like_chat_template.jinja").read_text(encoding="utf-8")
SAMPLER_DEFAULTS = {"temperature": 1.0, "top_p": 0.95, "top_k": 20}
THINK_PROMPT = [{"role": "user", "content": "Write a function that adds two numbers."}]


def write_thinking_model(path: Path, seed: int = 0) -> Path:
    """Write the checkpoint (config, weights, tokenizer with TEMPLATE, generation_config) to `path`."""
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer([TEXT * 4, "<think>\nLet me see.\n</think>\n\nThe answer."], vocab_size=400)
    save_tokenizer(tok, path)
    config_file = path / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text(encoding="utf-8"))
    config_file.write_text(json.dumps({**tok_config, "chat_template": TEMPLATE}, indent=1), encoding="utf-8")
    vocab = 64 * -(-tok.get_vocab_size() // 64)
    eos = tok.token_to_id("<|im_end|>")
    config = tiny_config(vocab, eos=eos)
    weights = random_weights(Model(ModelArgs.from_config(config), with_mtp=True), seed)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"do_sample": True, "eos_token_id": eos,
                                                             **SAMPLER_DEFAULTS}))
    return path
