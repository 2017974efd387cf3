"""Qwen4-Exp's decode step (`hetero/models/qwen4_exp/step.py`, `Indexer.pick`): the compiled few-token step gives
the uncompiled layers' logits and caches, and a decode step's picked keys are exactly those `select`'s mask keeps,
also after a rollback rewrote the index keys its kept block keys came from."""

from __future__ import annotations

import hetero  # before mlx: the fast BLAS
import mlx.core as mx
import numpy as np
import pytest
import qwen4_checkpoint as qc

from hetero.checkpoint.loader import load_model
from hetero.models.qwen4_exp import step
from hetero.models.qwen4_exp.qsa import QSACache

PROMPT = 48  # 12 index blocks of 4 against a budget of 2 blocks: the indexer drops keys


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4step")
    qc.build(path, ple_layer_ids=(1, 2), seed=0)
    return load_model(path)[0]


def _prompt(seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, qc.VOCAB, PROMPT)]


def _decode(model, prompt: list[int], steps: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Greedy decode steps after one prefill pass: (each step's logits [V], the caches' arrays after the last)."""
    cache = model.make_cache()
    logits, _ = model(mx.array([prompt]), cache)
    out = []
    for _ in range(steps):
        logits, _ = model(mx.array([[int(mx.argmax(logits[0, -1]))]]), cache)
        out.append(np.array(logits[0, -1]))
    return out, [np.array(a) for c in cache.backbone for a in c.state]


def test_compiled_decode_step_equals_the_uncompiled_layers(model, monkeypatch):
    """Every layer of a decode step takes the compiled step, and the step's logits and caches (GDN state and conv,
    PLE window, KV and index keys) equal those of the uncompiled layers."""
    taken = []
    takes = step.LayerSteps.takes
    monkeypatch.setattr(step.LayerSteps, "takes", lambda self, h, cache: taken.append(takes(self, h, cache)) or
                        taken[-1])
    compiled, compiled_caches = _decode(model, _prompt(0), 6)
    assert taken.count(True) == 6 * len(model.layers)  # every decode step, every layer (the prefill: none)
    monkeypatch.setattr(step.LayerSteps, "takes", lambda self, h, cache: False)
    plain, plain_caches = _decode(model, _prompt(0), 6)
    for a, b in zip(compiled + compiled_caches, plain + plain_caches, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _selected(indexer, q: mx.array, keys: mx.array) -> set[int]:
    """The positions `select`'s mask lets the newest query (position T-1) attend to."""
    T = keys.shape[1]
    return set(np.flatnonzero(np.array(indexer.select(q, keys, T - 1)[0, 0])).tolist())


def test_picked_keys_equal_the_selection_mask_through_a_rollback(model):
    indexer = next(l.self_attn.indexer for l in model.layers if not l.is_linear)
    rng = np.random.default_rng(1)
    cache = QSACache()

    def write(n: int) -> None:  # n new tokens' keys and raw index keys at the cache's offset
        kv = mx.zeros((1, 2, n, 16))
        cache.update_and_fetch(kv, kv)
        cache.update_index(mx.array(rng.standard_normal((1, n, indexer.dim)).astype(np.float32)))

    def check() -> None:
        q = mx.array(rng.standard_normal((1, 1, indexer.heads, indexer.dim)).astype(np.float32))
        picked = indexer.pick(q, cache.index_keys, cache)
        want = _selected(indexer, q, cache.index_keys)
        assert picked is not None and sorted(np.array(picked[0]).tolist()) == sorted(want)
        assert len(want) < cache.offset  # keys really dropped

    write(PROMPT)
    for _ in range(6):  # decode steps: one new block every 4, kept block keys reused
        write(1)
        check()
    assert cache.index_blocks(indexer.ratio).shape[1] == (PROMPT + 6) // indexer.ratio
    cache.trim_to(PROMPT - 5)  # a rollback: the blocks after it are written again with other keys
    write(6)
    check()
    write(1)
    check()


