"""The vision tower's programs (the Qwen3-VL tower of `qwen3_5` checkpoints), one per piece, for a bucket of S patches.

    patch_embed  patches (1, P, 1, S), pos (1, D, 1, S)  ->  x (1, D, 1, S)       proj(patches) + bias + pos
    block        x (1, D, 1, S), cos, sin (1, 1, Dh/2, S), mask (1, 1, S, S)  ->  x (1, D, 1, S)
    merger       x (1, D, 1, S)  ->  out (1, O, 1, S / m)                         m = merge x merge patches per row

A block is the whole ViT block: LayerNorm, q/k/v with biases, 2-D rotary positions over the whole head (NeoX
pairing; the host builds cos/sin from each patch's row and column, as `rope_tables` does for text), softmax
attention of every patch over the patches the mask lets it see, the output projection, the residual, LayerNorm,
the MLP with the checkpoint's GELU, the residual. The mask is an input: 0 where query s may see key t (same frame
of the same image), MASK_NEG elsewhere, so several images (or a clip's frames) packed in one bucket never see one
another, and padding patches (past the last image) are seen by none: real patches' outputs do not depend on them.

The residual stream lives in these programs (the text programs read the GPU lane's normed inputs instead), and a
real ViT's residual carries outliers in the thousands: each LayerNorm scales every patch's row by its own largest
value first (`layer_norm`: exact, its epsilon folded per row), so any residual inside fp16's range normalizes
without overflow, and the tower's 1e-6 epsilon (subnormal in fp16) is never a constant.
The softmax scale Dh^-0.5 rides on q's weights and bias. The merger's row gathering is a reshape and a transpose:
patch j of merged row a (S index a*m + j) becomes channels [j*D, (j+1)*D) of column a, as the tower's
`reshape(-1, D*m)` orders them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, Var

from hetero.coreml.graphs.attention import _attend, _head, _rope
from hetero.coreml.graphs.ops import MASK_NEG, SEQ_MULTIPLE, build_program, conv1x1, fp16

GELU_MODES = {"gelu_pytorch_tanh": "TANH_APPROXIMATION", "gelu": "EXACT"}  # checkpoint hidden_act -> MIL mode
VISION_EPS = 1e-6  # the tower's LayerNorms


@dataclass(frozen=True)
class PatchEmbedShape:
    """Static shape of the patch-embedding program."""

    patch_dim: int  # C * T * P * P
    hidden: int
    patches: int  # S, the bucket

    def inputs(self) -> dict[str, tuple[int, ...]]:
        return {"patches": (1, self.patch_dim, 1, self.patches), "pos": (1, self.hidden, 1, self.patches)}

    def outputs(self) -> dict[str, tuple[int, ...]]:
        return {"x": (1, self.hidden, 1, self.patches)}


@dataclass
class PatchEmbedWeights:
    proj: np.ndarray  # [D, C*T*P*P]  the Conv3d's kernel flattened in the patch's order
    bias: np.ndarray  # [D]


def build_patch_embed(shape: PatchEmbedShape, w: PatchEmbedWeights) -> Program:
    """proj(patches) + bias + pos: the Conv3d whose kernel is its stride is a 1x1 conv over flattened patches."""

    def body(inp: dict[str, Var]) -> dict[str, Var]:
        x = conv1x1(inp["patches"], w.proj, "patch_proj", w.bias)  # (1, D, 1, S)
        return {"x": mb.add(x=x, y=inp["pos"], name="with_pos")}

    return build_program(shape.inputs(), body, w)


@dataclass(frozen=True)
class VisionBlockShape:
    """Static shape of one vision block program."""

    hidden: int
    heads: int
    intermediate: int
    patches: int  # S, the bucket
    act: str = "gelu_pytorch_tanh"  # the checkpoint's hidden_act
    eps: float = VISION_EPS

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def inputs(self) -> dict[str, tuple[int, ...]]:
        S, half = self.patches, self.head_dim // 2
        return {"x": (1, self.hidden, 1, S), "cos": (1, 1, half, S), "sin": (1, 1, half, S), "mask": (1, 1, S, S)}

    def outputs(self) -> dict[str, tuple[int, ...]]:
        return {"x_out": (1, self.hidden, 1, self.patches)}


@dataclass
class VisionBlockWeights:
    """One block's weights (numpy, fp32); the qkv projection split into its q, k and v rows."""

    norm1: np.ndarray  # [D]
    norm1_bias: np.ndarray  # [D]
    q: np.ndarray  # [D, D]
    q_bias: np.ndarray  # [D]
    k: np.ndarray
    k_bias: np.ndarray
    v: np.ndarray
    v_bias: np.ndarray
    proj: np.ndarray  # [D, D]
    proj_bias: np.ndarray
    norm2: np.ndarray
    norm2_bias: np.ndarray
    fc1: np.ndarray  # [I, D]
    fc1_bias: np.ndarray  # [I]
    fc2: np.ndarray  # [D, I]
    fc2_bias: np.ndarray  # [D]


