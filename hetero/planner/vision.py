"""The vision tower's cost: its buckets of patches (the static shapes its Core ML programs are exported for), its
FLOPs per image on the GPU (attention over each image's own patches) and on the ANE (the whole padded bucket), and
the predicted seconds on either lane with the planner's rates (`Lanes`, the same roofline as the text pieces).

The ANE lane's buckets stop at `MAX_VISION_PATCHES` (4,096): a block program holds an S x S mask and, per head, S x S
scores in fp16 (32 MB each at 4,096 patches, 512 MB at 16,384), so a larger image goes to the GPU tower, and the plan
says so (`TowerTime.over_cap`, `lane_choice`, `tower_lines`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from hetero.models.qwen3_5_vision.args import VisionArgs
from hetero.planner.predict import Lanes, _seconds
from hetero.planner.slices import ANE_WEIGHT_BYTES

SEQ_MULTIPLE = 64  # the ANE programs' sequence rule (hetero.coreml.graphs.ops.SEQ_MULTIPLE): the merger's rows too
PLAN_SIZES = ((448, 448), (1024, 1024), (1920, 1080))  # the image sizes `hetero plan` reports
MAX_VISION_PATCHES = 4096  # the largest bucket the ANE lane's tower programs are exported for


def vision_bucket(patches: int, merge_unit: int) -> int:
    """The smallest bucket holding `patches`: 64 x merge_unit patches times a power of two (at most 2x padding, few
    buckets: each is a whole export of the tower)."""
    step = SEQ_MULTIPLE * merge_unit
    n = max(1, -(-patches // step))
    return step * (1 << (n - 1).bit_length())


def lane_bucket(patches: int, merge_unit: int) -> int | None:
    """The ANE lane's bucket for an image of `patches` patches; None above `MAX_VISION_PATCHES` (the GPU tower's)."""
    bucket = vision_bucket(patches, merge_unit)
    return bucket if bucket <= MAX_VISION_PATCHES else None


def image_grid(width: int, height: int, a: VisionArgs) -> tuple[int, int, int]:
    """(t, h, w) in patches of a still image resized to multiples of patch x merge (the processor's rounding, before
    its pixel limits)."""
    f = a.patch_size * a.spatial_merge_size
    h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
    return 1, h // a.patch_size, w // a.patch_size


def tower_flops(a: VisionArgs, patches: int, window: int) -> tuple[float, float]:
    """(matmul FLOPs of the projections, FLOPs of attention's scores and values) of the tower over `patches`
    patches, each attending to `window` patches."""
    D, I, m = a.hidden_size, a.intermediate_size, a.merge_unit
    per_patch = 2.0 * a.patch_dim * D + a.depth * 2.0 * (4 * D * D + 2 * D * I)  # patch embed, qkv + proj, MLP
    merger = 2.0 * (m * D) * (m * D + a.out_hidden_size) * patches / m
    return per_patch * patches + merger, a.depth * 4.0 * D * patches * window


def tower_params(a: VisionArgs) -> float:
    D, I, m = a.hidden_size, a.intermediate_size, a.merge_unit
    return a.patch_dim * D + a.depth * (4 * D * D + 2 * D * I) + (m * D) * (m * D + a.out_hidden_size)


@dataclass(frozen=True)
class TowerTime:
    """One image's predicted tower seconds on each lane (None: a rate the profile does not know)."""

    width: int
    height: int
    patches: int
    bucket: int | None  # None: above the lane's cap, the GPU tower encodes it
    tokens: int
    gpu_s: float | None
    ane_s: float | None

    @property
    def over_cap(self) -> bool:
        return self.bucket is None

    def to_dict(self) -> dict:
        r = lambda v: None if v is None else round(v, 6)  # noqa: E731
        return {"image": f"{self.width}x{self.height}", "patches": self.patches, "bucket": self.bucket,
                "tokens": self.tokens, "gpu_s": r(self.gpu_s), "ane_s": r(self.ane_s),
                **({"lane": "gpu", "why": f"above the ANE lane's {MAX_VISION_PATCHES:,}-patch cap"}
                   if self.over_cap else {})}


def predict_tower(a: VisionArgs, lanes: Lanes, width: int, height: int, bytes_per_weight: float = 2.0) -> TowerTime:
    """The tower's seconds for one `width` x `height` image on the GPU (its own patches) and on the ANE lane (its
    bucket's programs, padding and all, plus the fixed cost of each program call)."""
    return replace(predict_grid(a, lanes, image_grid(width, height, a), bytes_per_weight), width=width, height=height)


def predict_grid(a: VisionArgs, lanes: Lanes, grid: tuple[int, int, int], bytes_per_weight: float = 2.0
                 ) -> TowerTime:
    """`predict_tower` for an image (or clip) of `grid` (t, h, w) patches, as the processor made it; each frame
    attends to itself. Above the lane's cap there is no ANE time: the GPU tower encodes it."""
    t, h, w = (int(d) for d in grid)
    n = t * h * w
    bucket = lane_bucket(n, a.merge_unit)
    weights = tower_params(a)

    def lane(patches: int, window: int, rate, attn_rate, bw, wbytes) -> float | None:
        proj, attn = tower_flops(a, patches, window)
        p = _seconds(np.array([proj]), wbytes, rate, bw)
        s = _seconds(np.array([attn]), 0.0, attn_rate, None)
        return None if p is None or s is None else float(p[0] + s[0])

    gpu = lane(n, h * w, lanes.gpu_rate("mlp"), lanes.gpu_rate("attention"), lanes.gpu_bw, weights * bytes_per_weight)
    ane = None if bucket is None else lane(bucket, bucket, lanes.ane_rate("mlp"), lanes.ane_rate("attention"),
                                           lanes.ane_bw, weights * ANE_WEIGHT_BYTES)
    if gpu is not None:
        gpu += a.depth * a.num_heads * n * h * w * lanes.gpu_score_s
    if ane is not None and bucket is not None:
        ane += a.depth * a.num_heads * bucket * bucket * lanes.ane_score_s + (a.depth + 2) * lanes.ane_call_s
    return TowerTime(w * a.patch_size, h * a.patch_size, n, bucket, n // a.merge_unit, gpu, ane)


def lane_choice(times: list[TowerTime], reach_s: list[float | None]) -> list[bool]:
    """Which of a prompt's images (in prompt order) the ANE lane encodes, from the predicted seconds: `times` each
    image's tower on either lane, `reach_s` the GPU lane's prefill of the text before each image (None: unknown).

    The lane encodes its images one after another from the prefill's start while the GPU lane prefills the text;
    when the GPU lane reaches image i it waits for the lane's embeddings, if they are not ready, or encodes the
    image itself. The lane takes an image whose wait (its finish past the GPU lane's arrival) is shorter than the
    GPU tower's seconds on it: one that is ready in time, or late by less than the GPU would spend. A tiny image
    right after little text (the lane's whole padded bucket and per-program calls against a few patches on the
    GPU), or a tower that would keep the GPU lane waiting longer than encoding it, goes to the GPU. The GPU lane's
    arrival at each image includes its waits and encodes for the images before. An unknown rate: the lane. An
    image above the lane's cap (`MAX_VISION_PATCHES`): the GPU, always.
    """
    out: list[bool] = []
    lane_done = delay = 0.0  # the lane's last embeddings ready at; the GPU lane's time spent on images so far
    for t, reach in zip(times, reach_s):
        if t.over_cap:
            out.append(False)
            delay += t.gpu_s or 0.0
            continue
        if t.ane_s is None or t.gpu_s is None or reach is None:
            out.append(True)
            lane_done += t.ane_s or 0.0
            continue
        wait = max(0.0, lane_done + t.ane_s - (reach + delay))
        take = wait < t.gpu_s
        out.append(take)
        if take:
            lane_done += t.ane_s
        delay += wait if take else t.gpu_s
    return out


def tower_lines(a: VisionArgs, lanes: Lanes, sizes=PLAN_SIZES) -> list[str]:
    """`hetero plan`'s lines for the tower: per image size, its bucket and both lanes' predicted seconds."""
    fmt = lambda v: "unknown" if v is None else f"{v:.3f} s"  # noqa: E731
    out = ["", f"vision tower (depth {a.depth}, hidden {a.hidden_size}; on the ANE lane while the GPU prefills the "
               f"text before the image):",
           f"  {'image':<11} {'patches':>7} {'bucket':>6} {'tokens':>6} {'GPU':>10} {'ANE lane':>10}"]
    for width, height in sizes:
        p = predict_tower(a, lanes, width, height)
        ane = (f"{'GPU tower':>10} (above the lane's {MAX_VISION_PATCHES:,}-patch cap)" if p.over_cap
               else f"{fmt(p.ane_s):>10}")
        out.append(f"  {f'{width}x{height}':<11} {p.patches:>7} {p.bucket or '-':>6} {p.tokens:>6} {fmt(p.gpu_s):>10} "
                   f"{ane}")
    return out
