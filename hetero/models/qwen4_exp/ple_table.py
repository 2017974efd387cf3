"""A PLE n-gram table read where it lies: the checkpoint's safetensors files, memory-mapped.

At full size a Flash-Next checkpoint's tables hold about 45-51B parameters, more than a Mac's RAM in bf16, and a
chunk reads only the rows its n-grams hash to (tokens x heads of them). So the tables are never loaded: each
layer's shards (`...ngram_embedding.shard_{i}.weight`, rows in order) stay in their files, mapped read-only, and
`DiskTable` gathers the rows a chunk asks for. The OS pages in what is read and may drop it again; the memory
governor counts the tables as on disk, not as weights.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from hetero.errors import HeteroError

# safetensors dtype -> how its bytes are read (bf16 as its 16 bits, reinterpreted in MLX; U32: packed quantized rows)
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32}


@dataclass(frozen=True)
class StoredRows:
    """One block of a table's rows in a file: `shape` [rows, width] of `dtype` at byte `offset`."""

    file: Path
    dtype: str
    shape: tuple[int, int]
    offset: int


class DiskTable:
    """A [rows, width] table made of row blocks stored in files; `table(rows)` gathers rows into an mx.array."""

    def __init__(self, blocks: Sequence[StoredRows]):
        if not blocks:
            raise ValueError("a DiskTable needs at least one block of rows")
        dtypes, widths = {b.dtype for b in blocks}, {b.shape[1] for b in blocks}
        if len(dtypes) != 1 or len(widths) != 1 or next(iter(dtypes)) not in _DTYPES:
            raise HeteroError(f"PLE table blocks in {blocks[0].file.name} must share one float dtype (F32, F16, BF16; "
                              f"U32 packed when quantized) and width; found {sorted(dtypes)} and widths {sorted(widths)}")
        self.dtype, self.width = dtypes.pop(), widths.pop()
        maps = {file: _map(file) for file in {b.file for b in blocks}}
        np_dtype = _DTYPES[self.dtype]
        self._blocks = [np.frombuffer(maps[b.file], np_dtype, count=b.shape[0] * b.shape[1],
                                      offset=b.offset).reshape(b.shape) for b in blocks]
        self._starts = np.cumsum([0] + [b.shape[0] for b in blocks])  # [blocks + 1] first row of each block
        self.rows = int(self._starts[-1])
        self.nbytes = self.rows * self.width * np.dtype(np_dtype).itemsize

    def __call__(self, rows: np.ndarray) -> mx.array:
        """rows [...] (int, 0 <= row < self.rows) -> [..., width] in the stored dtype."""
        flat = np.asarray(rows, np.int64).reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.rows):
            raise IndexError(f"PLE row out of range 0..{self.rows - 1}")
        block = np.searchsorted(self._starts, flat, side="right") - 1  # [N] the block each row lies in
        out = np.empty((flat.size, self.width), self._blocks[0].dtype)
        for b in np.unique(block):
            picked = block == b
            out[picked] = self._blocks[b][flat[picked] - self._starts[b]]
        gathered = mx.array(out)
        if self.dtype == "BF16":
            gathered = gathered.view(mx.bfloat16)
        return gathered.reshape(*np.shape(rows), self.width)


class QuantizedDiskTable:
    """A table stored affine-quantized, as mlx-vlm's `convert -q` writes PLE shards: packed `weight` rows
    [rows, width * bits / 32] (U32) with `scales` and `biases` [rows, width / group_size]. `table(rows)` gathers the
    packed rows a chunk asks for and dequantizes only those, exactly as the stored values say."""

    def __init__(self, weight: DiskTable, scales: DiskTable, biases: DiskTable, bits: int, group_size: int):
        self.rows, self.width = weight.rows, weight.width * 32 // bits
        if weight.dtype != "U32" or {scales.rows, biases.rows} != {self.rows} or \
                {scales.width, biases.width} != {self.width // group_size}:
            raise HeteroError(f"a quantized PLE table's packed rows ({weight.dtype}, {weight.rows} x {weight.width}), "
                              f"scales ({scales.rows} x {scales.width}) and biases ({biases.rows} x {biases.width}) do "
                              f"not fit {bits}-bit groups of {group_size}: the checkpoint does not match its config.json")
        self.weight, self.scales, self.biases = weight, scales, biases
        self.bits, self.group_size = bits, group_size
        self.nbytes = weight.nbytes + scales.nbytes + biases.nbytes

    def __call__(self, rows: np.ndarray) -> mx.array:
        """rows [...] -> [..., width] in the scales' dtype."""
        flat = np.asarray(rows, np.int64).reshape(-1)  # [N]
        values = mx.dequantize(self.weight(flat), self.scales(flat), self.biases(flat),
                               group_size=self.group_size, bits=self.bits)  # [N, width]
        return values.reshape(*np.shape(rows), self.width)


def _map(file: Path) -> mmap.mmap:
    try:
        with open(file, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise HeteroError(f"cannot map {file} for its PLE table: {e.strerror}; re-download it") from None
