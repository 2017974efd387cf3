"""The GPU's share of each split piece (weights sliced once: rows = output channels, cols = input channels), and
the host-side conversions between MLX activations and the ANE programs' (1, C, 1, S) fp16 layout."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from hetero.coreml.fp16 import fp16_values
from hetero.errors import HeteroError
from hetero.models import activations as act
from hetero.models.attention import attend, attend_selected
from hetero.models.cache import GDNCache, KVCache
from hetero.models.interface import DecoderLayer
from hetero.models.mrope import apply_mrope


def _runs(idx: np.ndarray) -> slice | None:
    """`idx` as the slice it is when its units are consecutive, else None."""
    if len(idx) and np.array_equal(idx, np.arange(idx[0], idx[0] + len(idx))):
        return slice(int(idx[0]), int(idx[0]) + len(idx))
    return None


class Product:
    """x -> x @ W[sel].T for a selection of a Linear's or QuantizedLinear's weights. `copied`: the bytes it
    gathered into new arrays (an index selection, or a quantized one's columns); a slice is a view and costs none."""

    def __init__(self, fn: Callable[[mx.array], mx.array], copied: int):
        self.fn, self.copied = fn, copied

    def __call__(self, x: mx.array) -> mx.array:
        return self.fn(x)


def copied_bytes(*products: Product | None) -> int:
    """What `products` (None: absent) hold beyond the model's own weights."""
    return sum(p.copied for p in products if p is not None)


def _rows(lin: nn.Module, a: int | np.ndarray, b: int | None = None) -> Product:
    """x -> x @ W[rows].T for a Linear or QuantizedLinear (rows are whole output channels): rows [a, b), or the
    index array `a`."""
    rows = slice(a, b) if b is not None else (_runs(a) or mx.array(a))
    gathered = not isinstance(rows, slice)
    if isinstance(lin, nn.QuantizedLinear):
        w, s, z = lin.weight[rows], lin.scales[rows], lin.biases[rows]
        mx.eval(w, s, z)
        return Product(lambda x: mx.quantized_matmul(x, w, s, z, transpose=True, group_size=lin.group_size,
                                                     bits=lin.bits), gathered * (w.nbytes + s.nbytes + z.nbytes))
    w = lin.weight[rows]
    mx.eval(w)
    return Product(lambda x: x @ w.T, gathered * w.nbytes)


def _cols(lin: nn.Module, a: int | np.ndarray, b: int | None = None) -> Product:
    """x -> x @ W[:, cols].T (input channels [a, b), or the index array `a`, in whole quantization groups where
    quantized), for the partial sums of o_proj and down_proj."""
    idx = np.arange(a, b) if b is not None else np.asarray(a)
    if isinstance(lin, nn.QuantizedLinear):
        g, per = lin.group_size, 32 // lin.bits if 32 % lin.bits == 0 else 0
        groups = idx.reshape(-1, g)[:, 0] // g if per and len(idx) % g == 0 else None
        if groups is None or not np.array_equal(idx, (groups[:, None] * g + np.arange(g)).reshape(-1)):
            raise HeteroError(f"{lin.bits}-bit weights with group size {g} cannot be split at input channel "
                              f"{idx[0]}: the pipeline splits 2-, 4- and 8-bit weights at multiples of the group size")
        words = mx.array((groups[:, None] * (g // per) + np.arange(g // per)).reshape(-1))
        gs = mx.array(groups)
        w, s, z = mx.take(lin.weight, words, axis=1), mx.take(lin.scales, gs, axis=1), mx.take(lin.biases, gs, axis=1)
        mx.eval(w, s, z)
        return Product(lambda x: mx.quantized_matmul(x, w, s, z, transpose=True, group_size=g, bits=lin.bits),
                       w.nbytes + s.nbytes + z.nbytes)
    run = _runs(idx)
    w = lin.weight[:, run] if run is not None else mx.take(lin.weight, mx.array(idx), axis=1)
    mx.eval(w)
    return Product(lambda x: x @ w.T, (run is None) * w.nbytes)


def complement(units: int, ane: np.ndarray) -> np.ndarray:
    """The units of [0, units) the ANE does not take, in order."""
    keep = np.ones(units, bool)
    keep[ane] = False
    return np.flatnonzero(keep)


class GpuAttentionRest:
    """The GPU's KV-head groups [k, Hkv) of an attention layer: partial o_proj sum and their new K/V."""

    def __init__(self, layer: DecoderLayer, k: int):
        attn = layer.self_attn
        self.layer, self.attn, self.k = layer, attn, k
        D, group = attn.head_dim, attn.n_heads // attn.n_kv_heads
        self.heads = (attn.n_heads - k * group)
        self.kv = attn.n_kv_heads - k
        self.q = _rows(attn.q_proj, k * group * 2 * D, attn.n_heads * 2 * D)
        self.k_proj = _rows(attn.k_proj, k * D, attn.n_kv_heads * D)
        self.v_proj = _rows(attn.v_proj, k * D, attn.n_kv_heads * D)
        self.o = _cols(attn.o_proj, k * group * D, attn.n_heads * D)
        self.copied = copied_bytes(self.q, self.k_proj, self.v_proj, self.o)

    def __call__(self, x: mx.array, cache: KVCache, positions: mx.array | None = None, chosen: mx.array | None = None
                 ) -> tuple[mx.array, mx.array, mx.array]:
        """The normed input x [1, S, hidden] -> (partial o_proj sum, the GPU's heads' new keys and values); with
        `positions` [3, S] (a prompt with images) the heads rotate by those 3-D positions (`mrope`); with `chosen`
        [1, S, T] (a QSA layer's selection, causal included) each query attends to those keys only."""
        a, D = self.attn, self.attn.head_dim
        B, S, _ = x.shape
        qg = self.q(x).reshape(B, S, self.heads, 2 * D)  # [B, S, Hr, 2D]
        q, gate = qg[..., :D], qg[..., D:]
        keys = a.k_norm(self.k_proj(x).reshape(B, S, self.kv, D)).transpose(0, 2, 1, 3)  # [B, Kr, S, D]
        values = self.v_proj(x).reshape(B, S, self.kv, D).transpose(0, 2, 1, 3)  # [B, Kr, S, D]
        q = a.q_norm(q).transpose(0, 2, 1, 3)  # [B, Hr, S, D]
        if positions is not None:
            q, keys = apply_mrope(q, positions, *a.rope_args), apply_mrope(keys, positions, *a.rope_args)
        else:
            q, keys = a.rope(q, offset=cache.offset), a.rope(keys, offset=cache.offset)
        all_k, all_v = keys, values
        if cache.offset:
            all_k = mx.concatenate([cache.keys[:, self.k :, : cache.offset], keys], axis=2)  # [B, Kr, T+S, D]
            all_v = mx.concatenate([cache.values[:, self.k :, : cache.offset], values], axis=2)
        if chosen is None:
            out = attend(q, all_k, all_v, scale=D**-0.5)  # [B, Hr, S, D]
        else:
            out = attend_selected(q, all_k, all_v, D**-0.5, chosen[:, None])  # [B, Hr, S, D]
        out = out.transpose(0, 2, 1, 3) * act.sigmoid(gate)  # [B, S, Hr, D]
        partial = self.o(out.reshape(B, S, -1))  # [B, S, hidden]
        mx.eval(partial, keys, values)
        return partial, keys, values


class GpuMLPRest:
    """The GPU's channels of a SwiGLU MLP (the layer's dense `mlp`, or the SwiGLU `mlp` given: an MoE layer's shared
    expert): every channel but the ANE's `ane` (any set: those chosen by range), as a partial down_proj sum."""

    def __init__(self, layer: DecoderLayer, ane: np.ndarray, mlp: nn.Module | None = None):
        mlp = layer.mlp if mlp is None else mlp
        rest = complement(mlp.gate_proj.weight.shape[0], ane)
        self.layer = layer
        self.gate, self.up, self.down = _rows(mlp.gate_proj, rest), _rows(mlp.up_proj, rest), _cols(mlp.down_proj, rest)
        self.copied = copied_bytes(self.gate, self.up, self.down)

    def partial(self, x: mx.array) -> mx.array:
        """The partial sum of the GPU's channels on the normed input x [1, S, hidden] (lazy)."""
        return self.down(act.silu(self.gate(x)) * self.up(x))  # [1, S, hidden]


class GpuMoERest:
    """Everything of an MoE layer's MLP but the ANE's shared-expert channels `ane`: the router, the routed experts,
    the shared expert's other channels (a partial down_proj sum; none when the ANE has them all) and the shared
    expert's sigmoid gate, which `finish` applies once the ANE's partial sum is merged in.

    The routed sum is the model's own (`SparseMoeBlock.routed`), so only the shared expert's merge differs from
    the GPU-only run.
    """

    def __init__(self, layer: DecoderLayer, ane: np.ndarray):
        moe = layer.mlp
        self.layer, self.moe = layer, moe
        I = moe.shared_expert.gate_proj.weight.shape[0]
        self.shared = GpuMLPRest(layer, ane, moe.shared_expert) if len(ane) < I else None
        self.copied = self.shared.copied if self.shared is not None else 0

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array | None, mx.array]:
        """The normed input x [1, S, hidden] -> (routed [1, S, hidden], the GPU's shared channels [1, S, hidden] or
        None, gate logit [1, S, 1]), evaluated."""
        moe = self.moe
        routed = moe.routed(x)  # [1, S, hidden]
        shared = self.shared.partial(x) if self.shared is not None else None  # [1, S, hidden]
        gate = moe.shared_expert_gate(x)  # [1, S, 1]
        mx.eval(routed, gate, *([shared] if shared is not None else []))
        return routed, shared, gate

    @staticmethod
    def finish(routed: mx.array, shared: mx.array, gate: mx.array) -> mx.array:
        """The MoE output from the merged shared expert [1, S, hidden]: routed + sigmoid(gate) * shared."""
        return routed + shared * act.sigmoid(gate)


class GpuGDNRest:
    """A GDN layer without z rows [0, zr): everything that feeds the recurrence, run exactly as the model does.

    Runs `GatedDeltaNet.recurrence` unchanged; `finish` is its `output` once the ANE's z rows are merged in.
    """

    def __init__(self, layer: DecoderLayer, zr: int):
        m = layer.linear_attn
        self.layer, self.m, self.zr = layer, m, zr
        self.z_rest = _rows(m.in_proj_z, zr, m.nv * m.dv) if zr < m.nv * m.dv else None
        self.copied = copied_bytes(self.z_rest)

    def __call__(self, x: mx.array, cache: GDNCache) -> tuple[mx.array, mx.array | None]:
        """The normed input x [1, S, hidden] -> (the recurrence's output, the GPU's z rows), evaluated."""
        z_rest = self.z_rest(x) if self.z_rest is not None else None  # [B, S, rows - zr]
        out = self.m.recurrence(x, cache)  # [B, S, Hv, Dv] fp32: the model's own exact path
        mx.eval(out, *cache.state, *([z_rest] if z_rest is not None else []))
        return out, z_rest

    def finish(self, out: mx.array, z: mx.array, dtype: mx.Dtype) -> mx.array:
        """Gated norm with the merged z [B, S, nv*dv], then out_proj."""
        return self.m.output(out, z, dtype)


def host(a: mx.array) -> np.ndarray:
    """An evaluated MLX array as fp32 numpy; an fp32 one is read without an MLX op, so any thread may call it."""
    return np.asarray(a) if a.dtype == mx.float32 else np.asarray(a.astype(mx.float32))


def to_bc1s(x: mx.array, chunk: int) -> np.ndarray:
    """A normed input [1, s, hidden] -> (1, hidden, 1, chunk) fp16 values (in fp32: both backends take them). The
    rows past s repeat the last token's: a padded row is never all zeros, so nothing in a program divides 0 by 0."""
    a = host(x)[0].T  # [hidden, s]
    return fp16_values(np.pad(a, ((0, 0), (0, chunk - a.shape[1])), mode="edge"))[None, :, None, :]


def from_bc1s(out: np.ndarray, s: int) -> np.ndarray:
    """(1, C, 1, chunk) fp16 values -> [s, C] fp32."""
    return out[0, :, 0, :s].T.astype(np.float32)
