"""Hyper-connections: hc_count residual streams [B, S, hc*d], mixed into one block input and written back.

    n = N_group(h)                                  RMSNorm per stream (d-wide groups), scale 1 + w
    mix = sigmoid(up(silu(down(n) / hc)))          [B, S, hc, d]
    x = mean_over_streams(mix * n)                  the block's input [B, S, d]
    inject = 2 sigmoid(block_inject(n) / hc)        [B, S, hc] (absent in the final mixer)
    h' = h + inject[..., None] * block(x)[..., None, :]
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from hetero.models import activations as act
from hetero.models.linear import Linear


class GroupedRMSNorm(nn.Module):
    """RMSNorm over each `group`-wide slice of the last axis; `weight` [dims] is the effective scale (1 + w)."""

    def __init__(self, dims: int, group: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.group, self.eps = group, eps

    def __call__(self, x: mx.array) -> mx.array:
        """x [..., dims] -> [..., dims] (fp32 inside, x's dtype out)."""
        shape = x.shape
        groups = x.astype(mx.float32).reshape(*shape[:-1], -1, self.group)  # [..., G, group]
        w = self.weight.astype(mx.float32).reshape(-1, self.group)  # [G, group]
        return (mx.fast.rms_norm(groups, None, self.eps) * w).reshape(shape).astype(x.dtype)


class GatedResidual(nn.Module):
    """One hyper-connection: `hc_norm`, the low-rank input mixer and (unless `final`) the stream injection weights.
    Names equal the checkpoint's (`attn_hyper_connection.*`, `mlp_hyper_connection.*`, `hyper_connection_mixer.*`)."""

    def __init__(self, hidden: int, hc: int, lowrank: int, eps: float, final: bool = False):
        super().__init__()
        self.hc, self.hidden = hc, hidden
        self.hc_norm = GroupedRMSNorm(hc * hidden, hidden, eps)
        self.input_mix_weight_down = Linear(hc * hidden, lowrank, bias=False)
        self.input_mix_weight_up = Linear(lowrank, hc * hidden, bias=False)
        if not final:
            self.block_inject_weight = Linear(hc * hidden, hc, bias=False)

    def mix(self, h: mx.array) -> tuple[mx.array, mx.array]:
        """Streams h [B, S, hc*d] -> (block input [B, S, d], normed streams [B, S, hc*d])."""
        B, S, _ = h.shape
        n = self.hc_norm(h)  # [B, S, hc*d]
        sigmoid = act.sigmoid_now if S >= act.EAGER_MIN_TOKENS else act.sigmoid  # a prefill chunk: numpy's exp
        w = sigmoid(self.input_mix_weight_up(act.silu(self.input_mix_weight_down(n) / self.hc)))  # [B, S, hc*d]
        mixed = (w * n).reshape(B, S, self.hc, self.hidden).mean(axis=-2)  # [B, S, d]
        return mixed, n

    def __call__(self, h: mx.array) -> mx.array:
        """The final mixer: streams [B, S, hc*d] -> [B, S, d]."""
        return self.mix(h)[0]

    def inject(self, n: mx.array) -> mx.array:
        """Normed streams n [B, S, hc*d] -> the per-stream weights of the block's output [B, S, hc]."""
        return 2 * act.sigmoid(self.block_inject_weight(n) / self.hc)

    # Where a block meets the streams (`hetero.models.interface.Residual`): `read` gives its input and the streams'
    # injection weights, `write` adds its output back. The split prefill runs them as separate jobs, with the
    # block's shares merged in between; `around` runs all three.

    def read(self, h: mx.array) -> tuple[mx.array, mx.array]:
        """Streams h [B, S, hc*d] -> (the block's input [B, S, d], the injection weights [B, S, hc])."""
        x, n = self.mix(h)
        return x, self.inject(n)

    def write(self, h: mx.array, out: mx.array, inject: mx.array) -> mx.array:
        """h [B, S, hc*d] plus the block's output out [B, S, d] weighted per stream by inject [B, S, hc]."""
        B, S, _ = h.shape
        return h + (inject[..., None] * out[..., None, :]).reshape(B, S, -1)

    def around(self, h: mx.array, block) -> mx.array:
        """h' = h + inject * block(mixed input), per stream: h [B, S, hc*d] -> [B, S, hc*d]."""
        x, inject = self.read(h)
        return self.write(h, block(x), inject)
