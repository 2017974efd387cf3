"""The Core ML export of a checkpoint's vision tower: its patch embedding, every block and the merger as one program
each per bucket of S patches (`hetero.coreml.graphs.vision`), written with a manifest (`vision.json`) into a directory of
their own.

Each package is keyed as the text programs are (builder version, coremltools version, piece, shape, hash of the
weights as embedded): a re-run reuses every package whose key is unchanged and removes the ones it no longer
writes. The learned position table is resampled per image on the host (a gather: off the ANE) and enters the
patch-embedding program as an input, as the rotary tables and the attention mask enter the blocks.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import numpy as np

from hetero.coreml.export import remove_export, weights_nbytes, weights_sha256
from hetero.coreml.manifest import VISION, read_vision_manifest
from hetero.coreml.manifest import write as write_manifest
from hetero.errors import HeteroError
from hetero.models.qwen3_5_vision.model import VisionModel

VISION_BUILDER_VERSION = 2  # bump when a vision builder's graph changes


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def patch_embed_weights(tower: VisionModel):
    from hetero.coreml.graphs.vision import PatchEmbedWeights

    w = tower.patch_embed.proj.weight
    return PatchEmbedWeights(proj=_np(w.reshape(w.shape[0], -1)), bias=_np(tower.patch_embed.proj.bias))


def block_weights(tower: VisionModel, i: int):
    """Block i's weights, its fused qkv rows ([3][H][Dh] as the tower reshapes them) split into q, k and v."""
    from hetero.coreml.graphs.vision import VisionBlockWeights

    b, D = tower.blocks[i], tower.args.hidden_size
    qkv, qkv_b = _np(b.attn.qkv.weight), _np(b.attn.qkv.bias)
    return VisionBlockWeights(
        norm1=_np(b.norm1.weight), norm1_bias=_np(b.norm1.bias),
        q=qkv[:D], q_bias=qkv_b[:D], k=qkv[D : 2 * D], k_bias=qkv_b[D : 2 * D], v=qkv[2 * D :], v_bias=qkv_b[2 * D :],
        proj=_np(b.attn.proj.weight), proj_bias=_np(b.attn.proj.bias),
        norm2=_np(b.norm2.weight), norm2_bias=_np(b.norm2.bias),
        fc1=_np(b.mlp.linear_fc1.weight), fc1_bias=_np(b.mlp.linear_fc1.bias),
        fc2=_np(b.mlp.linear_fc2.weight), fc2_bias=_np(b.mlp.linear_fc2.bias),
    )


def merger_weights(tower: VisionModel):
    from hetero.coreml.graphs.vision import MergerWeights

    m = tower.merger
    return MergerWeights(norm=_np(m.norm.weight), norm_bias=_np(m.norm.bias), fc1=_np(m.linear_fc1.weight),
                         fc1_bias=_np(m.linear_fc1.bias), fc2=_np(m.linear_fc2.weight), fc2_bias=_np(m.linear_fc2.bias))


def vision_pieces(tower: VisionModel, bucket: int):
    """(piece name, shape, weights, builder) of every program of the tower at `bucket` patches, in run order."""
    from hetero.coreml.graphs.vision import (MergerShape, PatchEmbedShape, VisionBlockShape, build_merger,
                                      build_patch_embed, build_vision_block)

    a = tower.args
    yield "patch_embed", PatchEmbedShape(a.patch_dim, a.hidden_size, bucket), patch_embed_weights(tower), build_patch_embed
    shape = VisionBlockShape(a.hidden_size, a.num_heads, a.intermediate_size, bucket, a.hidden_act)
    for i in range(len(tower.blocks)):
        yield f"block{i:02d}", shape, block_weights(tower, i), build_vision_block
    yield "merger", MergerShape(a.hidden_size, a.out_hidden_size, a.merge_unit, bucket), merger_weights(tower), build_merger


def check_vision_bucket(tower: VisionModel, bucket: int) -> None:
    """One HeteroError line for a bucket the programs cannot take (or a tower activation they do not know)."""
    from hetero.coreml.graphs.vision import GELU_MODES, check_bucket

    try:
        check_bucket(bucket, tower.args.merge_unit)
    except ValueError as e:
        raise HeteroError(f"{e}: pick another bucket") from None
    if tower.args.hidden_act not in GELU_MODES:
        raise HeteroError(f"vision hidden_act {tower.args.hidden_act!r} has no Core ML program; the tower stays on the GPU")


def export_vision(tower: VisionModel, out: str | os.PathLike, buckets: list[int],
                  progress: Callable[[int, int], None] | None = None) -> dict:
    """Export `tower` (as loaded: its weights are embedded as fp16) for each bucket of patches in `buckets` into `out`
    (its own directory: the text export removes packages its manifest does not list); returns the manifest (also
    written there as `vision.json`). Packages whose key is unchanged are reused, the others removed."""
    from hetero.coreml.graphs.package import save_program  # first: quiets coremltools' import warnings

    import coremltools as ct

    buckets = sorted(set(buckets))
    for b in buckets:
        check_vision_bucket(tower, b)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        previous = {p["file"]: p for p in read_vision_manifest(out)["programs"]}
    except HeteroError:
        previous = {}
    total = len(buckets) * (len(tower.blocks) + 2)
    programs = []
    for bucket in buckets:
        for piece, shape, weights, build in vision_pieces(tower, bucket):
            digest = weights_sha256(weights)
            key = hashlib.sha256(json.dumps([VISION_BUILDER_VERSION, ct.__version__, piece, asdict(shape),
                                             digest]).encode()).hexdigest()
            file = f"vision_{piece}_s{bucket}.mlpackage"
            reused = previous.get(file, {}).get("key") == key and (out / file / "Manifest.json").is_file()
            if not reused:
                remove_export(out / file)
                save_program(build(shape, weights), out / file)
            programs.append({
                "file": file, "piece": piece, "bucket": bucket, "shape": asdict(shape),
                "inputs": {k: list(v) for k, v in shape.inputs().items()},
                "outputs": {k: list(v) for k, v in shape.outputs().items()},
                "weights_sha256": digest, "weight_bytes": weights_nbytes(weights), "key": key, "reused": reused,
            })
            if progress is not None:
                progress(len(programs), total)
    for stale in set(previous) - {p["file"] for p in programs}:
        remove_export(out / stale)
    manifest = {"format": VISION.format, "coremltools": ct.__version__, "builder_version": VISION_BUILDER_VERSION,
                "vision_config": asdict(tower.args), "buckets": buckets, "programs": programs}
    write_manifest(out, manifest, VISION)
    return manifest
