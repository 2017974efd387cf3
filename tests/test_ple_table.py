"""`DiskTable`: a table's rows gathered from row blocks memory-mapped in safetensors files (how Qwen4-Exp's PLE
n-gram tables are read), equal to the stored rows in every float dtype, across blocks and files; bad blocks and
rows refused."""

from __future__ import annotations

import hetero  # noqa: F401  (before mlx: the fast BLAS)
import mlx.core as mx
import numpy as np
import pytest

from hetero.checkpoint.safetensors import read_header
from hetero.errors import HeteroError
from hetero.models.qwen4_exp.ple_table import DiskTable, StoredRows


def write_blocks(tmp_path, dtype: mx.Dtype, sizes=((5, 3), (1, 4)), width: int = 6):
    """Row blocks of `sizes` per file ((rows per block, ...) per file); returns (blocks in order, the whole table
    as fp32)."""
    rng = np.random.default_rng(0)
    blocks, whole = [], []
    for f, rows in enumerate(sizes):
        arrays = {f"t.shard_{len(blocks) + j}.weight": mx.array(rng.standard_normal((n, width)).astype(np.float32))
                  .astype(dtype) for j, n in enumerate(rows)}
        file = tmp_path / f"part{f}.safetensors"
        mx.save_safetensors(str(file), arrays)
        header = read_header(file)
        for name in sorted(arrays, key=lambda k: int(k.split("_")[1].split(".")[0])):
            info = header[name]
            blocks.append(StoredRows(file, info.dtype, info.shape, info.offset))
            whole.append(np.array(arrays[name].astype(mx.float32)))
    return blocks, np.concatenate(whole)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_rows_are_the_stored_rows(tmp_path, dtype):
    blocks, whole = write_blocks(tmp_path, dtype)
    table = DiskTable(blocks)
    assert (table.rows, table.width) == whole.shape == (13, 6)
    rows = np.array([[0, 4, 5, 7, 8, 12], [12, 3, 9, 9, 0, 11]])  # every block, both files, repeats
    got = table(rows)
    assert got.dtype == dtype and got.shape == (2, 6, 6)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), whole[rows])
    assert table(np.zeros((1, 0), np.int64)).shape == (1, 0, 6)


def test_bad_blocks_and_rows_are_refused(tmp_path):
    blocks, _ = write_blocks(tmp_path, mx.float32)
    with pytest.raises(HeteroError, match="one float dtype"):
        DiskTable([blocks[0], StoredRows(blocks[1].file, "F16", blocks[1].shape, blocks[1].offset)])
    with pytest.raises(IndexError, match="out of range"):
        DiskTable(blocks)(np.array([13]))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_quantized_rows_are_the_stored_rows_dequantized(tmp_path, dtype):
    """`QuantizedDiskTable` over 4-bit affine shards (packed U32 rows, scales, biases; two shards in two files, as
    mlx-vlm's `convert -q` writes PLE tables): a gather equals MLX's own dequantization of the whole stored table."""
    from hetero.models.qwen4_exp.ple_table import QuantizedDiskTable

    rng = np.random.default_rng(1)
    parts = {kind: [] for kind in ("weight", "scales", "biases")}
    reference = []
    for f, n in enumerate((7, 5)):
        w, s, b = mx.quantize(mx.array(rng.standard_normal((n, 64)).astype(np.float32)).astype(dtype), 32, 4)
        file = tmp_path / f"q{f}.safetensors"
        mx.save_safetensors(str(file), {"weight": w, "scales": s, "biases": b})
        header = read_header(file)
        for kind in parts:
            parts[kind].append(StoredRows(file, header[kind].dtype, header[kind].shape, header[kind].offset))
        reference.append(mx.dequantize(w, s, b, group_size=32, bits=4))
    whole = np.array(mx.concatenate(reference).astype(mx.float32))  # [12, 64]
    table = QuantizedDiskTable(*(DiskTable(parts[k]) for k in ("weight", "scales", "biases")), bits=4, group_size=32)
    assert (table.rows, table.width) == whole.shape
    rows = np.array([[0, 6, 7, 11], [11, 3, 3, 8]])  # both shards, repeats
    got = table(rows)
    assert got.dtype == dtype and got.shape == (2, 4, 64)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), whole[rows])
    with pytest.raises(HeteroError, match="do not fit 8-bit groups of 32"):
        QuantizedDiskTable(*(DiskTable(parts[k]) for k in ("weight", "scales", "biases")), bits=8, group_size=32)
