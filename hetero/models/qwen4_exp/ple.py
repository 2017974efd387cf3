"""PLE: per-layer hashed n-gram embeddings, injected into every hyper-connection stream of a few GDN layers.

Token n-grams (orders 2..ngram_size, the context never crossing an EOS) are hashed on the host with per-layer
seeded odd multipliers, `(t0*m0 ^ t1*m1 ^ ...) mod p_head`, one distinct prime vocabulary p per head; each head's
row of one shared table (`ngram_embedding`, the heads' vocabularies laid end to end) is gathered. Then

    e = concat_heads(rows)                                        [B, S, E]
    g = signed_sqrt(<N_group(key_proj e), N_group(h)>_stream / sqrt(d))    one gate per stream [B, S, hc, 1]
    v = sigmoid(g) * value_proj(e)                                [B, S, hc, d]
    out = v + silu(dilated_depthwise_conv(N_group(v)))            kernel K, dilation ngram_size, causal

The cache (`PLECache`) carries the last ngram_size-1 tokens and the conv's last (K-1)*ngram_size inputs; a prefix-cache
checkpoint copies both.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from hetero.errors import HeteroError
from hetero.models import activations as act
from hetero.models.linear import Linear
from hetero.models.qwen4_exp.args import Qwen4Args
from hetero.models.qwen4_exp.hyper import GroupedRMSNorm
from hetero.models.qwen4_exp.ple_table import DiskTable

_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_LAYER_PRIME = 10007


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _M1) & _MASK64
    value = ((value ^ (value >> 27)) * _M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(vocab: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The odd hash multipliers of PLE layer `ple_index` (0-based among PLE layers), one per n-gram position;
    each below 2^63 / vocab, so token * multiplier never overflows int64."""
    half = max(1, ((1 << 63) - 1) // max(vocab, 1) // 2)
    base = seed + _LAYER_PRIME * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_vocab_sizes(base: int, ple_index: int, heads: int) -> list[int]:
    """Prime vocabularies of one PLE layer's heads: the (ple_index*heads + h + 1)-th prime at or after `base`."""
    primes, p = [], base - 1
    while len(primes) < (ple_index + 1) * heads:
        p += 1
        while not _is_prime(p):
            p += 1
        primes.append(p)
    return primes[ple_index * heads :]


class NGramHasher:
    """Token ids -> row ids of one PLE layer's table (host-side numpy int64)."""

    def __init__(self, args: Qwen4Args, ple_index: int):
        self.n, self.per_order, self.eos = args.ngram_size, args.heads_per_ngram, args.eos_token_id[0]
        self.multipliers = np.array(layer_multipliers(args.vocab_size, self.n, ple_index, args.seed), dtype=np.int64)
        self.sizes = np.array(head_vocab_sizes(args.ngram_vocab_size_base, ple_index, args.ngram_heads), np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        divisor = args.make_ngram_vocab_size_divisible_by
        self.table_rows = -(-int(self.sizes.sum()) // divisor) * divisor

    def _shifted(self, history: np.ndarray, shift: int) -> np.ndarray:
        """history [B, T] moved right by `shift`, with EOS wherever the source lies before the current EOS segment."""
        if shift == 0:
            return history
        B, T = history.shape
        pos = np.arange(T)
        eos_at = np.where(history == self.eos, pos, -1)
        last_eos = np.maximum.accumulate(eos_at, axis=1)  # [B, T] last EOS at or before p
        prev_eos = np.concatenate([np.full((B, 1), -1), last_eos[:, :-1]], axis=1)  # strictly before p
        src = pos - shift
        valid = (pos - (prev_eos + 1) >= shift) & (src >= 0)
        return np.where(valid, history[:, np.clip(src, 0, None)], self.eos)

    def rows(self, context: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """context [B, n-1] (the previous tokens, EOS-padded), tokens [B, S] -> table rows [B, S, heads]."""
        history = np.concatenate([context, tokens], axis=1).astype(np.int64)  # [B, n-1+S]
        shifted = [self._shifted(history, s) for s in range(self.n)]
        blocks = []
        for order in range(2, self.n + 1):
            mixed = shifted[0] * self.multipliers[0]
            for j in range(1, order):
                mixed = np.bitwise_xor(mixed, shifted[j] * self.multipliers[j])
            lo = (order - 2) * self.per_order
            sizes, offsets = self.sizes[lo : lo + self.per_order], self.offsets[lo : lo + self.per_order]
            blocks.append(np.remainder(mixed[..., None], sizes) + offsets)  # [B, T, heads_per_ngram]
        return np.concatenate(blocks, axis=-1)[:, -tokens.shape[1] :]  # [B, S, heads]


class PLECache:
    """One PLE layer's carried state: the last ngram_size-1 tokens and the dilated conv's last inputs.

    While `recording` (a speculative verify pass) the layer also keeps the pass's whole token history and conv
    inputs, so `split` can give each row the state as it stood after its own last kept token."""

    def __init__(self) -> None:
        self.context: np.ndarray | None = None  # [B, n-1] int64
        self.conv: mx.array | None = None  # [B, (K-1)*dilation, hc*d]
        self.recording = False
        self.recorded_history: np.ndarray | None = None  # [B, n-1+S]: the context before the pass + its tokens
        self.recorded_conv_in: mx.array | None = None  # [B, (K-1)*dilation+S, hc*d]: the window + the pass's inputs

    @staticmethod
    def stack(caches: list["PLECache"]) -> "PLECache":
        """A new cache holding the rows' states stacked [B, ...] (the arrays are never written in place): a batched
        pass runs on it, and `split` gives each row its own state back."""
        out = PLECache()
        if len(caches) == 1:
            out.context, out.conv = caches[0].context, caches[0].conv
        else:
            out.context = np.concatenate([c.context for c in caches])  # [B, n-1]
            out.conv = mx.concatenate([c.conv for c in caches])  # [B, (K-1)*dilation, hc*d]
        return out

    def split(self, kept: list[int]) -> list["PLECache"]:
        """One cache per row of a stacked pass: row i's state as after its first kept[i] tokens (a recorded pass,
        padding after each row's real tokens), or as after the pass (not recording: every row kept its one token)."""
        if not self.recording:
            views = [(self.context[i : i + 1], self.conv[i : i + 1]) for i in range(len(kept))]
        else:
            ctx, window = self.context.shape[1], self.conv.shape[1]
            views = [(self.recorded_history[i : i + 1, n : n + ctx], self.recorded_conv_in[i : i + 1, n : n + window])
                     for i, n in enumerate(kept)]
        out = []
        for context, conv in views:
            own = PLECache()
            own.context, own.conv = context, conv
            out.append(own)
        return out

    def start_recording(self) -> None:
        self.recording = True
        self.recorded_history, self.recorded_conv_in = None, None

    def checkpoint_layout(self, args: Qwen4Args, dtype: mx.Dtype) -> list[tuple[str, tuple[int, ...], mx.Dtype]]:
        """(name, shape, dtype) of what `checkpoint` returns (as `GDNCache.checkpoint_layout`)."""
        window = (args.ple_conv_kernel_size - 1) * args.ngram_size
        return [("ple.conv", (1, window, args.hc_count * args.hidden_size), dtype),
                ("ple.context", (1, args.ngram_size - 1), mx.int32)]

    def checkpoint(self) -> tuple[mx.array, mx.array]:
        """(conv window [1, (K-1)*dilation, hc*d], token context [1, n-1] int32) as they stand."""
        return self.conv, mx.array(self.context.astype(np.int32))

    def restore(self, conv: mx.array, context: mx.array) -> None:
        """Hold a `checkpoint`'s state: the conv window (an array nothing else writes) and the token context."""
        self.conv, self.context = conv, np.array(context, dtype=np.int64)

    @property
    def state(self) -> list[mx.array]:
        return [] if self.conv is None else [self.conv]


class NGramEmbedding(nn.Module):
    """The hashed table `ngram_embedding.weight` [rows, E/heads]: a parameter (the checkpoint's shards
    concatenated) until `use_table` swaps in the table as it lies on disk, which a loaded model always does."""

    def __init__(self, args: Qwen4Args, ple_index: int):
        super().__init__()
        self.hasher = NGramHasher(args, ple_index)
        self.ngram_embedding = nn.Embedding(self.hasher.table_rows, args.ple_embed_dim // args.ngram_heads)
        self.table: DiskTable | None = None

    def use_table(self, table: DiskTable) -> None:
        """Read rows from `table` (memory-mapped, `ple_table.DiskTable`) instead of the parameter, which goes."""
        want = self.ngram_embedding.weight.shape
        if (table.rows, table.width) != tuple(want):
            raise HeteroError(f"a PLE table on disk is {table.rows} x {table.width}; the config asks {want[0]} x "
                              f"{want[1]}: the checkpoint does not match its config.json")
        self.pop("ngram_embedding")
        self.table = table

    def __call__(self, context: np.ndarray, tokens: np.ndarray) -> mx.array:
        """-> concatenated head rows [B, S, E]; only the rows this chunk hashes to are read."""
        rows = self.hasher.rows(context, tokens)  # [B, S, heads]
        if self.table is not None:
            emb = self.table(rows)  # [B, S, heads, E/heads]
        else:
            emb = self.ngram_embedding(mx.array(rows.astype(np.uint32)))
        return emb.reshape(*rows.shape[:2], -1)


class PLELayer(nn.Module):
    """A layer's PLE block (`layers.{i}.ple.*`): returns the update added to all hc streams."""

    def __init__(self, args: Qwen4Args, ple_index: int):
        super().__init__()
        d, hc, E = args.hidden_size, args.hc_count, args.ple_embed_dim
        self.hidden, self.hc = d, hc
        self.context_len = args.ngram_size - 1
        self.eos = args.eos_token_id[0]
        self.kernel, self.dilation = args.ple_conv_kernel_size, args.ngram_size
        self.state_len = (self.kernel - 1) * self.dilation
        self.ple_embedding = NGramEmbedding(args, ple_index)
        self.key_proj = Linear(E, hc * d, bias=False)
        self.value_proj = Linear(E, d, bias=False)
        self.norm_key = GroupedRMSNorm(hc * d, d, args.rms_norm_eps)
        self.norm_query = GroupedRMSNorm(hc * d, d, args.rms_norm_eps)
        self.norm_conv = GroupedRMSNorm(hc * d, d, args.rms_norm_eps)
        self.conv1d = nn.Conv1d(hc * d, hc * d, self.kernel, groups=hc * d, bias=False)  # weight [C, K, 1]

    def __call__(self, h: mx.array, tokens: np.ndarray, cache: PLECache | None) -> mx.array:
        """Streams h [B, S, hc*d], the chunk's token ids [B, S] -> the PLE update [B, S, hc*d]."""
        emb = self.embed(tokens, cache, h.shape[0]).astype(h.dtype)  # [B, S, E]
        prev = cache.conv if cache is not None and cache.conv is not None else None
        if prev is None:
            prev = mx.zeros((h.shape[0], self.state_len, h.shape[-1]), dtype=h.dtype)
        update, conv_in = self.mix(h, emb, prev)
        if cache is not None:
            cache.conv = conv_in[:, -self.state_len :]
            if cache.recording:
                cache.recorded_conv_in = conv_in
        return update

    def embed(self, tokens: np.ndarray, cache: PLECache | None, batch: int) -> mx.array:
        """The chunk's token ids [B, S] -> their n-gram rows [B, S, E] (hashed and gathered on the host); moves the
        cache's token context on (and records the pass's history while it records)."""
        context = cache.context if cache is not None and cache.context is not None else None
        if context is None:
            context = np.full((batch, self.context_len), self.eos, dtype=np.int64)
        emb = self.ple_embedding(context, tokens)  # [B, S, E]
        if cache is not None:
            history = np.concatenate([context, np.asarray(tokens, np.int64)], axis=1)  # [B, n-1+S]
            cache.context = history[:, -self.context_len :]
            if cache.recording:
                cache.recorded_history = history
        return emb

    def mix(self, h: mx.array, emb: mx.array, prev: mx.array) -> tuple[mx.array, mx.array]:
        """Streams h [B, S, hc*d], n-gram rows emb [B, S, E], the conv's previous inputs prev [B, (K-1)*dilation, hc*d]
        -> (the PLE update [B, S, hc*d], the conv's inputs [B, (K-1)*dilation+S, hc*d]). Device ops only: a decode
        step compiles it (`qwen4_exp.step`)."""
        B, S, _ = h.shape
        key = self.norm_key(self.key_proj(emb)).reshape(B, S, self.hc, self.hidden)  # [B, S, hc, d]
        query = self.norm_query(h).reshape(B, S, self.hc, self.hidden)  # [B, S, hc, d]
        gate = (key * query).sum(axis=-1, keepdims=True) / math.sqrt(self.hidden)  # [B, S, hc, 1]
        gate = mx.sqrt(mx.maximum(mx.abs(gate), 1e-6)) * mx.sign(gate)
        value = act.sigmoid(gate) * self.value_proj(emb)[:, :, None, :]  # [B, S, hc, d]
        value = value.reshape(B, S, -1)  # [B, S, hc*d]
        conv_in = mx.concatenate([prev, self.norm_conv(value)], axis=1)  # [B, state_len+S, C]
        return value + act.silu(dilated_causal_conv(conv_in, self.conv1d.weight, self.dilation)), conv_in


def dilated_causal_conv(x: mx.array, weight: mx.array, dilation: int) -> mx.array:
    """Depthwise causal conv with dilation: x [B, (K-1)*dilation + S, C] (the previous inputs, then S new ones),
    weight [C, K, 1] -> [B, S, C]; out[t] = sum_j w[:, j] * x[t - (K-1-j)*dilation]."""
    K = weight.shape[1]
    S = x.shape[1] - (K - 1) * dilation
    w = weight[:, :, 0].astype(x.dtype)  # [C, K]
    out = x[:, :S] * w[:, 0]
    for j in range(1, K):
        out = out + x[:, j * dilation : j * dilation + S] * w[:, j]  # [B, S, C]
    return out