NORM_TOP = 2.0**8  # each row's largest |value| as the LayerNorm reads it
NORM_FLOOR = 2.0**-6  # rows whose largest |value| is below this are scaled as if it were this (zero rows too)
NORM_OP_EPS = 2.0**-13  # the fused op's own epsilon: normal in fp16, negligible against a row scaled to NORM_TOP


def layer_norm(x: Var, weight: np.ndarray, bias: np.ndarray, eps: float, name: str) -> Var:
    """LayerNorm over the channels of (1, C, 1, S) for any finite fp16 x (a residual up to fp16's 65504).

    Each row (patch) is scaled by its own c = NORM_TOP / max(max|x|, NORM_FLOOR) before the fused layer_norm, and
    LN(c x; c^2 eps) = LN(x; eps) exactly. The row's epsilon c^2 eps cannot be the op's constant, so it enters as
    two extra channels m +- e (m the row's mean, e = c sqrt(C eps / 2)): over the C + 2 channels the mean stays m
    and the variance is C / (C + 2) (var + c^2 eps), whose factor rides on gamma; the extra channels are then
    dropped. The op's own epsilon (NORM_OP_EPS, normal in fp16) adds 2^-13 to a variance of a row whose largest
    value is 2^8 (about 2^16 / C for a row of one outlier), and a zero row (padding) gives beta, finite. c is not
    a power of two: c x rounds once, at 2^-11 of the row's largest value, as any fp16 op on the residual does.
    """
    C = x.shape[1]
    top = mb.reduce_max(x=x, axes=[1], keep_dims=True, name=f"{name}_top")  # (1, 1, 1, S)
    bottom = mb.reduce_min(x=x, axes=[1], keep_dims=True, name=f"{name}_bottom")
    peak = mb.maximum(x=mb.maximum(x=top, y=mb.mul(x=bottom, y=np.float16(-1.0), name=f"{name}_neg"),
                                   name=f"{name}_absmax"), y=np.float16(NORM_FLOOR), name=f"{name}_peak")
    c = mb.real_div(x=np.float16(NORM_TOP), y=peak, name=f"{name}_c")  # (1, 1, 1, S): |c x| <= NORM_TOP
    y = mb.mul(x=x, y=c, name=f"{name}_scaled")  # (1, C, 1, S)
    m = mb.reduce_mean(x=y, axes=[1], keep_dims=True, name=f"{name}_mean")  # (1, 1, 1, S)
    e = mb.mul(x=c, y=np.float16(np.sqrt(C * eps / 2)), name=f"{name}_eps")  # c sqrt(C eps / 2): <= 2^14 x 0.09
    both = mb.concat(values=[y, mb.add(x=m, y=e, name=f"{name}_hi"), mb.sub(x=m, y=e, name=f"{name}_lo")], axis=1,
                     name=f"{name}_cat")  # (1, C + 2, 1, S)
    gamma = np.concatenate([np.asarray(weight, np.float32) * np.sqrt(C / (C + 2)), np.zeros(2, np.float32)])
    beta = np.concatenate([np.asarray(bias, np.float32), np.zeros(2, np.float32)])
    normed = mb.layer_norm(x=both, axes=[1], gamma=fp16(gamma), beta=fp16(beta), epsilon=np.float16(NORM_OP_EPS),
                           name=f"{name}_ln")
    return mb.slice_by_index(x=normed, begin=[0, 0, 0, 0], end=[1, C, 1, x.shape[3]], name=name)  # (1, C, 1, S)


def gelu(x: Var, act: str, name: str) -> Var:
    if act not in GELU_MODES:
        raise ValueError(f"vision hidden_act {act!r}: the Core ML tower knows {', '.join(GELU_MODES)}")
    return mb.gelu(x=x, mode=GELU_MODES[act], name=name)


