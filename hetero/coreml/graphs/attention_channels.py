"""The attention program in Apple's reference layout (apple/ml-ane-transformers `reference/multihead_attention.py`):
keys on channels, scores as (1, S_k, 1, S_q), the native softmax over axis 1, each head's norms over its channels.

Same interface as `hetero.coreml.graphs.attention.build_attention` (the inputs and outputs of `AttentionShape`, the
GPU cache's own `[1, Hkv, T, D]` blocks in, the chunk's K/V out), so the runtime runs either; only the inside
differs from the `heads` layout, which puts each head's keys on axis 2 with one channel, normalizes q and k over axis
2 and spells the softmax out over axis 2. Which of the two the Neural Engine runs faster (or keeps on the ANE at
all) is a fact of a Mac: `hetero doctor` times both on the model's own attention shape and the export takes the
faster (`hetero.pipeline.programs.attention_layout`).

Per KV head g, its keys (cache blocks, then the chunk's) are concatenated once on the channel axis, (1, T + S, 1, D),
and shared by the group's query heads; per query head h (1, D, 1, S):

    scores = einsum("nchw,nwhu->nchu", keys, q_h)     (1, T + S, 1, S)   MIL's einsum for this layout
    p      = softmax(scores + mask, axis=1)            (1, T + S, 1, S)
    out_h  = values^T p                                 (1, D, 1, S)

A cache longer than the ANE's axis limit (T + S above `key_block`, 16384) keeps its blocks apart, and the softmax
over them is spelled out on axis 1 with one shared max (the `heads` layout's way, on channels).
"""

from __future__ import annotations

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Var

from hetero.coreml.graphs.ops import conv1x1, head_of, norm_shift, rms_norm, scaled, softmax_parts, split_channels

SCORES = "nchw,nwhu->nchu"  # x (1, C, 1, W) . y (1, W, 1, U) -> (1, C, 1, U): keys (1, T, 1, D) . q (1, D, 1, S)


