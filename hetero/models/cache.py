"""Per-layer caches: attention KV written by position, GDN conv window and recurrent state.

A model's cache (`ModelCache`) is a list with one small object per layer, the backbone's then the MTP head's,
named by part; it is passed into the forward call, never hidden inside modules, so it can be snapshotted and
rolled back.
"""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """Keys and values of one attention layer, preallocated in steps and written at their positions.

    Writes are indexed by position, so rolling back to n tokens is `trim_to(n)`: the slots past n are simply
    overwritten later.
    """

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None  # [B, Hkv, capacity, D]
        self.values: mx.array | None = None  # [B, Hkv, capacity, D]
        self.offset = 0
        self.expected = 0  # positions the next allocation makes room for (`expect`)
        self.shift = 0  # RoPE position of slot i is i + shift: after a prompt's image, the positions it saved

    @property
    def position(self) -> int:
        """The RoPE position of the next slot written (`offset` + `shift`)."""
        return self.offset + self.shift

    def expect(self, n: int) -> None:
        """Make the next allocation hold n positions (a prefill about to write them): one buffer for the whole
        prompt instead of a regrowth per step, each of which copied the cache and briefly held it twice."""
        self.expected = max(self.expected, n)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write `keys`/`values` [B, Hkv, S, D] at positions offset..offset+S and return the whole valid cache."""
        B, H, S, D = keys.shape
        end = self.offset + S
        if self.keys is None or end > self.keys.shape[2]:
            capacity = ((max(end, self.expected) + self.step - 1) // self.step) * self.step
            new_k = mx.zeros((B, H, capacity, D), keys.dtype)
            new_v = mx.zeros((B, H, capacity, values.shape[-1]), values.dtype)
            if self.keys is not None and self.offset > 0:
                new_k[:, :, : self.offset] = self.keys[:, :, : self.offset]
                new_v[:, :, : self.offset] = self.values[:, :, : self.offset]
            self.keys, self.values = new_k, new_v
        self.keys[:, :, self.offset : end] = keys
        self.values[:, :, self.offset : end] = values
        self.offset = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def trim_to(self, n: int) -> None:
        """Forget every position at or after n."""
        self.offset = min(self.offset, n)

    # Rows: the arrays that hold positions, as the prefix and session caches copy them. Each is [B, heads, n, *] with
    # the positions on axis 2, so a slice, a concatenation or a file keeps them as they are (here: keys, values).

    def layout(self, args, dtype: mx.Dtype) -> list[tuple[str, int, int, mx.Dtype]]:
        """(name, heads, last dimension, dtype) of each row array, in `rows` order, for a model of `args` computing
        in `dtype`."""
        return [(name, args.num_key_value_heads, args.head_dim, dtype) for name in ("k", "v")]

    def rows(self, lo: int, hi: int) -> tuple[mx.array, ...]:
        """The row arrays of positions lo..hi-1 (views of the live buffers: copy them to keep them)."""
        return tuple(a[:, :, lo:hi] for a in self.state)

    def install(self, parts: list[tuple[mx.array, ...]]) -> None:
        """Hold exactly the rows of `parts` one after the other (positions 0..n-1, e.g. a checkpoint's edges), in
        fresh buffers with room to grow: one concatenation per array, never a view of the parts."""
        B, H = parts[0][0].shape[:2]
        n = sum(p[0].shape[2] for p in parts)
        cap = -(-n // self.step) * self.step
        fresh = [mx.concatenate([p[j] for p in parts] + [mx.zeros((B, H, cap - n, a.shape[3]), a.dtype)], axis=2)
                 for j, a in enumerate(parts[0])]
        self._set_buffers(fresh)
        self.offset = n

    def like(self) -> KVCache:
        """A new empty cache that stores K/V the way this one does."""
        return KVCache()

    def up_to(self, n: int) -> KVCache:
        """A cache of this kind reading this one's buffers up to position n: as this one stood at n (positions are
        only appended to, so the live buffers hold them until a rollback)."""
        at = self.like()
        at.keys, at.values, at.offset = self.keys, self.values, n
        return at

    def _set_buffers(self, arrays: list[mx.array]) -> None:
        self.keys, self.values = arrays

    @property
    def state(self) -> list[mx.array]:
        """The arrays that hold this cache (for evaluation and memory accounting)."""
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


class GDNCache:
    """Conv window and recurrent state of one Gated DeltaNet layer; they always change together.

    While `recording` (a speculative verify pass), the layer also keeps the state after every token and the
    conv inputs, so `commit(n)` can install the pair as it stood after the first n tokens with no re-run.
    """

    def __init__(self) -> None:
        self.conv: mx.array | None = None  # [B, K-1, C]: the last K-1 conv inputs
        self.recurrent: mx.array | None = None  # [B, Hv, Dk, Dv] fp32
        self.offset = 0
        self.recording = False
        self.recorded_states: list[mx.array] = []  # state after each token of the recorded pass
        self.recorded_conv_in: mx.array | None = None  # [B, K-1+S, C]: window before the pass + its inputs

    def start_recording(self) -> None:
        self.recording = True
        self.recorded_states, self.recorded_conv_in = [], None

    def commit(self, n: int) -> None:
        """Keep the first n tokens of the recorded pass: state and conv window as they were after token n."""
        if not self.recording:
            raise RuntimeError("commit() without a recorded pass")
        total = len(self.recorded_states)
        if not 1 <= n <= total:
            raise ValueError(f"commit({n}) of a {total}-token pass")
        window = self.conv.shape[1]
        self.recurrent = self.recorded_states[n - 1]
        self.conv = self.recorded_conv_in[:, n : n + window]
        self.offset -= total - n
        self.recording = False
        self.recorded_states, self.recorded_conv_in = [], None

    # Checkpoint: the fixed-size state at n tokens, as the prefix and session caches copy it (one request, B = 1).
    # A subclass that carries more (Qwen4-Exp's PLE state) appends its arrays to all three.

    def checkpoint_layout(self, args, dtype: mx.Dtype) -> list[tuple[str, tuple[int, ...], mx.Dtype]]:
        """(name, shape, dtype) of each array `checkpoint` returns, for a model of `args` computing in `dtype`;
        an integer array holds token ids."""
        conv_dim = (2 * args.linear_num_key_heads * args.linear_key_head_dim
                    + args.linear_num_value_heads * args.linear_value_head_dim)
        state = (1, args.linear_num_value_heads, args.linear_key_head_dim, args.linear_value_head_dim)
        return [("conv", (1, args.linear_conv_kernel_dim - 1, conv_dim), dtype), ("rec", state, mx.float32)]

    def checkpoint(self) -> tuple[mx.array, ...]:
        """The state as it stands, in `checkpoint_layout` order: conv window [1, K-1, C], recurrent [1, Hv, Dk, Dv]
        (the live arrays: copy them to keep them)."""
        return self.conv, self.recurrent

    def restore(self, arrays: list[mx.array], n: int) -> None:
        """Hold `arrays` (a `checkpoint`, arrays nothing else writes) as the state after n tokens."""
        self.conv, self.recurrent = arrays
        self.offset = n

    def like(self) -> GDNCache:
        """A new empty cache that holds the state this one does."""
        return GDNCache()

    def restored(self, arrays: tuple[mx.array, ...], n: int) -> GDNCache:
        """A new cache of this kind holding `arrays` (a `checkpoint` taken after n tokens) as its state."""
        at = self.like()
        at.restore(list(arrays), n)
        return at

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.conv, self.recurrent) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


class RaggedKV:
    """One attention layer's KV for a batch of requests, each in its own `KVCache` at its own length.

    A batched pass runs x [B, S, hidden] where row i holds `lengths[i]` real tokens (then padding): row i's
    real keys are written into `rows[i]` at its own positions and its queries attend over that cache alone,
    so every request sees exactly the attention it would see decoding alone (`DecoderLayer`).
    """

    def __init__(self, rows: list[KVCache], lengths: list[int]) -> None:
        if len(rows) != len(lengths):
            raise ValueError(f"{len(rows)} caches for {len(lengths)} lengths")
        self.rows, self.lengths = rows, lengths

    @property
    def offsets(self) -> mx.array:
        """[B] each row's position before this pass (its RoPE offset)."""
        return mx.array([c.position for c in self.rows])

    @property
    def state(self) -> list[mx.array]:
        return [a for c in self.rows for a in c.state]

    def last(self, x: mx.array) -> mx.array:
        """x [B, S, ...] over this pass -> [B, 1, ...] each row's last real position."""
        return x[mx.arange(len(self.rows)), mx.array(self.lengths) - 1][:, None]


