"""Prefix cache (DESIGN.md section 6): restoring a checkpoint and continuing equals a cold run, MTP on and off."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import hetero
from hetero.caches.prefix import PrefixCache
from hetero.decode.prefill import prefill
from tiny_checkpoint import write_tiny_model

CHUNK = 64


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return hetero.load(write_tiny_model(tmp_path_factory.mktemp("pc") / "m"))


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, n).tolist()


def cold_logits(model, ids: list[int]) -> np.ndarray:
    logits, _ = prefill(model, ids, model.make_cache(), CHUNK, all_logits=True, mtp=True)
    return np.array(logits)


@pytest.mark.parametrize("mtp", [False, True])
def test_restore_and_continue_equals_a_cold_run(engine, mtp):
    """Second turn of a growing transcript: prompt-end and turn-end checkpoints, greedy tokens identical."""
    engine.prefix_cache = None
    first = tokens(150, 1)
    reply = engine.generate(first, max_tokens=20, mtp=mtp, prefill_chunk=CHUNK).tokens
    grown = first + reply + tokens(90, 2)
    cold = engine.generate(grown, max_tokens=30, mtp=mtp, prefill_chunk=CHUNK)
    engine.prefix_cache = PrefixCache()
    try:
        turn1 = engine.generate(first, max_tokens=20, mtp=mtp, prefill_chunk=CHUNK)
        turn2 = engine.generate(grown, max_tokens=30, mtp=mtp, prefill_chunk=CHUNK)
    finally:
        engine.prefix_cache = None
    assert turn1.tokens == reply and turn1.stats["cached_tokens"] == 0
    assert turn2.stats["cached_tokens"] == len(first) + len(reply) - 1  # the last reply token was never run
    assert turn2.tokens == cold.tokens


def test_restored_logits_match_cold_within_1e5(engine):
    """Logits after a restore: exact at a chunk-edge checkpoint, within 1e-5 after a decoded turn's end."""
    model = engine.model
    ids = tokens(300, 3)
    pc = PrefixCache()
    engine.prefix_cache = pc
    try:
        engine.generate(ids[:200], max_tokens=15, mtp=True, prefill_chunk=CHUNK)  # edges 64..192, 200, turn end
    finally:
        engine.prefix_cache = None
    for limit in (130, 200):  # restores at the chunk edge 128 and the prompt end 200
        r = pc.restore(model, engine.cache_key, ids, limit)
        assert r.n == (128 if limit == 130 else 200)
        logits, _ = prefill(model, ids[r.n :], r.cache, CHUNK, all_logits=True, mtp=True, carry=r.hidden)
        np.testing.assert_allclose(np.array(logits), cold_logits(model, ids)[r.n :], rtol=0, atol=1e-5)
    gen = engine.generate(ids[:200], max_tokens=15, mtp=False, prefill_chunk=CHUNK, use_prefix_cache=False).tokens
    turn = ids[:200] + gen + tokens(40, 4)
    r = pc.restore(model, engine.cache_key, turn)
    assert r.n == 214  # the turn end: prompt + 14 of the 15 generated tokens ran through the backbone
    logits, _ = prefill(model, turn[r.n :], r.cache, CHUNK, all_logits=True, mtp=True, carry=r.hidden)
    np.testing.assert_allclose(np.array(logits), cold_logits(model, turn)[r.n :], rtol=0, atol=1e-5)


def test_mtp_state_survives_the_restore(engine):
    """The MTP head's KV and h_{n-1} come back: drafts after a restore equal drafts after a cold prefill."""
    model = engine.model
    ids = tokens(140, 5)
    pc = PrefixCache()
    prefix_cache = pc
    cache = model.make_cache()
    prefill(model, ids[:128], cache, CHUNK, mtp=True,
            on_chunk=lambda n, at, h: prefix_cache.capture(model, "k", ids[:n], at, h))
    r = pc.restore(model, "k", ids, 139)
    assert r.n == 128
    _, h_warm = prefill(model, ids[128:], r.cache, CHUNK, mtp=True, carry=r.hidden)
    cold = model.make_cache()
    _, h_cold = prefill(model, ids, cold, CHUNK, mtp=True)
    mtp_warm, mtp_cold = r.cache[-1], cold[-1]
    assert mtp_warm.offset == mtp_cold.offset == len(ids) - 1
    np.testing.assert_allclose(np.array(mtp_warm.keys[:, :, : mtp_warm.offset]),
                               np.array(mtp_cold.keys[:, :, : mtp_cold.offset]), atol=1e-6)
    np.testing.assert_allclose(np.array(h_warm), np.array(h_cold), atol=1e-6)


