"""Qwen3.5 / Qwen3.6 / Qwen3-Next hybrid models (Gated DeltaNet + gated full attention) with the MTP head.

One implementation serves `qwen3_5` (nested `text_config`), `qwen3_5_text` (flat), their mixture-of-experts
siblings `qwen3_5_moe` / `qwen3_5_moe_text`, and `qwen3_next` (fused GDN input projections, un-fused by
`weights.sanitize`; dense or with experts). MoE layers use `moe.SparseMoeBlock`. Attribute names equal the (canonical) checkpoint names:
`model.*` for the backbone, `lm_head`, `mtp.*`. Norm weights are held shifted (1 + w), so every RMSNorm here
is a plain `x * rsqrt(mean(x^2) + eps) * w`; `weights.sanitize` applies the shift exactly once.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from hetero.errors import HeteroError
from hetero.models import activations as act
from hetero.models.args import ModelArgs
from hetero.models.attention import attend
from hetero.models.cache import GDNCache, KVCache, LayerCache, ModelCache, RaggedKV, last_positions
from hetero.models.compiled import PerThread
from hetero.models.fused import FusedProjection, project_inputs
from hetero.models.gated_delta import chunked_gated_delta, recurrent_gated_delta
from hetero.models.kv_quant import KVQuant, QuantizedKVCache
from hetero.models.linear import Linear, project
from hetero.models.moe import SparseMoeBlock
from hetero.models.mrope import apply_mrope

RECURRENT_MAX_TOKENS = 16  # shorter inputs run the token-by-token form; longer ones the chunked form


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


class DecoderLayer(nn.Module):
    """Pre-norm residual block: mixer (GDN or attention), then the MLP (dense, or mixture-of-experts when `moe`).

    A few tokens over a warm cache (decode, draft and verify steps) run as compiled functions of fixed shape
    (see `compiled.py`): everything but the attention over the cache, whose length changes every step.
    """

    def __init__(self, args: ModelArgs, layer_type: str, moe: bool = False):
        super().__init__()
        self.is_linear = layer_type == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = Attention(args)
        self.mlp = make_mlp(args, moe)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if self.is_linear:
            self._gdn_step = PerThread(lambda x, conv, state: self._gdn_tokens(x, conv, state, record=False))
            self._gdn_recorded_step = PerThread(lambda x, conv, state: self._gdn_tokens(x, conv, state, record=True))
        else:
            self._attention_in = PerThread(lambda x, offset: self.self_attn.project(self.input_layernorm(x), offset))
            self._attention_out = PerThread(lambda x, out, g: self._feed_forward(x + self.self_attn.finish(out, g)))

    def __call__(self, x: mx.array, cache: LayerCache | RaggedKV | None, positions: mx.array | None = None) -> mx.array:
        if positions is not None:  # a prompt with images (or a step after one): 3-D rotary positions, plain path
            mixer = self.linear_attn(self.input_layernorm(x), cache) if self.is_linear else self.self_attn(
                self.input_layernorm(x), cache, positions)
            return self._feed_forward(x + mixer)
        if isinstance(cache, RaggedKV):
            return self._ragged_attention(x, cache)
        if cache is not None and x.shape[1] <= RECURRENT_MAX_TOKENS:
            if isinstance(cache, GDNCache) and cache.conv is not None:
                return self._compiled_gdn(x, cache)
            if isinstance(cache, KVCache):
                return self._compiled_attention(x, cache)
        mixer = self.linear_attn if self.is_linear else self.self_attn
        return self._feed_forward(x + mixer(self.input_layernorm(x), cache))

    def _feed_forward(self, h: mx.array) -> mx.array:
        return h + self.mlp(self.post_attention_layernorm(h))

    def _gdn_tokens(self, x: mx.array, conv: mx.array, state: mx.array, record: bool) -> list[mx.array]:
        """The whole layer over x [B, S, hidden] from (conv, state) -> [h, conv, state] (+ [conv_in, *states])."""
        cache = GDNCache()
        cache.conv, cache.recurrent = conv, state
        if record:
            cache.start_recording()
        h = self._feed_forward(x + self.linear_attn(self.input_layernorm(x), cache))
        recorded = [cache.recorded_conv_in, *cache.recorded_states] if record else []
        return [h, cache.conv, cache.recurrent, *recorded]

    def _compiled_gdn(self, x: mx.array, cache: GDNCache) -> mx.array:
        step = self._gdn_recorded_step if cache.recording else self._gdn_step
        h, cache.conv, cache.recurrent, *recorded = step(x, cache.conv, cache.recurrent)
        if cache.recording:
            cache.recorded_conv_in, *cache.recorded_states = recorded
        cache.offset += x.shape[1]
        return h

    def _compiled_attention(self, x: mx.array, cache: KVCache) -> mx.array:
        queries, keys, values, gate = self._attention_in(x, mx.array(cache.position))
        keys, values = cache.update_and_fetch(keys, values)  # [B, Hkv, offset+S, D]
        out = attend(queries, keys, values, scale=self.self_attn.head_dim**-0.5)  # [B, H, S, D]
        return self._attention_out(x, out, gate)

    def _ragged_attention(self, x: mx.array, cache: RaggedKV) -> mx.array:
        """A batch of requests, row i with cache.lengths[i] real tokens over its own KV (`RaggedKV`).

        Projections and the MLP run over the whole [B, S] block (weights read once for the batch); the attention
        proper runs row by row on the row's real tokens, the very shapes a request decoding alone runs.
        """
        B, S, _ = x.shape
        few = S <= RECURRENT_MAX_TOKENS  # the compiled pieces, as for one request (longer: the plain path)
        queries, keys, values, gate = (
            self._attention_in(x, cache.offsets) if few else self.self_attn.project(self.input_layernorm(x), cache.offsets)
        )  # [B, H, S, D], [B, Hkv, S, D] x2, [B, S, H, D]
        outs = []
        for i, (c, n) in enumerate(zip(cache.rows, cache.lengths)):
            k, v = c.update_and_fetch(keys[i : i + 1, :, :n], values[i : i + 1, :, :n])  # [1, Hkv, offset+n, D]
            out = attend(queries[i : i + 1, :, :n], k, v, scale=self.self_attn.head_dim**-0.5)  # [1, H, n, D]
            outs.append(out if n == S else mx.pad(out, [(0, 0), (0, 0), (0, S - n), (0, 0)]))
        out = mx.concatenate(outs) if B > 1 else outs[0]  # [B, H, S, D], zeros past each row's real tokens
        if few:
            return self._attention_out(x, out, gate)
        return self._feed_forward(x + self.self_attn.finish(out, gate))


class TextModel(nn.Module):
    """Embeddings, the decoder stack and the final norm; returns post-norm hidden states."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        moe = set(args.moe_layers)
        self.layers = [DecoderLayer(args, t, i in moe) for i, t in enumerate(args.layer_types)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, tokens: mx.array, cache: list[LayerCache] | None, embeddings: mx.array | None = None,
                 positions: mx.array | None = None) -> mx.array:
        """tokens [B, S] -> post-norm hidden [B, S, hidden]; `embeddings` [B, S, hidden] replace the token embeddings
        (images placed in the prompt), `positions` [3, S] are the attention layers' 3-D rotary positions."""
        h, positions = self.begin(tokens, embeddings, positions)
        for i in range(len(self.layers)):
            h = self.run_layer(i, h, positions, cache[i] if cache is not None else None)
        return self.end(h)

    # `__call__` in three steps, which the CPU prefill wavefront (`hetero.decode.wavefront`) runs layer by layer,
    # two chunks at once: the same ops in the same order per chunk.

    def begin(self, tokens: mx.array, embeddings: mx.array | None = None, positions: mx.array | None = None
              ) -> tuple[mx.array, mx.array | None]:
        """tokens [B, S] -> (the hidden entering layer 0 [B, S, hidden], what every layer takes besides: positions)."""
        return (self.embed_tokens(tokens) if embeddings is None else embeddings), positions

    def run_layer(self, i: int, h: mx.array, positions: mx.array | None, cache: LayerCache | None) -> mx.array:
        """Layer i: hidden [B, S, hidden] -> [B, S, hidden]; writes `cache` (layer i's own)."""
        return self.layers[i](h, cache, positions)

    def end(self, h: mx.array) -> mx.array:
        """After the last layer: the final norm -> post-norm hidden [B, S, hidden]."""
        return self.norm(h)


