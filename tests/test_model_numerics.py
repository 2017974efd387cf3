"""Numerics of the model code: chunked vs recurrent delta rule, cache-carried decode vs one prefill, quantized
checkpoints, and the MTP head against a direct numpy implementation of the spec (DESIGN.md section 2)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import helpers
from hetero.checkpoint.loader import load_model
from hetero.checkpoint.preflight import preflight
from hetero.decode.prefill import prefill
from hetero.models.cache import GDNCache, KVCache
from hetero.models.gated_delta import chunked_gated_delta, recurrent_gated_delta


def rel_err(ours, ref) -> float:
    """max |ours - ref| / max |ref|."""
    ours, ref = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


# ----------------------------------------------------------------------------------------------------------
# The delta rule


def delta_inputs(S: int, strong: bool, seed: int, B: int = 2, H: int = 3, Dk: int = 16, Dv: int = 24):
    """q, k normalised as the model does; strong decay alpha in (e^-8, e^-1), weak in (e^-0.02, 1)."""
    rng = np.random.default_rng(seed)
    l2 = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = l2(rng.standard_normal((B, S, H, Dk))) / np.sqrt(Dk)
    k = l2(rng.standard_normal((B, S, H, Dk)))
    v = rng.standard_normal((B, S, H, Dv))
    g = -rng.uniform(1.0, 8.0, (B, S, H)) if strong else -rng.uniform(0.0, 0.02, (B, S, H))
    beta = rng.uniform(0.0, 1.0, (B, S, H))
    state = rng.standard_normal((B, H, Dk, Dv))  # nonzero initial state
    return [a.astype(np.float32) for a in (q, k, v, g, beta, state)]


def numpy_delta_rule(q, k, v, g, beta, state):
    """The spec, literally: S = alpha S; u = beta (v - S^T k); S += k u^T; o = S^T q (float64)."""
    q, k, v, g, beta, S = (a.astype(np.float64) for a in (q, k, v, g, beta, state))
    out = np.zeros(v.shape)
    for t in range(q.shape[1]):
        S = S * np.exp(g[:, t])[..., None, None]
        u = beta[:, t][..., None] * (v[:, t] - np.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + np.einsum("bhk,bhv->bhkv", k[:, t], u)
        out[:, t] = np.einsum("bhkv,bhk->bhv", S, q[:, t])
    return out, S


@pytest.mark.parametrize("strong", [True, False], ids=["strong_decay", "weak_decay"])
def test_recurrent_delta_rule_matches_numpy_spec(strong):
    args = delta_inputs(70, strong, seed=1)
    out, state = recurrent_gated_delta(*map(mx.array, args))
    ref_out, ref_state = numpy_delta_rule(*args)
    assert rel_err(out, ref_out) <= 1e-5
    assert rel_err(state, ref_state) <= 1e-5


@pytest.mark.parametrize("strong", [True, False], ids=["strong_decay", "weak_decay"])
@pytest.mark.parametrize("S", [1, 63, 64, 65, 300])
def test_chunked_delta_rule_matches_recurrent(S, strong):
    args = list(map(mx.array, delta_inputs(S, strong, seed=S)))
    out_r, state_r = recurrent_gated_delta(*args)
    out_c, state_c = chunked_gated_delta(*args)
    assert out_c.shape == out_r.shape and state_c.shape == state_r.shape
    assert rel_err(out_c, out_r) <= 1e-5
    assert rel_err(state_c, state_r) <= 1e-5


# ----------------------------------------------------------------------------------------------------------
# Checkpoints (written by transformers) shared by the tests below


@pytest.fixture(scope="module")
def chaotic(tmp_path_factory) -> Path:
    """Flat, tied, unit-gain random checkpoint: the most sensitive to any numerical difference."""
    path = tmp_path_factory.mktemp("chaotic")
    helpers.save_flat(path, tie=True, seed=11)
    return path


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """Flat, untied random checkpoint plus an HF-named MTP head; (dir, stored mtp.* tensors).

    Block gain 0.5 and embedding std 1 make the residual stream dominate each block's update, so weight noise
    is not amplified chaotically (see helpers.randomize_): quantization error then looks like a trained model's.
    """
    path = tmp_path_factory.mktemp("mtp")
    helpers.save_flat(path, tie=False, seed=1, gain=0.5, embed_std=1.0)
    return path, helpers.add_mtp(path, seed=1)


@pytest.fixture(scope="module")
def float_model(with_mtp):
    model, _, _ = load_model(with_mtp[0], dtype=mx.float32)
    return model


# ----------------------------------------------------------------------------------------------------------
# Cache-carried decode


def test_gdn_chunked_layer_equals_token_by_token_through_cache(chaotic):
    model, _, _ = load_model(chaotic, dtype=mx.float32)
    gdn = model.layers[0].linear_attn
    x = mx.array(np.random.default_rng(0).standard_normal((1, 40, helpers.HIDDEN)).astype(np.float32))

    whole = GDNCache()
    out = gdn(x, whole)  # 40 > RECURRENT_MAX_TOKENS: the chunked form
    steps = GDNCache()
    outs = [gdn(x[:, t : t + 1], steps) for t in range(x.shape[1])]
    assert rel_err(mx.concatenate(outs, axis=1), out) <= 1e-5
    assert rel_err(steps.recurrent, whole.recurrent) <= 1e-5
    # the conv window is the last K-1 projected inputs: a fast BLAS projects one row and 40 rows with different
    # kernels, so they agree to fp32 rounding, not bit for bit
    assert rel_err(steps.conv, whole.conv) <= 1e-6
    assert steps.offset == whole.offset == 40

    split = GDNCache()  # the chunked form starting from a carried conv window and state: 20 + 20 tokens
    parts = [gdn(x[:, :20], split), gdn(x[:, 20:], split)]
    assert rel_err(mx.concatenate(parts, axis=1), out) <= 1e-5
    assert rel_err(split.recurrent, whole.recurrent) <= 1e-5


def test_step_by_step_decode_and_chunked_prefill_equal_one_prefill(chaotic):
    model, _, _ = load_model(chaotic, dtype=mx.float32)
    tokens = helpers.random_tokens(200, seed=3)
    full = np.array(model(mx.array(tokens)[None])[0][0])  # [200, V], no cache

    cache = model.make_cache()
    logits, _ = model(mx.array(tokens[:40])[None], cache)
    rows = [logits[0]]
    for t in tokens[40:]:
        logits, _ = model(mx.array([[t]]), cache)
        rows.append(logits[0])
        mx.eval(rows[-1])
    stepped = np.array(mx.concatenate(rows))
    assert rel_err(stepped, full) <= 3e-5  # 160 chained fp32 steps of a chaotic model, one-row vs many-row kernels

    chunked, hidden = prefill(model, tokens, model.make_cache(), chunk=64, all_logits=True)  # 64+64+64+8
    assert chunked.shape == (200, helpers.VOCAB) and hidden.shape == (200, helpers.HIDDEN)
    assert rel_err(chunked, full) <= 1e-5


def test_a_prefill_allocates_each_attention_cache_once(chaotic):
    """A long prompt's KV is allocated at its first chunk for the whole prompt plus a step of decoding: no regrowth
    (each copied the cache and held it twice at once), and the decoded tokens that follow still fit."""
    model, _, _ = load_model(chaotic, dtype=mx.float32)
    cache = model.make_cache()
    attention = [c for c in cache.backbone if isinstance(c, KVCache)]
    assert attention
    held = []  # each chunk's buffers, kept alive so that a new buffer can never reuse an old one's identity
    prefill(model, helpers.random_tokens(600, seed=4), cache, chunk=64,
            on_chunk=lambda n, at, h: held.append([c.keys for c in attention]))
    assert len(held) == 10 and all(all(a is b for a, b in zip(bufs, held[0])) for bufs in held)
    for t in helpers.random_tokens(KVCache.step, seed=5):
        mx.eval(model(mx.array([[t]]), cache)[0])
    assert all(c.keys is k for c, k in zip(attention, held[0])) and attention[0].offset == 600 + KVCache.step


# ----------------------------------------------------------------------------------------------------------
# Quantized checkpoints


@pytest.fixture(scope="module", params=[8, 4], ids=["8bit", "4bit"])
def quantized(request, with_mtp, tmp_path_factory):
    from hetero.cli.quantize import quantize_checkpoint

    bits = request.param
    out = quantize_checkpoint(str(with_mtp[0]), tmp_path_factory.mktemp(f"q{bits}") / "out", bits=bits)
    model, _, _ = load_model(out, dtype=mx.float32)  # load_model loads with strict=True
    return bits, out, model


def cosine(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_quantized_checkpoint_layout(quantized):
    bits, out, model = quantized
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": bits}
    assert preflight(out).ok
    assert model.has_mtp
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    assert len(linears) > 20
    for name, module in linears:
        keep_float = name.endswith(("in_proj_a", "in_proj_b"))
        assert isinstance(module, nn.Linear if keep_float else nn.QuantizedLinear), name
        if not keep_float:
            assert module.bits == bits and module.group_size == 64, name
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(model.mtp.fc, nn.QuantizedLinear)
    assert isinstance(model.mtp.layers[0].self_attn.q_proj, nn.QuantizedLinear)


def test_quantized_model_equals_float_model_with_rounded_weights(quantized, with_mtp):
    """The only difference a quantized checkpoint may make is the rounding of the quantized weights."""
    bits, _, qmodel = quantized
    model, _, _ = load_model(with_mtp[0], dtype=mx.float32)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and not name.endswith(("in_proj_a", "in_proj_b")):
            w, s, b = mx.quantize(module.weight, group_size=64, bits=bits)
            module.weight = mx.dequantize(w, s, b, group_size=64, bits=bits)
    tokens = mx.array(helpers.random_tokens(120, seed=4))[None]
    ref, ref_hidden = model(tokens)
    ours, hidden = qmodel(tokens)
    assert rel_err(ours, ref) <= 1e-4
    draft_ref = model.mtp_forward(tokens[:, 1:], ref_hidden[:, :-1])[0]
    draft = qmodel.mtp_forward(tokens[:, 1:], hidden[:, :-1])[0]
    assert rel_err(draft, draft_ref) <= 1e-4


def test_quantized_logits_stay_close_to_float(quantized, float_model):
    """Bounds from measurements on this kind of checkpoint (5 seeds, group size 64):
    8-bit: mean cosine >= 0.9999 (backbone) / 0.9999 (MTP), per-position min >= 0.9994, top-1 agreement >= 0.955.
    4-bit: mean cosine 0.988-0.989 (backbone) / 0.976-0.979 (MTP), top-1 agreement 0.75-0.84 / 0.62-0.73
    (random logits have many near-ties, so top-1 flips more often than a trained model's would).
    The bounds leave >= 10x margin on 1 - cosine at 8 bits and >= 2x at 4 bits; a missing or doubled norm
    shift, a wrong group layout or a dropped tensor lands far outside them.
    """
    bits, _, qmodel = quantized
    tokens = mx.array(helpers.random_tokens(200, seed=9))[None]
    ref, ref_hidden = float_model(tokens)
    ours, hidden = qmodel(tokens)
    cos = cosine(ours[0], ref[0])
    draft_cos = cosine(
        qmodel.mtp_forward(tokens[:, 1:], hidden[:, :-1])[0][0],
        float_model.mtp_forward(tokens[:, 1:], ref_hidden[:, :-1])[0][0],
    )
    top1 = (np.array(ours[0]).argmax(-1) == np.array(ref[0]).argmax(-1)).mean()
    if bits == 8:
        assert cos.mean() >= 0.999 and cos.min() >= 0.99, (cos.mean(), cos.min())
        assert draft_cos.mean() >= 0.999 and draft_cos.min() >= 0.99, (draft_cos.mean(), draft_cos.min())
        assert top1 >= 0.9
    else:
        assert cos.mean() >= 0.95, cos.mean()
        assert draft_cos.mean() >= 0.95, draft_cos.mean()
        assert top1 >= 0.6, top1
        draft_top1 = (np.array(qmodel.mtp_forward(tokens[:, 1:], hidden[:, :-1])[0][0]).argmax(-1)
                      == np.array(float_model.mtp_forward(tokens[:, 1:], ref_hidden[:, :-1])[0][0]).argmax(-1)).mean()
        assert draft_top1 >= 0.5, draft_top1


def test_quantized_checkpoint_norms_are_not_shifted_twice(quantized, float_model):
    _, _, qmodel = quantized
    for get in (
        lambda m: m.model.norm.weight,
        lambda m: m.layers[1].self_attn.q_norm.weight,
        lambda m: m.mtp.norm.weight,
        lambda m: m.mtp.pre_fc_norm_hidden.weight,
        lambda m: m.layers[0].linear_attn.norm.weight,
    ):
        np.testing.assert_allclose(np.array(get(qmodel)), np.array(get(float_model)), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# MTP head


def np_rms(x, w, eps=1e-6):
    """N(x; w) with a zero-centred stored weight w."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


def np_rope(x, positions, rotary_dims, theta):
    """Partial NeoX RoPE on the first `rotary_dims` dims of x [S, H, D]."""
    half = rotary_dims // 2
    inv_freq = theta ** (-np.arange(0, rotary_dims, 2) / rotary_dims)  # [half]
    ang = positions[:, None] * inv_freq[None]  # [S, half]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2, rest = x[..., :half], x[..., half:rotary_dims], x[..., rotary_dims:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def np_mtp_draft_logits(w: dict[str, np.ndarray], config: dict, next_tokens, h) -> np.ndarray:
    """DESIGN.md 2.9 from raw checkpoint arrays (float64): fc(cat[N(embed(t)), N(h)]) -> one full-attention
    decoder layer at positions 0..S-1 -> N(.; mtp.norm) -> lm_head."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    heads, kv, D = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    rope = config["rope_parameters"]
    rd = int(D * rope["partial_rotary_factor"])
    S = len(next_tokens)
    e = w["model.embed_tokens.weight"][next_tokens]  # [S, H]
    z = np.concatenate([np_rms(e, w["mtp.pre_fc_norm_embedding.weight"]), np_rms(h, w["mtp.pre_fc_norm_hidden.weight"])], -1)
    z = z @ w["mtp.fc.weight"].T  # [S, H]

    p = "mtp.layers.0."
    a = np_rms(z, w[p + "input_layernorm.weight"])
    qg = (a @ w[p + "self_attn.q_proj.weight"].T).reshape(S, heads, 2 * D)
    q, gate = qg[..., :D], qg[..., D:]  # [S, heads, D]
    k = (a @ w[p + "self_attn.k_proj.weight"].T).reshape(S, kv, D)
    v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(S, kv, D)
    q, k = np_rms(q, w[p + "self_attn.q_norm.weight"]), np_rms(k, w[p + "self_attn.k_norm.weight"])
    pos = np.arange(S, dtype=np.float64)
    q, k = np_rope(q, pos, rd, rope["rope_theta"]), np_rope(k, pos, rd, rope["rope_theta"])
    k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)  # GQA: head j uses kv head j // r
    scores = np.einsum("shd,thd->hst", q, k) * D**-0.5  # [heads, S, S]
    scores = np.where(np.tril(np.ones((S, S), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attn = np.einsum("hst,thd->shd", probs, v) * (1 / (1 + np.exp(-gate)))  # [S, heads, D]
    z = z + attn.reshape(S, -1) @ w[p + "self_attn.o_proj.weight"].T
    m = np_rms(z, w[p + "post_attention_layernorm.weight"])
    gate_h = m @ w[p + "mlp.gate_proj.weight"].T
    z = z + ((gate_h / (1 + np.exp(-gate_h))) * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    head = w["model.embed_tokens.weight"] if config["tie_word_embeddings"] else w["lm_head.weight"]
    return np_rms(z, w["mtp.norm.weight"]) @ head.T


def test_mtp_head_is_loaded_with_norms_shifted_once(with_mtp, float_model):
    _, stored = with_mtp
    assert float_model.has_mtp
    for name in (
        "mtp.norm.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.layers.0.input_layernorm.weight",
        "mtp.layers.0.post_attention_layernorm.weight",
        "mtp.layers.0.self_attn.q_norm.weight",
        "mtp.layers.0.self_attn.k_norm.weight",
    ):
        loaded = float_model
        for part in name.split("."):
            loaded = loaded[int(part)] if part.isdigit() else getattr(loaded, part)
        np.testing.assert_allclose(np.array(loaded), stored[name] + 1.0, rtol=0, atol=1e-7, err_msg=name)
    np.testing.assert_array_equal(np.array(float_model.mtp.fc.weight), stored["mtp.fc.weight"])


def test_mtp_draft_logits_match_numpy_spec(with_mtp, float_model):
    from safetensors.numpy import load_file

    path, _ = with_mtp
    config = json.loads((path / "config.json").read_text())
    raw = load_file(str(path / "model.safetensors"))
    tokens = helpers.random_tokens(33, seed=21)
    _, hidden = float_model(mx.array(tokens[:-1])[None])  # h_p for p = 0..31 (post-final-norm)
    next_tokens = tokens[1:]  # t_{p+1}
    draft, mtp_hidden = float_model.mtp_forward(mx.array(next_tokens)[None], hidden)
    assert mtp_hidden.shape == hidden.shape
    ref = np_mtp_draft_logits(raw, config, np.array(next_tokens), np.array(hidden[0], dtype=np.float64))
    assert np.abs(ref).max() > 1.0  # a live head, not near-zero logits
    assert rel_err(draft[0], ref) <= 1e-4


def test_check_reports_mtp(with_mtp, capsys):
    from hetero.cli.main import main

    path, _ = with_mtp
    assert preflight(path).has_mtp
    assert main(["check", "--model", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["has_mtp"] is True and report["ok"] is True