def valid_state(cache: list, hidden: mx.array) -> list[np.ndarray]:
    """Every array a continuation reads: K/V rows below each offset, GDN conv and recurrent state, the carry."""
    out = []
    for c in cache:
        if hasattr(c, "keys"):
            out += [np.array(c.keys[:, :, : c.offset]), np.array(c.values[:, :, : c.offset])]
        else:
            out += [np.array(c.conv), np.array(c.recurrent)]
    return out + [np.array(hidden), np.array([c.offset for c in cache])]


def scribble(restored) -> None:
    """Write into a restore in place, as a live cache does (a rollback rewrites rows below its capacity)."""
    for c in restored.cache:
        for x in c.state:
            x[:] = 7
    restored.hidden[:] = 7


def test_a_checkpoint_never_shares_buffers_with_a_live_cache(engine):
    """A restore equals an independent recomputation in every layer, and writing into one restore, into the
    cache the checkpoint was taken from, or into a cache continued from a restore changes no other restore."""
    model, pc = engine.model, PrefixCache()
    ids = tokens(100, 6)
    cache = model.make_cache()
    prefill(model, ids[:64], cache, CHUNK, mtp=True, on_chunk=lambda n, at, h: pc.capture(model, "k", ids[:n], at, h))
    fresh = model.make_cache()
    _, h_fresh = prefill(model, ids[:64], fresh, CHUNK, mtp=True)  # independent: its own cache, never captured
    expected = valid_state(fresh, h_fresh)
    first = pc.restore(model, "k", ids, 99)
    prefill(model, tokens(60, 7), first.cache, CHUNK, mtp=True, carry=first.hidden)  # a live cache moves on
    prefill(model, tokens(60, 8), cache, CHUNK, mtp=True)  # and so does the one the checkpoint was taken from
    one, two = pc.restore(model, "k", ids, 99), pc.restore(model, "k", ids, 99)
    assert one.n == two.n == 64
    for got, want in zip(valid_state(one.cache, one.hidden), expected, strict=True):
        np.testing.assert_array_equal(got, want)
    scribble(one)
    assert not np.array_equal(valid_state(one.cache, one.hidden)[0], expected[0])  # the scribble took effect
    for restored in (two, pc.restore(model, "k", ids, 99)):  # the other restore and the trie are untouched
        for got, want in zip(valid_state(restored.cache, restored.hidden), expected, strict=True):
            np.testing.assert_array_equal(got, want)


def test_growing_transcript_stores_each_position_once(engine):
    """A radix trie: three turns of one transcript hold the K/V rows of the longest turn once, plus 3 checkpoints."""
    model, pc = engine.model, PrefixCache()
    ids = tokens(192, 9)
    for n in (64, 128, 192):
        cache = model.make_cache()
        prefill(model, ids[:n], cache, CHUNK, mtp=True)
        pc.capture(model, "k", ids[:n], cache, cache_hidden(model, ids[:n]))
    kv = [c for c in cache if hasattr(c, "keys")]
    row = lambda c: c.keys[:, :, :1].nbytes + c.values[:, :, :1].nbytes  # noqa: E731
    rows = sum(192 * row(c) for c in kv[:-1]) + 191 * row(kv[-1])  # the MTP layer holds pairs 0..n-2
    assert pc.entries == 3
    assert pc.nbytes == rows + 3 * checkpoint_bytes(pc)


def cache_hidden(model, ids: list[int]) -> mx.array:
    _, h = prefill(model, ids, model.make_cache(), CHUNK)
    return h  # [1, H]


def checkpoint_bytes(pc: PrefixCache) -> int:
    return max(n.checkpoint.nbytes for n in pc._checkpoint_nodes())


def test_lru_by_bytes_and_per_model_isolation(engine, tmp_path):
    model = engine.model
    probe = PrefixCache()
    cache = model.make_cache()
    ids = tokens(64, 10)
    prefill(model, ids, cache, CHUNK, mtp=True)
    probe.capture(model, "k", ids, cache, cache_hidden(model, ids))
    one = probe.nbytes
    pc = PrefixCache(max_bytes=int(2.5 * one))
    prompts = [tokens(64, 20 + i) for i in range(4)]
    for p in prompts:
        c = model.make_cache()
        prefill(model, p, c, CHUNK, mtp=True)
        pc.capture(model, "k", p, c, cache_hidden(model, p))
        assert pc.nbytes <= pc.max_bytes
    assert pc.entries == 2
    assert pc.lookup("k", prompts[0] + [1]) is None  # the least recently used went first
    assert pc.lookup("k", prompts[3] + [1]) is not None
    assert pc.lookup("other-model", prompts[3] + [1]) is None

    other = hetero.load(write_tiny_model(tmp_path / "other", seed=1))
    assert other.identity != engine.identity
    shared = PrefixCache()
    engine.prefix_cache = other.prefix_cache = shared
    try:
        engine.generate(prompts[0], max_tokens=3)
        assert other.generate(prompts[0] + [5], max_tokens=3).stats["cached_tokens"] == 0
        assert engine.generate(prompts[0] + [5], max_tokens=3).stats["cached_tokens"] == 64
    finally:
        engine.prefix_cache = other.prefix_cache = None


