"""Batched decoding of Qwen4-Exp (hetero.decode.stepper): rows of different prompt lengths, some long enough that
QSA drops keys, decode together and each gets exactly the tokens it gets alone (and transformers' greedy tokens).

A batch stacks the rows' GDN states and PLE states (token context, conv window) for one pass and splits them back
at commit; QSA layers run each row's selection and attention over that row's own cache (`RaggedKV`). The tiny
checkpoint (with an MTP head) is tests/qwen4_checkpoint.py's; the server's batch is in tests/test_qwen4_exp.py.
"""

from __future__ import annotations

import hetero  # before mlx: the fast BLAS
import mlx.core as mx
import numpy as np
import pytest
import qwen4_checkpoint as qc
import torch
from test_qwen4_mtp import agreeing, assert_committed_state, rel

from hetero.checkpoint.loader import load_model
from hetero.decode.logprobs import LogprobRecorder
from hetero.decode.options import DecodeOptions
from hetero.decode.parts import RowParts
from hetero.decode.sampling import SamplingParams
from hetero.decode.solo import batch_generate, decode_tokens
from hetero.decode.stepper import Batch
from hetero.models.cache import RaggedKV
from hetero.models.qwen4_exp.qsa import QSACache

GREEDY = SamplingParams()
LENGTHS = [5, 48, 20, 70]  # 48 and 70: 12 and 17 index blocks of 4 against a budget of 2 blocks
LIMITS = [20, 14, 25, 18]


