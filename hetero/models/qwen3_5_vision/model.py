"""The vision tower: patches -> patch embedding + resampled learned positions -> blocks (2-D rotary) -> merger,
and its weights from transformers' layout (`model.visual.*`) or mlx-vlm's (`vision_tower.*`, channels-last conv)."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from hetero.errors import HeteroError
from hetero.models.qwen3_5_vision.args import VisionArgs
from hetero.models.qwen3_5_vision.blocks import VisionBlock
from hetero.models.qwen3_5_vision.merger import PatchMerger
from hetero.models.qwen3_5_vision.patch_embed import PatchEmbed
from hetero.models.qwen3_5_vision.positions import interpolation, rotary_angles

VISION_PREFIXES = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.", "model.language_model.visual.")


class VisionModel(nn.Module):
    """`Qwen3_5VisionModel`: flattened patches of one or more images -> one embedding per merged patch block."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.hidden_size)
        self.blocks = [VisionBlock(args) for _ in range(args.depth)]
        self.merger = PatchMerger(args)

    def encode(self, patches: mx.array, grid: tuple[int, int, int]) -> mx.array:
        """One image (or clip): patches [t*h*w, patch_dim] in the processor's order -> [t*h*w / merge^2, out]."""
        a = self.args
        t, h, w = grid
        idx, weights = interpolation(h, w, a.spatial_merge_size, a.num_position_embeddings)  # [h*w, 4] each
        pos = (self.pos_embed.weight[idx] * weights[:, :, None]).sum(axis=1)  # [h*w, D]
        dtype = self.pos_embed.weight.dtype
        x = self.patch_embed(patches.astype(dtype)) + mx.tile(pos.astype(dtype), (t, 1))  # [t*h*w, D]
        angles = rotary_angles(h, w, a.spatial_merge_size, a.head_dim, a.rope_theta)  # [h*w, Dh/2]
        angles = mx.tile(mx.concatenate([angles, angles], axis=-1), (t, 1))[:, None, :]  # [t*h*w, 1, Dh]
        cos, sin = mx.cos(angles), mx.sin(angles)
        for block in self.blocks:
            x = block(x, cos, sin, frames=t)
        return self.merger(x)

    def __call__(self, pixel_values: mx.array, grids: Sequence[Sequence[int]]) -> mx.array:
        """pixel_values [sum t*h*w, patch_dim] for the images in `grids` ((t, h, w) each, in patches) ->
        [sum t*h*w / merge^2, out_hidden_size], the images' embeddings one after the other."""
        out, start = [], 0
        for t, h, w in grids:  # images never attend to each other: encode them one by one
            n = int(t) * int(h) * int(w)
            out.append(self.encode(pixel_values[start : start + n], (int(t), int(h), int(w))))
            start += n
        if start != pixel_values.shape[0]:
            raise HeteroError(f"{pixel_values.shape[0]} patches given for grids that hold {start}")
        return mx.concatenate(out, axis=0)


def vision_name(key: str) -> str | None:
    """A checkpoint tensor name -> the tower's parameter name, or None for tensors that are not the tower's."""
    for prefix in VISION_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return None


def sanitize(args: VisionArgs, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The tower's tensors of a checkpoint under the tower's names, the patch embedding in transformers' Conv3d
    layout [D, C, T, P, P] (mlx-vlm stores it channels-last, [D, T, P, P, C])."""
    out = {}
    for key, value in weights.items():
        name = vision_name(key)
        if name is None or name.endswith("position_ids"):
            continue
        if name == "patch_embed.proj.weight":
            c, t, p = args.in_channels, args.temporal_patch_size, args.patch_size
            if tuple(value.shape[1:]) == (t, p, p, c) and tuple(value.shape[1:]) != (c, t, p, p):
                value = value.transpose(0, 4, 1, 2, 3)  # channels-last -> [D, C, T, P, P]
        out[name] = value
    return out


def load_vision(args: VisionArgs, weights: dict[str, mx.array], dtype: mx.Dtype = mx.float32) -> VisionModel:
    """A tower with the checkpoint's weights (every parameter required, none left over), cast to `dtype`."""
    tower = VisionModel(args)
    params = {k: v.astype(dtype) for k, v in sanitize(args, weights).items()}
    try:
        tower.load_weights(list(params.items()), strict=True)
    except ValueError as e:
        raise HeteroError(f"the checkpoint's vision tower does not match its vision_config: {e}") from None
    mx.eval(tower.parameters())
    return tower
