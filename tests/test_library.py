"""hetero as a library for MLX programs (issue 12): `hetero.prefill` hands mlx-lm a prompt cache in its own classes,
mlx-lm's caches feed hetero's MTP decoding, prompt-cache files in mlx-lm's format, and the mlx-lm-shaped
`generate` / `stream_generate`.

Two models: the bundled one (hetero.load() and mlx_lm.load of the same files, compared in fp32), and a tiny
nested `qwen3_5` checkpoint in the HF layout (conv1d [C,1,K], zero-centred norms, `model.language_model.*`, an MTP
head) written here from tests/tiny_checkpoint.py's model. The oracle is always mlx-lm alone on the same prompt.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx.utils import tree_flatten
from mlx_lm import load as lm_load
from mlx_lm import stream_generate as lm_stream_generate
from mlx_lm.models.cache import (
    ArraysCache, KVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache,
)

import hetero
from hetero.checkpoint.source import BUNDLED_MODEL
from hetero.models.qwen3_5.weights import is_zero_centred_norm
from tiny_checkpoint import write_tiny_model

NEW_TOKENS = 16


def write_nested(path: Path) -> Path:
    """The tiny model of tiny_checkpoint.py as an HF `qwen3_5` checkpoint: text under `text_config`
    (full_attention_interval 2 = its layer_types), weights under `model.language_model.*` with conv1d [C,1,K] and
    zero-centred norms, the MTP head under `mtp.*`."""
    flat = write_tiny_model(path.parent / f"{path.name}-flat", max_context=2048)
    path.mkdir(parents=True, exist_ok=True)
    for f in flat.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, path / f.name)
    text = json.loads((flat / "config.json").read_text())
    text.update(model_type="qwen3_5_text", full_attention_interval=2)
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
              "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    weights = {}
    for name, v in mx.load(str(flat / "model.safetensors")).items():
        if name.endswith("conv1d.weight"):
            v = v.swapaxes(1, 2)  # [C, K, 1] -> HF [C, 1, K]
        elif is_zero_centred_norm(name):
            v = v - 1.0  # stored as w, effective scale 1 + w
        weights["model.language_model." + name[len("model."):] if name.startswith("model.") else name] = v
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


@pytest.fixture(scope="module")
def nested_dir(tmp_path_factory) -> Path:
    return write_nested(tmp_path_factory.mktemp("nested") / "qwen3_5")


def _mlx_lm(path: Path):
    model, tokenizer = lm_load(str(path))
    model.set_dtype(mx.float32)  # fp32 like hetero on the CPU (the bundled files are bf16)
    mx.eval(model.parameters())
    return model, tokenizer


@pytest.fixture(scope="module", params=["bundled", "nested"])
def case(request, nested_dir):
    """(name, hetero Engine, mlx-lm model, its tokenizer, prompt ids)."""
    path = BUNDLED_MODEL if request.param == "bundled" else nested_dir
    engine = hetero.load(None if request.param == "bundled" else path)
    model, tokenizer = _mlx_lm(path)
    text = Path(hetero.engine.__file__).read_text()
    ids = engine.tokenizer.encode(text)[:200]  # > 3 chunks of 64 (GDN), so the chunked form runs
    return request.param, engine, model, tokenizer, ids


def lm_tokens(model, tokenizer, prompt: list[int], cache=None, n: int = NEW_TOKENS) -> list[int]:
    """mlx-lm's greedy continuation (its default sampler is argmax)."""
    return [r.token for r in lm_stream_generate(model, tokenizer, mx.array(prompt), max_tokens=n, prompt_cache=cache)]


def lm_last_logits(model, prompt: list[int], cache=None) -> np.ndarray:
    cache = cache if cache is not None else make_prompt_cache(model)
    return np.array(model(mx.array(prompt)[None], cache=cache)[0, -1])


def _tolerance(name: str, who: str) -> float:
    # mlx-lm adds the norms' +1 to the bf16 weights of the bundled files in bf16, hetero in fp32: the two models
    # differ by that rounding (measured: 3.4e-4 of the largest logit). On the same arrays, or fp32 files, fp32 noise.
    return 1e-3 if (name, who) == ("bundled", "engine") else 1e-5


def _close(ours: np.ndarray, ref: np.ndarray, rtol: float) -> None:
    err, scale = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    assert err <= rtol * scale, f"max |diff| {err:.3g} > {rtol} * max |ref| {scale:.3g}"


