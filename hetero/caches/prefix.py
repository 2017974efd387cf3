"""Prefix cache: a token trie of hybrid-state checkpoints, bounded by bytes in RAM, least recently used first out.

A checkpoint at n tokens is everything needed to continue after tokens[:n] as if they had just been prefilled:
  - every attention layer's rows for positions 0..n-1 (backbone) and the MTP layer's for its pairs 0..n-2: K/V,
    and whatever else the layer's cache keeps per position (`KVCache.rows`: a QSA layer's raw index keys),
  - every other layer's fixed-size state exactly at n (`GDNCache.checkpoint`: conv window and recurrent state,
    and on a Qwen4-Exp PLE layer the PLE's token context and dilated conv window),
  - the backbone's hidden h_{n-1} (`model.hidden_width` wide: Qwen4-Exp's hc streams), which the MTP head pairs
    with the next token t_n.
Each cache class says what its state is (`layout` / `rows` / `install`, `checkpoint_layout` / `checkpoint` /
`restore`); this module and the session store only copy what they are given.
The trie is a radix tree: an edge holds its tokens and the rows of exactly those positions, so a transcript
that grows turn by turn stores each position's rows once; a node holds the fixed-size state when it is a
checkpoint. Restoring concatenates the rows along the path into fresh buffers (a live KVCache writes in
place by slice assignment, so a checkpoint never shares a buffer with a live cache). A layer's rows are the arrays
its cache stores (`KVCache.rows`): keys and values, or with `--kv-bits` their packed values, scales and biases, so a
quantized cache is checkpointed and restored as stored, bit for bit.

A prompt with images comes keyed by content: each image token is a key drawn from the image's pixel digest
(`hetero.vision.prompt.ImagePrompt.cache_keys`), so the trie matches the same image and never another.

Trees are per `Engine.cache_key` (identity + the loaded weights' fingerprint + the KV storage): two models, two
versions of one model's weights, or full-precision and quantized KV, never see each other's state.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from hetero.models.cache import KVCache, ModelCache

DEFAULT_MAX_BYTES = 2 * 1024**3  # 2 GiB of RAM for checkpoints unless told otherwise


def _own(x: mx.array) -> mx.array:
    """A copy in its own buffer (a slice would pin, and could alias, the live cache's whole buffer)."""
    return x * mx.array(1, dtype=x.dtype)


@dataclass
class Checkpoint:
    """The fixed-size part of the state at n tokens: each non-attention layer's `checkpoint()` and h_{n-1}."""

    layers: list[tuple[mx.array, ...]]  # per GDN layer (make_cache order): conv [1, K-1, C], recurrent fp32, [PLE]
    hidden: mx.array  # [1, hidden_width] the backbone's hidden at position n-1

    @property
    def arrays(self) -> list[mx.array]:
        return [self.hidden, *(a for layer in self.layers for a in layer)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


@dataclass
class Snapshot:
    """A whole-path state at n tokens: the rows 0..n-1 (MTP: 0..n-2) of every attention layer plus a Checkpoint.

    `kv` follows the order of the model's KVCaches in `make_cache()` (backbone attention layers, then MTP).
    """

    tokens: list[int]
    kv: list[tuple[mx.array, ...]]  # per layer its rows [1, heads, n, *] each; the last n_mtp (MTP layers) n-1 rows
    checkpoint: Checkpoint
    n_mtp: int


@dataclass
class Restored:
    """A cache list rebuilt from a checkpoint: continue with tokens[n:], `hidden` [1, H] pairing with t_n."""

    cache: ModelCache
    n: int
    hidden: mx.array


@dataclass(eq=False)
class _Node:
    start: int  # absolute position where this node's edge begins
    tokens: list[int]  # the edge: tokens[start:end]
    kv: list[tuple[mx.array, ...]]  # per KV layer: rows of this edge's positions (MTP: shifted by one)
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)
    checkpoint: Checkpoint | None = None
    last_used: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def kv_bytes(self) -> int:
        return sum(a.nbytes for rows in self.kv for a in rows)


def _kv(model, c: KVCache) -> tuple[mx.array, ...]:
    """The row arrays of a KV cache (views of its valid positions: callers slice and copy); [1, heads, 0, *] each
    when it holds none yet (the MTP layer after a 1-token prompt)."""
    if c.keys is not None:
        return c.rows(0, c.offset)
    return tuple(mx.zeros((1, heads, 0, dim), dtype)
                 for _, heads, dim, dtype in c.layout(model.args, model.model.norm.weight.dtype))


def _rows(lo: int, hi: int, mtp: bool) -> tuple[int, int]:
    """K/V rows that belong to the edge of positions [lo, hi): an MTP row p pairs (t_{p+1}, h_p)."""
    return (max(lo - 1, 0), hi - 1) if mtp else (lo, hi)


class PrefixCache:
    """Token trie of checkpoints per model, at most `max_bytes` of arrays, least recently used evicted first.

    `store` (a `SessionStore`) backs it on disk: snapshots are written there with `persist` and read back on a
    lookup that the disk can serve further than RAM.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, store=None):
        self.max_bytes = max_bytes
        self.store = store
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.disk_hits = 0  # the hits that the disk store served further than RAM could
        self._roots: dict[str, _Node] = {}
        self._n_mtp: dict[str, int] = {}  # per model: how many trailing K/V entries are MTP layers
        self._clock = 0
        self._lock = threading.RLock()

    # ------------------------------------------------------------------------------------------------
    # Lookup and restore

    def lookup(self, key: str, tokens: Sequence[int], limit: int | None = None) -> _Node | None:
        """Deepest checkpoint node whose tokens are a prefix of tokens[:limit]."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        node, best = self._roots.get(key), None
        while node is not None:
            child = node.children.get(tokens[node.end]) if node.end < limit else None
            if child is None or child.end > limit or list(tokens[child.start : child.end]) != child.tokens:
                break
            node = child
            if node.checkpoint is not None:
                best = node
        return best

    def restore(self, model, key: str, tokens: Sequence[int], limit: int | None = None) -> Restored | None:
        """Rebuild caches from the longest cached prefix of tokens[:limit] (RAM, else disk); None on a miss."""
        with self._lock:
            node = self.lookup(key, tokens, limit)
            if self.store is not None:
                loaded = self.store.load_best(key, tokens, limit, better_than=node.end if node else 0, model=model)
                for snap in loaded:
                    self.insert_snapshot(key, snap)
                if loaded:
                    node = self.lookup(key, tokens, limit)
                    self.disk_hits += node is not None
            if node is None:
                self.misses += 1
                return None
            self.hits += 1
            self._touch(node)
            return Restored(self._build(model, node), node.end, _own(node.checkpoint.hidden))

    def _build(self, model, node: _Node) -> ModelCache:
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        last = path[-1]
        cache = model.make_cache()
        kv_caches = [c for c in cache if isinstance(c, KVCache)]
        fixed = [c for c in cache if not isinstance(c, KVCache)]
        for i, c in enumerate(kv_caches):
            parts = [p.kv[i] for p in path if p.kv[i][0].shape[2]]
            if parts:
                c.install(parts)  # fresh buffers with room to grow, never a view of the trie's rows
        for c, arrays in zip(fixed, last.checkpoint.layers, strict=True):
            c.restore([_own(a) for a in arrays], last.end)
        mx.eval(*[a for c in cache for a in c.state])
        return cache

    # ------------------------------------------------------------------------------------------------
    # Insertion

    def capture(
        self,
        model,
        key: str,
        tokens: Sequence[int],
        cache: ModelCache,
        pending_hidden: mx.array,
    ) -> None:
        """Checkpoint a live cache at n = len(tokens) (the backbone has run exactly tokens).

        pending_hidden [m, H]: the backbone's post-norm hiddens of positions n-m..n-1 that the MTP head has not
        consumed (its KV is at n-m); the head catches up on a copy, so the live cache is left as it was.
        """
        tokens = list(tokens)
        n, m = len(tokens), pending_hidden.shape[0]
        backbone, mtp = cache.backbone, cache.mtp
        if n == 0 or backbone[0].offset != n:
            raise ValueError(f"capture of {n} tokens from a cache at {backbone[0].offset}")
        if mtp and mtp[0].offset != n - m:
            return  # the MTP head is not where the pending hiddens say: no trustworthy checkpoint here
        if mtp and m > 1:  # catch up the head on a copy: pairs (t_{p+1}, h_p) for p = n-m..n-2
            copies = []
            for c in mtp:
                k = c.like()
                if c.offset:
                    k.install([c.rows(0, c.offset)])  # as stored (a quantized cache is not quantized twice)
                copies.append(k)
            model.mtp_hidden(mx.array(tokens[n - m + 1 :])[None], pending_hidden[None, :-1], copies, last=True)
            mtp = copies
        kv = [_kv(model, c) for c in backbone if isinstance(c, KVCache)] + [_kv(model, c) for c in mtp]
        n_mtp = len(mtp)
        layers = [tuple(_own(a) for a in c.checkpoint()) for c in backbone if not isinstance(c, KVCache)]
        checkpoint = Checkpoint(layers, _own(pending_hidden[-1:]))
        with self._lock:
            self._insert(key, tokens, kv, n_mtp, checkpoint)

    def insert_snapshot(self, key: str, snap: Snapshot) -> None:
        """Add a whole-path snapshot (read from disk) to the trie."""
        with self._lock:
            self._insert(key, snap.tokens, snap.kv, snap.n_mtp, snap.checkpoint)

    def _insert(self, key: str, tokens: list[int], kv: list, n_mtp: int, checkpoint: Checkpoint) -> None:
        """Walk/split the trie along tokens, add an edge for the uncached tail, put the checkpoint at its end."""
        n = len(tokens)
        node = self._roots.setdefault(key, _Node(0, [], []))
        self._n_mtp[key] = n_mtp
        n_kv = len(kv)

        def segment(lo: int, hi: int) -> list[tuple[mx.array, ...]]:
            out = []
            for i, arrays in enumerate(kv):
                a, b = _rows(lo, hi, i >= n_kv - n_mtp)
                out.append(tuple(_own(x[:, :, a:b]) for x in arrays))
            mx.eval(out)
            return out

        while node.end < n:
            child = node.children.get(tokens[node.end])
            if child is None:
                break
            same = 0
            while same < len(child.tokens) and child.start + same < n and child.tokens[same] == tokens[child.start + same]:
                same += 1
            if same < len(child.tokens):
                child = self._split(child, same, n_kv, n_mtp)
            node = child
        if node.end < n:
            leaf = _Node(node.end, tokens[node.end :], segment(node.end, n), parent=node)
            node.children[tokens[node.end]] = leaf
            self.nbytes += leaf.kv_bytes
            node = leaf
        if node.checkpoint is None:
            mx.eval(checkpoint.arrays)
            node.checkpoint = checkpoint
            self.nbytes += checkpoint.nbytes
        self._touch(node)
        self._evict()

    def _split(self, child: _Node, at: int, n_kv: int, n_mtp: int) -> _Node:
        """Cut child's edge after `at` tokens; returns the new middle node (no checkpoint)."""
        parent = child.parent
        cut = child.start + at
        head_kv, tail_kv = [], []
        for i, arrays in enumerate(child.kv):
            mtp = i >= n_kv - n_mtp
            a, b = _rows(child.start, cut, mtp)
            rows = b - a  # rows of this edge that belong to the head part
            head_kv.append(tuple(_own(x[:, :, :rows]) for x in arrays))
            tail_kv.append(tuple(_own(x[:, :, rows:]) for x in arrays))
        mx.eval(head_kv, tail_kv)
        middle = _Node(child.start, child.tokens[:at], head_kv, parent=parent)
        parent.children[middle.tokens[0]] = middle
        child.start, child.tokens, child.kv, child.parent = cut, child.tokens[at:], tail_kv, middle
        middle.children[child.tokens[0]] = child
        return middle

    # ------------------------------------------------------------------------------------------------
    # Export (for the disk store), accounting, eviction

    def snapshot(self, key: str, tokens: Sequence[int], since: int = 0) -> list[Snapshot]:
        """Whole-path snapshots of the checkpoints on tokens' path at positions >= since (deepest last)."""
        with self._lock:
            node, path = self._roots.get(key), []
            while node is not None:
                child = node.children.get(tokens[node.end]) if node.end < len(tokens) else None
                if child is None or list(tokens[child.start : child.end]) != child.tokens:
                    break
                path.append(child)
                node = child
            out = []
            for j, p in enumerate(path):
                if p.checkpoint is None or p.end < since:
                    continue
                kv = [tuple(mx.concatenate([q.kv[i][a] for q in path[: j + 1]], axis=2) for a in range(len(p.kv[i])))
                      for i in range(len(p.kv))]
                out.append(Snapshot(list(tokens[: p.end]), kv, p.checkpoint, self._n_mtp[key]))
            return out

    def persist(self, model, key: str, tokens: Sequence[int], since: int = 0) -> None:
        """Write the deepest checkpoint on tokens' path (with those at >= since along it) to the disk store."""
        if self.store is None:
            return
        snaps = self.snapshot(key, tokens, since)
        if snaps:
            self.store.save(key, snaps, model=model)

    def _touch(self, node: _Node) -> None:
        self._clock += 1
        node.last_used = self._clock

    def _checkpoint_nodes(self) -> list[_Node]:
        out, stack = [], list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.checkpoint is not None:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def _evict(self) -> None:
        if self.nbytes <= self.max_bytes:
            return
        for node in sorted(self._checkpoint_nodes(), key=lambda n: n.last_used):
            if self.nbytes <= self.max_bytes:
                break
            self.nbytes -= node.checkpoint.nbytes
            node.checkpoint = None
            # rows nobody can restore any more go too: a childless node without a checkpoint
            while node.parent is not None and node.checkpoint is None and not node.children:
                self.nbytes -= node.kv_bytes
                del node.parent.children[node.tokens[0]]
                node = node.parent

    @property
    def entries(self) -> int:
        """Checkpoints held in RAM."""
        with self._lock:
            return len(self._checkpoint_nodes())

    def stats(self) -> dict:
        return {"bytes": self.nbytes, "max_bytes": self.max_bytes, "entries": self.entries, "hits": self.hits,
                "misses": self.misses}

