"""Multimodal RoPE (transformers' interleaved mrope of Qwen3.5): each rotary frequency turns by one of three
position streams, time, height or width. Frequency j takes height where j % 3 == 1 and j < 3 * section[1], width
where j % 3 == 2 and j < 3 * section[2], time elsewhere. Text tokens carry one position in all three streams, so
for them this is the plain partial NeoX RoPE that `nn.RoPE` applies; image tokens carry (t, row, column)."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from hetero.models.rope import Rotary


def frequency_streams(rotary_dims: int, section: Sequence[int]) -> np.ndarray:
    """[rotary_dims / 2] stream index (0 time, 1 height, 2 width) per rotary frequency."""
    j = np.arange(rotary_dims // 2)
    streams = np.zeros_like(j)
    streams[(j % 3 == 1) & (j < 3 * section[1])] = 1
    streams[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return streams


def apply_mrope(x: mx.array, positions: mx.array, rotary: Rotary, section: Sequence[int]) -> mx.array:
    """x [B, H, S, D] with positions [3, S] (time, height, width) -> x with its first `rotary.dims` dims rotated by
    the model's frequencies (`hetero.models.rope.Rotary`, scaled ones included)."""
    rotary_dims = rotary.dims
    half = rotary_dims // 2
    streams = mx.array(frequency_streams(rotary_dims, section))
    pos = positions.astype(mx.float32)[streams, :]  # [half, S]: each frequency's own stream
    cos, sin = rotary.angles(pos)  # [S, half] each
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:rotary_dims], x[..., rotary_dims:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def frequency_positions(positions: np.ndarray, rotary_dims: int, section: Sequence[int], length: int) -> np.ndarray:
    """[rotary_dims / 2, length] float32: each rotary frequency's position (its stream's) for positions [3, S],
    S <= length; the padding after them counts on from the largest position (rows nobody reads, kept finite)."""
    S = positions.shape[1]
    pad = int(positions.max(initial=-1)) + 1 + np.arange(length - S)  # [length - S]
    full = np.concatenate([positions, np.broadcast_to(pad, (3, length - S))], axis=1)  # [3, length]
    return full[frequency_streams(rotary_dims, section)].astype(np.float32)  # [R/2, length]