def _selected_rows(indexer, q: mx.array, keys: mx.array) -> list[set[int]]:
    """The positions `select`'s mask lets each of the newest L queries (positions T-L..T-1) attend to."""
    T, L = keys.shape[1], q.shape[1]
    return [set(np.flatnonzero(row).tolist()) for row in np.array(indexer.select(q, keys, T - L)[0])]


def test_each_querys_picked_keys_equal_its_selection_mask_row(model):
    """A verify pass's queries each pick exactly the keys of its row of `select`'s mask (no key twice), over a long
    context, through a rollback, and where the earlier queries see fewer complete blocks than the budget."""
    indexer = next(l.self_attn.indexer for l in model.layers if not l.is_linear)
    rng = np.random.default_rng(4)
    cache = QSACache()

    def write(n: int) -> None:
        kv = mx.zeros((1, 2, n, 16))
        cache.update_and_fetch(kv, kv)
        cache.update_index(mx.array(rng.standard_normal((1, n, indexer.dim)).astype(np.float32)))

    def check(L: int) -> None:
        q = mx.array(rng.standard_normal((1, L, indexer.heads, indexer.dim)).astype(np.float32))
        picked, kept = (np.array(a[0]) for a in indexer.pick_rows(q, cache.index_keys, cache))
        for row, keep, want in zip(picked, kept, _selected_rows(indexer, q, cache.index_keys), strict=True):
            assert sorted(row[keep].tolist()) == sorted(want)

    short = (indexer.blocks + 1) * indexer.ratio  # one block over the budget: the first queries see fewer
    write(short)
    check(2 * indexer.ratio)
    write(PROMPT - short)
    for L in (2, 5):  # verify passes, the drafts then rolled back
        write(L)
        check(L)
        cache.trim_to(cache.offset - L + 1)
    write(7)
    check(7)


def test_a_verify_pass_over_picked_keys_equals_the_whole_prompts_pass(model):
    """Logits of a few tokens over a warm cache where QSA drops keys (each query its picked keys) equal those of one
    uncached pass over the whole sequence (`select`'s mask)."""
    tokens = _prompt(5)
    whole, _ = model(mx.array([tokens]))
    cache = model.make_cache()
    model(mx.array([tokens[:-5]]), cache)
    verify, _ = model(mx.array([tokens[-5:]]), cache)
    np.testing.assert_allclose(np.array(verify[0]), np.array(whole[0, -5:]), rtol=1e-5, atol=1e-5)


def test_a_short_context_picks_every_key(model):
    indexer = next(l.self_attn.indexer for l in model.layers if not l.is_linear)
    cache = QSACache()
    n = indexer.blocks * indexer.ratio + indexer.ratio - 1  # every complete block within the budget
    kv = mx.zeros((1, 2, n, 16))
    cache.update_and_fetch(kv, kv)
    cache.update_index(mx.ones((1, n, indexer.dim)))
    assert indexer.pick(mx.ones((1, 1, indexer.heads, indexer.dim)), cache.index_keys, cache) is None


def test_a_batch_takes_the_compiled_step_and_keeps_each_rows_solo_tokens(model, monkeypatch):
    """Plain rows decoding together run the compiled QSA step over their own caches (`RaggedKV`), and each gets
    the tokens it gets decoding alone."""
    from hetero.decode.options import DecodeOptions
    from hetero.decode.solo import batch_generate, decode_tokens
    from hetero.models.cache import RaggedKV

    prompts = [_prompt(2), _prompt(3)[:40]]
    alone = [list(decode_tokens(model, p, DecodeOptions(5), set())) for p in prompts]
    ragged = []
    takes = step.LayerSteps.takes
    monkeypatch.setattr(step.LayerSteps, "takes", lambda self, h, cache: (
        ragged.append(takes(self, h, cache)) or ragged[-1]) if isinstance(cache, RaggedKV) else takes(self, h, cache))
    rows = batch_generate(model, prompts, [DecodeOptions(5), DecodeOptions(5)], set(), [0, 0])
    assert ragged and all(ragged)
    assert [r.tokens for r in rows] == alone
