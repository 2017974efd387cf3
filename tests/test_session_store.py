"""On-disk session cache: safetensors + manifest, atomic, LRU by bytes; damaged or foreign entries never served."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import hetero
from hetero.caches.prefix import PrefixCache
from hetero.caches.session import SessionStore
from hetero.checkpoint.fingerprint import weights_fingerprint
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
    assert manifest["checkpoints"] == [128, 150, 159] and manifest["format"] == "hetero-session/2"
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
    caplog.set_level(logging.WARNING, logger="hetero.caches.session")
    again = run(engine, tmp_path, ids + [5])
    assert again.stats["cached_tokens"] == 0 and again.tokens == cold.tokens
    assert "skipping" in caplog.text


def test_manifest_of_another_model_is_not_served(engine, tmp_path, caplog):
    ids = tokens(130, 3)
    run(engine, tmp_path, ids)
    manifest = next(tmp_path.glob("*/*.json"))
    meta = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**meta, "model": "someone-else@0"}))
    caplog.set_level(logging.WARNING, logger="hetero.caches.session")
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


# ----------------------------------------------------------------------------------------------------------
# Never serve stale state: every cached state is keyed by the weights actually loaded, not by name + config


def change_one_weight(model_dir: Path) -> None:
    """Rewrite one tensor in place as a new revision or a re-download would: same name, shape and dtype (same
    config, same header, same size). The mtime moves on by a second whatever the filesystem's clock resolution."""
    file = model_dir / "model.safetensors"
    before = file.stat().st_mtime_ns
    arrays = mx.load(str(file))
    name = "model.embed_tokens.weight"  # feeds every layer: the cached K/V and GDN states depend on it
    arrays[name] = mx.roll(arrays[name], 1, axis=0)
    mx.save_safetensors(str(file), arrays, metadata={"format": "mlx"})
    os.utime(file, ns=(before + 10**9, before + 10**9))


def test_new_weights_under_the_same_name_and_config_never_restore_old_sessions(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m")
    ids = tokens(150, 12)
    old = hetero.load(model_dir)
    run(old, tmp_path / "sessions", ids)
    assert run(old, tmp_path / "sessions", ids + [5]).stats["cached_tokens"] == 150  # it serves its own weights
    stale = old.generate(ids + [5], max_tokens=10, prefill_chunk=64)
    change_one_weight(model_dir)
    new = hetero.load(model_dir)  # a restarted server on the changed checkpoint
    assert new.identity == old.identity and new.cache_key != old.cache_key
    cold = new.generate(ids + [5], max_tokens=10, prefill_chunk=64)
    assert cold.tokens != stale.tokens  # the change matters: the old state would answer wrongly
    warm = run(new, tmp_path / "sessions", ids + [5])
    assert warm.stats["cached_tokens"] == 0 and warm.tokens == cold.tokens


def test_a_shared_ram_cache_never_serves_one_version_of_the_weights_to_another(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m")
    ids = tokens(150, 13)
    old, shared = hetero.load(model_dir), PrefixCache()
    old.prefix_cache = shared
    old.generate(ids, max_tokens=10, prefill_chunk=64)
    change_one_weight(model_dir)
    new = hetero.load(model_dir)
    cold = new.generate(ids + [5], max_tokens=10, prefill_chunk=64)
    new.prefix_cache = shared
    warm = new.generate(ids + [5], max_tokens=10, prefill_chunk=64)
    assert warm.stats["cached_tokens"] == 0 and warm.tokens == cold.tokens
    # the old engine still holds the weights it loaded: its own checkpoints stay valid for it
    assert old.generate(ids + [5], max_tokens=10, prefill_chunk=64).stats["cached_tokens"] == 150


class _Exported(Exception):
    pass


def test_the_core_ml_export_key_follows_the_weights(tmp_path, monkeypatch):
    from hetero.pipeline import run as pipeline_run

    keys = []

    def record(model_ref, key, *args, **kw):
        keys.append(key)
        raise _Exported  # the key is all this test needs; exporting would take seconds

    monkeypatch.setattr(pipeline_run, "ensure_export", record)

    def export_key(engine) -> str:
        with pytest.raises(_Exported):
            pipeline_run.configure(engine, 0.5, 64).splitter(100)
        return keys[-1]

    model_dir = write_tiny_model(tmp_path / "m")
    before = export_key(hetero.load(model_dir))
    assert export_key(hetero.load(model_dir)) == before  # stable while nothing changes
    change_one_weight(model_dir)
    assert export_key(hetero.load(model_dir)) != before


def _swap_two_tensors_in_the_header(file: Path) -> None:
    """Swap the data offsets of two same-shaped tensors, keeping the header's length (so the file's size)."""
    data = bytearray(file.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    a, b = [k for k, v in header.items() if k != "__metadata__" and v["shape"] == [32]][:2]
    header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    data[8 : 8 + n] = text.ljust(n, b" ")  # safetensors pads its header with spaces
    file.write_bytes(bytes(data))


def test_the_fingerprint_sees_a_header_a_directory_and_an_mtime(tmp_path):
    """Each part on its own: a rewritten tensor (mtime), another directory of the same name with the same bytes and
    times (path), a changed header with the size and mtime kept (header)."""
    model_dir = write_tiny_model(tmp_path / "a" / "m")
    file = model_dir / "model.safetensors"
    first = weights_fingerprint(model_dir)
    assert weights_fingerprint(model_dir) == first
    copy = tmp_path / "b" / "m"
    shutil.copytree(model_dir, copy)  # copy2: same bytes, same mtimes
    assert (copy / "model.safetensors").stat().st_mtime_ns == file.stat().st_mtime_ns
    assert weights_fingerprint(copy) != first
    stat = file.stat()
    _swap_two_tensors_in_the_header(file)
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert file.stat().st_size == stat.st_size and weights_fingerprint(model_dir) != first
    second = weights_fingerprint(model_dir)
    change_one_weight(model_dir)
    assert weights_fingerprint(model_dir) != second


def test_opening_removes_temporary_files_of_dead_writers_only(tmp_path):
    """A process stopped while saving leaves `.<id>.<pid>.tmp.*` behind: the next open removes it, but not the
    files of a writer still alive (another server on the same directory)."""
    folder = tmp_path / "model"
    folder.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # a process that has exited
    orphan = folder / f".abc.{dead_pid}.tmp.safetensors"
    live = folder / f".def.{os.getpid()}.tmp.json"
    orphan.write_bytes(b"half")
    live.write_bytes(b"being written")
    SessionStore(tmp_path)
    assert not orphan.exists() and live.exists()