@pytest.mark.parametrize("who", ["engine", "mlx_lm"])
def test_hetero_prefill_then_mlx_lm_decode_equals_mlx_lm_alone(case, who):
    name, engine, model, tokenizer, ids = case
    cache = hetero.prefill(engine if who == "engine" else model, ids[:-1])
    assert [type(c) for c in cache] == [type(c) for c in make_prompt_cache(model)]
    assert all(c.offset == len(ids) - 1 for c in cache if isinstance(c, KVCache))
    _close(lm_last_logits(model, ids[-1:], cache), lm_last_logits(model, ids), _tolerance(name, who))
    cache = hetero.prefill(engine if who == "engine" else model, ids[:-1])
    assert lm_tokens(model, tokenizer, ids[-1:], cache) == lm_tokens(model, tokenizer, ids)


def test_the_split_prefill_hands_mlx_lm_the_same_continuation(case):
    """ane_fraction 0.5 through the split runtime (reference executor here), verified against GPU-only."""
    name, engine, model, tokenizer, ids = case
    who = model if name == "nested" else engine  # one split export per model keeps the file fast
    cache = hetero.prefill(who, ids[:-1], ane_fraction=0.5, chunk=64, verify=True)
    _close(lm_last_logits(model, ids[-1:], cache), lm_last_logits(model, ids), 2e-2)  # fp16 on the ANE lane
    cache = hetero.prefill(who, ids[:-1], ane_fraction=0.5, chunk=64)
    assert lm_tokens(model, tokenizer, ids[-1:], cache) == lm_tokens(model, tokenizer, ids)


def test_appending_a_turn_equals_prefilling_both_at_once(case):
    name, engine, model, tokenizer, ids = case
    first, second = ids[:90], ids[90:-1]
    cache = hetero.prefill(model, first)
    same = hetero.prefill(model, second, cache=cache)
    assert same is cache  # updated in place, like mlx-lm's own caches
    whole = hetero.prefill(model, ids[:-1])
    for a, b in zip(cache, whole):
        for x, y in zip(_arrays(a), _arrays(b)):
            _close(np.array(x), np.array(y), 1e-5)
    assert lm_tokens(model, tokenizer, ids[-1:], cache) == lm_tokens(model, tokenizer, ids)


def _arrays(c) -> list[mx.array]:
    if isinstance(c, KVCache):
        return [c.keys[:, :, : c.offset], c.values[:, :, : c.offset]]
    return [c[0], c[1]]


def test_mlx_lm_prefill_then_hetero_mtp_generate_equals_hetero_alone(case):
    name, engine, model, tokenizer, ids = case
    assert engine.model.has_mtp
    cache = make_prompt_cache(model)
    model(mx.array(ids[:-1])[None], cache=cache)
    mx.eval([c.state for c in cache])
    ours = engine.generate(ids[-1:], max_tokens=24, mtp=True, draft_depth=3, prompt_cache=cache)
    alone = engine.generate(ids, max_tokens=24, mtp=True, draft_depth=3)
    assert ours.tokens == alone.tokens
    assert ours.stats["cached_tokens"] == len(ids) - 1 and ours.stats["mtp"]["rounds"] > 0
    assert cache[0][1].shape[-2:] == (engine.model.args.linear_value_head_dim, engine.model.args.linear_key_head_dim)


def test_cache_files_round_trip_through_mlx_lm(case, tmp_path):
    name, engine, model, tokenizer, ids = case
    ours = tmp_path / "hetero.safetensors"
    hetero.save_prompt_cache(ours, hetero.prefill(engine, ids[:-1]), {"model": name})
    cache, meta = load_prompt_cache(str(ours), return_metadata=True)  # mlx-lm's reader
    assert meta == {"model": name}
    assert lm_tokens(model, tokenizer, ids[-1:], cache) == lm_tokens(model, tokenizer, ids)

    assert [p.name for p in tmp_path.iterdir()] == ["hetero.safetensors"]  # written whole, under its own name
    with pytest.raises(hetero.HeteroError, match="must end in .safetensors"):
        hetero.save_prompt_cache(tmp_path / "cache.bin", hetero.prefill(engine, ids[:4]))

    theirs = tmp_path / "mlx_lm.safetensors"  # and the reverse: mlx-lm writes, hetero reads and decodes
    lm_cache = make_prompt_cache(model)
    model(mx.array(ids[:-1])[None], cache=lm_cache)
    save_prompt_cache(str(theirs), lm_cache, {"model": "x"})
    back, meta = hetero.load_prompt_cache(theirs, return_metadata=True)
    assert meta == {"model": "x"} and [type(c) for c in back] == [type(c) for c in lm_cache]
    for a, b in zip(back, lm_cache):
        for x, y in zip(_arrays(a), _arrays(b)):
            assert mx.array_equal(x, y)
    again = engine.generate(ids[-1:], max_tokens=NEW_TOKENS, mtp=False, prompt_cache=back)
    assert again.tokens == engine.generate(ids, max_tokens=NEW_TOKENS, mtp=False).tokens


