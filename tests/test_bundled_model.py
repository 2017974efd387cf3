"""The bundled tiny model (hetero/bundled) and the code that made it: hetero.training.train_tiny and hetero.training.hf_export."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from hetero.checkpoint.loader import load_model
from hetero.checkpoint.source import BUNDLED_MODEL
from hetero.models.qwen3_5.weights import is_zero_centred_norm
from hetero.training import hf_export, train_tiny

MAX_CHECKPOINT_BYTES = 20_000_000
# Validation loss bound: ln(4096) = 8.3 nats is a uniform guess, and a model that knew only the token frequencies
# (unigram) would score 6.3 nats/token on the validation split. 4.5 sits well below both, so passing means the
# model uses context; the shipped model scores about 3.8.
MAX_VALID_LOSS = 4.5
# MTP draft top-1 on t+2: chance is 1/4096; always predicting the snippet's most frequent token scores ~0.05;
# the shipped head scores about 0.3 on the snippet and 0.35 over the validation split.
MIN_MTP_TOP1 = 0.2


def test_the_bundled_model_ships_with_the_package():
    """`hetero run` with no --model needs these files: their absence is a failure, never a skip."""
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "training.json"):
        assert (BUNDLED_MODEL / name).is_file(), f"{BUNDLED_MODEL / name} is missing: the bundled model is not installed"


@pytest.fixture(scope="module")
def bundled():
    model, path, config = load_model(None, dtype=mx.float32)
    return model, path, config


def test_bundled_checkpoint_shape_and_size():
    size = (BUNDLED_MODEL / "model.safetensors").stat().st_size
    assert size <= MAX_CHECKPOINT_BYTES
    config = json.loads((BUNDLED_MODEL / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    text = config["text_config"]
    assert text["model_type"] == "qwen3_5_text" and text["mtp_num_hidden_layers"] == 1
    assert text["num_hidden_layers"] >= 6 and len(text["layer_types"]) == text["num_hidden_layers"]
    assert {"linear_attention", "full_attention"} == set(text["layer_types"])
    names = mx.load(str(BUNDLED_MODEL / "model.safetensors")).keys()
    assert any(n.startswith("mtp.") for n in names)
    assert all(n.startswith(("model.language_model.", "mtp.")) for n in names)
    assert (BUNDLED_MODEL / "tokenizer.json").is_file() and (BUNDLED_MODEL / "generation_config.json").is_file()


def test_bundled_training_record():
    record = json.loads((BUNDLED_MODEL / "training.json").read_text())
    assert record["valid_loss"] < MAX_VALID_LOSS < math.log(record["shape"]["vocab_size"])
    assert record["mtp_top1"] > MIN_MTP_TOP1
    assert record["checkpoint_bytes"] == (BUNDLED_MODEL / "model.safetensors").stat().st_size


def _validation_snippet(n_tokens: int = 200) -> str:
    """Text of the first sizeable stdlib file in the validation split (never trained on)."""
    from hetero.training import tokenizer_train

    files = tokenizer_train.corpus_files()
    every = tokenizer_train.VALID_EVERY
    for i, path in enumerate(files):
        if i % every == every - 1 and path.stat().st_size > 20 * n_tokens:
            return path.read_text(encoding="utf-8", errors="replace")
    raise AssertionError(f"no validation-split standard-library file among {len(files)} corpus files")


def test_bundled_mtp_head_predicts_t_plus_2(bundled):
    from tokenizers import Tokenizer

    model, path, _ = bundled
    assert model.has_mtp and len(model.layers) >= 6
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = tok.encode(_validation_snippet()).ids[:202]
    x = mx.array([ids])
    logits, hidden = model(x[:, :-2])  # [1, 200, V]
    draft, _ = model.mtp_forward(x[:, 1:-1], hidden)  # at p: embed(t_{p+1}), h_p -> t_{p+2}
    mtp_top1 = (draft.argmax(-1) == x[:, 2:]).mean().item()
    backbone_top1 = (logits.argmax(-1) == x[:, 1:-1]).mean().item()
    most_frequent = np.bincount(np.array(ids[2:])).max() / len(ids[2:])
    assert mtp_top1 > max(MIN_MTP_TOP1, 2 * most_frequent), (mtp_top1, most_frequent)
    assert backbone_top1 > mtp_top1 - 0.05  # the next token is the easier prediction


# ----------------------------------------------------------------------------------------------------------
# hf_export and the training code, on tiny random models


def _tiny_args(vocab: int = 64):
    return train_tiny.make_args(
        vocab, [2, 0], hidden_size=32, num_hidden_layers=4, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16,
    )


def test_hf_export_round_trip(tmp_path: Path):
    args = _tiny_args()
    model = train_tiny.init_model(args, seed=1)
    # random norm weights, so that a missing or doubled +1 shift shows in the logits
    noisy = [(k, v + 0.3 * mx.random.normal(v.shape)) if v.ndim == 1 else (k, v) for k, v in tree_flatten(model.parameters())]
    model.load_weights(noisy)
    config = hf_export.hf_config(args, [2, 0])
    hf_export.save_hf_checkpoint(model, config, tmp_path, dtype=mx.float32)

    stored = mx.load(str(tmp_path / "model.safetensors"))
    params = dict(tree_flatten(model.parameters()))
    assert "lm_head.weight" not in stored  # tied
    for name, value in params.items():
        key = "model.language_model." + name[len("model.") :] if name.startswith("model.") else name
        if is_zero_centred_norm(name):
            assert mx.allclose(stored[key], value - 1.0, atol=1e-6), name
        elif name.endswith("conv1d.weight"):
            assert stored[key].shape == (value.shape[0], 1, value.shape[1])  # HF [C, 1, K]
        else:
            assert mx.array_equal(stored[key], value), name  # incl. the GDN output norm, stored as-is
    assert any(k.endswith("linear_attn.norm.weight") for k in stored)

    loaded, _, loaded_config = load_model(tmp_path, dtype=mx.float32)
    assert loaded_config["text_config"]["layer_types"] == args.layer_types
    for name, value in tree_flatten(loaded.parameters()):
        assert mx.allclose(value, params[name], atol=1e-6), name  # each norm shifted exactly once
    x = mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]])
    ref, ref_hidden = model(x)
    got, got_hidden = loaded(x)
    assert mx.allclose(got, ref, atol=1e-4)
    assert mx.allclose(loaded.mtp_forward(x, got_hidden)[0], model.mtp_forward(x, ref_hidden)[0], atol=1e-4)


def test_a_few_training_steps_reduce_the_loss():
    args = _tiny_args(vocab=32)
    model = train_tiny.init_model(args, seed=0)
    pattern = np.array([5, 6, 7, 8, 9, 10, 11, 12, 6, 7, 13], dtype=np.int32)  # a repeated, learnable sequence
    tokens = np.tile(pattern, 200)
    window = mx.array(np.stack([tokens[i : i + 34] for i in range(0, 80, 10)]))  # [8, 34]
    before = [v.item() for v in train_tiny.losses(model, window)]
    run = train_tiny.train(model, tokens, steps=30, batch=8, seq=32, lr=1e-2, warmup=3, compile=False, log=lambda s: None)
    after = [v.item() for v in train_tiny.losses(model, window)]
    assert run["steps"] == 30 and run["tokens_seen"] == 30 * 8 * 32
    assert after[0] < 0.5 * before[0]  # next token
    assert after[1] < 0.5 * before[1]  # MTP head (t+2)


# ----------------------------------------------------------------------------------------------------------
# Chat: the shipped model ends its replies, as the agents' turns need


def _chat_reply(engine, system: str, user: str, limit: int = 300) -> tuple[list[int], str]:
    prompt = engine.tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": user}],
                                                  add_generation_prompt=True)
    result = engine.generate(prompt, max_tokens=limit, use_prefix_cache=False, mtp=False)
    return result.tokens, result.stats["finish_reason"]


@pytest.mark.parametrize("context_tokens", [0, 8000])
def test_the_bundled_model_ends_a_chat_reply(context_tokens):
    """A reply to a short request closes with <|im_end|> well within 300 tokens, also after a system turn of
    8,000 tokens of text it never trained on (this repository's docs), as an agent's first request carries."""
    import hetero

    engine = hetero.load()
    docs = "\n".join(p.read_text(encoding="utf-8") for p in sorted((Path(__file__).parents[1] / "docs").glob("*.md")))
    ids = engine.tokenizer.encode(docs)
    assert len(ids) >= context_tokens
    system = engine.tokenizer.decode(ids[:context_tokens]) if context_tokens else "You are a helpful coding assistant."
    tokens, finish = _chat_reply(engine, system, "Say hello.")
    assert finish == "stop" and len(tokens) < 300, (finish, engine.tokenizer.decode(tokens)[:300])


def test_chat_samples_render_as_the_bundled_template_does():
    from hetero.checkpoint.tokenizer import Tokenizer
    from hetero.training import chat_samples

    tok = Tokenizer.from_dir(BUNDLED_MODEL)
    messages = [("system", "You are brief."), ("user", "What does `f` do?"), ("assistant", "`f`: adds."),
                ("user", "Thanks!"), ("assistant", "You're welcome.")]
    expected = tok.apply_chat_template([{"role": r, "content": c} for r, c in messages], add_generation_prompt=False)
    assert chat_samples.render(messages) == expected
    source = 'def add(a, b):\n    """Add two numbers.\n\n    More text."""\n    return a + b\n\nclass _Hidden:\n    pass\n'
    (d,) = chat_samples.definitions("calc", source)  # undocumented definitions are skipped
    assert (d.module, d.name, d.kind, d.summary) == ("calc", "add", "function", "Add two numbers.")
    conversations = chat_samples.conversations([("calc", source)] * 3, seed=1)
    assert conversations == chat_samples.conversations([("calc", source)] * 3, seed=1)  # seeded
    assert all(c.endswith("<|im_end|>\n") and "<|im_start|>assistant\n" in c for c in conversations)
