"""The vision tower run program by program (patch embedding, each block, merger) from an export directory
(`hetero.coreml.export_vision`), with the reference executor here or any runner that takes the same inputs.

The host builds what depends on the images' grids and not on weights the programs hold: the learned position
table resampled to each grid (a gather), the 2-D rotary tables and the attention mask (one window per frame of each
image; padding in windows of its own), then packs the images' patches into the bucket, padded with zeros.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from hetero.coreml.backends.reference_executor import ReferenceExecutor
from hetero.coreml.manifest import read_vision_manifest
from hetero.errors import HeteroError
from hetero.models.qwen3_5_vision.args import VisionArgs
from hetero.models.qwen3_5_vision.positions import interpolation, rotary_angles


def grid_inputs(args: VisionArgs, pos_table: np.ndarray, grids: Sequence[Sequence[int]],
                bucket: int) -> dict[str, np.ndarray]:
    """The programs' grid-dependent inputs for images `grids` ((t, h, w) each) packed from patch 0 of a bucket:
    `pos` (1, D, 1, S) for the patch embedding, `cos`, `sin` (1, 1, Dh/2, S) and `mask` (1, 1, S, S) for the blocks.
    `pos_table` [num_position_embeddings, D] fp32 is the tower's learned table."""
    # the graphs import coremltools (4-8 s): the worker process loads it with its first vision program only
    from hetero.coreml.graphs.ops import fp16
    from hetero.coreml.graphs.vision import rotary_tables, window_mask

    pos, angles, windows = [], [], []
    for t, h, w in grids:
        idx, weights = interpolation(h, w, args.spatial_merge_size, args.num_position_embeddings)  # [h*w, 4] each
        grid_pos = (pos_table[np.array(idx)] * np.array(weights)[:, :, None]).sum(axis=1)  # [h*w, D]
        grid_angles = np.array(rotary_angles(h, w, args.spatial_merge_size, args.head_dim, args.rope_theta))
        pos.append(np.tile(grid_pos, (t, 1)))
        angles.append(np.tile(grid_angles, (t, 1)))  # [t*h*w, Dh/2]
        windows += [h * w] * t  # each frame attends only to itself
    n = sum(windows)
    if n > bucket:
        raise HeteroError(f"{n} patches do not fit the vision bucket of {bucket}: export a larger bucket")
    pos_bc1s = np.zeros((1, args.hidden_size, 1, bucket), np.float16)
    pos_bc1s[0, :, 0, :n] = fp16(np.concatenate(pos)).T
    return {"pos": pos_bc1s, **rotary_tables(np.concatenate(angles), bucket), "mask": window_mask(windows, bucket)}


def pack_patches(pixel_values: np.ndarray, bucket: int) -> np.ndarray:
    """Patches [n, P] -> (1, P, 1, S) fp16, zero-padded."""
    n, p = pixel_values.shape
    out = np.zeros((1, p, 1, bucket), np.float16)
    out[0, :, 0, :n] = np.asarray(pixel_values, np.float32).T
    return out


class VisionPrograms:
    """The exported tower at one bucket: `run(pixel_values, grids)` gives the images' embeddings, as the MLX tower's
    `__call__`. `runner(path)` makes a callable program from a package (default: the reference executor)."""

    def __init__(self, directory: str | os.PathLike, bucket: int, args: VisionArgs, pos_table: np.ndarray,
                 runner: Callable[[Path], Callable[[dict], dict]] | None = None):
        directory = Path(directory)
        entries = [p for p in read_vision_manifest(directory)["programs"] if p["bucket"] == bucket]
        if not entries:
            raise HeteroError(f"{directory}: no vision programs for a bucket of {bucket} patches")
        make = runner or ReferenceExecutor
        self.pieces = [(p["piece"], make(directory / p["file"])) for p in entries]  # run order
        self.bucket, self.args = bucket, args
        self.pos_table = np.asarray(pos_table, np.float32)

    def run(self, pixel_values: np.ndarray, grids: Sequence[Sequence[int]]) -> np.ndarray:
        """pixel_values [sum t*h*w, patch_dim] -> [sum t*h*w / merge^2, out_hidden] (fp16 values in fp32)."""
        grids = [tuple(int(d) for d in g) for g in grids]
        n = sum(t * h * w for t, h, w in grids)
        if n != pixel_values.shape[0]:
            raise HeteroError(f"{pixel_values.shape[0]} patches given for grids that hold {n}")
        inputs = grid_inputs(self.args, self.pos_table, grids, self.bucket)
        x = None
        for piece, program in self.pieces:
            if piece == "patch_embed":
                x = program({"patches": pack_patches(pixel_values, self.bucket), "pos": inputs["pos"]})["x"]
            elif piece == "merger":
                out = program({"x": x})["out"]  # (1, O, 1, S / m)
                return out[0, :, 0, : n // self.args.merge_unit].T
            else:
                x = program({"x": x, "cos": inputs["cos"], "sin": inputs["sin"], "mask": inputs["mask"]})["x_out"]
        raise HeteroError("the vision export has no merger program")  # a manifest lists one per bucket
