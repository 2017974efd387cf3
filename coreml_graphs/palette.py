"""Weights as per-group lookup tables (Core ML's iOS 18 `constexpr_lut_to_dense`): MLX's affine quantization,
exactly.

MLX stores a quantized matrix per group of `group` input channels as w = scale * q + bias with q in [0, 2^bits).
A group's 2^bits possible weights are therefore a table: lut[row, group, k] = fp16(scale * k + bias), and the
matrix is `lut[row, col // group, q[row, col]]`. The exporter has MLX compute the entries (hetero/export.py:
`mx.dequantize` of `table_indices` with the matrix's scales and biases), so they are MLX's values bit for bit.
Core ML's LUT op is a gather, so the ANE's fp16 weights are those table entries whatever arithmetic its
decompression uses: each equals MLX's dequantized weight rounded once to fp16. Blockwise shift-scale (`scale * (q - offset)`) would need offset = -bias / scale in fp16, which holds for
only about 72% of 4-bit groups and 6% of 8-bit ones (docs/coreml.md, measured), so it is not used.

A table costs 2^bits fp16 entries per group beside the packed indices: fewer bytes than fp16 weights only for
2, 3 and 4 bits (`lut_bytes_per_weight`); other checkpoints are exported as fp16, which is exact too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

LUT_BITS = (1, 2, 3, 4)  # index widths Core ML has whose per-group table (group >= 32) costs less than fp16


def lut_bytes_per_weight(bits: int, group: int) -> float:
    """Bytes per weight of a per-group table: the index (`bits` / 8) plus the group's 2^bits fp16 entries."""
    return bits / 8 + 2 * 2**bits / group


@dataclass(frozen=True)
class Palettized:
    """A weight [rows, cols] stored as indices and per-block tables: w[r, c] = lut[r, c // block, indices[r, c]].

    `block` is MLX's group size, or a divisor of it where a column slice starts inside a group (the group's
    table is then repeated per block: the same values, more table bytes).
    """

    indices: np.ndarray  # [rows, cols] uint8, each < 2**bits
    lut: np.ndarray  # [rows, cols // block, 2**bits] fp16
    bits: int

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
            out = Palettized(out.indices[rows], out.lut[rows], out.bits)
        if not (isinstance(cols, slice) and cols == slice(None)):
            out = out._columns(*cols.indices(out.shape[1])[:2])
        return out

    def _columns(self, start: int, stop: int) -> Palettized:
        """Columns [start, stop), re-blocked where the range cuts a block (the tables repeat, exactly)."""
        block = math.gcd(self.block, start, stop - start)
        lut = np.repeat(self.lut, self.block // block, axis=1) if block != self.block else self.lut
        return Palettized(self.indices[:, start:stop], lut[:, start // block : stop // block], self.bits)


def concat_columns(parts: list[Palettized]) -> Palettized:
    """Column blocks side by side (each re-blocked to the block all share: the tables repeat, exactly)."""
    block = math.gcd(*(p.block for p in parts))
    luts = [np.repeat(p.lut, p.block // block, axis=1) for p in parts]
    return Palettized(np.concatenate([p.indices for p in parts], 1), np.concatenate(luts, 1), parts[0].bits)


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
