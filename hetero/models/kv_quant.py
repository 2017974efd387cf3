"""Quantized KV (`--kv-bits 8|4`, `--kv-group-size`): the attention layers' keys and values stored as MLX affine
quantization (`mx.quantize`, groups along head_dim), read back dequantized.

Attention itself is unchanged: it runs the same math over the dequantized K/V, so the only difference from a full
precision cache is the rounding of each stored value (one scale and one bias per group of `group_size` values of one
head at one position). The GDN layers' conv window and recurrent state stay as they are (fp32 state): rounding
there would compound over the whole context.

Every position is quantized on its own (groups never span positions), so writes stay indexed by position: a
speculative rejection rolls back with `trim_to` exactly as in `KVCache`, and a checkpoint's rows are the stored
(packed, scales, biases) arrays themselves, restored bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from hetero.errors import HeteroError
from hetero.models.cache import KVCache
from hetero.models.compiled import PerThread

KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)  # the group sizes `mx.quantize` takes
DEFAULT_GROUP_SIZE = 64


@dataclass(frozen=True)
class KVQuant:
    """How the attention layers' KV is stored: `bits` per value, one fp scale and bias per `group_size` values."""

    bits: int
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.bits not in KV_BITS:
            raise HeteroError(f"--kv-bits {self.bits}: choose 8 or 4 (or leave it out for full-precision KV)")
        if self.group_size not in KV_GROUP_SIZES:
            raise HeteroError(f"--kv-group-size {self.group_size}: choose 32, 64 or 128")

    def check(self, head_dim: int) -> None:
        """HeteroError unless the group size divides the model's head_dim (groups run along it)."""
        if head_dim % self.group_size:
            fits = [g for g in KV_GROUP_SIZES if head_dim % g == 0]
            raise HeteroError(f"--kv-group-size {self.group_size} does not divide the model's head_dim {head_dim}; "
                              f"choose {' or '.join(map(str, fits)) if fits else 'full-precision KV'}")

    def element_bytes(self, dtype_bytes: int) -> float:
        """Bytes per stored K or V value: the packed bits plus a scale and a bias (in the `dtype_bytes` compute
        dtype) shared by each group."""
        return self.bits / 8 + 2 * dtype_bytes / self.group_size

    @property
    def label(self) -> str:
        return f"{self.bits}-bit KV, groups of {self.group_size}"

    @property
    def key(self) -> str:
        """What cache keys carry, so a quantized entry never restores into another setting."""
        return f"kv{self.bits}g{self.group_size}"


def kv_quant(bits: int | None, group_size: int | None = None) -> KVQuant | None:
    """The setting of `--kv-bits` / `--kv-group-size` (None: full-precision KV; a group size alone is an error)."""
    if bits is None:
        if group_size is not None:
            raise HeteroError(f"--kv-group-size {group_size} needs --kv-bits 8 or 4")
        return None
    return KVQuant(bits, DEFAULT_GROUP_SIZE if group_size is None else group_size)


# `code * scale + bias` as one fused elementwise loop over the cache (any length: shapeless), from its bytes:
# 8 bits: codes [..., G, group] bytes; 4 bits: bytes [..., G, group/2, 1] whose low then high nibble are the codes
_SCALE8 = PerThread(lambda codes, s, b: codes.astype(s.dtype) * s + b, shapeless=True)
_SCALE4 = PerThread(lambda u, shifts, s, b: ((u >> shifts) & 15).astype(s.dtype) * s + b, shapeless=True)