def channels_body(shape, w, inp: dict[str, Var]) -> dict[str, Var]:
    """The attention program's body in the keys-on-channels layout (`AttentionShape` interface)."""
    H, Hkv, D, S = shape.heads, shape.kv_heads, shape.head_dim, shape.chunk
    half, group = shape.rotary_dims // 2, shape.heads // shape.kv_heads
    up = 2.0 ** norm_shift(shape.eps)  # q and k 2^k larger (exact): a normal fp16 epsilon, as in the heads layout
    eps = shape.eps * up**2
    x = inp["x"]  # (1, hidden, 1, S), normed
    q = conv1x1(x, scaled(w.q, up), "q_proj")  # (1, H*D, 1, S)
    gate = conv1x1(x, w.gate, "gate_proj")  # (1, H*D, 1, S)
    k = conv1x1(x, scaled(w.k, up), "k_proj")  # (1, Hkv*D, 1, S)
    v = conv1x1(x, w.v, "v_proj")  # (1, Hkv*D, 1, S)
    rot = {n: mb.reshape(x=inp[n], shape=(1, half, 1, S), name=f"{n}_c") for n in ("cos", "sin")} if half else {}
    k_heads = split_channels(k, [D] * Hkv, 1, "k_head")  # Hkv x (1, D, 1, S)
    v_heads = split_channels(v, [D] * Hkv, 1, "v_head")
    keys_new, vals_new = [], []  # per KV head: (1, S, 1, D), the chunk's keys and values with positions on channels
    for g in range(Hkv):
        kg = rms_norm(k_heads[g], w.k_norm, eps, axis=1, name=f"k_norm_{g}")  # (1, D, 1, S)
        kg = _rope(kg, rot, half, f"k_rope_{g}") if half else kg
        keys_new.append(mb.transpose(x=kg, perm=[0, 3, 2, 1], name=f"k_t_{g}"))  # (1, S, 1, D)
        vals_new.append(mb.transpose(x=v_heads[g], perm=[0, 3, 2, 1], name=f"v_t_{g}"))  # (1, S, 1, D)
    k_new = _stack(keys_new, S, D, "k_new_t")  # (1, Hkv, S, D)
    v_new = _stack(vals_new, S, D, "v_new_t")

    n_blocks = len(shape.cache_blocks)
    masks = [mb.reshape(x=inp[f"mask_cache_{b}"], shape=(1, tb, 1, S), name=f"mask_c{b}")
             for b, tb in enumerate(shape.cache_blocks)] + [mb.reshape(x=inp["mask_chunk"], shape=(1, S, 1, S),
                                                                        name="mask_n")]
    one = shape.cache_slots + S <= shape.key_block  # every key on one axis (<= 16384): the native softmax
    if one and len(masks) > 1:
        masks = [mb.concat(values=masks, axis=1, name="mask_all")]  # (1, T + S, 1, S)
    segments = []  # per KV head: ([keys (1, Ti, 1, D)], [values (1, 1, Ti, D)])
    for g in range(Hkv):
        keys = [mb.reshape(x=head_of(inp[f"k_cache_{b}"], g, f"kc{b}_{g}"), shape=(1, tb, 1, D), name=f"kc{b}_{g}_c")
                for b, tb in enumerate(shape.cache_blocks)] + [keys_new[g]]
        vals = [head_of(inp[f"v_cache_{b}"], g, f"vc{b}_{g}") for b in range(n_blocks)]  # (1, 1, Tb, D)
        vals.append(mb.reshape(x=vals_new[g], shape=(1, 1, S, D), name=f"vn_{g}"))
        if one and len(keys) > 1:
            keys = [mb.concat(values=keys, axis=1, name=f"keys_{g}")]  # (1, T + S, 1, D)
            vals = [mb.concat(values=vals, axis=2, name=f"vals_{g}")]  # (1, 1, T + S, D)
        segments.append((keys, vals))
    q_heads = split_channels(q, [D] * H, 1, "q_head")  # H x (1, D, 1, S)
    heads = []
    for h in range(H):
        qh = rms_norm(q_heads[h], w.q_norm * D**-0.5, eps, axis=1, name=f"q_norm_{h}")  # the scale rides on q_norm
        qh = _rope(qh, rot, half, f"q_rope_{h}") if half else qh
        keys, vals = segments[h // group]
        heads.append(_attend(qh, keys, vals, masks, f"h{h}"))  # (1, D, 1, S)
    attn = heads[0] if H == 1 else mb.concat(values=heads, axis=1, name="attn")  # (1, H*D, 1, S)
    gated = mb.mul(x=attn, y=mb.sigmoid(x=gate, name="gate_sigmoid"), name="gated")  # (1, H*D, 1, S)
    return {"out": conv1x1(gated, w.o, "o_proj"), "k_new": k_new, "v_new": v_new}


def _stack(per_head: list[Var], S: int, D: int, name: str) -> Var:
    """KV heads' (1, S, 1, D) tensors as the cache's (1, Hkv, S, D)."""
    parts = [mb.reshape(x=t, shape=(1, 1, S, D), name=f"{name}_{g}") for g, t in enumerate(per_head)]
    return parts[0] if len(parts) == 1 else mb.concat(values=parts, axis=1, name=name)


def _rope(t: Var, rot: dict[str, Var], half: int, name: str) -> Var:
    """NeoX (rotate-half) RoPE on the first 2*half channels of (1, D, 1, S); the rest pass through."""
    _, D, _, S = t.shape
    x1, x2, *rest = split_channels(t, [half, half] + ([D - 2 * half] if D > 2 * half else []), 1, f"{name}_x")
    cos, sin = rot["cos"], rot["sin"]  # (1, R/2, 1, S)
    r1 = mb.sub(x=mb.mul(x=x1, y=cos, name=f"{name}_x1c"), y=mb.mul(x=x2, y=sin, name=f"{name}_x2s"), name=f"{name}_r1")
    r2 = mb.add(x=mb.mul(x=x2, y=cos, name=f"{name}_x2c"), y=mb.mul(x=x1, y=sin, name=f"{name}_x1s"), name=f"{name}_r2")
    return mb.concat(values=[r1, r2, *rest], axis=1, name=name)  # (1, D, 1, S)


def _attend(q: Var, keys: list[Var], vals: list[Var], masks: list[Var], name: str) -> Var:
    """One head's attention: q (1, D, 1, S); keys[i] (1, Ti, 1, D), vals[i] (1, 1, Ti, D), masks[i] (1, Ti, 1, S).
    One segment: the native softmax on axis 1; several: spelled out on axis 1 with one shared max. (1, D, 1, S)."""
    _, D, _, S = q.shape
    scores = [mb.add(x=mb.einsum(values=(k, q), equation=SCORES, name=f"{name}_s{i}"), y=m, name=f"{name}_sm{i}")
              for i, (k, m) in enumerate(zip(keys, masks))]  # (1, Ti, 1, S)
    if len(scores) == 1:
        probs = [mb.softmax(x=scores[0], axis=1, name=f"{name}_p")]
    else:  # the heads layout's spelled-out softmax, over axis 1
        exps, den = softmax_parts(scores, 1, name)
        probs = [mb.real_div(x=e, y=den, name=f"{name}_p{i}") for i, e in enumerate(exps)]
    out = None
    for i, (p, v) in enumerate(zip(probs, vals)):
        t = p.shape[1]
        p = mb.reshape(x=p, shape=(1, 1, t, S), name=f"{name}_pr{i}")  # (1, 1, Ti, S): the same values
        o = mb.matmul(x=v, y=p, transpose_x=True, name=f"{name}_o{i}")  # (1, 1, D, S)
        out = o if out is None else mb.add(x=out, y=o, name=f"{name}_acc{i}")
    return mb.reshape(x=out, shape=(1, D, 1, S), name=f"{name}_out")  # (1, D, 1, S)