def test_diverging_prompt_restores_the_deepest_checkpoint_at_or_below_the_match(engine):
    model, pc = engine.model, PrefixCache()
    ids = tokens(200, 11)
    cache = model.make_cache()
    prefill(model, ids, cache, CHUNK, mtp=True, on_chunk=lambda n, at, h: pc.capture(model, "k", ids[:n], at, h))
    branch = ids[:150] + tokens(30, 12)
    r = pc.restore(model, "k", branch)
    assert r.n == 128
    logits, _ = prefill(model, branch[128:], r.cache, CHUNK, all_logits=True, mtp=True, carry=r.hidden)
    np.testing.assert_array_equal(np.array(logits), cold_logits(model, branch)[128:])


@pytest.mark.parametrize("mtp", [False, True])
def test_the_next_turn_resumes_from_a_mark_inside_a_chunk(engine, mtp):
    """A chat turn's mark (where its transcript ends, before the generation prompt) cuts the prefill there, so it
    is checkpointed; the next turn, which parts from this one right after the mark, resumes from it. That run
    computes the chunk holding the mark in two pieces where the next turn's cold run uses one: the same values
    up to rounding, the same greedy tokens."""
    transcript = tokens(100, 5)  # the mark at 100, inside the chunk [64, 128)
    turn1 = transcript + [7, 8, 9]  # + the generation prompt
    turn2 = transcript + [7, 8, 10, 11] + tokens(50, 6) + [7, 8, 9]  # this turn's reply rendered otherwise
    mark2 = len(turn2) - 3
    engine.prefix_cache = None
    cold = engine.generate(turn2, max_tokens=20, mtp=mtp, prefill_chunk=CHUNK, mark=mark2)
    pc = PrefixCache()
    engine.prefix_cache = pc
    try:
        first = engine.generate(turn1, max_tokens=5, mtp=mtp, prefill_chunk=CHUNK, mark=100)
        second = engine.generate(turn2, max_tokens=20, mtp=mtp, prefill_chunk=CHUNK, mark=mark2)
    finally:
        engine.prefix_cache = None
    assert first.stats["cached_tokens"] == 0 and second.stats["cached_tokens"] == 100
    assert second.tokens == cold.tokens
    model = engine.model
    r = pc.restore(model, engine.cache_key, turn2, limit=101)
    assert r.n == 100
    restored, _ = prefill(model, turn2[100:], r.cache, CHUNK, all_logits=True, mtp=True, carry=r.hidden, marks=[mark2])
    whole, _ = prefill(model, turn2, model.make_cache(), CHUNK, all_logits=True, mtp=True, marks=[mark2])
    np.testing.assert_allclose(np.array(restored), np.array(whole)[100:], rtol=0, atol=1e-5)  # 1e-6 measured


@pytest.mark.parametrize("shared", [False, True])
def test_a_plain_turn_with_the_prefix_cache_decodes_in_the_solo_round(engine, monkeypatch, shared):
    """The prefix cache's trace (what a plain turn's end-of-turn checkpoint is built from) keeps a lone plain row
    on the solo round (`Batch._solo_round`), alone and in the server's shared decode loop (`shared`): no round of
    it takes the batch round, and the next turn resumes from its checkpoint with a cold run's tokens."""
    from hetero.decode.loop import DecodeLoop, Seat
    from hetero.decode.stepper import Batch

    calls = {"solo": 0, "batch": 0}

    def counted(kind, method):
        def wrapper(self, *args):
            calls[kind] += 1
            return method(self, *args)
        return wrapper

    monkeypatch.setattr(Batch, "_solo_round", counted("solo", Batch._solo_round))
    monkeypatch.setattr(Batch, "_batch_round", counted("batch", Batch._batch_round))
    loop = DecodeLoop(engine.model, max_batch=4) if shared else None
    options = dict(mtp=False, prefill_chunk=CHUNK, batch=Seat(loop) if shared else None)
    first = tokens(150, 7)
    engine.prefix_cache = PrefixCache()
    try:
        turn1 = engine.generate(first, max_tokens=20, **options)
        rounds = dict(calls)
        grown = first + turn1.tokens + tokens(40, 8)
        turn2 = engine.generate(grown, max_tokens=20, **options)
    finally:
        engine.prefix_cache = None
        if loop is not None:
            loop.close()
    assert rounds == {"solo": 19, "batch": 0}  # the first token comes from the prefill, each other from a round
    cold = engine.generate(grown, max_tokens=20, mtp=False, prefill_chunk=CHUNK)
    assert turn2.stats["cached_tokens"] == len(first) + len(turn1.tokens) - 1 and turn2.tokens == cold.tokens
