"""On-disk session cache: safetensors + manifest, atomic, LRU by bytes; damaged or foreign entries never served."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

import hetero
from hetero.prefix_cache import PrefixCache
from hetero.session_store import SessionStore
from tiny_checkpoint import write_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return hetero.load(write_tiny_model(tmp_path_factory.mktemp("ss") / "m"))


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, n).tolist()


def run(engine, store_dir, ids, **kw):
    """One generation in a fresh 'process': an empty RAM cache over the store directory."""
    engine.prefix_cache = PrefixCache(store=SessionStore(store_dir, **kw))
    try:
        return engine.generate(ids, max_tokens=10, prefill_chunk=64)
    finally:
        engine.prefix_cache = None


@pytest.mark.parametrize("mtp", [False, True])
def test_restart_restores_from_disk(engine, tmp_path, mtp):
    ids = tokens(150, 1)
    cold = engine.generate(ids + [7, 8, 9], max_tokens=10, mtp=mtp, prefill_chunk=64)
    engine.prefix_cache = PrefixCache(store=SessionStore(tmp_path))
    engine.generate(ids, max_tokens=10, mtp=mtp, prefill_chunk=64)
    files = sorted(p.suffix for p in tmp_path.glob("*/*"))
    assert files == [".json", ".safetensors"]  # one entry, nothing temporary left behind
    manifest = json.loads(next(tmp_path.glob("*/*.json")).read_text())
    assert manifest["checkpoints"] == [128, 150, 159] and manifest["format"] == "hetero-session/1"
    engine.prefix_cache = PrefixCache(store=SessionStore(tmp_path))  # restart: nothing in RAM
    warm = engine.generate(ids + [7, 8, 9], max_tokens=10, mtp=mtp, prefill_chunk=64)
    engine.prefix_cache = None
    assert warm.stats["cached_tokens"] == 150
    assert warm.tokens == cold.tokens


def corrupt_truncate(f):
    f.write_bytes(f.read_bytes()[:-100])


def corrupt_flip(f):
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x55
    f.write_bytes(bytes(data))


def corrupt_foreign(f):
    """A file of the right size and checksum whose tensors belong to another model (other shapes)."""
    import hashlib

    import mlx.core as mx

    manifest = f.with_suffix(".json")
    meta = json.loads(manifest.read_text())
    arrays = mx.load(str(f))
    arrays["kv.0.k"] = mx.zeros((1, 3, meta["n"], 16))
    mx.save_safetensors(str(f), arrays)
    meta["bytes"], meta["sha256"] = f.stat().st_size, hashlib.sha256(f.read_bytes()).hexdigest()
    manifest.write_text(json.dumps(meta))


@pytest.mark.parametrize("damage", [corrupt_truncate, corrupt_flip, corrupt_foreign])
def test_damaged_or_foreign_entries_are_skipped_and_recomputed(engine, tmp_path, damage, caplog):
    ids = tokens(130, 2)
    cold = engine.generate(ids + [5], max_tokens=10, prefill_chunk=64)
    run(engine, tmp_path, ids)
    damage(next(tmp_path.glob("*/*.safetensors")))
    caplog.set_level(logging.WARNING, logger="hetero.session_store")
    again = run(engine, tmp_path, ids + [5])
    assert again.stats["cached_tokens"] == 0 and again.tokens == cold.tokens
    assert "skipping" in caplog.text


def test_manifest_of_another_model_is_not_served(engine, tmp_path, caplog):
    ids = tokens(130, 3)
    run(engine, tmp_path, ids)
    manifest = next(tmp_path.glob("*/*.json"))
    meta = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**meta, "model": "someone-else@0"}))
    caplog.set_level(logging.WARNING, logger="hetero.session_store")
    assert run(engine, tmp_path, ids + [5]).stats["cached_tokens"] == 0
    assert "another model" in caplog.text


def test_lru_by_bytes_on_disk(engine, tmp_path):
    run(engine, tmp_path, tokens(130, 4))
    one = SessionStore(tmp_path).nbytes
    for seed in (5, 6, 7):
        run(engine, tmp_path, tokens(130, seed), max_bytes=int(2.5 * one))
    store = SessionStore(tmp_path)
    assert len(store.entries) == 2 and store.nbytes <= 2.5 * one
    assert run(engine, tmp_path, tokens(130, 7) + [1]).stats["cached_tokens"] == 130  # the newest survived
    assert run(engine, tmp_path, tokens(130, 4) + [1]).stats["cached_tokens"] == 0  # the oldest went first


def test_an_entry_without_manifest_does_not_exist(engine, tmp_path):
    run(engine, tmp_path, tokens(130, 8))
    next(tmp_path.glob("*/*.json")).unlink()  # as if the writer died before its commit point
    assert SessionStore(tmp_path).entries == {}
    assert run(engine, tmp_path, tokens(130, 8) + [1]).stats["cached_tokens"] == 0