def build_vision_block(shape: VisionBlockShape, w: VisionBlockWeights) -> Program:
    """One vision block (see the module docstring for its interface)."""
    H, Dh, S = shape.heads, shape.head_dim, shape.patches
    scale = np.float32(Dh**-0.5)

    def body(inp: dict[str, Var]) -> dict[str, Var]:
        x = inp["x"]  # (1, D, 1, S), the residual stream
        n = layer_norm(x, w.norm1, w.norm1_bias, shape.eps, "norm1")  # (1, D, 1, S)
        q = conv1x1(n, w.q * scale, "q_proj", w.q_bias * scale)  # the softmax scale on q: (1, D, 1, S)
        q = mb.reshape(x=q, shape=(1, H, Dh, S), name="q_heads")  # (1, H, Dh, S)
        k = mb.reshape(x=conv1x1(n, w.k, "k_proj", w.k_bias), shape=(1, H, Dh, S), name="k_heads")
        v = mb.reshape(x=conv1x1(n, w.v, "v_proj", w.v_bias), shape=(1, H, Dh, S), name="v_heads")
        q = _rope(q, inp["cos"], inp["sin"], Dh // 2, "q_rope")  # (1, H, Dh, S)
        k = _rope(k, inp["cos"], inp["sin"], Dh // 2, "k_rope")
        keys = mb.transpose(x=k, perm=[0, 1, 3, 2], name="keys")  # (1, H, S, Dh)
        vals = mb.transpose(x=v, perm=[0, 1, 3, 2], name="vals")  # (1, H, S, Dh)
        heads = [_attend(_head(q, h, f"q_h{h}"), [_head(keys, h, f"k_h{h}")], [_head(vals, h, f"v_h{h}")],
                         [inp["mask"]], f"h{h}") for h in range(H)]  # (1, 1, Dh, S) each
        attn = heads[0] if H == 1 else mb.concat(values=heads, axis=1, name="heads")  # (1, H, Dh, S)
        attn = mb.reshape(x=attn, shape=(1, H * Dh, 1, S), name="attn")  # (1, D, 1, S)
        x = mb.add(x=x, y=conv1x1(attn, w.proj, "proj", w.proj_bias), name="resid1")
        n = layer_norm(x, w.norm2, w.norm2_bias, shape.eps, "norm2")
        a = gelu(conv1x1(n, w.fc1, "fc1", w.fc1_bias), shape.act, "act")  # (1, I, 1, S)
        return {"x_out": mb.add(x=x, y=conv1x1(a, w.fc2, "fc2", w.fc2_bias), name="resid2")}

    return build_program(shape.inputs(), body, w)


@dataclass(frozen=True)
class MergerShape:
    """Static shape of the patch-merger program."""

    hidden: int
    out: int
    merge_unit: int  # patches per merged row (spatial_merge_size^2)
    patches: int  # S, the bucket (a multiple of merge_unit)
    eps: float = VISION_EPS

    def inputs(self) -> dict[str, tuple[int, ...]]:
        return {"x": (1, self.hidden, 1, self.patches)}

    def outputs(self) -> dict[str, tuple[int, ...]]:
        return {"out": (1, self.out, 1, self.patches // self.merge_unit)}


@dataclass
class MergerWeights:
    norm: np.ndarray  # [D]
    norm_bias: np.ndarray  # [D]
    fc1: np.ndarray  # [D*m, D*m]
    fc1_bias: np.ndarray
    fc2: np.ndarray  # [O, D*m]
    fc2_bias: np.ndarray  # [O]


def build_merger(shape: MergerShape, w: MergerWeights) -> Program:
    """LayerNorm per patch, merge_unit consecutive patches as one row of D*m channels, then fc1, exact GELU, fc2."""
    D, m, S = shape.hidden, shape.merge_unit, shape.patches

    def body(inp: dict[str, Var]) -> dict[str, Var]:
        n = layer_norm(inp["x"], w.norm, w.norm_bias, shape.eps, "norm")  # (1, D, 1, S)
        rows = mb.reshape(x=n, shape=(1, D, S // m, m), name="rows")  # [c, a, j] = patch a*m + j
        rows = mb.transpose(x=rows, perm=[0, 3, 1, 2], name="rows_t")  # (1, m, D, S/m)
        wide = mb.reshape(x=rows, shape=(1, m * D, 1, S // m), name="wide")  # channel j*D + c
        a = gelu(conv1x1(wide, w.fc1, "fc1", w.fc1_bias), "gelu", "act")
        return {"out": conv1x1(a, w.fc2, "fc2", w.fc2_bias)}  # (1, O, 1, S/m)

    return build_program(shape.inputs(), body, w)


# ----------------------------------------------------------------------------------------------------------
# Host side


def check_bucket(patches: int, merge_unit: int) -> None:
    """A bucket of S patches: the merger's output S / m must be a multiple of 64 (the ANE's sequence rule)."""
    step = SEQ_MULTIPLE * merge_unit
    if patches <= 0 or patches % step:
        raise ValueError(f"vision bucket {patches}: must be a positive multiple of {step} patches")


def window_mask(windows: Sequence[int], patches: int) -> np.ndarray:
    """(1, 1, S, S) fp16 [key, query]: 0 where both patches lie in the same window (one frame of one image; the
    windows follow one another from patch 0), MASK_NEG elsewhere; each padding patch sees only itself."""
    label = np.full(patches, -1, np.int64)
    start = 0
    for i, n in enumerate(windows):
        label[start : start + n] = i
        start += n
    if start > patches:
        raise ValueError(f"{start} patches do not fit a bucket of {patches}")
    pad = np.arange(patches) >= start
    label[pad] = len(windows) + np.arange(int(pad.sum()))  # each padding patch is its own window
    visible = label[:, None] == label[None, :]
    return np.where(visible, 0.0, MASK_NEG).astype(np.float16)[None, None]


def rotary_tables(angles: np.ndarray, patches: int) -> dict[str, np.ndarray]:
    """cos and sin (1, 1, Dh/2, S) fp16 of per-patch angles [n, Dh/2] (fp32), padding patches at angle 0."""
    n = angles.shape[0]
    full = np.zeros((patches, angles.shape[1]), np.float32)
    full[:n] = angles
    return {"cos": fp16(np.cos(full).T)[None, None], "sin": fp16(np.sin(full).T)[None, None]}