def _tokens(n: int, seed: int) -> list[int]:
    toks = [int(t) for t in np.random.default_rng(seed).integers(2, qc.VOCAB, n)]
    toks[n // 3] = qc.EOS  # the n-gram context restarts there
    return toks


PROMPTS = [_tokens(n, 20 + i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4batch")
    hf = qc.build(path, ple_layer_ids=(1, 2), seed=3, mtp=True)
    return path, hf


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt[0])[0]


@pytest.fixture(scope="module")
def agreeing_model(ckpt):
    return agreeing(load_model(ckpt[0])[0], alpha=0.02)


def solo(model, prompt: list[int], n: int, depth: int, sampling: SamplingParams = GREEDY, seed: int | None = None,
         parts: RowParts = RowParts()) -> list[int]:
    return list(decode_tokens(model, prompt, DecodeOptions(n, sampling, seed, copy=False), set(), depth, parts))


def test_plain_batch_equals_solo_and_transformers(ckpt, model):
    """Four plain rows (5 to 70 prompt tokens) in one batch: each row's tokens and logprobs are its solo ones, and
    the 48-token row's are transformers' greedy tokens."""
    recorders = [LogprobRecorder(3) for _ in PROMPTS]
    batch = Batch(model, max_batch=4)
    rows = [batch.join(p, DecodeOptions(n, copy=False), set(), 0, RowParts(logprobs=rec))
            for p, n, rec in zip(PROMPTS, LIMITS, recorders)]
    sizes = []
    while batch.rows:
        sizes.append(len(batch.step()))
    assert sizes[0] == 4  # they really decoded together
    for i, (r, p, n, rec) in enumerate(zip(rows, PROMPTS, LIMITS, recorders)):
        ref = LogprobRecorder(3)
        assert r.tokens == solo(model, p, n, 0, parts=RowParts(logprobs=ref)), f"row {i}"
        assert [x.token for x in rec.items] == [x.token for x in ref.items]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(rec.items, ref.items)) < 1e-4
    with torch.no_grad():
        hf = ckpt[1].generate(torch.tensor([PROMPTS[1]]), max_new_tokens=LIMITS[1], do_sample=False)
    assert rows[1].tokens == hf[0, len(PROMPTS[1]) :].tolist()


@pytest.mark.parametrize("which", ["rejecting", "agreeing"])
def test_mtp_rows_in_a_batch_equal_solo(model, agreeing_model, which):
    """MTP rows at depths 1-3 beside a plain row: each row's greedy tokens are its solo ones, whether the head's
    drafts are mostly rejected or mostly kept (both commit paths of the stacked GDN and PLE states ran)."""
    m = model if which == "rejecting" else agreeing_model
    depths = [2, 0, 3, 1]
    rows = batch_generate(m, PROMPTS, [DecodeOptions(n, copy=False) for n in LIMITS], set(), depths)
    for i, (r, p, n, d) in enumerate(zip(rows, PROMPTS, LIMITS, depths)):
        assert r.tokens == solo(m, p, n, d), f"row {i}"
    accepted = [r.parts.stats.to_dict()["mean_accepted_length"] for r in rows if r.depth > 1]
    if which == "agreeing":
        assert all(1.3 < a < 4 for a in accepted)


def test_sampled_rows_keep_their_seeds(model):
    """Seeded sampled rows (plain and MTP, beside a greedy one) draw what they draw alone with the same seed."""
    kinds = [SamplingParams(0.8, top_k=20), GREEDY, SamplingParams(1.0, top_p=0.9), SamplingParams(0.7)]
    depths = [0, 0, 2, 1]
    options = [DecodeOptions(n, k, 40 + i, copy=False) for i, (k, n) in enumerate(zip(kinds, LIMITS))]
    rows = batch_generate(model, PROMPTS, options, set(), depths)
    for i, (r, p, n, d, k) in enumerate(zip(rows, PROMPTS, LIMITS, depths, kinds)):
        assert r.tokens == solo(model, p, n, d, k, 40 + i), f"row {i}"
    again = batch_generate(model, PROMPTS[:2], [DecodeOptions(20, kinds[0], s) for s in (7, 8)], set(), [0, 0])
    assert again[0].tokens != solo(model, PROMPTS[0], 20, 0, kinds[0], 8)  # each row its own key stream


def test_rows_join_and_leave_mid_flight(model):
    """A row joins a running batch, an MTP row finishes, and a plain row is cancelled while the next plain pass is
    already queued: the others' tokens stay their solo ones, and the cancelled row leaves with caches (GDN, PLE,
    QSA keys and index keys) holding exactly its committed tokens."""
    batch = Batch(model, max_batch=3)
    a = batch.join(PROMPTS[3], DecodeOptions(40, copy=False), set(), 0)
    b = batch.join(PROMPTS[2], DecodeOptions(6, copy=False), set(), 2)
    for _ in range(2):
        batch.step()
    c = batch.join(PROMPTS[1], DecodeOptions(16, copy=False), set(), 0)
    while b in batch.rows:
        batch.step()
    for _ in range(3):
        batch.step()
    assert batch._ahead is not None and len(batch.rows) == 2  # a and c decode plainly, the next pass queued
    batch.leave(a)
    assert not a.done and a.tokens == solo(model, PROMPTS[3], 40, 0)[: len(a.tokens)]
    assert_committed_state(model, a.decoder, PROMPTS[3] + a.tokens[:-1], mtp=False)
    d = batch.join(PROMPTS[0], DecodeOptions(12, copy=False), set(), 1)
    for _ in batch.drain():
        pass
    assert b.tokens == solo(model, PROMPTS[2], 6, 2) and b.finish_reason == "length"
    assert c.tokens == solo(model, PROMPTS[1], 16, 0)
    assert d.tokens == solo(model, PROMPTS[0], 12, 1)
    for r, p in ((c, PROMPTS[1]), (d, PROMPTS[0])):  # finished rows: caches end at their last committed token
        assert_committed_state(model, r.decoder, p + r.tokens[:-1], mtp=r.depth > 0)


@pytest.mark.parametrize("S", [1, 3])
def test_qsa_rows_select_over_their_own_keys(model, S):
    """A QSA layer over rows of different real lengths and cache lengths (0 to 60 earlier tokens: the indexer drops
    keys in the long ones) equals each row run alone: outputs, keys and index keys."""
    attn = next(layer.self_attn for layer in model.layers if not layer.is_linear)
    lengths, history = [S, 1, max(S - 1, 1)], [60, 0, 23]
    x = mx.random.normal((3, S, qc.TEXT["hidden_size"]), key=mx.random.key(0))
    alone, caches = [], []
    for i, (n, h) in enumerate(zip(lengths, history)):
        ref, mine = QSACache(), QSACache()
        if h:
            past = mx.random.normal((1, h, qc.TEXT["hidden_size"]), key=mx.random.key(i + 1))
            attn(past, ref)
            attn(past, mine)
        alone.append(np.array(attn(x[i : i + 1, :n], ref)[0], np.float64))  # [n, hidden]
        caches.append((mine, ref))
    out = attn(x, RaggedKV([m for m, _ in caches], lengths))  # [3, S, hidden]
    for i, (n, (mine, ref)) in enumerate(zip(lengths, caches)):
        assert rel(out[i, :n], alone[i]) <= 1e-5, f"row {i}"
        assert mine.offset == ref.offset == history[i] + n
        assert rel(mine.index_keys, np.array(ref.index_keys, np.float64)) <= 1e-5
        assert rel(mine.keys[:, :, : mine.offset], np.array(ref.keys[:, :, : ref.offset], np.float64)) <= 1e-5
