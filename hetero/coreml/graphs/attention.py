"""The attention-layer prefill graph: one chunk of S tokens for a slice of whole KV-head groups.

Inputs (all fp16, static):
    x            (1, hidden, 1, S)        input_layernorm's output (the GPU lane computes it: bounded, no epsilon)
    cos, sin     (1, 1, R/2, S)           RoPE tables for positions p..p+S-1 (R = rotary dims, NeoX pairing)
    k_cache_b    (1, Hkv, Tb, D)          cache block b of this slice's KV heads, in the GPU cache's own layout
    v_cache_b    (1, Hkv, Tb, D)
    mask_cache_b (1, 1, Tb, S)            0 where query s may see cache slot t, MASK_NEG elsewhere
    mask_chunk   (1, 1, S, S)             the same within the chunk (causal)
Outputs:
    out          (1, hidden, 1, S)        this slice's partial o_proj sum (all slices add up to the layer)
    k_new, v_new (1, Hkv, S, D)           the chunk's keys (normed, rotated) and values, for the GPU cache

The cache's T slots are split into blocks of at most 16384 (the ANE's axis limit); the softmax spans all blocks
and the chunk with one shared max. Attention runs per head, so no axis ever holds S * head_dim.

Two layouts of the same program (`AttentionShape.layout`, `LAYOUTS`): `heads` (here: each head's keys on axis 2
with one channel, q and k normalized over axis 2, the softmax spelled out over axis 2) and `keys_on_channels`
(Apple's reference layout, `hetero.coreml.graphs.attention_channels`: scores (1, S_k, 1, S_q), the native softmax
over axis 1). Same inputs, same outputs; `hetero doctor` times both on a Mac.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, Var

from hetero.coreml.graphs import LAYOUTS
from hetero.coreml.graphs.ops import MASK_NEG, MAX_AXIS, blocks, build_program, conv1x1, fp16, norm_shift, rms_norm, scaled
from hetero.coreml.graphs.ops import head_of as _head, softmax_parts
from hetero.coreml.graphs.palette import Palettized


@dataclass(frozen=True)
class AttentionShape:
    """Static shape of one attention program: the slice's heads, the chunk and the cache context."""

    hidden: int
    heads: int  # query heads in the slice (whole KV groups)
    kv_heads: int  # their KV heads
    head_dim: int
    rotary_dims: int
    chunk: int  # S
    cache_slots: int  # T: positions before the chunk this program can attend to (0: first chunk only)
    eps: float
    key_block: int = MAX_AXIS  # most cache slots per input block
    layout: str = "heads"  # `LAYOUTS`: how the program lays out its heads' keys and softmax inside

    @property
    def cache_blocks(self) -> list[int]:
        return blocks(self.cache_slots, self.key_block, 64) if self.cache_slots else []

    def inputs(self) -> dict[str, tuple[int, ...]]:
        """Input name -> shape, in the program's order."""
        S, D, half = self.chunk, self.head_dim, self.rotary_dims // 2
        out = {"x": (1, self.hidden, 1, S)}
        if half:
            out.update(cos=(1, 1, half, S), sin=(1, 1, half, S))
        for b, tb in enumerate(self.cache_blocks):
            out[f"k_cache_{b}"] = (1, self.kv_heads, tb, D)
            out[f"v_cache_{b}"] = (1, self.kv_heads, tb, D)
            out[f"mask_cache_{b}"] = (1, 1, tb, S)
        out["mask_chunk"] = (1, 1, S, S)
        return out

    def outputs(self) -> dict[str, tuple[int, ...]]:
        S, D = self.chunk, self.head_dim
        return {"out": (1, self.hidden, 1, S), "k_new": (1, self.kv_heads, S, D), "v_new": (1, self.kv_heads, S, D)}


