"""The Qwen3.5 family's blocks: RMSNorm (weights held as 1 + w), gated full attention, the dense SwiGLU (or the
mixture-of-experts block, `make_mlp`) and the Gated DeltaNet mixer with its causal depthwise conv. Qwen4-Exp builds on
the same attention, MLP and GDN."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from hetero.models import activations as act
from hetero.models.attention import attend
from hetero.models.cache import GDNCache, KVCache
from hetero.models.fused import FusedProjection, project_inputs
from hetero.models.gated_delta import RECURRENT_MAX_TOKENS, chunked_gated_delta, recurrent_gated_delta
from hetero.models.linear import Linear
from hetero.models.moe import SparseMoeBlock
from hetero.models.mrope import apply_mrope
from hetero.models.qwen3_5.args import ModelArgs


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """x * rsqrt(mean(x^2) + eps) * weight, computed in fp32 and returned in x's dtype."""
    return mx.fast.rms_norm(x.astype(mx.float32), weight, eps).astype(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm whose weight is already the effective scale (zero-centred checkpoints get +1 in `sanitize`)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.weight.astype(mx.float32), self.eps)


class Attention(nn.Module):
    """Gated full attention: q_proj gives query and gate per head, q/k RMSNorm, partial NeoX RoPE, GQA.

    q_proj, k_proj and v_proj run as one `q|k|v` product once `fused.fuse` has fused them (at load).
    """

    PROJECTIONS = ("q_proj", "k_proj", "v_proj")
    fused: FusedProjection | None = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        bias = args.attention_bias
        self.q_proj = Linear(args.hidden_size, self.n_heads * self.head_dim * 2, bias=bias)
        self.k_proj = Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, args.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.rope = args.rotary  # a plain callable (`hetero.models.rope.Rotary`): no parameters
        self.rope_args = (args.rotary, args.mrope_section)
        self.indexer = None  # every causal key is read (Qwen4-Exp's QSA attention selects them: `qsa.Indexer`)

    def __call__(self, x: mx.array, cache: KVCache | None, positions: mx.array | None = None) -> mx.array:
        offset = cache.position if cache is not None else 0
        queries, keys, values, gate = self.project(x, offset, positions)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)  # [B, Hkv, offset+S, D]
        return self.finish(attend(queries, keys, values, scale=self.head_dim**-0.5), gate)

    def project(self, x: mx.array, offset: int | mx.array, positions: mx.array | None = None
                ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """x [B, S, hidden] at positions offset.. -> queries [B, H, S, D], keys and values [B, Hkv, S, D] (RoPE
        applied), gate [B, S, H, D]. With `positions` [3, S] (a prompt with images) the rotary angles come from those
        (time, height, width) positions instead (`mrope`)."""
        B, S, _ = x.shape
        q, k, v = project_inputs(self, x)  # [B, S, H*2D], [B, S, Hkv*D], [B, S, Hkv*D]
        qg = q.reshape(B, S, self.n_heads, 2 * self.head_dim)  # [B, S, H, 2D]
        queries, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]  # [B, S, H, D] each
        keys = k.reshape(B, S, self.n_kv_heads, self.head_dim)  # [B, S, Hkv, D]
        values = v.reshape(B, S, self.n_kv_heads, self.head_dim)  # [B, S, Hkv, D]
        queries, keys = self.q_norm(queries).transpose(0, 2, 1, 3), self.k_norm(keys).transpose(0, 2, 1, 3)
        if positions is not None:
            queries, keys = apply_mrope(queries, positions, *self.rope_args), apply_mrope(keys, positions, *self.rope_args)
        else:
            queries, keys = self.rope(queries, offset=offset), self.rope(keys, offset=offset)  # [B, H|Hkv, S, D]
        return queries, keys, values.transpose(0, 2, 1, 3), gate

    def finish(self, out: mx.array, gate: mx.array) -> mx.array:
        """Attention output [B, H, S, D] and gate [B, S, H, D] -> o_proj(out * sigmoid(gate)) [B, S, hidden]."""
        B, _, S, _ = out.shape
        out = out.transpose(0, 2, 1, 3) * act.sigmoid(gate)  # [B, S, H, D]
        return self.o_proj(out.reshape(B, S, -1))


