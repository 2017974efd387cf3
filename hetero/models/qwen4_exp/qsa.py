"""QSA: gated GQA whose keys are chosen per query by a token indexer over compressed key blocks.

Per query at position p (tokens 0..p visible, c = indexer_compress_ratio, k = indexer_budget / c):
    complete blocks b < (p+1) // c, each key  K_b = rope(N(mean of raw index keys of tokens bc..bc+c-1), pos bc)
    score_b = sum_heads relu(q_h . K_b) / sqrt(Di)      q = rope(N(index q), pos p), Di = indexer_head_dim
    selected = tokens of the k best blocks + the tail tokens after the last complete block
The attention proper (Qwen3.5's gated attention) then runs with the causal mask ANDed with `selected`.
`QSACache` keeps the layer's keys and values and the raw index keys (the block keys are recomputed from them), and
checkpoints all three as rows.
A batch of requests (`RaggedKV`) selects and attends row by row, each row over its own `QSACache`.
"""

from __future__ import annotations

import contextlib
import math
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from hetero.models.attention import attend_selected
from hetero.models.cache import KVCache, RaggedKV
from hetero.models.gated_delta import RECURRENT_MAX_TOKENS
from hetero.models.linear import Linear
from hetero.models.qwen3_5.layers import Attention, RMSNorm
from hetero.models.rope import Rotary
from hetero.models.qwen4_exp.args import Qwen4Args


