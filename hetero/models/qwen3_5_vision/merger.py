"""Patch merger: LayerNorm per patch, then each merge x merge block of patches (adjacent in the processor's order)
concatenated and projected by a GELU MLP to the language model's width."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from hetero.models.activations import gelu
from hetero.models.qwen3_5_vision.args import VisionArgs


class PatchMerger(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        wide = args.hidden_size * args.merge_unit
        self.norm = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(wide, wide, bias=True)
        self.linear_fc2 = nn.Linear(wide, args.out_hidden_size, bias=True)
        self.wide = wide

    def __call__(self, x: mx.array) -> mx.array:
        x = self.norm(x).reshape(-1, self.wide)  # [N, D] -> [N / merge^2, D * merge^2]
        return self.linear_fc2(gelu(self.linear_fc1(x)))  # [N / merge^2, out_hidden]