def dequantize(packed: mx.array, scales: mx.array, biases: mx.array, quant: KVQuant) -> mx.array:
    """packed [..., D*bits/32] uint32, scales and biases [..., D/group] -> [..., D], equal to `mx.dequantize`.

    On MLX's CPU backend `mx.dequantize` runs one value at a time (20 ms per 16K-position layer of the bundled
    model's K at 8 bits, measured here, against 6.6 ms for this), so there the codes are read from the packed
    bytes (little-endian: the first code is the lowest byte or nibble) and scaled as `mx.dequantize` does,
    `code * scale + bias`, in one compiled elementwise loop: the same values bit for bit (tests/test_kv_quant.py).
    On Metal its own kernel is the fast way."""
    g = quant.group_size
    if mx.default_device() != mx.cpu:
        return mx.dequantize(packed, scales, biases, group_size=g, bits=quant.bits)
    *lead, groups = scales.shape
    u8 = mx.view(packed, mx.uint8)  # [..., D*bits/8]
    if quant.bits == 8:
        w = _SCALE8(u8.reshape(*lead, groups, g), scales[..., None], biases[..., None])  # [..., G, group]
    else:
        w = _SCALE4(u8.reshape(*lead, groups, g // 2, 1), mx.array([0, 4], mx.uint8), scales[..., None, None],
                    biases[..., None, None])  # [..., G, group/2, 2]
    return w.reshape(*lead, groups * g)


class QuantizedKVCache(KVCache):
    """A `KVCache` whose keys and values are each (packed uint32 [B, Hkv, cap, D*bits/32], scales [B, Hkv, cap,
    D/group], biases [B, Hkv, cap, D/group]); `update_and_fetch` returns the valid positions dequantized."""

    def __init__(self, quant: KVQuant) -> None:
        super().__init__()
        self.quant = quant
        self.keys: tuple[mx.array, mx.array, mx.array] | None = None
        self.values: tuple[mx.array, mx.array, mx.array] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Quantize `keys`/`values` [B, Hkv, S, D] into positions offset..offset+S; return all valid K/V
        [B, Hkv, offset+S, D] dequantized (in the dtype of `keys`)."""
        g, bits = self.quant.group_size, self.quant.bits
        B, H, S, D = keys.shape
        end = self.offset + S
        new_k = mx.quantize(keys, group_size=g, bits=bits)  # (packed, scales, biases), [B, Hkv, S, *] each
        new_v = mx.quantize(values, group_size=g, bits=bits)
        if self.keys is None or end > self.keys[0].shape[2]:
            capacity = ((max(end, self.expected) + self.step - 1) // self.step) * self.step
            grown = [mx.zeros((B, H, capacity, a.shape[3]), a.dtype) for a in (*new_k, *new_v)]
            if self.keys is not None and self.offset > 0:
                for buf, old in zip(grown, self.state):
                    buf[:, :, : self.offset] = old[:, :, : self.offset]
            self._set_buffers(grown)
        for buf, new in zip(self.state, (*new_k, *new_v)):
            buf[:, :, self.offset : end] = new
        self.offset = end
        return self.dequantized()

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """The valid K/V [B, Hkv, offset, D] as attention reads them."""
        return tuple(dequantize(*(a[:, :, : self.offset] for a in part), self.quant) for part in (self.keys, self.values))

    def layout(self, args, dtype: mx.Dtype) -> list[tuple[str, int, int, mx.Dtype]]:
        heads, head_dim = args.num_key_value_heads, args.head_dim
        packed, groups = head_dim * self.quant.bits // 32, head_dim // self.quant.group_size
        return [(f"{part}{suffix}", heads, dim, dt) for part in ("k", "v")
                for suffix, dim, dt in (("", packed, mx.uint32), (".scales", groups, dtype), (".biases", groups, dtype))]

    def like(self) -> QuantizedKVCache:
        return QuantizedKVCache(self.quant)

    def _set_buffers(self, arrays: list[mx.array]) -> None:
        self.keys, self.values = tuple(arrays[:3]), tuple(arrays[3:])

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [*self.keys, *self.values]


def use_kv_quant(model, quant: KVQuant | None) -> None:
    """Make `model.make_cache()` store attention KV as `quant` says (None: full precision); a model whose caches
    cannot (its architecture keeps other per-position state) or whose head_dim the groups do not divide: HeteroError."""
    if quant is None:
        if "kv_quant" in vars(model):
            del model.kv_quant
        return
    if not hasattr(type(model), "kv_quant"):
        raise HeteroError(f"--kv-bits: {type(model).__module__.split('.')[-2]} models keep full-precision KV only; "
                          "leave --kv-bits out")
    quant.check(model.args.head_dim)
    model.kv_quant = quant