class QSACache(KVCache):
    """KV of one QSA layer plus its raw (un-normed, un-rotated) index keys [B, T, Di]."""

    def __init__(self) -> None:
        super().__init__()
        self.index_keys: mx.array | None = None
        self._blocks: mx.array | None = None  # [B, m, Di] fp32: the indexer's first m block keys (`Indexer.pick`)
        self._blocks_from = 0  # index keys unchanged since `_blocks` was kept: blocks within them still hold

    def update_index(self, keys: mx.array) -> mx.array:
        """Append index keys [B, S, Di] at positions offset-S.. (call after `update_and_fetch`) -> all [B, T, Di]."""
        start = self.offset - keys.shape[1]
        old = self.index_keys[:, :start] if self.index_keys is not None and start > 0 else None
        self.index_keys = keys if old is None else mx.concatenate([old, keys], axis=1)
        self._blocks_from = min(self._blocks_from, start)
        return self.index_keys

    def trim_to(self, n: int) -> None:
        super().trim_to(n)
        if self.index_keys is not None:
            self.index_keys = self.index_keys[:, : self.offset]
        self._blocks_from = min(self._blocks_from, self.offset)

    def index_blocks(self, ratio: int) -> mx.array | None:
        """The kept block keys [B, m, Di] whose `ratio` index keys are all unchanged since (None: none)."""
        m = 0 if self._blocks is None else min(self._blocks.shape[1], self._blocks_from // ratio)
        return self._blocks[:, :m] if m else None

    def keep_index_blocks(self, blocks: mx.array) -> None:
        """Keep the block keys [B, m, Di] of the index keys as they stand (a decode step pools only new blocks)."""
        self._blocks, self._blocks_from = blocks, self.index_keys.shape[1]

    # Rows (`KVCache.rows`): K and V, then with an indexer its raw keys as one head [B, 1, n, Di]; the block keys
    # follow from them (`Indexer.select` pools them again), so a checkpoint needs no more.

    def layout(self, args, dtype: mx.Dtype) -> list[tuple[str, int, int, mx.Dtype]]:
        index = [("index", 1, args.indexer_head_dim, dtype)] if args.qsa else []
        return super().layout(args, dtype) + index

    def rows(self, lo: int, hi: int) -> tuple[mx.array, ...]:
        kv = (self.keys[:, :, lo:hi], self.values[:, :, lo:hi])
        return kv if self.index_keys is None else (*kv, self.index_keys[:, None, lo:hi])

    def install(self, parts: list[tuple[mx.array, ...]]) -> None:
        super().install([p[:2] for p in parts])
        with_index = len(parts[0]) > 2
        self.index_keys = mx.concatenate([p[2][:, 0] for p in parts], axis=1) if with_index else None  # [B, n, Di]
        self._blocks, self._blocks_from = None, 0

    def like(self) -> QSACache:
        return QSACache()

    def up_to(self, n: int) -> QSACache:
        at = super().up_to(n)
        if self.index_keys is not None:
            at.index_keys = self.index_keys[:, :n]  # [B, n, Di]
        return at

    @property
    def state(self) -> list[mx.array]:
        return super().state + ([] if self.index_keys is None else [self.index_keys])


def rope_at(x: mx.array, positions: mx.array, rotary: Rotary) -> mx.array:
    """NeoX RoPE (the model's frequencies and scale) on the first `rotary.dims` features of x [..., N, H, D] at
    positions [N] (any, not only consecutive)."""
    dims = rotary.dims
    cos, sin = rotary.angles(positions)  # [N, dims/2] each
    cos = mx.concatenate([cos] * 2, axis=-1)[:, None, :]  # [N, 1, dims]
    sin = mx.concatenate([sin] * 2, axis=-1)[:, None, :]
    rot, rest = x[..., :dims], x[..., dims:]
    half = dims // 2
    rotated = mx.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return mx.concatenate([rot * cos + rotated * sin, rest], axis=-1).astype(x.dtype)


class Indexer(nn.Module):
    """`self_attn.indexer.*`: one projection to Hi query heads and one key head, q/k layernorms (scale 1 + w)."""

    def __init__(self, args: Qwen4Args):
        super().__init__()
        self.heads, self.dim = args.indexer_n_heads, args.indexer_head_dim
        self.ratio, self.blocks = args.indexer_compress_ratio, args.indexer_budget // args.indexer_compress_ratio
        self.rotary = args.rotary
        self.index_qk_proj = Linear(args.hidden_size, (self.heads + 1) * self.dim, bias=False)
        self.q_layernorm = RMSNorm(self.dim, args.rms_norm_eps)
        self.k_layernorm = RMSNorm(self.dim, args.rms_norm_eps)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x [B, S, hidden] -> (normed queries [B, S, Hi, Di] before RoPE, raw keys [B, S, Di])."""
        B, S, _ = x.shape
        qk = self.index_qk_proj(x)  # [B, S, (Hi+1)*Di]
        q = qk[..., : self.heads * self.dim].reshape(B, S, self.heads, self.dim)
        return self.q_layernorm(q), qk[..., self.heads * self.dim :]

    def choose(self, x: mx.array, cache: QSACache, start: int) -> tuple[mx.array, mx.array]:
        """A prefill chunk at positions start.. over the index keys `cache` holds before it: its input x [B, s, hidden]
        -> (its raw index keys [B, s, Di], for the cache once the chunk's K/V are written; the keys each query may
        attend to [B, s, T], causal included). The split prefill selects a chunk's keys with it, for both lanes."""
        q, k = self.project(x)  # [B, s, Hi, Di], [B, s, Di]
        old = cache.index_keys[:, :start] if cache.index_keys is not None and start else None
        keys = k if old is None else mx.concatenate([old, k], axis=1)  # [B, T, Di]
        return k, self.select(q, keys, start)

    def select(self, q: mx.array, keys: mx.array, offset: int) -> mx.array:
        """Normed queries [B, L, Hi, Di] at positions offset..offset+L-1 and all raw keys [B, T, Di] (T = offset+L)
        -> the keys each query may attend to [B, L, T] bool (causal included). Under `Selections.using`
        (`--verify`) the choice is recorded, or replaced by the recorded one."""
        chosen = self._select(q, keys, offset)
        selections = _selections[0]
        return chosen if selections is None else selections.choose(self, offset, chosen)

    def _select(self, q: mx.array, keys: mx.array, offset: int) -> mx.array:
        B, L = q.shape[:2]
        T = keys.shape[1]
        pos = mx.arange(offset, offset + L)  # [L]
        q = rope_at(q, pos, self.rotary).astype(mx.float32)
        t = mx.arange(T)
        causal = t[None, :] <= pos[:, None]  # [L, T]
        n_blocks = T // self.ratio
        if n_blocks == 0:
            return mx.broadcast_to(causal, (B, L, T))
        block_keys = self.pool(keys, 0, n_blocks)  # [B, NB, Di]
        scores = mx.maximum(q @ block_keys[:, None].swapaxes(-1, -2), 0.0)  # [B, L, Hi, NB]
        scores = scores.sum(axis=2) / math.sqrt(self.dim)  # [B, L, NB]
        complete = (pos + 1) // self.ratio  # [L] complete blocks each query sees
        valid = mx.arange(n_blocks)[None, :] < complete[:, None]  # [L, NB]
        if n_blocks > self.blocks:
            chosen = top_blocks(mx.where(valid, scores, -mx.inf), self.blocks) & valid  # [B, L, NB]
        else:
            chosen = mx.broadcast_to(valid, (B, L, n_blocks))
        block_of = mx.minimum(t // self.ratio, n_blocks - 1)  # [T]
        in_blocks = t[None, :] < (complete * self.ratio)[:, None]  # [L, T]
        picked = mx.take(chosen, block_of, axis=-1)  # [B, L, T]
        return mx.where(in_blocks, picked, causal)

    def pool(self, keys: mx.array, lo: int, hi: int) -> mx.array:
        """Raw index keys [B, T, Di] -> the keys of blocks lo..hi-1 [B, hi-lo, Di] fp32: each block's mean, normed,
        rotated at the block's first position. A block's key depends on its own raw keys alone."""
        B = keys.shape[0]
        raw = keys[:, lo * self.ratio : hi * self.ratio].astype(mx.float32).reshape(B, hi - lo, self.ratio, self.dim)
        pooled = self.k_layernorm(raw.mean(axis=2).astype(keys.dtype))  # [B, hi-lo, Di]
        starts = mx.arange(lo, hi) * self.ratio
        return rope_at(pooled[:, :, None, :], starts, self.rotary)[:, :, 0].astype(mx.float32)

    def pick(self, q: mx.array, keys: mx.array, cache: QSACache) -> mx.array | None:
        """`select` for one query at the newest position T-1 (a decode step), as token ids rather than a mask:
        normed query [B, 1, Hi, Di] and all raw keys [B, T, Di] -> the positions it attends to [B, N] (the k best
        blocks' tokens, then the tail after the last complete block), or None when it sees every key. The blocks'
        keys are kept in `cache` (`QSACache.keep_index_blocks`), so a step pools only the block it completes."""
        B, T = keys.shape[:2]
        n_blocks = T // self.ratio
        if n_blocks <= self.blocks:  # every complete block is chosen: the whole causal prefix
            return None
        block_keys = self.kept_blocks(keys, cache)  # [B, NB, Di]
        q = rope_at(q, mx.array([T - 1]), self.rotary).astype(mx.float32)  # [B, 1, Hi, Di]
        scores = mx.maximum(q @ block_keys[:, None].swapaxes(-1, -2), 0.0)  # [B, 1, Hi, NB]
        scores = scores.sum(axis=2) / math.sqrt(self.dim)  # [B, 1, NB]: every block is complete for this query
        top = mx.argsort(-scores, axis=-1)[:, 0, : self.blocks].astype(mx.int32)  # [B, k] as `select` orders them
        tokens = (top[..., None] * self.ratio + mx.arange(self.ratio, dtype=mx.int32)).reshape(B, -1)  # [B, k*c]
        tail = mx.arange(n_blocks * self.ratio, T, dtype=mx.int32)  # the incomplete block's tokens
        return mx.concatenate([tokens, mx.broadcast_to(tail, (B, tail.size))], axis=1)  # [B, N]

    def pick_rows(self, q: mx.array, keys: mx.array, cache: QSACache) -> tuple[mx.array, mx.array] | None:
        """`pick` for L queries at the newest positions T-L..T-1 (a verify pass, the MTP head's catch-up): normed
        queries [B, L, Hi, Di] and all raw keys [B, T, Di] -> (positions [B, L, N], kept [B, L, N] bool), N = k*c +
        c-1: each query's k best complete blocks' tokens, then its own tail, the places it does not fill (fewer
        complete blocks than k, a shorter tail) not kept; or None when every query sees every key. The keys each
        query keeps are those of `select`'s mask row."""
        B, L = q.shape[:2]
        T = keys.shape[1]
        n_blocks = T // self.ratio
        if n_blocks <= self.blocks:  # every query's complete blocks are all chosen: the whole causal prefix
            return None
        block_keys = self.kept_blocks(keys, cache)  # [B, NB, Di]
        pos = mx.arange(T - L, T)  # [L]
        q = rope_at(q, pos, self.rotary).astype(mx.float32)  # [B, L, Hi, Di]
        scores = mx.maximum(q @ block_keys[:, None].swapaxes(-1, -2), 0.0)  # [B, L, Hi, NB]
        scores = scores.sum(axis=2) / math.sqrt(self.dim)  # [B, L, NB]
        complete = ((pos + 1) // self.ratio).astype(mx.int32)  # [L] complete blocks each query sees
        scores = mx.where(mx.arange(n_blocks)[None, :] < complete[:, None], scores, -mx.inf)
        top = mx.argsort(-scores, axis=-1)[..., : self.blocks].astype(mx.int32)  # [B, L, k] as `pick` orders them
        c = mx.arange(self.ratio, dtype=mx.int32)
        tokens = (top[..., None] * self.ratio + c).reshape(B, L, -1)  # [B, L, k*c]
        in_blocks = mx.repeat(top < complete[:, None], self.ratio, axis=-1)  # [B, L, k*c] a complete block's
        tail = complete[:, None] * self.ratio + c[: self.ratio - 1]  # [L, c-1] the incomplete block's tokens
        picked = mx.concatenate([tokens, mx.broadcast_to(tail, (B, L, self.ratio - 1))], axis=-1)  # [B, L, N]
        kept = mx.concatenate([in_blocks, mx.broadcast_to(tail <= pos[:, None], (B, L, self.ratio - 1))], axis=-1)
        return mx.where(kept, picked, 0), kept

    def kept_blocks(self, keys: mx.array, cache: QSACache) -> mx.array:
        """The block keys [B, NB, Di] of the raw keys [B, T, Di] (NB = T // c), those kept in `cache` reused and
        the new ones pooled and kept (`QSACache.keep_index_blocks`)."""
        n_blocks = keys.shape[1] // self.ratio
        block_keys = cache.index_blocks(self.ratio)  # [B, m, Di] or None
        m = 0 if block_keys is None else block_keys.shape[1]
        if m < n_blocks:
            new = self.pool(keys, m, n_blocks)  # [B, NB-m, Di]
            block_keys = new if block_keys is None else mx.concatenate([block_keys, new], axis=1)
            cache.keep_index_blocks(block_keys)
        return block_keys


def top_blocks(scores: mx.array, k: int) -> mx.array:
    """The k largest of scores [..., NB] per row as a mask [..., NB] bool; of equal scores the lower index first
    (what a stable descending sort keeps), so the choice is deterministic.

    By threshold, not by sorting: the k-th largest value (`mx.topk`), every score above it, and of the scores equal
    to it the first k - (how many are above) by index. A stable `argsort` of a 4K-token prefill chunk's [512, 1024]
    scores took 36 ms on the CPU, this 7.6 ms."""
    kth = mx.topk(scores, k, axis=-1).min(axis=-1, keepdims=True)  # [..., 1]
    above = scores > kth  # [..., NB]
    tied = scores == kth
    room = k - above.sum(axis=-1, keepdims=True)  # [..., 1] tied scores still to take
    return above | (tied & (mx.cumsum(tied.astype(mx.int32), axis=-1) <= room))


class QSAAttention(Attention):
    """Qwen3.5's gated attention (q|gate, q/k norms, partial RoPE, GQA) restricted to the indexer's tokens."""

    def __init__(self, args: Qwen4Args):
        super().__init__(args)
        self.indexer = Indexer(args) if args.qsa else None

    def __call__(self, x: mx.array, cache: QSACache | RaggedKV | None) -> mx.array:
        """x [B, S, hidden] -> [B, S, hidden]; `cache` gets the chunk's keys, values and index keys. A `RaggedKV`
        (a batch of requests, row i with cache.lengths[i] real tokens, padding after them) runs the projections over
        the whole batch and the selection and attention row by row over the row's own `QSACache`."""
        if isinstance(cache, RaggedKV):
            return self._ragged(x, cache)
        offset = cache.offset if cache is not None else 0
        queries, keys, values, gate = self.project(x, offset)  # [B, H, S, D], [B, Hkv, S, D] x2, [B, S, H, D]
        index = self.indexer.project(x) if self.indexer is not None else None
        return self.finish(self._attend(queries, keys, values, index, cache, offset), gate)  # [B, S, hidden]

    def _ragged(self, x: mx.array, cache: RaggedKV) -> mx.array:
        """Each row's indexer sees its own keys and positions only: the tokens it selects, and its causal mask,
        are exactly those of the request decoding alone."""
        offsets = [c.offset for c in cache.rows]
        queries, keys, values, gate = self.project(x, mx.array(offsets))  # [B, H, S, D], [B, Hkv, S, D] x2, ...
        index = self.indexer.project(x) if self.indexer is not None else None  # [B, S, Hi, Di], [B, S, Di]
        return self.finish(self.attend_rows(queries, keys, values, index, cache), gate)

    def attend_rows(self, queries: mx.array, keys: mx.array, values: mx.array, index: tuple[mx.array, mx.array] | None,
                    cache: RaggedKV, last: bool = False) -> mx.array:
        """A batch's projections (queries [B, H, S, D], keys and values [B, Hkv, S, D], index queries and raw keys)
        -> attention [B, H, S, D], row i over its own cache and its first cache.lengths[i] tokens (zeros after);
        `last`: [B, H, 1, D], each row's last real query alone (`_attend`)."""
        S = queries.shape[2]
        outs = []
        for i, (c, n) in enumerate(zip(cache.rows, cache.lengths)):
            own = None if index is None else (index[0][i : i + 1, :n], index[1][i : i + 1, :n])
            out = self._attend(queries[i : i + 1, :, :n], keys[i : i + 1, :, :n], values[i : i + 1, :, :n], own, c,
                               c.offset, last)  # [1, H, n, D] ([1, H, 1, D] when last)
            outs.append(out if n == S or last else mx.pad(out, [(0, 0), (0, 0), (0, S - n), (0, 0)]))
        return mx.concatenate(outs) if len(outs) > 1 else outs[0]  # zeros past each row's real tokens

    def _attend(self, queries: mx.array, keys: mx.array, values: mx.array, index: tuple[mx.array, mx.array] | None,
                cache: QSACache | None, offset: int, last: bool = False) -> mx.array:
        """One request's queries [B, H, S, D] at positions offset.., its new keys and values [B, Hkv, S, D] and
        index (queries, raw keys) -> attention [B, H, S, D] over the keys the indexer selects; writes `cache`.
        `last` (over a cache): every position's keys written, the last query alone attends -> [B, H, 1, D] (the
        MTP head's catch-up, whose earlier positions leave nothing but their keys)."""
        S = queries.shape[2]
        few = S <= RECURRENT_MAX_TOKENS  # a step (decode, verify, catch-up), not a prefill chunk
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)  # [B, Hkv, T, D]
        T = keys.shape[2]
        if last and cache is not None:  # the newest position's query: it is a decode step's from here
            queries, offset, S = queries[:, :, -1:], offset + S - 1, 1
            index = None if index is None else (index[0][:, -1:], index[1])  # every raw index key is still written
        if index is None:
            mask = mx.arange(T)[None, :] <= mx.arange(offset, offset + S)[:, None]  # [S, T]
        else:
            q_index, k_index = index
            all_keys = cache.update_index(k_index) if cache is not None else k_index  # [B, T, Di]
            # A step's queries attend to their picked keys alone (the cache keeps the block keys for the next step);
            # a prefill chunk's (its last query alone for the MTP head's pairs, whose output nothing reads) keep
            # nothing in the cache: an unevaluated block key must not outlive the chunk's thread (the split prefill)
            if S == 1 and cache is not None and few:  # a decode step: attend to the picked keys alone, no mask
                return attend_picked(queries, keys, values, self.head_dim**-0.5,
                                     self.indexer.pick(q_index, all_keys, cache))
            if cache is not None and few:  # verify, catch-up: each query its picked keys
                picked = self.indexer.pick_rows(q_index, all_keys, cache)
                if picked is not None:
                    return attend_picked_rows(queries, keys, values, self.head_dim**-0.5, *picked)
                mask = mx.arange(T)[None, :] <= mx.arange(offset, offset + S)[:, None]  # [S, T]: what `select` keeps
            else:
                mask = self.indexer.select(q_index, all_keys, offset)[:, None]  # [B, 1, S, T]
        return attend_selected(queries, keys, values, self.head_dim**-0.5, mask)


def attend_picked(queries: mx.array, keys: mx.array, values: mx.array, scale: float, picked: mx.array | None
                  ) -> mx.array:
    """One query per row [B, H, 1, D] over the keys/values [B, Hkv, T, D] at `picked` [B, N] (None: all T) ->
    [B, H, 1, D]. Equal to the masked attention over all T (the keys it drops weigh exactly 0 there), at the cost of
    N keys: the indexer keeps ~budget of them however long the context."""
    if picked is not None:
        B, Hkv, _, D = keys.shape
        at = mx.broadcast_to(picked[:, None, :, None], (B, Hkv, picked.shape[1], 1))  # [B, Hkv, N, 1]
        keys, values = mx.take_along_axis(keys, at, axis=2), mx.take_along_axis(values, at, axis=2)  # [B, Hkv, N, D]
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale)


def attend_picked_rows(queries: mx.array, keys: mx.array, values: mx.array, scale: float, picked: mx.array,
                       kept: mx.array) -> mx.array:
    """Queries [B, H, L, D], each over the keys/values [B, Hkv, T, D] at its own `picked` [B, L, N] where `kept`
    [B, L, N] -> [B, H, L, D]: `attend_picked` per query, one attention over B*L rows of one query each."""
    B, Hkv, _, D = keys.shape
    H, L, N = queries.shape[1], queries.shape[2], picked.shape[-1]
    at = mx.broadcast_to(picked.reshape(B, 1, L * N, 1), (B, Hkv, L * N, 1))

    def rows(x: mx.array) -> mx.array:  # [B, Hkv, T, D] -> each query's own [B*L, Hkv, N, D]
        x = mx.take_along_axis(x, at, axis=2).reshape(B, Hkv, L, N, D)
        return x.transpose(0, 2, 1, 3, 4).reshape(B * L, Hkv, N, D)

    q = queries.transpose(0, 2, 1, 3).reshape(B * L, H, 1, D)
    out = mx.fast.scaled_dot_product_attention(q, rows(keys), rows(values), scale=scale,
                                               mask=kept.reshape(B * L, 1, 1, N))  # [B*L, H, 1, D]
    return out.reshape(B, L, H, D).transpose(0, 2, 1, 3)


_selections: list[Selections | None] = [None]  # the `Selections` in use (one `--verify` at a time), else None


class Selections:
    """The keys each QSA query kept as one prefill chose them, recorded (`replay` None) or imposed on another prefill
    of the same prompt and chunks (`replay`: a recording), for `--verify`, as `hetero.models.moe.Routes` does for
    experts: two blocks whose scores lie within rounding of each other are kept by either of two runs that differ
    only in rounding. A call is told apart by its indexer's name and its chunk's offset; `flips` counts the queries
    whose kept keys the replaying run would have chosen otherwise. Prefill chunks alone run under it (`select`)."""

    def __init__(self, model: nn.Module, replay: Selections | None = None):
        self.names = {id(m): name for name, m in model.named_modules() if isinstance(m, Indexer)}
        self.replay = replay
        self.calls: dict[tuple[str, int], np.ndarray] = {}  # (indexer, offset) -> kept keys [B, L, T]
        self.flips = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def using(self):
        """Record or replay every indexer's choice inside the block (this thread and the lanes)."""
        _selections[0] = self
        try:
            yield self
        finally:
            _selections[0] = None

    def choose(self, indexer: Indexer, offset: int, chosen: mx.array) -> mx.array:
        """`chosen` [B, L, T] recorded, or the recorded choice of the same indexer and offset in its place (a split's
        padded chunk recorded more rows and keys: its first L and T)."""
        name = self.names.get(id(indexer))
        if name is None:
            return chosen
        own = np.array(chosen)
        if self.replay is None:
            with self._lock:
                self.calls[(name, offset)] = own
            return chosen
        theirs = self.replay.calls.get((name, offset))
        if theirs is None or theirs.shape[1] < own.shape[1] or theirs.shape[2] < own.shape[2]:
            return chosen
        theirs = theirs[:, : own.shape[1], : own.shape[2]]
        differ = int((theirs != own).any(-1).sum())
        if not differ:
            return chosen
        with self._lock:
            self.flips += differ
        return mx.array(theirs)

    def differs(self, other: Selections) -> int:
        """How many queries' kept keys of this recording another recording of the same prompt chose otherwise."""
        count = 0
        for key, own in self.calls.items():
            theirs = other.calls.get(key)
            if theirs is not None:
                L, T = min(own.shape[1], theirs.shape[1]), min(own.shape[2], theirs.shape[2])
                count += int((own[:, :L, :T] != theirs[:, :L, :T]).any(-1).sum())
        return count