class MTPHead(nn.Module):
    """Multi-token prediction: one full-attention decoder layer fed [N(embed(t_{p+1})), N(h_p)].

    `h_p` is the backbone's post-norm hidden state at position p; the output is this head's post-norm hidden
    state, which feeds the shared lm_head (draft logits) and, for depth > 1, the head itself again.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.pre_fc_norm_embedding = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.fc = Linear(2 * args.hidden_size, args.hidden_size, bias=False)
        moe = set(args.mtp_moe_layers)
        self.layers = [DecoderLayer(args, "full_attention", j in moe) for j in range(max(1, args.mtp_num_hidden_layers))]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: list[KVCache] | None,
                 positions: mx.array | None = None) -> mx.array:
        z = mx.concatenate([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1)
        z = self.fc(z)  # [B, S, hidden]
        for i, layer in enumerate(self.layers):
            z = layer(z, cache[i] if cache is not None else None, positions)
        return self.norm(z)


class Model(nn.Module):
    """The whole causal LM: `model` (backbone), `lm_head` (unless tied) and, when present, `mtp`.

    `kv_quant` (None: full precision) is how `make_cache` stores the attention layers' KV (`hetero.models.kv_quant`).
    """

    kv_quant: KVQuant | None = None

    def __init__(self, args: ModelArgs, with_mtp: bool = False):
        super().__init__()
        self.args = args
        self.model = TextModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.mtp = MTPHead(args) if with_mtp else None

    @property
    def has_mtp(self) -> bool:
        return self.mtp is not None

    @property
    def hidden_width(self) -> int:
        """Width of the hidden `__call__` returns, which the MTP head reads and prefix checkpoints carry."""
        return self.args.hidden_size

    def __call__(self, tokens: mx.array, cache: ModelCache | None = None) -> tuple[mx.array, mx.array]:
        """tokens [B, S] -> (logits [B, S, vocab], post-norm hidden [B, S, hidden]); `cache` is `make_cache()`."""
        hidden = self.model(tokens, cache.backbone if cache is not None else None)
        return self.logits(hidden), hidden

    def logits(self, hidden: mx.array) -> mx.array:
        embed = self.model.embed_tokens
        if self.args.tie_word_embeddings:
            return project(hidden, embed.weight) if isinstance(embed, nn.Embedding) else embed.as_linear(hidden)
        return self.lm_head(hidden)

    def mtp_hidden(self, next_tokens: mx.array, hidden: mx.array, cache: list[KVCache] | None = None,
                   positions: mx.array | None = None, last: bool = False) -> mx.array:
        """MTP step: next_tokens [B, S] (t_{p+1}) with hidden [B, S, H] (h_p) -> the head's post-norm output.

        `cache` is the MTP layers' caches (`make_cache().mtp`); `positions` [3, S] the 3-D rotary positions of the
        p's (a prompt with images), else the caches' own. `last`: [B, 1, H], each row's last real position (a
        `RaggedKV` row's own length; Qwen4-Exp's head computes that position alone).
        """
        if self.mtp is None:
            raise HeteroError("this checkpoint has no MTP head (no mtp.* tensors): speculative decoding is unavailable")
        z = self.mtp(self.model.embed_tokens(next_tokens), hidden, cache, positions)
        return last_positions(z, cache[-1] if cache else None) if last else z

    def draft_logits(self, z: mx.array) -> mx.array:
        """The MTP head's output [B, S, H] -> draft logits [B, S, V]: the shared lm_head (its post-norm output
        needs nothing else here; Qwen4-Exp's head mixes its streams first)."""
        return self.logits(z)

    def mtp_forward(
        self, next_tokens: mx.array, hidden: mx.array, cache: list[KVCache] | None = None
    ) -> tuple[mx.array, mx.array]:
        """Draft step: (draft logits [B, S, V], MTP hidden [B, S, H]); see `mtp_hidden`."""
        z = self.mtp_hidden(next_tokens, hidden, cache)
        return self.draft_logits(z), z

    def make_cache(self) -> ModelCache:
        """One cache per backbone layer, then one per MTP layer; attention KV quantized when `kv_quant` is set."""
        kv = lambda: KVCache() if self.kv_quant is None else QuantizedKVCache(self.kv_quant)  # noqa: E731
        return ModelCache([GDNCache() if l.is_linear else kv() for l in self.model.layers],
                          [kv() for _ in self.mtp.layers] if self.mtp is not None else [])

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers
