"""Qwen3.5-family checkpoint tensors -> the model's parameters (`sanitize`): canonical names, vision tensors
skipped, Qwen3-Next's fused GDN projections un-fused, experts stacked, the conv layout, and the zero-centred norms'
+1 applied exactly once."""

from __future__ import annotations

import mlx.core as mx

from hetero.models.qwen3_5.args import ModelArgs
from hetero.models.weights import FUSED, canonical_name, finish, hf_conv_layout, unfused_names

_NORM_SUFFIXES = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")
_MTP_NORMS = ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")


def is_zero_centred_norm(name: str) -> bool:
    """Norms stored as w with effective scale 1 + w (every RMSNorm except the GDN output norm)."""
    return name.endswith(_NORM_SUFFIXES) or name == "model.norm.weight" or name in _MTP_NORMS


def _unfuse(args: ModelArgs, kind: str, w: mx.array) -> tuple[mx.array, mx.array]:
    """Split a fused projection's rows (grouped per key head) into the Qwen3.5 layout."""
    nk, dk, dv, r = args.linear_num_key_heads, args.linear_key_head_dim, args.linear_value_head_dim, (
        args.linear_num_value_heads // args.linear_num_key_heads
    )
    grouped = w.reshape(nk, -1, *w.shape[1:])  # [nk, per-group rows, in]
    if kind == "qkvz":
        q, k, v, z = mx.split(grouped, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
        flat = lambda t: t.reshape(-1, *w.shape[1:])  # noqa: E731
        return mx.concatenate([flat(q), flat(k), flat(v)], axis=0), flat(z)
    b, a = mx.split(grouped, [r], axis=1)
    return b.reshape(-1, *w.shape[1:]), a.reshape(-1, *w.shape[1:])


def sanitize(args: ModelArgs, weights: dict[str, mx.array], zero_centred: bool = True) -> dict[str, mx.array]:
    """Checkpoint tensors -> this model's parameters: rename, skip vision, un-fuse, stack experts, conv layout,
    norm shift.

    Routed experts come per expert (stacked here, lazily; `hetero.checkpoint.loader` stacks them shard by shard before),
    fused (`experts.gate_up_proj`, split here) or already stacked under mlx-lm's `switch_mlp` names.

    The norms' +1 is applied exactly once: where the checkpoint stores them zero-centred (`hf_conv_layout`: the
    GDN conv's layout tells; `zero_centred`, what the files' writer says, for a layout without a GDN conv).
    """
    out: dict[str, mx.array] = {}
    for key, value in weights.items():
        name = canonical_name(key)
        if name is not None:
            out[name] = value
    hf_layout = hf_conv_layout(out, zero_centred)
    if args.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    for name in list(out):
        m = FUSED.match(name)
        if m:
            first, second = unfused_names(name)
            out[first], out[second] = _unfuse(args, m.group(2), out.pop(name))
    return finish(out, args.num_experts, hf_layout, is_zero_centred_norm)