def last_positions(x: mx.array, cache: KVCache | RaggedKV | None) -> mx.array:
    """x [B, S, ...] of a pass over `cache` -> [B, 1, ...] each row's last real position (a `RaggedKV`'s rows end at
    their own lengths; otherwise every row at S)."""
    return cache.last(x) if isinstance(cache, RaggedKV) else x[:, -1:]


LayerCache = KVCache | GDNCache


class ModelCache(list):
    """A model's caches, one per backbone layer (`backbone`, in layer order) then one per MTP layer (`mtp`).

    Still a list in that order, so evaluation, snapshots and the cache files keep their layout; code that means one
    part names it instead of slicing at the number of layers."""

    def __init__(self, backbone: list[LayerCache] = (), mtp: list[KVCache] = ()) -> None:
        super().__init__([*backbone, *mtp])
        self.n_backbone = len(backbone)

    @property
    def backbone(self) -> list[LayerCache]:
        return self[: self.n_backbone]

    @property
    def mtp(self) -> list[KVCache]:
        return self[self.n_backbone :]


def cache_arrays(cache: list[LayerCache]) -> list[mx.array]:
    """Every array the caches hold, e.g. to `mx.eval` them after a step."""
    return [a for c in cache for a in c.state]


def expect_positions(cache: list[LayerCache], n: int) -> None:
    """Before a prefill that fills the caches up to n positions: every attention cache allocates room for them
    once, plus one step for the first decoded tokens (`KVCache.expect`)."""
    for c in cache:
        if isinstance(c, KVCache):
            c.expect(n + KVCache.step)
