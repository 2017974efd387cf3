"""Qwen4-Exp's prefix and session caches against transformers, on prompts where QSA drops keys.

A checkpoint holds every GDN layer's recurrent state and conv window with, on PLE layers, the PLE's n-gram token
context and dilated conv window; every QSA layer's K/V and raw index keys (the compressed-block keys are pooled from
them again); the MTP layer's QSA cache; and the hidden carry, the hc*d-wide streams. A restore from RAM, or from disk
after a restart, continues as a cold run: logits within 1e-4 relative of transformers, greedy tokens identical, with
and without MTP; a session file of another layout is refused in one line."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil

import hetero  # before mlx: the fast BLAS
import mlx.core as mx
import numpy as np
import pytest
import qwen4_checkpoint as qc
import torch

from hetero.caches.prefix import PrefixCache
from hetero.caches.session import SessionStore
from hetero.decode.prefill import prefill

CHUNK = 16
PROMPT = 44  # 11 index blocks of 4 against a budget of 2 blocks: QSA drops keys
REPLY = 6
MORE = 10
RATIO, NGRAM = qc.TEXT["indexer_compress_ratio"], qc.TEXT["ngram_size"]


def _tokens(n: int, seed: int) -> list[int]:
    toks = [int(t) for t in np.random.default_rng(seed).integers(2, qc.VOCAB, n)]
    toks[n // 3] = qc.EOS  # an EOS inside the prompt: the n-gram context restarts there
    return toks


def _close(ours: np.ndarray, ref: np.ndarray) -> None:
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids) :].tolist()


def decoding(mtp: bool) -> dict:
    """Plain greedy, or MTP at depth 2 (the random head's drafts: mostly rejected)."""
    return dict(mtp=True, draft_depth=2) if mtp else dict(mtp=False)


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    """A flat checkpoint with PLE on layers 0 and 1, QSA on layer 2, an MTP head (whose QSA layer drops keys too),
    and a tokenizer; with transformers' model of it."""
    path = tmp_path_factory.mktemp("q4caches")
    hf = qc.build(path, ple_layer_ids=(1, 2), seed=0, mtp=True)
    qc.add_tokenizer(path)
    return path, hf


@pytest.fixture(scope="module")
def nested(tmp_path_factory):
    """A nested (`qwen4_exp`, vision weights skipped) checkpoint with PLE on layers 1 and 3 (the last), an MTP head
    and a tokenizer; with transformers' model of it."""
    path = tmp_path_factory.mktemp("q4caches_nested")
    hf = qc.build(path, nested=True, ple_layer_ids=(2, 4), seed=1, mtp=True)
    qc.add_tokenizer(path)
    return path, hf


@pytest.fixture(scope="module")
def engine(flat):
    return hetero.load(str(flat[0]))


@pytest.mark.parametrize("layout,mtp", [("flat", False), ("flat", True), ("nested", False), ("nested", True)])
def test_a_second_request_resumes_from_the_prefix_cache(request, layout, mtp):
    """The second turn of a growing transcript restores the first turn's end (prompt + reply but its last token,
    which never ran): greedy tokens are transformers', and so are the logits of every position run after it."""
    path, hf = request.getfixturevalue(layout)
    engine = hetero.load(str(path))
    first = _tokens(PROMPT, 1)
    grown_tail = _tokens(MORE, 2)
    engine.prefix_cache = pc = PrefixCache()
    turn1 = engine.generate(first, max_tokens=REPLY, prefill_chunk=CHUNK, **decoding(mtp))
    grown = first + turn1.tokens + grown_tail
    turn2 = engine.generate(grown, max_tokens=MORE, prefill_chunk=CHUNK, **decoding(mtp))
    engine.prefix_cache = None
    held = len(first) + REPLY - 1
    assert turn1.stats["cached_tokens"] == 0 and turn2.stats["cached_tokens"] == held
    assert turn1.tokens == hf_greedy(hf, first, REPLY)
    assert turn2.tokens == hf_greedy(hf, grown, MORE)
    assert turn2.tokens == engine.generate(grown, max_tokens=MORE, prefill_chunk=CHUNK, **decoding(mtp)).tokens
    r = pc.restore(engine.model, engine.cache_key, grown, limit=len(grown) - 1)
    assert r.n == held and r.hidden.shape == (1, qc.TEXT["hc_count"] * qc.TEXT["hidden_size"])  # the streams
    logits, _ = prefill(engine.model, grown[held:], r.cache, CHUNK, all_logits=True, mtp=True, carry=r.hidden)
    _close(np.array(logits), qc.hf_logits(hf, grown)[held:])


def test_restores_inside_a_compressed_block_and_an_ngram_window_stay_exact(engine, flat):
    """Chunk edges every 7 tokens put checkpoints inside QSA's blocks of 4 and between the PLE's dilation-3 taps:
    at 7 (the PLE conv window of 9 not yet full) and at 35 (two tokens after an EOS, so the n-gram context spans
    the restart). Continuing from either gives the cold run's logits bit for bit, within 1e-4 of transformers,
    and a prompt that branches there gets transformers' greedy tokens."""
    model, (_, hf) = engine.model, flat
    ids = _tokens(56, 7)
    ids[33] = qc.EOS
    chunk = 7
    pc = PrefixCache()
    cache = model.make_cache()
    prefill(model, ids, cache, chunk, mtp=True, on_chunk=lambda n, at, h: pc.capture(model, "k", ids[:n], at, h))
    cold, _ = prefill(model, ids, model.make_cache(), chunk, all_logits=True, mtp=True)
    ref = qc.hf_logits(hf, ids)
    for n in (7, 35):
        assert n % RATIO and n % NGRAM
        r = pc.restore(model, "k", ids, limit=n + 1)
        assert r.n == n
        logits, _ = prefill(model, ids[n:], r.cache, chunk, all_logits=True, mtp=True, carry=r.hidden)
        np.testing.assert_array_equal(np.array(logits), np.array(cold)[n:])
        _close(np.array(logits), ref[n:])

    engine.prefix_cache = PrefixCache()
    try:
        engine.generate(ids[:50], max_tokens=1, prefill_chunk=chunk, mtp=False)  # checkpoints at 7, 14, .., 49
        branch = ids[:37] + _tokens(12, 8)
        warm = engine.generate(branch, max_tokens=MORE, prefill_chunk=chunk, mtp=True, draft_depth=2)
    finally:
        engine.prefix_cache = None
    assert warm.stats["cached_tokens"] == 35
    assert warm.tokens == hf_greedy(hf, branch, MORE)


def test_mtp_after_a_restore_equals_plain_greedy(flat):
    """With a head whose drafts are mostly accepted, MTP decoding resumed from a checkpoint (the head's QSA cache and
    the pending streams restored) gives plain greedy decoding's tokens."""
    from test_qwen4_mtp import agreeing

    engine = hetero.load(str(flat[0]))
    agreeing(engine.model, alpha=0.02)
    first = _tokens(PROMPT, 5)
    reply = engine.generate(first, max_tokens=REPLY, prefill_chunk=CHUNK, mtp=False).tokens
    grown = first + reply + _tokens(MORE, 6)
    plain = engine.generate(grown, max_tokens=16, prefill_chunk=CHUNK, mtp=False).tokens
    engine.prefix_cache = PrefixCache()
    turn1 = engine.generate(first, max_tokens=REPLY, prefill_chunk=CHUNK, mtp=True, draft_depth=3)
    turn2 = engine.generate(grown, max_tokens=16, prefill_chunk=CHUNK, mtp=True, draft_depth=3)
    assert turn1.tokens == reply and turn2.tokens == plain
    assert turn2.stats["cached_tokens"] == len(first) + REPLY - 1
    assert turn2.stats["mtp"]["acceptance_by_depth"][0] > 0.5  # the head drafted from its restored cache


# ----------------------------------------------------------------------------------------------------------
# The session cache on disk


def restart(path, store_dir) -> hetero.Engine:
    """A new engine (a new process's) over the session cache in `store_dir`: nothing in RAM."""
    engine = hetero.load(str(path))
    engine.prefix_cache = PrefixCache(store=SessionStore(store_dir))
    return engine


@pytest.mark.parametrize("layout,mtp", [("flat", False), ("flat", True), ("nested", False), ("nested", True)])
def test_a_session_restart_resumes_from_disk(request, tmp_path, layout, mtp):
    """The first turn's end goes to disk with every part of the state; a new engine resumes the second turn there,
    with transformers' greedy tokens."""
    path, hf = request.getfixturevalue(layout)
    first = _tokens(PROMPT, 3)
    reply = restart(path, tmp_path).generate(first, max_tokens=REPLY, prefill_chunk=CHUNK, **decoding(mtp)).tokens
    assert sorted(p.suffix for p in tmp_path.glob("*/*")) == [".json", ".safetensors"]  # one entry, no temporary
    stored = mx.load(str(next(tmp_path.glob("*/*.safetensors"))))
    assert stored["cp.0.hidden"].shape == (1, qc.TEXT["hc_count"] * qc.TEXT["hidden_size"])  # the streams
    assert stored["kv.0.index"].shape == (1, 1, len(first) + REPLY - 1, qc.TEXT["indexer_head_dim"])  # backbone QSA
    assert stored["kv.1.index"].shape[2] == len(first) + REPLY - 2  # the MTP layer's, its pairs
    gdn = [i for i, kind in enumerate(qc.TEXT["layer_types"]) if kind == "linear_attention"]
    ple = json.loads((path / "config.json").read_text())
    ple = (ple.get("text_config") or ple)["ple_layer_ids"]
    for l, layer in enumerate(gdn):
        names = {k.split(".", 4)[4] for k in stored if k.startswith(f"cp.0.gdn.{l}.")}
        assert names == ({"conv", "rec", "ple.conv", "ple.context"} if layer + 1 in ple else {"conv", "rec"})

    engine = restart(path, tmp_path)
    grown = first + reply + _tokens(MORE, 4)
    warm = engine.generate(grown, max_tokens=MORE, prefill_chunk=CHUNK, **decoding(mtp))
    assert engine.prefix_cache.disk_hits == 1
    assert warm.stats["cached_tokens"] == len(first) + REPLY - 1
    assert reply == hf_greedy(hf, first, REPLY)
    assert warm.tokens == hf_greedy(hf, grown, MORE)


@pytest.fixture(scope="module")
def saved(flat, tmp_path_factory):
    """A session directory holding one entry: the end of a turn over a prompt of PROMPT tokens."""
    store = tmp_path_factory.mktemp("q4session")
    prompt = _tokens(PROMPT, 9)
    restart(flat[0], store).generate(prompt, max_tokens=REPLY, prefill_chunk=CHUNK, mtp=False)
    return store, prompt


def _rewrite(store, change):
    """Change the entry's tensors and re-sign its manifest: right size and checksum, another layout. -> its file"""
    tensors = next(store.glob("*/*.safetensors"))
    arrays = dict(mx.load(str(tensors)))
    change(arrays)
    mx.save_safetensors(str(tensors), arrays)
    manifest = tensors.with_suffix(".json")
    meta = json.loads(manifest.read_text())
    meta["bytes"], meta["sha256"] = tensors.stat().st_size, hashlib.sha256(tensors.read_bytes()).hexdigest()
    manifest.write_text(json.dumps(meta))
    return tensors


LAYOUTS = {
    "d-wide hidden": (lambda a: a.update({k: v[:, : qc.TEXT["hidden_size"]] for k, v in a.items() if "hidden" in k}),
                      r"cp\.0\.hidden is \(1, 32\)"),
    "no PLE context": (lambda a: a.pop("cp.0.gdn.0.ple.context"), r"no tensor cp\.0\.gdn\.0\.ple\.context"),
    "PLE conv too short": (lambda a: a.update({"cp.0.gdn.1.ple.conv": a["cp.0.gdn.1.ple.conv"][:, 1:]}),
                           r"cp\.0\.gdn\.1\.ple\.conv is \(1, 8, 64\)"),
    "no index keys": (lambda a: [a.pop(k) for k in [k for k in a if k.endswith(".index")]], r"no tensor kv\.0\.index"),
    "a GDN layer too many": (lambda a: a.update({"cp.0.gdn.5.conv": a["cp.0.gdn.0.conv"]}),
                            r"unexpected tensor cp\.0\.gdn\.5\.conv"),
    "context outside the vocabulary": (lambda a: a.update({"cp.0.gdn.0.ple.context": a["cp.0.gdn.0.ple.context"]
                                                           + qc.VOCAB}),
                                       r"ple\.context holds token ids outside the vocabulary"),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_session_file_of_another_layout_is_refused_in_one_line(flat, saved, tmp_path, caplog, layout):
    """Right size and checksum, wrong layout: skipped with one warning line naming what differs, removed, and the
    prompt recomputed with transformers' tokens."""
    path, hf = flat
    source, prompt = saved
    store = tmp_path / "sessions"
    shutil.copytree(source, store)
    change, why = LAYOUTS[layout]
    damaged = _rewrite(store, change)
    caplog.set_level(logging.WARNING, logger="hetero.caches.session")
    engine = restart(path, store)
    again = engine.generate(prompt + [5, 6], max_tokens=REPLY, prefill_chunk=CHUNK, mtp=False)
    assert again.stats["cached_tokens"] == 0
    assert again.tokens == hf_greedy(hf, prompt + [5, 6], REPLY)
    warnings = [r.getMessage() for r in caplog.records if r.name == "hetero.caches.session"]
    assert len(warnings) == 1 and "\n" not in warnings[0] and "does not fit this model" in warnings[0], warnings
    assert re.search(why, warnings[0]), warnings[0]
    assert not damaged.exists() and not damaged.with_suffix(".json").exists()  # removed, never served later


def test_serve_answers_the_second_turn_from_the_cache(flat, tmp_path):
    """`hetero serve` with the prefix and session caches on this checkpoint (MTP on, the default here): the second
    turn of a chat reports cached tokens and answers as a server without caches does."""
    from test_server import LiveServer

    path, _ = flat
    warm_engine = restart(path, tmp_path)
    cold_engine = hetero.load(str(path))
    warm, cold = LiveServer(warm_engine, max_batch=1), LiveServer(cold_engine, max_batch=1)
    try:
        def ask(server, messages):
            client = server.openai()
            return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                                  max_tokens=8, temperature=0)

        turn1 = [{"role": "user", "content": "def add(a, b):\n    return a + b\n" * 3}]
        first = ask(warm, turn1)
        assert first.usage.prompt_tokens >= 4 * qc.TEXT["indexer_budget"]  # QSA drops keys
        turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "and now subtract"}]
        second = ask(warm, turn2)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2
        assert first.choices[0].message.content == ask(cold, turn1).choices[0].message.content
        assert second.choices[0].message.content == ask(cold, turn2).choices[0].message.content
    finally:
        warm.stop()
        cold.stop()