def test_an_mlx_lm_model_is_run_on_its_own_weight_arrays():
    """Every parameter of hetero's view is the very mx.array mlx-lm holds, and wrapping + a prefill peaks no higher
    than mlx-lm's own prefill of the same tokens (MLX's allocator; a copy of the weights would add 12.6 MB)."""
    from hetero.checkpoint.mlx_lm_model import wrap

    model, _ = lm_load(str(BUNDLED_MODEL))  # bf16 as stored: the dtype mlx-lm chose is the one hetero runs
    mx.eval(model.parameters())
    weights = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    ids = list(range(1, 9))

    def peak_of(fn) -> tuple[int, int]:
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        cache = fn()
        mx.eval([c.state for c in cache])
        return mx.get_peak_memory() - before, mx.get_active_memory() - before

    def theirs_prefill():
        cache = make_prompt_cache(model)
        model(mx.array(ids)[None], cache=cache)
        return cache

    ours_peak, ours_held = peak_of(lambda: hetero.prefill(model, ids))  # the first call wraps the model
    their_peak, _ = peak_of(theirs_prefill)
    # measured: 1.3 MB each (the CPU backend's bf16 matmuls widen one weight matrix at a time), 12.6 MB of weights
    assert ours_peak <= their_peak + 0.05 * weights, (ours_peak, their_peak, weights)
    assert ours_held < 0.1 * weights, (ours_held, weights)  # the cache itself: 0.75 MB (K/V in 256-slot buffers)
    theirs = dict(tree_flatten(model.language_model.parameters()))
    ours = dict(tree_flatten(wrap(model).model.parameters()))
    assert ours.keys() == theirs.keys() and all(ours[k] is theirs[k] for k in ours)


def test_layouts_mlx_lm_gets_wrong_are_refused_by_name(case):
    from mlx_lm.models import llama, qwen3_5, qwen3_next

    name, engine, model, tokenizer, ids = case
    fields = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                  linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, vocab_size=64,
                  rms_norm_eps=1e-6, max_position_embeddings=256, full_attention_interval=2)
    nxt = qwen3_next.Model(qwen3_next.ModelArgs(
        model_type="qwen3_next", num_experts=0, num_experts_per_tok=0, decoder_sparse_step=1,
        shared_expert_intermediate_size=0, mlp_only_layers=[], moe_intermediate_size=0, rope_theta=1e4,
        partial_rotary_factor=0.5, **fields))
    with pytest.raises(hetero.HeteroError, match="qwen3_next layout"):
        hetero.prefill(nxt, [1, 2, 3])
    typed = dict(fields, model_type="qwen3_5_text", layer_types=["full_attention", "linear_attention"])
    wrong = qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=typed))
    with pytest.raises(hetero.HeteroError, match="ignores config.json layer_types"):
        hetero.prefill(wrong, [1, 2, 3])
    other = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                                        num_attention_heads=2, rms_norm_eps=1e-6, vocab_size=64))
    with pytest.raises(hetero.HeteroError, match="qwen3_5 models only"):
        hetero.prefill(other, [1, 2, 3])
    # a cache of another model's layout is refused, not decoded from
    bad = [ArraysCache(size=2) for _ in engine.model.layers]
    with pytest.raises(hetero.HeteroError, match="needs a KVCache"):
        engine.generate(ids[-1:], max_tokens=2, prompt_cache=bad)
    with pytest.raises(hetero.HeteroError, match="layers"):
        hetero.prefill(model, ids[:4], cache=make_prompt_cache(model)[:-1])


