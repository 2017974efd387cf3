"""On-disk session cache: prefix-cache snapshots as safetensors files with a small JSON manifest.

One entry = two files in DIR/<model key hash>/, the key being `Engine.cache_key` (name, config hash, the loaded
weights' fingerprint, dtype: new weights under the same name never see old entries):
  <id>.safetensors  tokens int32 [n] (an image's tokens as content keys: `image_prompt.content_keys`);
                    kv.<i>.<name> the rows 0..n-1 of every attention layer (MTP layers: 0..n-2), named by its
                    cache's `layout`: k / v (with --kv-bits also k.scales / .biases and the same for v, the K/V as
                    stored; a Qwen4-Exp QSA layer also `index`, its raw index keys [1, 1, n, Di]);
                    cp.<j>.hidden [1, hidden_width] and cp.<j>.gdn.<l>.<name>: the fixed-size state of checkpoint j,
                    named by the GDN layer's `checkpoint_layout` (conv / rec; on a Qwen4-Exp PLE layer also
                    ple.conv / ple.context)
  <id>.json         {"format", "model", "n", "checkpoints": [positions], "n_mtp", "bytes", "sha256"}
Never pickle. Each file is written under a temporary name and renamed into place; the manifest goes last, so an
entry without a manifest never existed. Before an entry is used its bytes are checked against the manifest's
sha256 and its tensors, every name, shape and dtype, against the layout the model's caches give: a truncated,
damaged or foreign entry (or one with a tensor too many or too few) is skipped with a one-line warning (and
removed), and the prefix is recomputed, never served. Least recently used entries go first (file mtime)
when the directory holds more than `max_bytes`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from hetero.caches.prefix import Checkpoint, Snapshot
from hetero.models.cache import KVCache
from hetero.vision.prompt import IMAGE_KEY_BASE

FORMAT = "hetero-session/2"  # /1 keyed entries without the weights: removed as foreign when met
DEFAULT_MAX_BYTES = 16 * 1024**3
log = logging.getLogger("hetero.caches.session")


def default_dir() -> Path:
    """$HETERO_HOME/sessions, else $XDG_CACHE_HOME/hetero/sessions, else ~/.cache/hetero/sessions."""
    if os.environ.get("HETERO_HOME"):
        return Path(os.environ["HETERO_HOME"]) / "sessions"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hetero" / "sessions"


@dataclass
class _Entry:
    manifest: Path
    tensors: Path
    model: str
    n: int
    checkpoints: list[int]
    n_mtp: int
    nbytes: int
    sha256: str
    tokens: list[int] | None = None  # read on first use


class SessionStore:
    """Snapshots on disk under `root`, at most `max_bytes`; `load_best` / `save` are what `PrefixCache` calls."""

    def __init__(self, root: str | os.PathLike | None = None, max_bytes: int = DEFAULT_MAX_BYTES):
        self.root = Path(root) if root is not None else default_dir()
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self.entries: dict[Path, _Entry] = {}
        self.skipped = 0  # entries refused as damaged or foreign since start
        _sweep(self.root)
        for manifest in sorted(self.root.glob("*/*.json")):
            if manifest.name.startswith("."):  # another writer's manifest still under its temporary name
                continue
            entry = self._read_manifest(manifest)
            if entry is not None:
                self.entries[manifest] = entry

    @staticmethod
    def _model_dir_name(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def _read_manifest(self, manifest: Path) -> _Entry | None:
        try:
            m = json.loads(manifest.read_text())
            entry = _Entry(
                manifest, manifest.with_suffix(".safetensors"), str(m["model"]), int(m["n"]),
                [int(p) for p in m["checkpoints"]], int(m["n_mtp"]), int(m["bytes"]), str(m["sha256"]),
            )
            if m.get("format") != FORMAT:
                raise ValueError(f"format {m.get('format')!r}")
            if manifest.parent.name != self._model_dir_name(entry.model):
                raise ValueError("manifest names another model than its folder")
            if not entry.tensors.is_file() or entry.tensors.stat().st_size != entry.nbytes:
                raise ValueError("tensor file missing or of the wrong size (truncated?)")
            return entry
        except (OSError, ValueError, KeyError, TypeError) as e:
            self._reject(manifest, f"unreadable manifest ({e})")
            return None

    def _reject(self, manifest: Path, why: str) -> None:
        log.warning("session cache: skipping %s: %s; the prefix will be recomputed", manifest, why)
        self.skipped += 1
        self.entries.pop(manifest, None)
        for f in (manifest, manifest.with_suffix(".safetensors")):
            try:
                f.unlink()
            except OSError:
                pass

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    # ------------------------------------------------------------------------------------------------
    # Reading

    def _tokens(self, e: _Entry) -> list[int] | None:
        if e.tokens is None:
            try:
                from safetensors import safe_open

                with safe_open(str(e.tensors), framework="numpy") as f:
                    tokens = f.get_tensor("tokens")
                if tokens.shape != (e.n,):
                    raise ValueError(f"tokens shape {tokens.shape}, manifest says {e.n}")
                e.tokens = tokens.astype(np.int64).tolist()
            except Exception as err:  # safetensors raises its own error types on a damaged header
                self._reject(e.manifest, f"cannot read its tokens ({err})")
                return None
        return e.tokens

    def load_best(self, key: str, tokens, limit: int | None, better_than: int, model) -> list[Snapshot]:
        """Snapshots of the entry with the deepest checkpoint that prefixes tokens[:limit], if deeper than
        `better_than`; [] otherwise. Damaged entries are skipped (and the next best tried)."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        while True:
            best, best_p = None, better_than
            for e in list(self.entries.values()):
                if e.model != key:
                    continue
                et = self._tokens(e)
                if et is None:
                    continue
                common = _common_prefix(et, tokens, limit)
                p = max((p for p in e.checkpoints if p <= common), default=0)
                if p > best_p:
                    best, best_p = e, p
            if best is None:
                return []
            snaps = self._load(best, model)
            if snaps is not None:
                os.utime(best.tensors)  # least recently used goes first
                return snaps

    def _load(self, e: _Entry, model) -> list[Snapshot] | None:
        h = hashlib.sha256()
        try:
            with open(e.tensors, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
        except OSError as err:
            self._reject(e.manifest, f"unreadable ({err})")
            return None
        if h.hexdigest() != e.sha256:
            self._reject(e.manifest, "contents do not match the manifest's sha256 (damaged)")
            return None
        try:
            arrays = mx.load(str(e.tensors))
            snaps = _unpack(arrays, e, model)
        except (RuntimeError, ValueError, KeyError) as err:
            self._reject(e.manifest, f"does not fit this model ({err})")
            return None
        return snaps

    # ------------------------------------------------------------------------------------------------
    # Writing

    def save(self, key: str, snaps: list[Snapshot], model) -> None:
        """Write one entry holding the deepest snapshot's K/V and every snapshot's checkpoint (atomically)."""
        deepest = max(snaps, key=lambda s: len(s.tokens))
        n = len(deepest.tokens)
        folder = self.root / self._model_dir_name(key)
        folder.mkdir(parents=True, exist_ok=True)
        eid = hashlib.sha256(np.asarray(deepest.tokens, np.int64).tobytes()).hexdigest()[:24]
        manifest, tensors = folder / f"{eid}.json", folder / f"{eid}.safetensors"
        if manifest in self.entries:
            os.utime(tensors)
            return
        kv_layout, fixed_layout = _layouts(model)
        arrays = {"tokens": mx.array(deepest.tokens, dtype=mx.int32)}
        for i, (layout, rows) in enumerate(zip(kv_layout, deepest.kv, strict=True)):
            arrays.update({f"kv.{i}.{name}": a for (name, *_), a in zip(layout, rows, strict=True)})
        positions = []
        for j, s in enumerate(sorted(snaps, key=lambda s: len(s.tokens))):
            positions.append(len(s.tokens))
            arrays[f"cp.{j}.hidden"] = s.checkpoint.hidden
            for l, (layout, layer) in enumerate(zip(fixed_layout, s.checkpoint.layers, strict=True)):
                arrays.update({f"cp.{j}.gdn.{l}.{name}": a for (name, *_), a in zip(layout, layer, strict=True)})
        tmp = folder / f".{eid}.{os.getpid()}.tmp.safetensors"
        mx.save_safetensors(str(tmp), arrays, metadata={"format": FORMAT})
        digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
        size = tmp.stat().st_size
        os.replace(tmp, tensors)
        meta = {"format": FORMAT, "model": key, "n": n, "checkpoints": positions, "n_mtp": deepest.n_mtp,
                "bytes": size, "sha256": digest}
        tmp_manifest = folder / f".{eid}.{os.getpid()}.tmp.json"
        tmp_manifest.write_text(json.dumps(meta))
        os.replace(tmp_manifest, manifest)  # the commit point: the entry exists from here on
        entry = self._read_manifest(manifest)
        if entry is not None:
            entry.tokens = list(deepest.tokens)
            self.entries[manifest] = entry
        self._evict(keep=manifest)

    def _evict(self, keep: Path) -> None:
        def mtime(e: _Entry) -> float:
            try:
                return e.tensors.stat().st_mtime
            except OSError:
                return 0.0

        for e in sorted(self.entries.values(), key=mtime):
            if self.nbytes <= self.max_bytes:
                break
            if e.manifest == keep:
                continue
            self.entries.pop(e.manifest)
            for f in (e.manifest, e.tensors):
                try:
                    f.unlink()
                except OSError:
                    pass


def _sweep(root: Path) -> None:
    """Remove the temporary files of writers that died mid-write (a process stopped while saving): their names
    carry the writer's pid, so a live writer's are left alone."""
    for tmp in root.glob("*/.*.tmp.*"):
        pid = tmp.name.split(".")[2]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _common_prefix(a, b, limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _layouts(model) -> tuple[list[list[tuple]], list[list[tuple]]]:
    """What the model's caches (`make_cache` order) store: per attention layer its rows' (name, heads, dim, dtype)
    (`KVCache.layout`), per other layer its checkpoint's (name, shape, dtype) (`GDNCache.checkpoint_layout`)."""
    args, dtype = model.args, model.model.norm.weight.dtype  # the compute dtype (a quantized embedding's is uint32)
    cache = model.make_cache()
    return ([c.layout(args, dtype) for c in cache if isinstance(c, KVCache)],
            [c.checkpoint_layout(args, dtype) for c in cache if not isinstance(c, KVCache)])


def _unpack(arrays: dict[str, mx.array], e: _Entry, model) -> list[Snapshot]:
    """Snapshots from an entry's tensors, every name, shape and dtype checked against the model's cache layouts
    (ValueError if one differs, is missing or is left over)."""
    args, n = model.args, e.n
    dtype = model.model.norm.weight.dtype  # the compute dtype (a quantized embedding's weight is uint32)
    kv_layout, fixed_layout = _layouts(model)
    n_mtp = len(model.make_cache().mtp)
    if e.n_mtp != n_mtp or sorted(e.checkpoints) != e.checkpoints or not e.checkpoints:
        raise ValueError("layer counts or checkpoint list differ from this model")
    if e.checkpoints[-1] != n or e.checkpoints[0] < 1:
        raise ValueError("checkpoint positions out of range")
    expected = {"tokens"} | {f"kv.{i}.{name}" for i, layout in enumerate(kv_layout) for name, *_ in layout}
    for j in range(len(e.checkpoints)):
        expected |= {f"cp.{j}.hidden"} | {f"cp.{j}.gdn.{l}.{name}" for l, layout in enumerate(fixed_layout)
                                          for name, *_ in layout}
    if set(arrays) != expected:
        extra, missing = sorted(set(arrays) - expected), sorted(expected - set(arrays))
        raise ValueError(f"unexpected tensor {extra[0]}" if extra else f"no tensor {missing[0]}")

    def get(name: str, shape: tuple, want: mx.Dtype) -> mx.array:
        a = arrays[name]
        if tuple(a.shape) != shape or a.dtype != want:
            raise ValueError(f"{name} is {tuple(a.shape)} {a.dtype}, expected {shape} {want}")
        return a

    tokens = get("tokens", (n,), mx.int32).tolist()
    if any(not (0 <= t < args.vocab_size or IMAGE_KEY_BASE <= t < 2 * IMAGE_KEY_BASE) for t in tokens):
        raise ValueError("token ids outside the vocabulary (and not image content keys)")

    def state(name: str, shape: tuple, want: mx.Dtype) -> mx.array:
        """A checkpoint array; an integer one holds token ids (a PLE layer's context), each in the vocabulary."""
        a = get(name, shape, want)
        if mx.issubdtype(want, mx.integer) and a.size and not bool(mx.all((a >= 0) & (a < args.vocab_size))):
            raise ValueError(f"{name} holds token ids outside the vocabulary")
        return a

    mtp_from = len(kv_layout) - e.n_mtp
    kv = [tuple(get(f"kv.{i}.{name}", (1, heads, n - 1 if i >= mtp_from else n, dim), dt)
                for name, heads, dim, dt in layout) for i, layout in enumerate(kv_layout)]
    snaps = []
    for j, p in enumerate(e.checkpoints):
        layers = [tuple(state(f"cp.{j}.gdn.{l}.{name}", shape, dt) for name, shape, dt in layout)
                  for l, layout in enumerate(fixed_layout)]
        hidden = get(f"cp.{j}.hidden", (1, model.hidden_width), dtype)
        rows = [tuple(a[:, :, : (p - 1 if i >= mtp_from else p)] for a in arrays) for i, arrays in enumerate(kv)]
        snaps.append(Snapshot(tokens[:p], rows, Checkpoint(layers, hidden), e.n_mtp))
    return snaps
