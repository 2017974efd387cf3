"""mlx-community quantized checkpoints load: a checkpoint written by mlx-lm's own `convert` (the tool that makes
them), not only by ours, gives mlx-lm's logits and greedy tokens on the same quantized weights."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import hetero
from hetero.training.tokenizer_train import save_tokenizer, train_tokenizer
from helpers import hf_logits, random_tokens, save_nested
from tiny_checkpoint import TEXT

# Measured: 2e-4 at most between the two engines on logits of magnitude ~15 (fp32 accumulation order);
# 4-bit rounding moves the same logits by far more (asserted below, so the comparison has teeth).
ATOL = 2e-3


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> tuple[Path, object]:
    """A tiny HF `qwen3_5` checkpoint (text under text_config, a vision tower), as mlx-community converts them."""
    path = tmp_path_factory.mktemp("hf") / "model"
    model = save_nested(path)
    save_tokenizer(train_tokenizer([TEXT] * 4, vocab_size=256), path)
    return path, model


@pytest.fixture(scope="module", params=[4, 8])
def converted(request, hf_checkpoint, tmp_path_factory) -> tuple[int, Path]:
    """The checkpoint after `mlx_lm.convert --quantize --q-bits N` (run in-process, as its CLI does)."""
    from mlx_lm.convert import convert

    out = tmp_path_factory.mktemp(f"mlx_lm_q{request.param}") / "model"
    convert(str(hf_checkpoint[0]), str(out), quantize=True, q_bits=request.param, q_group_size=64)
    return request.param, out


def mlx_lm_model(path: Path):
    from mlx_lm import load

    model, tokenizer = load(str(path))
    model.set_dtype(mx.float32)
    return model, tokenizer


def test_the_converted_checkpoint_is_mlx_lms_layout(converted):
    import json

    bits, path = converted
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"]["bits"] == bits
    names = mx.load(str(path / "model.safetensors")).keys()
    assert any(n.startswith("language_model.model.layers.") and n.endswith(".scales") for n in names)
    assert not any("visual" in n for n in names)  # mlx-lm drops the vision tower


def test_logits_match_mlx_lm_on_the_same_quantized_weights(converted, hf_checkpoint):
    bits, path = converted
    engine = hetero.load(path, dtype=mx.float32)
    assert engine.model.args.quantization["bits"] == bits
    theirs_model, _ = mlx_lm_model(path)
    ids = random_tokens(48, 1)
    ours = engine.logits(ids)
    theirs = np.array(theirs_model(mx.array([ids]))[0].astype(mx.float32))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=ATOL)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    if bits == 4:  # the weights are really the rounded ones: the float model is further away than ATOL
        assert np.abs(ours - hf_logits(hf_checkpoint[1], ids)).max() > 10 * ATOL


def test_greedy_tokens_match_mlx_lm(converted):
    from mlx_lm import stream_generate

    _, path = converted
    engine = hetero.load(path, dtype=mx.float32)
    theirs_model, tokenizer = mlx_lm_model(path)
    tokenizer._eos_token_ids = set()  # decode exactly max_tokens, as hetero does without an EOS id
    prompt = random_tokens(20, 2)
    ours = engine.generate(prompt, max_tokens=16, mtp=False).tokens
    theirs = [int(r.token) for r in stream_generate(theirs_model, tokenizer, prompt, max_tokens=16)]
    assert ours == theirs[: len(ours)] and len(ours) >= 1
    assert len(ours) == 16 or ours[-1] in engine.eos_ids