def test_hetero_prefill_command_writes_what_mlx_lm_generate_reads(tmp_path):
    import subprocess
    import sys

    from hetero.cli.main import main

    engine = hetero.load()
    text = Path(hetero.engine.__file__).read_text()[:1500]
    (tmp_path / "prompt.txt").write_text(text)
    out = tmp_path / "cache.safetensors"
    assert main(["prefill", "--prompt-file", str(tmp_path / "prompt.txt"), "--out", str(out)]) == 0
    ids, more = engine.tokenizer.encode(text), engine.tokenizer.encode("    def run(self):")
    model, tokenizer = _mlx_lm(BUNDLED_MODEL)
    cache, meta = load_prompt_cache(str(out), return_metadata=True)
    assert meta["model"] == str(BUNDLED_MODEL) and json.loads(meta["tokenizer_config"]) == {}
    assert cache[3].offset == len(ids)
    assert lm_tokens(model, tokenizer, more, cache) == lm_tokens(model, tokenizer, ids + more)
    # mlx-lm's own command line: finds the model in the file's metadata and continues from the cache
    done = subprocess.run([sys.executable, "-m", "mlx_lm.generate", "--prompt-cache-file", str(out), "--prompt", "def",
                           "--max-tokens", "4", "--ignore-chat-template"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Prompt: 1 tokens" in done.stdout  # the 1-token suffix ran on top of the cached prompt


def test_the_prefill_command_refuses_what_it_cannot_do(tmp_path, capsys):
    from hetero.cli.main import main

    out = str(tmp_path / "c.safetensors")
    assert main(["prefill", "--prompt-file", str(tmp_path / "missing.txt"), "--out", out]) == 1
    assert "missing.txt" in capsys.readouterr().err
    (tmp_path / "p.txt").write_text("x = 1\n")
    assert main(["prefill", "--prompt-file", str(tmp_path / "p.txt"), "--out", out, "--verify"]) == 1
    assert "--verify needs --ane-fraction" in capsys.readouterr().err
    assert main(["prefill", "--prompt-file", str(tmp_path / "p.txt"), "--out", str(tmp_path / "c")]) == 1
    assert "must end in .safetensors" in capsys.readouterr().err  # said before any prefill
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt"]  # nothing written


def test_stream_generate_is_shaped_like_mlx_lms_and_decodes_the_same(case):
    name, engine, model, tokenizer, ids = case
    theirs = list(lm_stream_generate(model, tokenizer, mx.array(ids), max_tokens=NEW_TOKENS))
    ours = list(hetero.stream_generate(engine, None, ids, max_tokens=NEW_TOKENS, logprobs=2))
    assert [r.token for r in ours] == [r.token for r in theirs]
    assert "".join(r.text for r in ours) == engine.generate(ids, max_tokens=NEW_TOKENS).text
    assert [r.finish_reason for r in ours] == [None] * (len(ours) - 1) + ["length"]
    last = ours[-1]
    assert last.prompt_tokens == len(ids) and last.generation_tokens == NEW_TOKENS
    assert last.prompt_tps > 0 and last.generation_tps > 0 and 0 < last.peak_memory < 10
    for r, t in zip(ours, theirs):  # the chosen token's logprob, as mlx-lm's vector holds it
        assert abs(r.logprobs - float(t.logprobs[t.token])) < 1e-2 and len(r.top_logprobs) == 2


def test_generate_and_a_stream_stopped_early(case):
    name, engine, model, tokenizer, ids = case
    text = hetero.generate(engine, None, ids, max_tokens=8, temp=0.0)
    assert text == engine.generate(ids, max_tokens=8).text
    stream = hetero.stream_generate(engine, None, ids, max_tokens=200)
    first = next(stream)
    stream.close()  # the generating thread is told to stop and joined
    assert first.token is not None and first.finish_reason is None
    cache = hetero.prefill(engine, ids[:-1])  # continuing from a prompt cache, as mlx-lm's prompt_cache=
    assert [r.token for r in hetero.stream_generate(engine, None, ids[-1:], max_tokens=8, prompt_cache=cache)] == \
        engine.generate(ids, max_tokens=8).tokens
    with pytest.raises(hetero.HeteroError, match="sampler"):
        hetero.generate(engine, None, ids, sampler=lambda x: x)
