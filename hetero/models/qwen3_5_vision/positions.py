"""Where each patch sits: its (row, col) in the image grid, in the spatial-merge-block order the processor emits,
the learned position table resampled (bilinear, corners aligned) to that grid, and the 2-D rotary angles."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def patch_rows_cols(grid_h: int, grid_w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of every patch, [h*w] each, block-major: merge x merge blocks in raster order, raster inside."""
    rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")  # [h, w]
    block = (grid_h // merge, merge, grid_w // merge, merge)
    return rows.reshape(block).transpose(0, 2, 1, 3).ravel(), cols.reshape(block).transpose(0, 2, 1, 3).ravel()


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (floor, floor+1, clamped) into a `side`-long table and their weights, align_corners=True."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))  # [n]
    floor = np.floor(src)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)  # [n, 2]
    weights = np.clip(1.0 - np.abs(src[:, None] - floor[:, None] - np.arange(2)), 0.0, None)  # [n, 2]
    return taps, weights.astype(np.float32)


def interpolation(grid_h: int, grid_w: int, merge: int, num_positions: int) -> tuple[mx.array, mx.array]:
    """Indices [h*w, 4] into the flattened square position table and their bilinear weights [h*w, 4]."""
    side = int(num_positions**0.5)
    rows, cols = patch_rows_cols(grid_h, grid_w, merge)
    h_taps, h_w = _axis_taps(rows, grid_h, side)
    w_taps, w_w = _axis_taps(cols, grid_w, side)
    idx = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    return mx.array(idx.astype(np.int32)), mx.array(weights)


def rotary_angles(grid_h: int, grid_w: int, merge: int, head_dim: int, theta: float) -> mx.array:
    """Angles [h*w, head_dim / 2]: a quarter of the head rotates by the row, a quarter by the column."""
    quarter = np.arange(0, head_dim // 2, 2, dtype=np.float32) / np.float32(head_dim // 2)
    inv_freq = (1.0 / (theta**quarter)).astype(np.float32)  # [head_dim / 4]
    rows, cols = patch_rows_cols(grid_h, grid_w, merge)
    angles = np.concatenate([rows[:, None] * inv_freq, cols[:, None] * inv_freq], axis=-1)
    return mx.array(angles.astype(np.float32))
