"""One vision block: pre-LayerNorm bidirectional attention with 2-D rotary positions, then a GELU MLP."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from hetero.models.activations import gelu, gelu_tanh
from hetero.models.qwen3_5_vision.args import VisionArgs

# mlx.nn's activations are compiled once for all threads (see activations.py): ours are plain functions
_ACTIVATIONS = {"gelu_pytorch_tanh": gelu_tanh, "gelu": gelu}


def apply_rotary(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """NeoX (rotate-half) rotation over the whole head: x [N, H, Dh], cos/sin [N, 1, Dh]."""
    half = x.shape[-1] // 2
    rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.num_heads = args.num_heads
        self.scale = args.head_dim**-0.5
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size, bias=True)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size, bias=True)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, frames: int) -> mx.array:
        n, d = x.shape  # [N, D], N = frames * patches per frame; each frame attends only to itself
        qkv = self.qkv(x).reshape(n, 3, self.num_heads, -1)  # [N, 3, H, Dh]
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # [N, H, Dh]
        q, k = apply_rotary(q, cos, sin).astype(x.dtype), apply_rotary(k, cos, sin).astype(x.dtype)  # angles in fp32
        per = lambda t: t.reshape(frames, n // frames, self.num_heads, -1).transpose(0, 2, 1, 3)  # noqa: E731
        out = mx.fast.scaled_dot_product_attention(per(q), per(k), per(v), scale=self.scale)  # [F, H, S, Dh]
        return self.proj(out.transpose(0, 2, 1, 3).reshape(n, d))


class MLP(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.linear_fc1 = nn.Linear(args.hidden_size, args.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=True)
        self.act = _ACTIVATIONS[args.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.attn = Attention(args)
        self.mlp = MLP(args)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, frames: int) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp(self.norm2(x))
