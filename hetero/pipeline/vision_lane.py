"""The vision tower on the ANE lane: its Core ML programs (`hetero.coreml.export_vision`), exported per bucket of patches on
first use beside the split's text programs, loaded into the lane's worker (or run in this process), and one image's
encoding as a job the ANE lane runs while the GPU lane prefills the text before the image.

An image the lane cannot take (no programs for its tower, a bucket that failed to export) is said in one warning
line and encoded by the GPU tower instead; a lane that fails mid-prompt (worker lost, non-finite output) is the
split's failure: the prompt is prefilled GPU-only, its images encoded by the GPU tower (`PipelineRun.prefill`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from hetero.checkpoint.dtypes import dtype_name
from hetero.coreml.manifest import read_vision_manifest
from hetero.errors import AneNonFinite, HeteroError
from hetero.host.progress import ProgressBar
from hetero.planner.vision import MAX_VISION_PATCHES, lane_bucket
from hetero.vision.prompt import ImagePrompt

COSINE, PSNR = 0.9999, 60.0  # `--verify`: the lane's embeddings against the GPU tower's (as the programs' tests)


def image_bucket(images: ImagePrompt, i: int, merge_unit: int) -> int:
    """Image i's bucket on the lane; HeteroError above the lane's cap (`MAX_VISION_PATCHES`): the GPU tower's."""
    t, h, w = images.grids[i]
    bucket = lane_bucket(t * h * w, merge_unit)
    if bucket is None:
        raise HeteroError(f"image {i} has {t * h * w:,} patches, above the ANE lane's {MAX_VISION_PATCHES:,}-patch "
                          f"cap (a bucket's mask and scores grow with its square)")
    return bucket


def tower_dtype(tower) -> str:
    """The dtype the tower's weights were loaded in ("bfloat16"), which its exported programs hold."""
    floating = (v.dtype for _, v in tree_flatten(tower.parameters()) if mx.issubdtype(v.dtype, mx.floating))
    return dtype_name(next(floating))


def ensure_vision_export(tower, out: Path, bucket: int, check: Callable[[], None] | None = None) -> Path:
    """The tower's programs for `bucket` in `out` (their own directory): exported on first use with a progress bar,
    reused while the manifest lists every package and was written by this builder version (an older one's programs
    are exported again: e.g. version 1's LayerNorm overflowed past a residual of 4096)."""
    # the exporter imports coremltools (4-8 s): loaded with the first export, not with the lane
    from hetero.coreml.export_vision import VISION_BUILDER_VERSION, export_vision

    try:
        manifest = read_vision_manifest(out)
        if (manifest["buckets"] == [bucket] and manifest.get("builder_version") == VISION_BUILDER_VERSION
                and all((out / p["file"] / "Manifest.json").is_file() for p in manifest["programs"])):
            return out
    except HeteroError:
        pass
    bar = ProgressBar("export Core ML (vision tower)")

    def progress(done: int, total: int) -> None:
        bar(done, total)
        if check is not None:
            check()

    export_vision(tower, out, [bucket], progress=progress)
    return out


