"""A Qwen4-Exp decoder layer's few-token step (decode, verify, MTP draft) as compiled functions of fixed shape.

A decode step of the uncompiled layer stack is ~3,200 small MLX ops (hyper-connection mixers, grouped norms,
router, GDN step, PLE gate and conv, QSA projections); on MLX's CPU backend dispatching them, not arithmetic,
set the step's time. As Qwen3.5's layers do (`qwen3_5.DecoderLayer`, `compiled.py`), everything of a layer but
what changes shape every step runs as one compiled function per shape:

  GDN layer   [h, conv, state (, n-gram rows, PLE conv window)] -> [h', conv', state' (, PLE conv inputs)]:
              the PLE update, both hyper-connections, the delta rule and the MoE block; the PLE's n-grams are
              hashed and their rows gathered on the host first (`PLELayer.embed`), as outside the step.
  QSA layer   `attention_in`: h -> the attention's and the indexer's projections and the streams' injection
              weights; then the indexer's choice and the attention over the grown cache (uncompiled: T grows;
              a batch's rows each over their own cache, `QSAAttention.attend_rows`);
              `attention_out`: the output gate, o_proj, the injection, and the MLP hyper-connection around the MoE.

Same ops as the uncompiled layer (`DecoderLayer.__call__` runs them for prefill chunks and cold caches), fused.
The MTP head's layer also runs here when only each row's last position is read (`last`: a catch-up before a draft,
a prefill chunk's pairs): every position's keys are written, the attention proper, o_proj and the MoE run for that
position alone (`_project` and `_finish` uncompiled past a few positions).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from hetero.models.cache import GDNCache, RaggedKV, last_positions
from hetero.models.choices import recording
from hetero.models.compiled import PerThread
from hetero.models.gated_delta import RECURRENT_MAX_TOKENS
from hetero.models.qwen4_exp.qsa import QSACache


class LayerSteps:
    """The compiled step of one `model.DecoderLayer` (see the module docstring); `run` when `takes` says so."""

    def __init__(self, layer) -> None:
        self.layer = layer
        if layer.is_linear:
            self._gdn = PerThread(lambda h, conv, state, *ple: self._gdn_tokens(h, conv, state, ple, record=False))
            self._gdn_recorded = PerThread(lambda h, conv, state, *ple: self._gdn_tokens(h, conv, state, ple,
                                                                                          record=True))
        else:
            self._attention_in = PerThread(self._project)
            self._attention_out = PerThread(self._finish)

    def takes(self, h: mx.array, cache) -> bool:
        """Whether the step runs compiled: a few tokens over a warm cache of this layer's own kind, or a batch's
        rows' (`RaggedKV`) all warm (cold caches take the uncompiled layer, and so does a run whose choices are
        recorded: `hetero.models.choices.recording`)."""
        if cache is None or h.shape[1] > RECURRENT_MAX_TOKENS or recording():
            return False
        if self.layer.is_linear:
            ple = getattr(cache, "ple", None)
            return cache.conv is not None and (ple is None or ple.conv is not None)
        rows = cache.rows if isinstance(cache, RaggedKV) else [cache]
        return all(isinstance(c, QSACache) and c.keys is not None for c in rows)

    def run(self, h: mx.array, tokens: np.ndarray, cache, last: bool = False) -> mx.array:
        """h [B, S, hc*d] and the chunk's token ids [B, S] over `cache` -> h' [B, S, hc*d]; updates `cache`.
        `last`: h' [B, 1, hc*d] of each row's last real position alone (`DecoderLayer.__call__`)."""
        if self.layer.is_linear:
            h = self._gdn_step(h, tokens, cache)
            return last_positions(h, cache) if last else h
        return self._qsa_step(h, cache, last)

    # GDN layers -------------------------------------------------------------------------------------------

    def _gdn_step(self, h: mx.array, tokens: np.ndarray, cache: GDNCache) -> mx.array:
        ple, ple_in = cache.ple if self.layer.ple is not None else None, []
        if ple is not None:
            ple_in = [self.layer.ple.embed(tokens, ple, h.shape[0]).astype(h.dtype), ple.conv]  # [B, S, E], window
        step = self._gdn_recorded if cache.recording else self._gdn
        h, cache.conv, cache.recurrent, *rest = step(h, cache.conv, cache.recurrent, *ple_in)
        if ple is not None:
            conv_in, *rest = rest  # [B, window+S, hc*d]
            ple.conv = conv_in[:, -self.layer.ple.state_len :]
            if ple.recording:
                ple.recorded_conv_in = conv_in
        if cache.recording:
            cache.recorded_conv_in, *cache.recorded_states = rest
        cache.offset += h.shape[1]
        return h

    def _gdn_tokens(self, h: mx.array, conv: mx.array, state: mx.array, ple: tuple, record: bool) -> list[mx.array]:
        """The whole GDN layer over h [B, S, hc*d] from (conv, state) and, on a PLE layer, (n-gram rows, PLE
        window) -> [h', conv', state', (PLE conv inputs,) (conv inputs, *states while recording)]."""
        layer, cache = self.layer, GDNCache()
        cache.conv, cache.recurrent = conv, state
        if record:
            cache.start_recording()
        out = []
        if ple:
            update, conv_in = layer.ple.mix(h, *ple)
            h, out = h + update, [conv_in]
        h = layer.attn_hyper_connection.around(h, lambda x: layer.linear_attn(x, cache))
        h = layer.mlp_hyper_connection.around(h, layer.mlp)
        recorded = [cache.recorded_conv_in, *cache.recorded_states] if record else []
        return [h, cache.conv, cache.recurrent, *out, *recorded]

    # QSA layers -------------------------------------------------------------------------------------------

    def _qsa_step(self, h: mx.array, cache: QSACache | RaggedKV, last: bool) -> mx.array:
        attn, ragged = self.layer.self_attn, isinstance(cache, RaggedKV)
        offset = [c.offset for c in cache.rows] if ragged else cache.offset  # a batch: each row's own
        few = h.shape[1] <= RECURRENT_MAX_TOKENS  # else a prefill chunk's pairs for the MTP head (`last`): uncompiled
        project, finish = (self._attention_in, self._attention_out) if few else (self._project, self._finish)
        queries, keys, values, gate, inject, *index = project(h, mx.array(offset))
        index = tuple(index) if index else None
        if ragged:
            out = attn.attend_rows(queries, keys, values, index, cache, last)  # [B, H, S or 1, D]
        else:
            out = attn._attend(queries, keys, values, index, cache, offset, last)  # [B, H, S or 1, D]
        if last:  # the rows' last positions alone go on through the output projection and the MoE
            h, inject, gate = (last_positions(x, cache) for x in (h, inject, gate))
        return finish(h, inject, out, gate)

    def _project(self, h: mx.array, offset: mx.array) -> list[mx.array]:
        """h [B, S, hc*d] at positions offset.. -> [queries, keys, values, gate, injection weights [B, S, hc]
        (, index queries, raw index keys)] (`QSAAttention.project`, `Indexer.project`)."""
        layer = self.layer
        x, n = layer.attn_hyper_connection.mix(h)  # [B, S, d], [B, S, hc*d]
        attn = layer.self_attn
        index = list(attn.indexer.project(x)) if attn.indexer is not None else []
        return [*attn.project(x, offset), layer.attn_hyper_connection.inject(n), *index]

    def _finish(self, h: mx.array, inject: mx.array, out: mx.array, gate: mx.array) -> mx.array:
        """The attention's output [B, H, S, D] with its gate -> the layer's output streams [B, S, hc*d]."""
        layer = self.layer
        h = layer.attn_hyper_connection.write(h, layer.self_attn.finish(out, gate), inject)
        return layer.mlp_hyper_connection.around(h, layer.mlp)