class MLP(nn.Module):
    """Dense SwiGLU: down(silu(gate(x)) * up(x)); gate_proj and up_proj run as one `gate|up` product once fused."""

    PROJECTIONS = ("gate_proj", "up_proj")
    fused: FusedProjection | None = None

    def __init__(self, dims: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(dims, hidden, bias=False)
        self.up_proj = Linear(dims, hidden, bias=False)
        self.down_proj = Linear(hidden, dims, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = project_inputs(self, x)  # [..., hidden] each
        return self.down_proj(act.silu(gate) * up)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet mixer: projections, depthwise causal conv + SiLU, delta rule in fp32, gated RMSNorm.

    The four input projections run as one `qkv|z|b|a` product once `fused.fuse` has fused them (at load).
    """

    PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    fused: FusedProjection | None = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.nk, self.nv = args.linear_num_key_heads, args.linear_num_value_heads
        self.dk, self.dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.kernel = args.linear_conv_kernel_dim
        self.eps = args.rms_norm_eps
        key_dim, value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * key_dim + value_dim
        self.in_proj_qkv = Linear(args.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = Linear(args.hidden_size, value_dim, bias=False)
        self.in_proj_b = Linear(args.hidden_size, self.nv, bias=False)
        self.in_proj_a = Linear(args.hidden_size, self.nv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = mx.ones((self.nv,))
        self.A_log = mx.zeros((self.nv,))
        self.norm = RMSNorm(self.dv, args.rms_norm_eps)
        self.out_proj = Linear(value_dim, args.hidden_size, bias=False)

    def __call__(self, x: mx.array, cache: GDNCache | None) -> mx.array:
        qkv, z, b, a = project_inputs(self, x)  # [B, S, C], [B, S, Hv*Dv], [B, S, Hv], [B, S, Hv]
        return self.output(self.mix(qkv, b, a, cache), z, x.dtype)

    def recurrence(self, x: mx.array, cache: GDNCache | None) -> mx.array:
        """Everything that feeds the recurrent state (qkv, b, a, conv, delta rule): x [B, S, hidden] -> [B, S, Hv, Dv] fp32.

        Runs in_proj_qkv, in_proj_b and in_proj_a on their own (not z: the pipeline's GPU share computes only some
        of z's rows), then `mix`.
        """
        return self.mix(self.in_proj_qkv(x), self.in_proj_b(x), self.in_proj_a(x), cache)

    def mix(self, qkv: mx.array, b: mx.array, a: mx.array, cache: GDNCache | None) -> mx.array:
        """Conv and delta rule from the projections qkv [B, S, C], b and a [B, S, Hv] -> [B, S, Hv, Dv] fp32.

        Updates `cache` (conv window, state, offset); while it is recording, keeps every intermediate state.
        """
        B, S, _ = qkv.shape
        prev = cache.conv if cache is not None and cache.conv is not None else None
        if prev is None:
            prev = mx.zeros((B, self.kernel - 1, self.conv_dim), dtype=qkv.dtype)
        conv_in = mx.concatenate([prev, qkv], axis=1)  # [B, K-1+S, C]
        silu = act.silu_now if S >= act.EAGER_MIN_TOKENS else act.silu  # a prefill chunk: numpy's exp
        conv_out = silu(causal_depthwise_conv(conv_in, self.conv1d.weight))  # [B, S, C]

        key_dim = self.nk * self.dk
        q = conv_out[..., :key_dim].reshape(B, S, self.nk, self.dk)
        k = conv_out[..., key_dim : 2 * key_dim].reshape(B, S, self.nk, self.dk)
        v = conv_out[..., 2 * key_dim :].reshape(B, S, self.nv, self.dv).astype(mx.float32)
        r = self.nv // self.nk
        q = mx.repeat(_l2norm(q), r, axis=2) * self.dk**-0.5  # [B, S, Hv, Dk] value head j uses key head j // r
        k = mx.repeat(_l2norm(k), r, axis=2)  # [B, S, Hv, Dk]
        beta = act.sigmoid(b.astype(mx.float32))  # [B, S, Hv]
        softplus = mx.logaddexp(a.astype(mx.float32) + self.dt_bias, 0.0)  # not nn.softplus: see activations.py
        g = -mx.exp(self.A_log.astype(mx.float32)) * softplus  # [B, S, Hv]

        state = cache.recurrent if cache is not None else None
        if state is None:
            state = mx.zeros((B, self.nv, self.dk, self.dv), dtype=mx.float32)
        if cache is not None and cache.recording:  # speculative verify: keep every intermediate state
            out, state = recurrent_gated_delta(q, k, v, g, beta, state, record=cache.recorded_states)
            cache.recorded_conv_in = conv_in
        elif S <= RECURRENT_MAX_TOKENS:
            out, state = recurrent_gated_delta(q, k, v, g, beta, state)  # out [B, S, Hv, Dv] fp32
        else:
            out, state = chunked_gated_delta(q, k, v, g, beta, state)
        if cache is not None:
            cache.conv = conv_in[:, -(self.kernel - 1) :]
            cache.recurrent = state
            cache.offset += S
        return out

    def output(self, core: mx.array, z: mx.array, dtype: mx.Dtype) -> mx.array:
        """Gated norm and out_proj: core [B, S, Hv, Dv] fp32, z [B, S, Hv*Dv] -> [B, S, hidden] in `dtype`."""
        B, S = core.shape[:2]
        z = z.reshape(B, S, self.nv, self.dv)
        out = rms_norm(core, self.norm.weight.astype(mx.float32), self.eps) * act.silu(z.astype(mx.float32))
        return self.out_proj(out.astype(dtype).reshape(B, S, -1))


def make_mlp(args: ModelArgs, moe: bool) -> nn.Module:
    """A layer's feed-forward block: the dense SwiGLU, or the sparse MoE block with its gated shared expert."""
    if not moe:
        return MLP(args.hidden_size, args.intermediate_size)
    return SparseMoeBlock(
        args.hidden_size, args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size, args.norm_topk_prob,
        shared_expert=MLP(args.hidden_size, args.shared_expert_intermediate_size),
    )


def causal_depthwise_conv(x: mx.array, weight: mx.array) -> mx.array:
    """The GDN's short convolution, `nn.Conv1d(C, C, K, groups=C)` without padding: x [B, K-1+S, C] (the
    previous K-1 inputs, then the S new ones), weight [C, K, 1] -> [B, S, C].

    As K shifted multiply-adds: MLX's CPU depthwise conv1d took 24 ms for a 512-token chunk at C = 2048 against
    2.9 ms for these (a quarter of a GDN layer's prefill time; bench/step_profile.py --part conv), and the sums
    agree within fp32 rounding.
    """
    K = weight.shape[1]
    S = x.shape[1] - K + 1
    w = weight[:, :, 0].astype(x.dtype)  # [C, K]
    out = x[:, :S] * w[:, 0]
    for j in range(1, K):
        out = out + x[:, j : j + S] * w[:, j]  # [B, S, C]
    return out


def _l2norm(x: mx.array, eps: float = 1e-6) -> mx.array:
    x = x.astype(mx.float32)
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)
