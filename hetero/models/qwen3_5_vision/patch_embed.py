"""Patch embedding: the Conv3d whose kernel equals its stride, as one matrix product over flattened patches."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from hetero.models.qwen3_5_vision.args import VisionArgs


class PatchEmbed(nn.Module):
    """`proj.weight` keeps transformers' Conv3d layout [D, C, T, P, P]; a patch arrives flattened in that order."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        t, p = args.temporal_patch_size, args.patch_size
        self.proj = nn.Module()
        self.proj.weight = mx.zeros((args.hidden_size, args.in_channels, t, p, p))
        self.proj.bias = mx.zeros((args.hidden_size,))

    def __call__(self, patches: mx.array) -> mx.array:
        w = self.proj.weight.reshape(self.proj.weight.shape[0], -1)  # [D, C*T*P*P]
        return patches @ w.T + self.proj.bias  # [N, C*T*P*P] -> [N, D]
