"""Where a split piece reads its input from the residual stream and writes its output back, for each family.

Qwen3.5 / Qwen3-Next (pre-norm):  x = N(h);                 h' = h + out
Qwen4-Exp (hyper-connections):    x, n = hc.mix(h);          h' = h + inject(n) (x) out   (per stream, [B, S, hc*d])

The ANE's programs read x only: the Qwen4-Exp hyper-connection mixers (and the PLE block before a layer's mixer)
run on the GPU lane, exactly as the model runs them, and the merged block output is written through the same
`GatedResidual.write` the model's `around` uses. `read` gives (x, what `write` needs besides h and out).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from hetero.models.qwen4_exp.hyper import GatedResidual


class PreNorm:
    """h -> (norm(h), None); h' = h + out."""

    def __init__(self, norm):
        self.norm = norm

    def read(self, h: mx.array) -> tuple[mx.array, None]:
        return self.norm(h), None  # [1, S, hidden]

    @staticmethod
    def write(h: mx.array, out: mx.array, _: None) -> mx.array:
        return h + out


class Hyper:
    """Streams h [1, S, hc*d] -> (the block input [1, S, d], the injection weights [1, S, hc]);
    h' = h + inject (x) out."""

    def __init__(self, hc: GatedResidual):
        self.hc = hc

    def read(self, h: mx.array) -> tuple[mx.array, mx.array]:
        x, n = self.hc.mix(h)  # [1, S, d], [1, S, hc*d]
        return x, self.hc.inject(n)  # [1, S, d], [1, S, hc]

    def write(self, h: mx.array, out: mx.array, inject: mx.array) -> mx.array:
        return self.hc.write(h, inject, out)


def is_hyper(model) -> bool:
    """A Qwen4-Exp model (hc streams, PLE, QSA)."""
    return hasattr(model.model, "hyper_connection_mixer")


def mixer_io(layer) -> PreNorm | Hyper:
    """How layer's mixer (GDN or attention) meets the residual stream."""
    if hasattr(layer, "attn_hyper_connection"):
        return Hyper(layer.attn_hyper_connection)
    return PreNorm(layer.input_layernorm)


def mlp_io(layer) -> PreNorm | Hyper:
    """How layer's MLP (dense or MoE) meets the residual stream."""
    if hasattr(layer, "mlp_hyper_connection"):
        return Hyper(layer.mlp_hyper_connection)
    return PreNorm(layer.post_attention_layernorm)


def embed(model, piece: mx.array) -> mx.array:
    """Token ids [1, S] -> the residual stream the first layer reads: [1, S, hidden], or Qwen4-Exp's hc copies
    [1, S, hc*d]."""
    h = model.model.embed_tokens(piece)  # [1, S, hidden]
    return mx.tile(h, (1, 1, model.model.hc)) if is_hyper(model) else h


def ple(layer, h: mx.array, tokens: np.ndarray, cache) -> mx.array:
    """The PLE update of a Qwen4-Exp PLE layer, added before its mixer (h as is on every other layer); advances the
    PLE cache. tokens [1, S] int64 on the host."""
    if getattr(layer, "ple", None) is None:
        return h
    return h + layer.ple(h, tokens, cache.ple)  # [1, S, hc*d]


def has_ple(layer) -> bool:
    """A Qwen4-Exp PLE layer: its PLE cache carries the last chunk's tokens and conv inputs into the next."""
    return getattr(layer, "ple", None) is not None


def final_hidden(model, h: mx.array) -> mx.array:
    """The last layer's stream -> the hidden `Model.logits` and the MTP head read: Qwen3.5's post-norm hidden, or
    Qwen4-Exp's streams as they are (its final mixer is part of `logits`)."""
    return h if is_hyper(model) else model.model.norm(h)