@dataclass
class AttentionWeights:
    """The slice's weights as numpy arrays; norm weights are effective scales (already 1 + w)."""

    q: np.ndarray | Palettized  # [heads*D, hidden]  query rows of q_proj
    gate: np.ndarray | Palettized  # [heads*D, hidden]  gate rows of q_proj
    k: np.ndarray | Palettized  # [kv_heads*D, hidden]
    v: np.ndarray | Palettized  # [kv_heads*D, hidden]
    q_norm: np.ndarray  # [D]
    k_norm: np.ndarray  # [D]
    o: np.ndarray | Palettized  # [hidden, heads*D]  the slice's o_proj columns


def build_attention(shape: AttentionShape, w: AttentionWeights) -> Program:
    """The attention prefill program for one slice (see the module docstring for its interface), in
    `shape.layout`."""
    if shape.layout not in LAYOUTS:
        raise ValueError(f"attention layout {shape.layout!r}: one of {', '.join(LAYOUTS)}")
    if shape.layout == "keys_on_channels":
        from hetero.coreml.graphs.attention_channels import channels_body

        return build_program(shape.inputs(), lambda inp: channels_body(shape, w, inp), w)
    H, Hkv, D, S = shape.heads, shape.kv_heads, shape.head_dim, shape.chunk
    half = shape.rotary_dims // 2
    group = H // Hkv  # query heads per KV head

    def body(inp: dict[str, Var]) -> dict[str, Var]:
        x = inp["x"]  # (1, hidden, 1, S), normed
        # q and k come out 2^k larger (exact) so that the norms' epsilon, times 4^k, is a normal fp16 number: the
        # norms give the same result, and a zero row (a padded token) normalizes to zero, never 0/0.
        up = 2.0 ** norm_shift(shape.eps)
        q = mb.reshape(x=conv1x1(x, scaled(w.q, up), "q_proj"), shape=(1, H, D, S), name="q_heads")  # (1, H, D, S)
        gate = conv1x1(x, w.gate, "gate_proj")  # (1, H*D, 1, S)
        k = mb.reshape(x=conv1x1(x, scaled(w.k, up), "k_proj"), shape=(1, Hkv, D, S), name="k_heads")  # (1, Hkv, D, S)
        v = mb.reshape(x=conv1x1(x, w.v, "v_proj"), shape=(1, Hkv, D, S), name="v_heads")  # (1, Hkv, D, S)
        # The softmax scale D^-0.5 rides on q_norm's weight: one multiply fewer, same rounding point.
        q = rms_norm(q, w.q_norm * D**-0.5, shape.eps * up**2, axis=2, name="q_norm")  # (1, H, D, S)
        k = rms_norm(k, w.k_norm, shape.eps * up**2, axis=2, name="k_norm")  # (1, Hkv, D, S)
        if half:
            q = _rope(q, inp["cos"], inp["sin"], half, "q_rope")
            k = _rope(k, inp["cos"], inp["sin"], half, "k_rope")
        k_new = mb.transpose(x=k, perm=[0, 1, 3, 2], name="k_new_t")  # (1, Hkv, S, D)
        v_new = mb.transpose(x=v, perm=[0, 1, 3, 2], name="v_new_t")  # (1, Hkv, S, D)

        n_blocks = len(shape.cache_blocks)
        heads = []
        for h in range(H):
            g = h // group  # KV heads are repeated by indexing, never by merging axes
            keys = [_head(inp[f"k_cache_{b}"], g, f"kc{b}_h{h}") for b in range(n_blocks)]  # (1, 1, Tb, D)
            vals = [_head(inp[f"v_cache_{b}"], g, f"vc{b}_h{h}") for b in range(n_blocks)]  # (1, 1, Tb, D)
            masks = [inp[f"mask_cache_{b}"] for b in range(n_blocks)] + [inp["mask_chunk"]]
            keys.append(_head(k_new, g, f"kn_h{h}"))  # (1, 1, S, D)
            vals.append(_head(v_new, g, f"vn_h{h}"))  # (1, 1, S, D)
            heads.append(_attend(_head(q, h, f"q_h{h}"), keys, vals, masks, f"h{h}"))  # (1, 1, D, S)
        attn = heads[0] if H == 1 else mb.concat(values=heads, axis=1, name="heads")  # (1, H, D, S)
        attn = mb.reshape(x=attn, shape=(1, H * D, 1, S), name="attn")  # (1, H*D, 1, S)
        gated = mb.mul(x=attn, y=mb.sigmoid(x=gate, name="gate_sigmoid"), name="gated")  # (1, H*D, 1, S)
        out = conv1x1(gated, w.o, "o_proj")  # (1, hidden, 1, S)
        return {"out": out, "k_new": k_new, "v_new": v_new}

    return build_program(shape.inputs(), body, w)


