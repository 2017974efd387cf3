"""Weights as per-group lookup tables (Core ML's iOS 18 `constexpr_lut_to_dense`): MLX's affine quantization,
exactly.

MLX stores a quantized matrix per group of `group` input channels as w = scale * q + bias with q in [0, 2^bits).
A group's 2^bits possible weights are therefore a table: lut[row, group, k] = fp16(scale * k + bias), and the
matrix is `lut[row, col // group, q[row, col]]`. The exporter has MLX compute the entries (hetero/coreml/export.py:
`mx.dequantize` of `table_indices` with the matrix's scales and biases), so they are MLX's values bit for bit.
Core ML's LUT op is a gather, so the ANE's fp16 weights are those table entries whatever arithmetic its
decompression uses: each equals MLX's dequantized weight rounded once to fp16.

The second exact form (`--ane-weights blockwise`): Core ML's iOS 18 `constexpr_blockwise_shift_scale`, w =
scale * (q - offset) per block. It equals MLX's w = scale * q + bias only where a group's scale is an fp16 number
and its bias an exact multiple of it by an fp16 offset (offset = -bias / scale) with every q - offset an fp16 number:
then q - offset is exact and scale * (q - offset) is one product of two fp16 numbers, rounded once to fp16,
whatever arithmetic (fp16 or fp32) computes it. A negative scale's zero would come out -0 where MLX has +0: those
groups store mirrored data (2^bits - 1 - q, the scale and offset mirrored too). `Palettized.affine` carries each
block's (scale, offset, mirrored), NaN where a group has none (`group_affine`); `shift_scale` gives the op's inputs
for a matrix only when every block has one and the result is the tables bit for bit. The op takes one block size
per matrix, so a matrix with any other group keeps its tables: under MLX's own quantizer about 71% of 4-bit groups
qualify and every 2-bit one (docs/coreml.md), so a real 4-bit matrix almost never does.

A table costs 2^bits fp16 entries per group beside the packed indices: fewer bytes than fp16 weights only for
2, 3 and 4 bits (`hetero.planner.slices.lut_bytes_per_weight`, which the planner prices the ANE's share by); other checkpoints are exported as fp16, which is exact too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

@dataclass(frozen=True)
class Palettized:
    """A weight [rows, cols] stored as indices and per-block tables: w[r, c] = lut[r, c // block, indices[r, c]].

    `block` is MLX's group size, or a divisor of it where a column slice starts inside a group (the group's
    table is then repeated per block: the same values, more table bytes).
    """

    indices: np.ndarray  # [rows, cols] uint8, each < 2**bits
    lut: np.ndarray  # [rows, cols // block, 2**bits] fp16
    bits: int
    # [rows, cols // block, 3] fp16: each block's (scale, offset, mirrored) for `constexpr_blockwise_shift_scale`
    # (`group_affine`, made by `with_affine`), NaN where the block has no exact one; None: tables only
    affine: np.ndarray | None = None
    # [rows, cols // block, 2] fp32: each block's MLX scale and bias as MLX applies them, from which `with_affine`
    # derives the shift-scale form (only then: the tables' export never pays for it); None: not known
    scale_bias: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.indices.shape

    @property
    def block(self) -> int:
        return self.indices.shape[1] // self.lut.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes as Core ML stores them: packed indices plus the fp16 tables."""
        return math.ceil(self.indices.size * self.bits / 8) + self.lut.nbytes

    def dense(self) -> np.ndarray:
        """The fp16 weight [rows, cols] the tables stand for."""
        rows, cols = self.shape
        grouped = self.indices.reshape(rows, cols // self.block, self.block).astype(np.intp)  # [rows, blocks, block]
        return np.take_along_axis(self.lut, grouped, axis=2).reshape(rows, cols)

    def __getitem__(self, key) -> Palettized:
        """Rows (`w[a:b]`, `w[index_array]`) or a column range (`w[:, a:b]`), as numpy would slice the dense weight."""
        rows, cols = key if isinstance(key, tuple) else (key, slice(None))
        out = self
        if not (isinstance(rows, slice) and rows == slice(None)):
            affine, sb = (None if a is None else a[rows] for a in (out.affine, out.scale_bias))
            out = Palettized(out.indices[rows], out.lut[rows], out.bits, affine, sb)
        if not (isinstance(cols, slice) and cols == slice(None)):
            out = out._columns(*cols.indices(out.shape[1])[:2])
        return out

    def _columns(self, start: int, stop: int) -> Palettized:
        """Columns [start, stop), re-blocked where the range cuts a block (the tables repeat, exactly)."""
        block = math.gcd(self.block, start, stop - start)
        cut = slice(start // block, stop // block)
        lut, affine, sb = (np.repeat(a, self.block // block, axis=1)[:, cut] if a is not None else None
                           for a in (self.lut, self.affine, self.scale_bias))
        return Palettized(self.indices[:, start:stop], lut, self.bits, affine, sb)

    def without_affine(self) -> Palettized:
        """The same matrix as tables only."""
        return Palettized(self.indices, self.lut, self.bits)

    def with_affine(self) -> Palettized:
        """The same matrix carrying each block's exact shift-scale form (`group_affine`), where its scales and
        biases are known."""
        if self.affine is not None or self.scale_bias is None:
            return self
        affine = group_affine(self.lut, self.scale_bias[..., 0], self.scale_bias[..., 1])
        return Palettized(self.indices, self.lut, self.bits, affine)

    def may_shift_scale(self) -> bool:
        """Whether the matrix can have a shift-scale form at all: every block passes `group_affine`'s cheap tests
        (on its scale and bias alone), or its form is already known; False is certain, True is checked by
        `with_affine().shift_scale()`."""
        if self.affine is not None:
            return bool(np.isfinite(self.affine).all())
        if self.scale_bias is None:
            return False
        return bool(_candidates(self.scale_bias[..., 0], self.scale_bias[..., 1])[0].all())

    def shift_scale(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(data [rows, cols] uint8, scale [rows, blocks] fp16, offset [rows, blocks] fp16) for
        `constexpr_blockwise_shift_scale` when every block has an exact (scale, offset) (`group_affine`; a mirrored
        block's data is 2^bits - 1 - index) and scale * (data - offset), rounded once to fp16, is the tables' dense
        weight bit for bit (signed zeros included); else None. Worked out once per matrix."""
        return self._shift_scale

    @cached_property
    def _shift_scale(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        if self.affine is None or not np.isfinite(self.affine).all():
            return None
        scale, offset, mirrored = self.affine[..., 0], self.affine[..., 1], self.affine[..., 2] != 0
        flip = np.repeat(mirrored, self.block, axis=1)  # [rows, cols]
        data = np.where(flip, 2**self.bits - 1 - self.indices.astype(np.int16), self.indices).astype(np.uint8)
        if shift_scale_dense(data, scale, offset).view(np.uint16).tobytes() != self.dense().view(np.uint16).tobytes():
            return None
        return data, scale, offset

    def shift_scale_nbytes(self) -> int:
        """Bytes as `constexpr_blockwise_shift_scale` stores the matrix: uint4 (bits <= 4) or uint8 data, an fp16
        scale and offset per block."""
        width = 4 if self.bits <= 4 else 8
        return math.ceil(self.indices.size * width / 8) + 2 * self.lut.shape[0] * self.lut.shape[1] * 2


def shift_scale_dense(data: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """scale * (data - offset) per block of data [rows, cols] (scale, offset [rows, blocks]): data - offset exact
    (`group_affine` keeps only offsets for which it is an fp16 number), each product exact in fp32 (two 11-bit
    significands) and rounded once to fp16."""
    rows, cols = data.shape
    block = cols // scale.shape[1]
    q = data.reshape(rows, -1, block).astype(np.float32)  # [rows, blocks, block]
    out = (q - offset.astype(np.float32)[..., None]) * scale.astype(np.float32)[..., None]
    return out.reshape(rows, cols).astype(np.float16)


def group_affine(lut: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> np.ndarray:
    """[rows, groups, 3] fp16: each group's (scale, offset, mirrored) for scale * (data - offset) where that is the
    group's table `lut` [rows, groups, 2^bits] bit for bit; NaN where the group has none. `scales`, `biases`
    [rows, groups] as MLX applies them (fp32): w = scale * k + bias for index k.

    The offset is -bias / scale, kept where it and the scale are fp16 numbers, bias = -offset * scale exactly and
    every k - offset is an fp16 number (so any arithmetic of at least fp16's precision computes it exactly); then
    each product is exact in fp32 and rounded once. A zero weight is +0 in MLX (s * k + b = +0), but a negative
    scale times (k - offset) = 0 is -0: such a group is stored `mirrored`, data = 2^bits - 1 - k with the scale and
    the offset negated and mirrored too (the same products, a positive scale's zero)."""
    top = lut.shape[-1] - 1  # 2^bits - 1
    s = np.asarray(scales, np.float64)
    ok, offset = _candidates(scales, biases)
    found = np.full(s.shape + (3,), np.nan)
    for mirrored in (True, False):  # mirrored first: it gives a negative scale's zeros MLX's sign
        sc, off = (-s, top - offset) if mirrored else (s, offset)
        good = ok & (off.astype(np.float16).astype(np.float64) == off)
        k = np.arange(top + 1, dtype=np.float32)  # [2^bits]: the data value that stands for index k
        data = top - k if mirrored else k
        shifted = data - np.where(good, off, 0).astype(np.float32)[..., None]  # [rows, groups, 2^bits], exact
        good &= (shifted.astype(np.float16).astype(np.float32) == shifted).all(axis=-1)
        table = (shifted * sc.astype(np.float32)[..., None]).astype(np.float16)  # products exact, rounded once
        good &= (table.view(np.uint16) == np.asarray(lut, np.float16).view(np.uint16)).all(axis=-1)
        good &= np.isnan(found[..., 0])
        found[good] = np.stack([sc, off, np.full(s.shape, float(mirrored))], axis=-1)[good]
    return found.astype(np.float16)


def _candidates(scales: np.ndarray, biases: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(which groups pass the tests on scale and bias alone: both the scale and offset = -bias / scale fp16
    numbers, the division exact; their offsets, 0 elsewhere), all [rows, groups]."""
    s, b = np.asarray(scales, np.float64), np.asarray(biases, np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        offset = -b / s
        ok = (s != 0) & np.isfinite(offset) & (-offset * s == b)  # the division was exact
        ok &= (s.astype(np.float16).astype(np.float64) == s) & (offset.astype(np.float16).astype(np.float64) == offset)
    return ok, np.where(ok, offset, 0.0)


def concat_columns(parts: list[Palettized]) -> Palettized:
    """Column blocks side by side (each re-blocked to the block all share: the tables repeat, exactly)."""
    block = math.gcd(*(p.block for p in parts))
    luts = [np.repeat(p.lut, p.block // block, axis=1) for p in parts]
    extra = [None if any(getattr(p, name) is None for p in parts) else
             np.concatenate([np.repeat(getattr(p, name), p.block // block, axis=1) for p in parts], 1)
             for name in ("affine", "scale_bias")]
    return Palettized(np.concatenate([p.indices for p in parts], 1), np.concatenate(luts, 1), parts[0].bits, *extra)


def unpack(packed: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """MLX's packed quantized weight [rows, cols * bits / 32] (uint32) -> indices [rows, cols] uint8.

    MLX packs a row's values as one little-endian bit stream (value j in bits [j * bits, (j + 1) * bits)).
    """
    words = np.ascontiguousarray(packed, dtype=np.uint32)
    rows = words.shape[0]
    if 32 % bits == 0:  # whole values per word: shifts, no bit stream
        shifts = np.arange(0, 32, bits, dtype=np.uint32)  # [32 / bits]
        q = (words[:, :, None] >> shifts) & np.uint32(2**bits - 1)  # [rows, words, 32 / bits]
        return q.reshape(rows, -1)[:, :cols].astype(np.uint8)
    stream = np.unpackbits(words.view(np.uint8).reshape(rows, -1), axis=1, bitorder="little")  # [rows, bits]
    stream = stream[:, : cols * bits].reshape(rows, cols, bits)
    return (stream.astype(np.uint16) << np.arange(bits, dtype=np.uint16)).sum(axis=2).astype(np.uint8)


def pack(indices: np.ndarray, bits: int) -> np.ndarray:
    """indices [rows, cols] (each < 2**bits) -> MLX's packed layout [rows, cols * bits / 32] uint32 (`unpack`'s
    inverse)."""
    rows, cols = indices.shape
    stream = ((indices[:, :, None].astype(np.uint16) >> np.arange(bits, dtype=np.uint16)) & 1).astype(np.uint8)
    packed = np.packbits(stream.reshape(rows, cols * bits), axis=1, bitorder="little")  # [rows, bytes]
    return np.ascontiguousarray(packed).view(np.uint32)


def table_indices(bits: int, group: int) -> np.ndarray:
    """One group's worth of indices [1, group] that lists every table entry first: 0, 1, ..., 2^bits - 1, then 0s.

    Dequantized with a matrix's scales and biases (MLX's own arithmetic), it yields that matrix's tables."""
    if 2**bits > group:
        raise ValueError(f"a {bits}-bit table has {2**bits} entries, more than a group of {group}")
    k = np.zeros((1, group), np.uint8)
    k[0, : 2**bits] = np.arange(2**bits)
    return k