class VisionLane:
    """The tower's programs per bucket, loaded by `loader` (path -> callable: the worker's `load`, or the platform's
    backend in this process) from `root / vision_s<bucket>_d<dtype>`. `check`: look for non-finite outputs here (a
    loader in this process; the worker looks itself)."""

    def __init__(self, tower, root: Path, loader: Callable, check: bool):
        from hetero.coreml.backends.reference_vision import VisionPrograms

        self.tower, self.root, self.loader, self.check = tower, Path(root), loader, check
        self._programs: dict[int, VisionPrograms] = {}
        self._fp32 = None  # the tower widened to fp32, made on the first `verify` of a half-precision tower
        self._pos = np.array(tower.pos_embed.weight.astype(mx.float32))

    def programs(self, bucket: int, check: Callable[[], None] | None = None):
        """The loaded programs of `bucket` (exported and loaded on first use)."""
        from hetero.coreml.backends.reference_vision import VisionPrograms

        if bucket not in self._programs:
            out = ensure_vision_export(self.tower, self.root / f"vision_s{bucket}_d{tower_dtype(self.tower)}", bucket,
                                       check)  # (the tower's weights as loaded are exported: one folder per dtype)
            self._programs[bucket] = VisionPrograms(out, bucket, self.tower.args, self._pos, runner=self.loader)
        return self._programs[bucket]

    def encoder(self, images: ImagePrompt, i: int) -> Callable[[], np.ndarray]:
        """Image i's encoding through the programs, as a callable for the ANE lane: -> [tokens, out_hidden] fp32
        (fp16 values), a copy (a worker's outputs are views of a buffer its next job reuses). Raises AneNonFinite on
        NaN or inf (the worker raises it itself)."""
        progs = self.programs(image_bucket(images, i, self.tower.args.merge_unit))
        patches, grid = images.patches[i], images.grids[i]

        def run() -> np.ndarray:
            out = np.array(progs.run(patches, [grid]), np.float32)  # [tokens, out_hidden]
            if self.check and not np.isfinite(out).all():
                raise AneNonFinite(f"the ANE lane's vision tower returned non-finite embeddings for image {i}")
            return out

        return run

    def encoders(self, images: ImagePrompt | None, warn: Callable[[str], None] | None = None,
                 which: Collection[int] | None = None) -> dict[int, Callable[[], np.ndarray]]:
        """Image index -> its lane encoder, for the prompt's images not encoded yet (of `which`, when given); an
        image whose programs cannot be had is left to the GPU tower, said in one line."""
        if images is None:
            return {}
        out = {}
        for i, rows in enumerate(images.embeddings):
            if rows is not None or (which is not None and i not in which):
                continue
            try:
                out[i] = self.encoder(images, i)
            except HeteroError as e:
                (warn or _stderr)(f"warning: image {i} is encoded on the GPU: the ANE lane has no vision programs "
                                  f"for it ({e})")
        return out

    def verify(self, images: ImagePrompt, warn: Callable[[str], None] | None = None) -> list[dict]:
        """`--verify`'s vision check: each image through the lane's programs against the GPU tower in fp32
        (`reference`): cosine, PSNR, max |diff|, ok: at least COSINE and PSNR, or, for a half-precision tower, at
        least what the GPU tower's own run reaches against the same reference (`gpu_cosine`, `gpu_psnr_db`: a bf16
        tower lies 46-50 dB from fp32 on random towers; the programs, exported from whichever dtype loaded the
        checkpoint first, compute fp16). Non-finite
        embeddings from the lane are said in one line and fail the check (`non_finite`); the prompt keeps the GPU
        tower's, and the images after it are not checked (a worker that returned them is gone)."""
        from hetero.coreml.backends.accuracy import compare

        out = []
        for i in range(len(images.grids)):
            try:
                bucket = image_bucket(images, i, self.tower.args.merge_unit)
            except HeteroError as e:  # the GPU tower's image: nothing of the lane to verify
                out.append({"image": i, "bucket": None, "lane": "gpu", "why": str(e), "ok": True})
                continue
            try:
                lane = self.encoder(images, i)()
            except AneNonFinite as e:
                (warn or _stderr)(f"warning: --verify: image {i}: {e}; its embeddings are the GPU tower's")
                out.append({"image": i, "bucket": bucket, "non_finite": True, "ok": False})
                break
            patches, grid = mx.array(images.patches[i]), [images.grids[i]]
            exact = np.array(self.reference()(patches, grid).astype(mx.float32))  # [tokens, out_hidden]
            m = compare(lane, exact)
            cosine, psnr, row = COSINE, PSNR, {}
            if self.reference() is not self.tower:  # a half-precision tower: held to no less than its own run
                own = compare(np.array(self.tower(patches, grid).astype(mx.float32)), exact)
                cosine, psnr = min(cosine, own["cosine"]), min(psnr, own["psnr_db"])
                row = {"gpu_cosine": round(own["cosine"], 8), "gpu_psnr_db": round(own["psnr_db"], 2)}
            out.append({"image": i, "bucket": bucket, "cosine": round(m["cosine"], 8),
                        "psnr_db": round(m["psnr_db"], 2), "max_abs": round(m["max_abs"], 6), **row,
                        "ok": m["cosine"] >= cosine and m["psnr_db"] >= psnr})
        return out


    def reference(self):
        """The GPU tower in fp32 (itself where it computes fp32), the lane's programs' reference: they compute fp16
        whatever the GPU lane's dtype, and a bf16 tower's own rounding (46-50 dB from fp32 on random towers) lies
        below the 60 dB the programs are held to."""
        from mlx.utils import tree_flatten

        from hetero.models.qwen3_5_vision.model import VisionModel

        if self.tower.pos_embed.weight.dtype == mx.float32:
            return self.tower
        if self._fp32 is None:
            tower = VisionModel(self.tower.args)
            tower.load_weights([(k, v.astype(mx.float32)) for k, v in tree_flatten(self.tower.parameters())])
            mx.eval(tower.parameters())
            self._fp32 = tower
        return self._fp32


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)