def _rope(t: Var, cos: Var, sin: Var, half: int, name: str) -> Var:
    """NeoX (rotate-half) RoPE on the first 2*half dims of axis 2 of (1, H, D, S); the rest pass through."""
    _, H, D, S = t.shape
    x1 = mb.slice_by_index(x=t, begin=[0, 0, 0, 0], end=[1, H, half, S], name=f"{name}_x1")  # (1, H, R/2, S)
    x2 = mb.slice_by_index(x=t, begin=[0, 0, half, 0], end=[1, H, 2 * half, S], name=f"{name}_x2")
    r1 = mb.sub(x=mb.mul(x=x1, y=cos, name=f"{name}_x1c"), y=mb.mul(x=x2, y=sin, name=f"{name}_x2s"), name=f"{name}_r1")
    r2 = mb.add(x=mb.mul(x=x2, y=cos, name=f"{name}_x2c"), y=mb.mul(x=x1, y=sin, name=f"{name}_x1s"), name=f"{name}_r2")
    parts = [r1, r2]
    if 2 * half < D:
        parts.append(mb.slice_by_index(x=t, begin=[0, 0, 2 * half, 0], end=[1, H, D, S], name=f"{name}_pass"))
    return mb.concat(values=parts, axis=2, name=name)  # (1, H, D, S)


def _attend(q: Var, keys: list[Var], vals: list[Var], masks: list[Var], name: str) -> Var:
    """One head's softmax attention over key segments (cache blocks, then the chunk) with one shared max.

    q (1, 1, D, S); keys[i], vals[i] (1, 1, Ti, D); masks[i] (1, 1, Ti, S). Returns (1, 1, D, S).
    """
    scores = []
    for i, (k, m) in enumerate(zip(keys, masks)):
        s = mb.matmul(x=k, y=q, name=f"{name}_s{i}")  # (1, 1, Ti, S)
        scores.append(mb.add(x=s, y=m, name=f"{name}_sm{i}"))
    exps, den = softmax_parts(scores, 2, name)
    out = None
    for i, (e, v) in enumerate(zip(exps, vals)):
        p = mb.real_div(x=e, y=den, name=f"{name}_p{i}")  # normalise before the sum: no fp16 overflow
        o = mb.matmul(x=v, y=p, transpose_x=True, name=f"{name}_o{i}")  # (1, 1, D, S)
        out = o if out is None else mb.add(x=out, y=o, name=f"{name}_acc{i}")
    return out


# ----------------------------------------------------------------------------------------------------------
# Host side: the inputs a caller feeds for the chunk at positions [start, start + S)


