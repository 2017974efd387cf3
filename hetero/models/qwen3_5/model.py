"""Qwen3.5 / Qwen3.6 / Qwen3-Next hybrid models (Gated DeltaNet + gated full attention) with the MTP head: the
decoder layer (and the pieces the split takes of it), the backbone, the MTP head and the causal LM; the blocks
(attention, GDN, MLP, RMSNorm) are in `layers`.

One implementation serves `qwen3_5` (nested `text_config`), `qwen3_5_text` (flat), their mixture-of-experts
siblings `qwen3_5_moe` / `qwen3_5_moe_text`, and `qwen3_next` (fused GDN input projections, un-fused by
`weights.sanitize`; dense or with experts). MoE layers use `moe.SparseMoeBlock`. Attribute names equal the
(canonical) checkpoint names: `model.*` for the backbone, `lm_head`, `mtp.*`. Norm weights are held shifted (1 + w), so every RMSNorm here
is a plain `x * rsqrt(mean(x^2) + eps) * w`; `weights.sanitize` applies the shift exactly once.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from hetero.errors import HeteroError
from hetero.models.attention import attend
from hetero.models.cache import GDNCache, KVCache, LayerCache, ModelCache, RaggedKV, last_positions
from hetero.models.compiled import PerThread
from hetero.models.gated_delta import RECURRENT_MAX_TOKENS
from hetero.models.kv_quant import KVQuant, QuantizedKVCache
from hetero.models.linear import Linear, project
from hetero.models.qwen3_5.args import ModelArgs
from hetero.models.qwen3_5.layers import Attention, GatedDeltaNet, RMSNorm, make_mlp


class PreNorm:
    """Where a pre-norm block meets the residual stream (`hetero.models.interface.Residual`): it reads N(h) and
    adds its output back, h' = h + out."""

    def __init__(self, norm: RMSNorm):
        self.norm = norm

    def read(self, h: mx.array) -> tuple[mx.array, None]:
        return self.norm(h), None  # [B, S, hidden]

    @staticmethod
    def write(h: mx.array, out: mx.array, _: None) -> mx.array:
        return h + out


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
            self._attention_out = PerThread(lambda x, out, g: self.mlp_block(x + self.self_attn.finish(out, g)))

    def __call__(self, x: mx.array, cache: LayerCache | RaggedKV | None, positions: mx.array | None = None) -> mx.array:
        if positions is None and isinstance(cache, RaggedKV):
            return self._ragged_attention(x, cache)
        if positions is None and cache is not None and x.shape[1] <= RECURRENT_MAX_TOKENS:
            if isinstance(cache, GDNCache) and cache.conv is not None:
                return self._compiled_gdn(x, cache)
            if isinstance(cache, KVCache):
                return self._compiled_attention(x, cache)
        # a prefill chunk, a cold cache, or a prompt with images (3-D rotary `positions`): the plain path
        return self.mlp_block(self.mixer_block(x, cache, positions=positions))

    # The layer's pieces, as the split prefill runs them one by one (`hetero.models.interface.DecoderLayer`): each
    # block reads its input from the residual stream and writes its output back through its `PreNorm`.

    @property
    def mixer_io(self) -> PreNorm:
        return PreNorm(self.input_layernorm)

    @property
    def mlp_io(self) -> PreNorm:
        return PreNorm(self.post_attention_layernorm)

    pre_mixer_state = False  # nothing runs before the mixer

    def before_mixer(self, h: mx.array, tokens, cache) -> mx.array:
        return h

    def mixer(self, x: mx.array, cache: LayerCache | None, positions: mx.array | None = None) -> mx.array:
        """The normed input x [B, S, hidden] -> the mixer's output [B, S, hidden] (GDN, or attention rotating by
        `positions` [3, S] when given); advances `cache`."""
        return self.linear_attn(x, cache) if self.is_linear else self.self_attn(x, cache, positions)

    def mixer_block(self, h: mx.array, cache: LayerCache | None, tokens=None,
                    positions: mx.array | None = None) -> mx.array:
        """h + mixer(N(h)): [B, S, hidden] -> [B, S, hidden]."""
        x, ctx = self.mixer_io.read(h)
        return self.mixer_io.write(h, self.mixer(x, cache, positions), ctx)

    def mlp_block(self, h: mx.array) -> mx.array:
        """h + mlp(N(h)): [B, S, hidden] -> [B, S, hidden]."""
        x, ctx = self.mlp_io.read(h)
        return self.mlp_io.write(h, self.mlp(x), ctx)

    def _gdn_tokens(self, x: mx.array, conv: mx.array, state: mx.array, record: bool) -> list[mx.array]:
        """The whole layer over x [B, S, hidden] from (conv, state) -> [h, conv, state] (+ [conv_in, *states])."""
        cache = GDNCache()
        cache.conv, cache.recurrent = conv, state
        if record:
            cache.start_recording()
        h = self.mlp_block(x + self.linear_attn(self.input_layernorm(x), cache))
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
        return self.mlp_block(x + self.self_attn.finish(out, gate))


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

    on_disk: list[tuple[str, int]] = []  # every parameter is held in memory (nothing read from the files as needed)

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
