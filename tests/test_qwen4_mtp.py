"""The Qwen4-Exp MTP head (`mtp.*`): loaded from the shipped tensor names, exact against a float64 oracle of its own
(tests/qwen4_oracle64.py, written from transformers' layer code: transformers has no MTP forward), and speculative
decoding with it: greedy identical to plain decoding at several depths over prompts where QSA drops keys, the
rollback of PLE, GDN and QSA state on rejection, and sampled MTP following the exact law of plain decoding (the
total-variation check of tests/test_speculative.py)."""

from __future__ import annotations

import hetero  # before mlx: the fast BLAS
import mlx.core as mx
import numpy as np
import pytest
import qwen4_checkpoint as qc
from mlx.utils import tree_flatten, tree_unflatten

from hetero.checkpoint.loader import load_model
from hetero.decode.prefill import prefill
from hetero.decode.records import MTPStats
from hetero.decode.sampling import Sampler, SamplingParams, warp
from hetero.decode.solo import decode_tokens
from hetero.decode.stepper import Batch
from hetero.errors import HeteroError
from hetero.models.cache import GDNCache
from qwen4_oracle64 import Oracle
from test_speculative import assert_warp_unambiguous, first_round, tv

GREEDY = SamplingParams()
PROMPT = 40  # 10 index blocks of 4 against a budget of 2 blocks: the backbone's and the head's QSA drop keys
TOL = 2e-6  # fp32 against float64, relative to the largest magnitude (measured: below 4e-7)


def load(path):
    return load_model(path)[0]


def _tokens(n: int, seed: int, vocab: int = qc.VOCAB) -> list[int]:
    toks = [int(t) for t in np.random.default_rng(seed).integers(2, vocab, n)]
    toks[n // 3] = qc.EOS  # the n-gram context restarts there
    return toks


def rel(ours, ref) -> float:
    ours = np.asarray(ours, dtype=np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def agreeing(model, alpha: float):
    """Make the head mostly predict what the backbone will say (as test_speculative.agreeing_model does for
    Qwen3.5). Backbone: every block's output (GDN and attention out, experts' down, PLE values and conv) scaled by `alpha`,
    so every stream stays close to e_t and the next token is mostly f(t) = argmax lm_head(mixer(e_t, .., e_t)).
    Head: fc_hidden 0, fc_embedding I, its norm 1 and its layer's outputs 0, so its streams are N(e_{t_{p+1}}) each,
    and its mixer the backbone's (grouped RMSNorm first: the scale of e does not matter): the draft is f(t_{p+1})."""
    d = model.args.hidden_size
    new = []
    for name, p in tree_flatten(model.parameters()):
        if name.startswith("model.layers.") and name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight",
                                                                "value_proj.weight", "ple.conv1d.weight")):
            new.append((name, alpha * p))
        elif name.startswith("mtp.layers.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            new.append((name, mx.zeros_like(p)))
        elif name == "mtp.fc_hidden.weight":
            new.append((name, mx.zeros_like(p)))
        elif name == "mtp.fc_embedding.weight":
            new.append((name, mx.eye(d)))
        elif name == "mtp.pre_fc_norm_embedding.weight":
            new.append((name, mx.ones_like(p)))
        elif name.startswith("mtp.hyper_connection_mixer."):
            new.append((name, model.model.hyper_connection_mixer[name.split(".", 2)[2].split(".")[0]]["weight"]))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4mtp")
    qc.build(path, ple_layer_ids=(1, 2), seed=0, mtp=True)
    return path


@pytest.fixture(scope="module")
def rejecting(ckpt):
    """The random head: its drafts are mostly rejected."""
    return load(ckpt)


@pytest.fixture(scope="module")
def agreeing_model(ckpt):
    return agreeing(load(ckpt), alpha=0.02)


# ----------------------------------------------------------------------------------------------------------
# The head against the float64 oracle, and the loader


def test_mtp_head_matches_float64_oracle(ckpt, rejecting):
    """Draft logits and streams of the pairs (t_{p+1}, h_p) over a prompt where the head's own QSA drops keys: in one
    pass, chunk by chunk over its cache, and one depth further fed its own streams and a draft token."""
    model, oracle = rejecting, Oracle(ckpt)
    tokens = _tokens(PROMPT + 1, 1)
    _, streams = model(mx.array([tokens[:-1]]))  # [1, S, hc*d]: the backbone's last streams, before its mixer
    assert streams.shape == (1, PROMPT, qc.TEXT["hc_count"] * qc.TEXT["hidden_size"])
    h = np.array(streams[0]).astype(np.float64)
    ref_logits, ref_z = oracle.draft(tokens[1:], h)

    z = model.mtp_hidden(mx.array([tokens[1:]]), streams)
    assert rel(model.draft_logits(z)[0], ref_logits) <= TOL
    assert rel(z[0], ref_z) <= TOL
    for chunk in (1, 7):
        cache, out = model.make_cache().mtp, []
        for i in range(0, PROMPT, chunk):
            z_i = model.mtp_hidden(mx.array([tokens[1 + i : 1 + i + chunk]]), streams[:, i : i + chunk], cache)
            out.append(np.array(model.draft_logits(z_i)[0]))
        assert rel(np.concatenate(out), ref_logits) <= TOL, f"chunk {chunk}"
    assert cache[0].offset == PROMPT and cache[0].index_keys.shape[1] == PROMPT

    draft = int(np.argmax(ref_logits[-1]))  # depth 2: (d, z_{S-1}) at the next MTP position
    chain_logits, _ = oracle.draft(tokens[1:] + [draft], np.concatenate([h, ref_z[-1:]]))
    z2 = model.draft_logits(model.mtp_hidden(mx.array([[draft]]), z[:, -1:], cache))
    assert rel(z2[0], chain_logits[-1:]) <= TOL


def _draft_chain(model, tokens: list[int], depth: int) -> list[np.ndarray]:
    """The head over the pairs of `tokens` (a cold pass, then a catch-up over the last 3 pairs over its cache), then
    `depth` greedy draft steps fed its own streams: each pass's draft logits and streams, and its caches' arrays."""
    cache = model.make_cache()
    _, streams = model(mx.array([tokens[:-1]]), cache)  # [1, S, hc*d]
    n = len(tokens) - 1
    model.mtp_hidden(mx.array([tokens[1 : n - 2]]), streams[:, : n - 3], cache.mtp)
    z = model.mtp_hidden(mx.array([tokens[n - 2 :]]), streams[:, n - 3 :], cache.mtp)[:, -1:]  # [1, 1, hc*d]
    out = [np.array(z)]
    for _ in range(depth):
        logits = model.draft_logits(z)  # [1, 1, V]
        z = model.mtp_hidden(mx.argmax(logits[:, -1], axis=-1)[:, None], z, cache.mtp)
        out += [np.array(logits), np.array(z)]
    return out + [np.array(a) for c in cache.mtp for a in c.state]


def test_compiled_draft_steps_equal_the_uncompiled_head(ckpt, monkeypatch):
    """The head's catch-up and draft steps run compiled (its inputs, its layer's `LayerSteps`, its mixer and lm_head)
    and give the uncompiled head's draft logits, streams and caches, over a prompt where its QSA drops keys."""
    from hetero.models.compiled import PerThread
    from hetero.models.qwen4_exp import step

    model, tokens = load(ckpt), _tokens(PROMPT + 1, 3)
    taken = []
    takes = step.LayerSteps.takes

    def head_takes(self, h, cache) -> bool:  # records the head layer's choices
        took = takes(self, h, cache)
        if self.layer is model.mtp.layers[0]:
            taken.append(took)
        return took

    monkeypatch.setattr(step.LayerSteps, "takes", head_takes)
    compiled = _draft_chain(model, tokens, 4)
    assert taken == [False, True] + [True] * 4  # the cold pass uncompiled; the catch-up and every draft step compiled
    for fn in (model.mtp._step_inputs, model._step_draft_logits):
        assert getattr(fn._local, "compiled", None) is not None
    monkeypatch.setattr(step.LayerSteps, "takes", lambda self, h, cache: False)
    monkeypatch.setattr(PerThread, "__call__", lambda self, *args: self._fn(*args))
    plain = _draft_chain(model, tokens, 4)
    for a, b in zip(compiled, plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _warm_head(model, tokens: list[int], pending: int):
    """The backbone's streams over `tokens` and a head cache warm over all pairs but the last `pending` ones."""
    cache = model.make_cache()
    _, streams = model(mx.array([tokens[:-1]]), cache)  # [1, S, hc*d]
    n = len(tokens) - 1
    model.mtp_hidden(mx.array([tokens[1 : n + 1 - pending]]), streams[:, : n - pending], cache.mtp)
    return streams, cache.mtp


def test_catch_up_runs_the_last_pair_alone(ckpt):
    """`mtp_hidden(last=True)`, the catch-up before a draft: the last pair's streams as the whole pass gives them, the
    same keys, values and index keys written for every pair (bit for bit), and the attention's output side (o_proj,
    the MoE) run for one position, not for each pair; over a prompt where the head's QSA drops keys."""
    from hetero.models.moe import SparseMoeBlock

    model, tokens = load(ckpt), _tokens(PROMPT + 1, 5)
    n, m = len(tokens) - 1, 4
    full, last = [], []
    for out, flag in ((full, False), (last, True)):
        streams, cache = _warm_head(model, tokens, m)
        z = model.mtp_hidden(mx.array([tokens[n + 1 - m :]]), streams[:, n - m :], cache, last=flag)
        out += [np.array(z[:, -1:]), *[np.array(a) for a in cache[0].state]]
    assert full[0].shape == last[0].shape == (1, 1, qc.TEXT["hc_count"] * qc.TEXT["hidden_size"])
    np.testing.assert_allclose(last[0], full[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(full[1:], last[1:], strict=True):
        assert np.array_equal(a, b)

    rows, call, head_moe = [], SparseMoeBlock.__call__, model.mtp.layers[0].mlp
    streams, cache = _warm_head(model, tokens, m)

    def counted(self, x: mx.array) -> mx.array:  # the positions [B, S, d] the head's MoE runs
        if self is head_moe:
            rows.append(x.shape[1])
        return call(self, x)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SparseMoeBlock, "__call__", counted)
        mx.disable_compile()  # traced or not, the step's Python runs on every call
        try:
            model.mtp_hidden(mx.array([tokens[n + 1 - m :]]), streams[:, n - m :], cache, last=True)
        finally:
            mx.enable_compile()
    assert rows == [1]


def test_prefill_writes_the_heads_keys_alone(ckpt, monkeypatch):
    """Prefill with the head (chunks of 24 and 16 tokens: 23 pairs past the compiled step's size, then 16 within it)
    fills the head's cache as the whole head pass over each chunk's pairs does, and runs its MoE for each chunk's last
    pair alone (the head's outputs over a prompt are never read); over a prompt where its QSA drops keys."""
    from hetero.models.moe import SparseMoeBlock

    model, tokens = load(ckpt), _tokens(PROMPT, 8)
    whole, mtp_hidden = model.make_cache(), type(model).mtp_hidden
    with monkeypatch.context() as mp:
        mp.setattr(type(model), "mtp_hidden", lambda self, *a, last=False: mtp_hidden(self, *a))
        prefill(model, tokens, whole, chunk=24, mtp=True)
    rows, call, head_moe = [], SparseMoeBlock.__call__, model.mtp.layers[0].mlp

    def counted(self, x: mx.array) -> mx.array:
        if self is head_moe:
            rows.append(x.shape[1])
        return call(self, x)

    monkeypatch.setattr(SparseMoeBlock, "__call__", counted)
    cache = model.make_cache()
    mx.disable_compile()  # traced or not, the step's Python runs on every call
    try:
        prefill(model, tokens, cache, chunk=24, mtp=True)
    finally:
        mx.enable_compile()
    assert rows == [1, 1]
    assert cache.mtp[0].offset == whole.mtp[0].offset == PROMPT - 1
    for a, b in zip(cache.mtp[0].state, whole.mtp[0].state, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6, atol=1e-6)


def test_batched_catch_up_takes_each_rows_own_last_pair(ckpt):
    """A batch's catch-up (`RaggedKV`, rows of 3 and 1 pending pairs, padded): each row's streams at its own last real
    pair, as the row's catch-up alone gives them, and each row's cache as alone."""
    from hetero.models.cache import RaggedKV

    model = load(ckpt)
    prompts, pending = [_tokens(PROMPT + 1, 6), _tokens(PROMPT - 6, 7)], [3, 1]
    alone, warm = [], []
    for t, m in zip(prompts, pending):
        streams, cache = _warm_head(model, t, m)
        warm.append((streams, _warm_head(model, t, m)[1]))
        n = len(t) - 1
        z = model.mtp_hidden(mx.array([t[n + 1 - m :]]), streams[:, n - m :], cache, last=True)
        alone.append((np.array(z), [np.array(a) for a in cache[0].state]))
    M = max(pending)
    tokens = mx.array([t[len(t) - m :] + [0] * (M - m) for t, m in zip(prompts, pending)])  # [2, M]
    hidden = mx.concatenate([mx.pad(s[:, s.shape[1] - m :], [(0, 0), (0, M - m), (0, 0)])
                             for (s, _), m in zip(warm, pending)])  # [2, M, hc*d]
    z = model.mtp_hidden(tokens, hidden, [RaggedKV([c[0] for _, c in warm], pending)], last=True)  # [2, 1, hc*d]
    assert z.shape[:2] == (2, 1)
    for i, (ref, ref_state) in enumerate(alone):
        np.testing.assert_allclose(np.array(z[i : i + 1]), ref, rtol=1e-5, atol=1e-6)
        for a, b in zip(warm[i][1][0].state, ref_state, strict=True):
            np.testing.assert_allclose(np.array(a), b, rtol=1e-5, atol=1e-6)


def test_backbone_streams_are_transformers_last_layer_output(tmp_path):
    """What the head reads, h_p: the last decoder layer's hc streams before the final mixer, as transformers computes
    them (captured from its last Qwen4ExpTextDecoderLayer), over a prompt where QSA drops keys."""
    import torch

    hf = qc.build(tmp_path, nested=True, ple_layer_ids=(1, 4), seed=12)
    captured = []
    hf.model.language_model.layers[-1].register_forward_hook(lambda m, args, out: captured.append(out))
    tokens = _tokens(PROMPT, 12)
    with torch.no_grad():
        hf(torch.tensor([tokens]))
    ref = captured[0][0].double().numpy()  # [S, hc*d]
    _, streams = load(tmp_path)(mx.array([tokens]))
    assert rel(streams[0], ref) <= 1e-4


def test_oracle_qsa_drops_keys_in_the_head(ckpt):
    """The oracle's (and so the test's) head attention is sparse over this prompt: later queries see fewer keys than
    the causal ones, so the draft logits depend on the indexer's choice."""
    oracle = Oracle(ckpt)
    x = np.random.default_rng(0).standard_normal((PROMPT, qc.TEXT["hidden_size"]))
    kept = oracle.selected(x, "layers.0.self_attn.indexer").sum(1)  # [S]
    budget, ratio = qc.TEXT["indexer_budget"], qc.TEXT["indexer_compress_ratio"]
    assert kept.max() <= budget + ratio - 1 and kept[-1] < PROMPT


def test_fused_expert_layout_gives_the_same_head(ckpt, rejecting, tmp_path):
    """`mtp.layers.0.mlp.experts.gate_up_proj` / `down_proj` (transformers 5's fused form) load as the per-expert
    tensors do."""
    qc.build(tmp_path, ple_layer_ids=(1, 2), seed=0, mtp=True, mtp_fused_experts=True)
    fused = load(tmp_path)
    tokens = _tokens(12, 2)
    _, streams = rejecting(mx.array([tokens[:-1]]))
    a = rejecting.draft_logits(rejecting.mtp_hidden(mx.array([tokens[1:]]), streams))
    b = fused.draft_logits(fused.mtp_hidden(mx.array([tokens[1:]]), streams))
    assert mx.array_equal(a, b)


def test_check_reports_the_head(ckpt):
    from hetero.checkpoint.preflight import preflight

    text = "\n".join(preflight(ckpt).lines())
    assert "MTP head: present" in text and "result: OK" in text


def test_incomplete_head_is_one_line(tmp_path):
    """A checkpoint whose mtp.* tensors lack the decoder layer's attention: one line naming a missing tensor."""
    from safetensors.numpy import load_file, save_file

    qc.build(tmp_path, seed=3, mtp=True)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.layers.0.self_attn.")}, file,
              metadata={"format": "pt"})
    with pytest.raises(HeteroError, match=r"no tensor for parameter mtp\.layers\.0\.self_attn\..*incomplete") as e:
        load(tmp_path)
    assert "\n" not in str(e.value)


def test_head_has_one_layer_whatever_the_depth_field_says(tmp_path):
    """mtp_num_hidden_layers 2 over the shipped `mtp.layers.0` alone: one layer, as mlx-vlm reads the released head
    (it takes the field as the draft depth)."""
    qc.build(tmp_path, seed=15, mtp=True)
    qc.patch_config(tmp_path, mtp_num_hidden_layers=2)
    model = load(tmp_path)
    assert model.has_mtp and len(model.mtp.layers) == 1 and len(model.make_cache().mtp) == 1


def test_without_mtp_tensors_the_head_is_absent(tmp_path):
    """A config that declares the head (mtp_num_hidden_layers) over a checkpoint converted without it (mlx-vlm keeps
    the head as a separate artifact) loads without MTP and says so."""
    from hetero.checkpoint.preflight import preflight

    qc.build(tmp_path, seed=4)
    qc.patch_config(tmp_path, mtp_num_hidden_layers=1)
    report = preflight(tmp_path)
    assert report.ok and not report.has_mtp and any("no mtp.* tensors" in w for w in report.warnings)
    assert not load(tmp_path).has_mtp


def test_quantized_checkpoint_keeps_the_head(ckpt, rejecting, tmp_path):
    """`hetero convert`'s quantization (8-bit, group 32) writes the head too: it loads quantized, its draft logits stay
    within 2% of the float head's, and greedy MTP on the quantized model equals its plain decoding."""
    import mlx.nn as nn

    from hetero.cli.quantize import quantize_checkpoint

    model = load(quantize_checkpoint(str(ckpt), tmp_path / "q8", bits=8, group_size=32))
    assert model.has_mtp and isinstance(model.mtp.fc_hidden, nn.QuantizedLinear)
    assert isinstance(model.mtp.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    tokens = _tokens(PROMPT + 1, 13)
    _, streams = rejecting(mx.array([tokens[:-1]]))
    ref = np.array(rejecting.draft_logits(rejecting.mtp_hidden(mx.array([tokens[1:]]), streams))[0], np.float64)
    assert rel(model.draft_logits(model.mtp_hidden(mx.array([tokens[1:]]), streams))[0], ref) <= 0.02
    prompt = _tokens(PROMPT, 14)
    assert spec(model, prompt, 12, 3) == plain(model, prompt, 12)


# ----------------------------------------------------------------------------------------------------------
# Speculative decoding


def plain(model, prompt: list[int], n: int) -> list[int]:
    return list(decode_tokens(model, prompt, Sampler(GREEDY), n, set()))


def spec(model, prompt: list[int], n: int, depth: int, stats: MTPStats | None = None) -> list[int]:
    return list(decode_tokens(model, prompt, Sampler(GREEDY), n, set(), depth=depth, copy=False, stats=stats))


GREEDY_TOKENS = 24


@pytest.mark.parametrize("depth", [1, 3])
def test_greedy_mtp_equals_plain_when_drafts_are_rejected(rejecting, depth):
    prompt = _tokens(PROMPT, 5)
    stats = MTPStats(depth)
    assert spec(rejecting, prompt, GREEDY_TOKENS, depth, stats) == plain(rejecting, prompt, GREEDY_TOKENS)
    assert stats.mtp_rounds > 0 and stats.to_dict()["acceptance_by_depth"][0] < 0.3


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_greedy_mtp_equals_plain_when_drafts_are_accepted(agreeing_model, depth):
    prompt = _tokens(PROMPT, 6)
    stats = MTPStats(depth)
    assert spec(agreeing_model, prompt, GREEDY_TOKENS, depth, stats) == plain(agreeing_model, prompt, GREEDY_TOKENS)
    summary = stats.to_dict()
    assert summary["acceptance_by_depth"][0] > 0.6
    assert 1.5 < summary["mean_accepted_length"] < depth + 1  # some drafts were rejected: both paths ran


def test_rollback_leaves_exactly_the_committed_state(agreeing_model):
    """After speculative rounds with rejections, every backbone cache (GDN state and conv window, PLE token context
    and conv window, QSA keys, values and index keys) and the head's QSA cache equal a fresh run over the committed
    tokens alone."""
    model = agreeing_model
    prompt = _tokens(PROMPT, 7)
    batch = Batch(model, max_batch=1)
    row = batch.join(prompt, Sampler(GREEDY), 1000, set(), depth=3, copy=False, stats=MTPStats(3))
    while len(row.tokens) < 14:
        batch.step()
    assert row.stats.mtp_rounds > row.stats.accepted[-1] > 0  # rounds that kept all drafts, and some that did not
    assert_committed_state(model, row.decoder, prompt + row.tokens[:-1])  # the backbone has run all but x


def assert_committed_state(model, d, committed: list[int], mtp: bool = True) -> None:
    """Every backbone cache of decoder `d` (GDN state and conv window, PLE token context and conv window, QSA keys,
    values and index keys) and, for a row that drafted (`mtp`), its head's QSA cache and its pending streams equal
    a fresh run over `committed`."""
    ref = model.make_cache()
    _, hidden = prefill(model, committed, ref, chunk=16, all_logits=True, mtp=mtp)
    for i, (c, r) in enumerate(zip(d.backbone, ref.backbone, strict=True)):
        assert c.offset == r.offset == len(committed), f"layer {i}"
        if isinstance(c, GDNCache):
            assert rel(c.recurrent, np.array(r.recurrent, np.float64)) <= 1e-5, f"layer {i} state"
            assert rel(c.conv, np.array(r.conv, np.float64)) <= 1e-5, f"layer {i} conv"
            if c.ple is not None:
                assert (c.ple.context == r.ple.context).all() and not c.ple.recording, f"layer {i} PLE context"
                assert rel(c.ple.conv, np.array(r.ple.conv, np.float64)) <= 1e-5, f"layer {i} PLE conv"
        else:
            n = len(committed)
            for got, want in ((c.keys[:, :, :n], r.keys[:, :, :n]), (c.values[:, :, :n], r.values[:, :, :n]),
                              (c.index_keys, r.index_keys)):
                assert rel(got, np.array(want, np.float64)) <= 1e-5, f"layer {i}"
    if not mtp:
        return
    (c,), (r,) = d.mtp_cache, ref.mtp
    consumed = c.offset  # the head has consumed every pair but the pending ones
    assert consumed == len(committed) - 1 - len(d.pending_tokens)
    assert rel(c.keys[:, :, :consumed], np.array(r.keys[:, :, :consumed], np.float64)) <= 1e-5
    assert rel(c.index_keys, np.array(r.index_keys[:, :consumed], np.float64)) <= 1e-5
    assert rel(d.pending_hidden, np.array(hidden[consumed:], np.float64)) <= 1e-5


# ----------------------------------------------------------------------------------------------------------
# Sampling: the exact law


LAW_VOCAB = 8
LAW_PROMPT = [7, 3, 3, 1, 0, 6, 2, 5, 4, 1, 3]
LAW_DRAWS = 700


@pytest.fixture(scope="module")
def law_model(tmp_path_factory):
    """Vocabulary 8, two layers (GDN with PLE, QSA), a head that agrees with the backbone often enough that the x3
    check has data."""
    path = tmp_path_factory.mktemp("q4law")
    qc.build(path, ple_layer_ids=(1,), seed=9, mtp=True, vocab_size=LAW_VOCAB, num_hidden_layers=2,
             layer_types=["linear_attention", "indexed_attention"])
    return agreeing(load(path), alpha=0.5)


def exact_three_token_law(model, params: SamplingParams):
    """P(x1), P(x2 | x1) [V, V], P(x3 | x1, x2) [V, V, V] from the model's own logits with `warp`."""
    V = model.args.vocab_size
    probs = lambda logits: np.exp(np.array(warp(logits, params), dtype=np.float64))  # noqa: E731

    def last(tokens):
        logits, _ = prefill(model, tokens, model.make_cache())
        assert_warp_unambiguous(np.array(logits[-1]), params)
        return probs(logits[-1])

    p1, p2, p3 = last(LAW_PROMPT), np.zeros((V, V)), np.zeros((V, V, V))
    for x1 in np.flatnonzero(p1):
        p2[x1] = last(LAW_PROMPT + [int(x1)])
        for x2 in np.flatnonzero(p2[x1]):
            p3[x1, x2] = last(LAW_PROMPT + [int(x1), int(x2)])
    return p1, p2, p3


def test_sampled_mtp_matches_the_exact_law(law_model):
    """x1 ~ P(x1), (x1, x2) ~ P(x1) P(x2|x1) and x3 ~ P(x3|x1,x2) when x2 was an accepted draft, through one
    speculative round of depth 2 per seed from a shared prefilled cache (test_speculative's harness)."""
    model, V = law_model, LAW_VOCAB
    params = SamplingParams(1.0, top_k=3)
    p1, p2, p3 = exact_three_token_law(model, params)
    cache = model.make_cache()
    logits, last_hidden = prefill(model, LAW_PROMPT, cache, mtp=True)
    rows, accepted, outside = [], [], 0
    for seed in range(LAW_DRAWS):
        sampler = Sampler(params, seed)
        x1 = sampler(logits[-1]).item()
        drafts, a, block = first_round(model, cache, x1, last_hidden, sampler)
        rows.append((x1, block[0], block[1] if a >= 1 else -1))
        accepted.append(a)
        outside += p2[x1, drafts[0]] == 0
    rows, accepted = np.array(rows), np.array(accepted)
    print(f"first drafts accepted: {(accepted >= 1).mean():.2f}, both: {(accepted == 2).mean():.2f}, outside: {outside}")
    assert 0.05 < (accepted >= 1).mean() < 0.95 and (accepted == 2).any() and outside > 0
    dist, bound = tv(p1[None], np.zeros(LAW_DRAWS, dtype=int), rows[:, 0])
    assert dist <= bound, f"x1: TV {dist:.4f} > {bound:.4f}"
    joint = (p1[:, None] * p2).reshape(1, V * V)
    dist, bound = tv(joint, np.zeros(LAW_DRAWS, dtype=int), rows[:, 0] * V + rows[:, 1])
    assert dist <= bound, f"(x1, x2): TV {dist:.4f} > {bound:.4f}"
    acc = rows[accepted >= 1]
    dist, bound = tv(p3.reshape(V * V, V), acc[:, 0] * V + acc[:, 1], acc[:, 2])
    assert dist <= bound, f"x3 | x1, x2 (x2 accepted): TV {dist:.4f} > {bound:.4f}"


def test_oracle_layer_is_transformers_decoder_layer(ckpt):
    """The oracle's own decoder layer (QSA, MoE, hyper-connections) against transformers' Qwen4ExpTextDecoderLayer
    loaded with the head's layer tensors, both in float64, over a sequence where the indexer drops keys: the oracle
    is transformers' layer math, written independently. transformers keeps two pieces in fp32 inside a float64
    module (the router's softmax, `dtype=torch.float`, and the rotary cos/sin), hence 1e-6, not float64's 1e-12
    (measured 1.2e-7; a wrong piece of math moves the output by O(1))."""
    import torch
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextDecoderLayer, Qwen4ExpTextRotaryEmbedding

    oracle = Oracle(ckpt)
    config = Qwen4ExpTextConfig(**dict(qc.TEXT, num_hidden_layers=1, layer_types=["indexed_attention"],
                                       ple_layer_ids=[]))
    config._attn_implementation = "sdpa"
    layer = Qwen4ExpTextDecoderLayer(config, 0).double().eval()
    prefix = "mtp.layers.0."
    state = {k[len(prefix) :]: torch.from_numpy(v) for k, v in oracle.t.items() if k.startswith(prefix)}
    E = qc.TEXT["num_experts"]
    experts = "mlp.experts."
    state[experts + "gate_up_proj"] = torch.stack([torch.cat([state.pop(f"{experts}{e}.gate_proj.weight"),
                                                              state.pop(f"{experts}{e}.up_proj.weight")]) for e in range(E)])
    state[experts + "down_proj"] = torch.stack([state.pop(f"{experts}{e}.down_proj.weight") for e in range(E)])
    layer.load_state_dict(state)
    N, width = PROMPT, qc.TEXT["hc_count"] * qc.TEXT["hidden_size"]
    x = np.random.default_rng(3).standard_normal((N, width))
    positions = torch.arange(N).view(1, 1, -1).expand(3, 1, -1)
    with torch.no_grad():
        xt = torch.from_numpy(x)[None]
        cos_sin = Qwen4ExpTextRotaryEmbedding(config)(xt, positions)
        mask = torch.tril(torch.ones(N, N, dtype=torch.bool))[None, None]
        ref = layer(xt, position_embeddings=cos_sin, attention_mask=mask, cache=None)[0].numpy()
    assert rel(oracle.layer(x, "layers.0"), ref) <= 1e-6


def test_cli_check_and_run_use_the_head(tmp_path, capsys):
    """`hetero check` reports the head of a qwen4_exp checkpoint and `hetero run --draft-depth 2` decodes with it
    (its `mtp` block in --json), greedy-identical to `--no-mtp`."""
    import json

    from hetero.cli.main import main

    qc.build(tmp_path, nested=True, ple_layer_ids=(2, 4), seed=10, mtp=True)
    qc.add_tokenizer(tmp_path)
    assert main(["check", "--model", str(tmp_path)]) == 0
    assert "MTP head: present" in capsys.readouterr().out
    prompt = "def add(a, b):\n    return a + b\n" * 2
    runs = {}
    for flag in ("--no-mtp", "--draft-depth=2"):
        assert main(["run", "--model", str(tmp_path), "--prompt", prompt, "--max-tokens", "12", "--json", flag]) == 0
        runs[flag] = json.loads(capsys.readouterr().out)
    assert runs["--draft-depth=2"]["mtp"]["depth"] == 2 and runs["--draft-depth=2"]["mtp"]["rounds"] > 0
    assert "mtp" not in runs["--no-mtp"] or not runs["--no-mtp"]["mtp"]
    assert runs["--draft-depth=2"]["tokens"] == runs["--no-mtp"]["tokens"]