def rope_tables(start: int, shape: AttentionShape, rotary, positions: np.ndarray | None = None
                ) -> dict[str, np.ndarray]:
    """cos and sin (1, 1, R/2, S) fp16 for positions start..start+S-1, as MLX's RoPE computes them (fp32).

    `rotary`: the model's `hetero.models.rope.Rotary` (its frequencies, and the scale a yarn rope gives cos and
    sin), or a plain rope's theta. `positions` [R/2, S] (a prompt with images: each rotary frequency's own position,
    from its mrope stream) replaces them; the program is the same, only its tables change."""
    half = shape.rotary_dims // 2
    if not half:
        return {}
    if hasattr(rotary, "inv_freq"):
        inv_freq, scale = np.asarray(rotary.inv_freq, np.float32), np.float32(rotary.scale)  # [R/2]
    else:  # theta
        inv_freq, scale = rotary ** (-np.arange(0, half, dtype=np.float32) / half), np.float32(1.0)
    if positions is None:
        pos = np.arange(start, start + shape.chunk, dtype=np.float32)[None, :]  # [1, S]
    else:
        if positions.shape != (half, shape.chunk):
            raise ValueError(f"positions {positions.shape}: the program rotates {half} frequencies of {shape.chunk}")
        pos = positions.astype(np.float32)  # [R/2, S]
    angle = inv_freq[:, None] * pos  # [R/2, S]
    return {"cos": fp16(np.cos(angle) * scale)[None, None], "sin": fp16(np.sin(angle) * scale)[None, None]}


def attention_masks(start: int, shape: AttentionShape) -> dict[str, np.ndarray]:
    """Masks for a chunk at `start`: cache slot t is visible iff t < start; within the chunk, causal.

    Padded query rows (past the prompt's end) still see themselves, so every softmax row has a finite max.
    """
    S = shape.chunk
    if start > shape.cache_slots:
        raise ValueError(f"chunk at position {start} needs {start} cache slots; this program has {shape.cache_slots}")
    out = {}
    offset = 0
    for b, tb in enumerate(shape.cache_blocks):
        slots = np.arange(offset, offset + tb)
        visible = np.broadcast_to((slots < start)[:, None], (tb, S))  # [Tb, S]
        out[f"mask_cache_{b}"] = np.where(visible, 0.0, MASK_NEG).astype(np.float16)[None, None]
        offset += tb
    causal = np.arange(S)[:, None] <= np.arange(S)[None, :]  # [key, query]
    out["mask_chunk"] = np.where(causal, 0.0, MASK_NEG).astype(np.float16)[None, None]
    return out


def selected_masks(start: int, shape: AttentionShape, chosen: np.ndarray) -> dict[str, np.ndarray]:
    """Masks for a chunk at `start` whose queries see only the positions `chosen` [s, start + s] (bool, a QSA
    indexer's selection, causal included) marks: the same program then attends as QSA does. Padded query rows
    (s..S-1) see themselves only, so every softmax row has a finite max."""
    S, s = shape.chunk, chosen.shape[0]
    if start > shape.cache_slots:
        raise ValueError(f"chunk at position {start} needs {start} cache slots; this program has {shape.cache_slots}")
    cache = np.zeros((shape.cache_slots, S), bool)  # [slot, query]
    cache[:start, :s] = chosen[:, :start].T
    chunk = np.eye(S, dtype=bool)  # [key, query]
    chunk[:s, :s] = chosen[:, start : start + s].T
    out, offset = {}, 0
    for b, tb in enumerate(shape.cache_blocks):
        out[f"mask_cache_{b}"] = np.where(cache[offset : offset + tb], 0.0, MASK_NEG).astype(np.float16)[None, None]
        offset += tb
    out["mask_chunk"] = np.where(chunk, 0.0, MASK_NEG).astype(np.float16)[None, None]
    return out


def cache_inputs(keys: np.ndarray, values: np.ndarray, shape: AttentionShape) -> dict[str, np.ndarray]:
    """The slice's cache [1, Hkv, n, D] (n <= T valid slots) zero-padded to T and split into the input blocks."""
    n = keys.shape[2]
    pad = ((0, 0), (0, 0), (0, shape.cache_slots - n), (0, 0))
    k, v = np.pad(fp16(keys), pad), np.pad(fp16(values), pad)  # [1, Hkv, T, D]
    out, offset = {}, 0
    for b, tb in enumerate(shape.cache_blocks):
        out[f"k_cache_{b}"] = k[:, :, offset : offset + tb]
        out[f"v_cache_{b}"] = v[:, :, offset : offset + tb]
        offset += tb
    return out
