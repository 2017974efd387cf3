"""Qwen3.5-family checkpoint tensors -> the model's parameters: canonical names (HF nested, mlx-lm nested, flat),
vision tensors skipped, Qwen3-Next's fused projections un-fused, experts stacked, the conv layout, and the
zero-centred norms' +1 applied exactly once (`sanitize`)."""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx

from hetero.errors import HeteroError
from hetero.models.args import ModelArgs


_NORM_SUFFIXES = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")
_MTP_NORMS = ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.", "model.language_model.visual.")
# Qwen4-Exp PLE shards as mlx-vlm 0.7.10 converts them (`...ngram_embedding.shards.{i}.*`, a list of embeddings)
_MLX_VLM_PLE_SHARD = re.compile(r"\.ngram_embedding\.shards\.(\d+)(?=\.|$)")


def canonical_name(key: str) -> str | None:
    """Map a checkpoint tensor name onto this model's naming; None for tensors we deliberately skip (vision).

    Accepts HF nested (`model.language_model.*`), mlx-lm / mlx-vlm nested (`language_model.model.*`) and flat
    (`model.*`); mlx-vlm's Qwen4-Exp PLE shards `ngram_embedding.shards.{i}.*` become transformers'
    `ngram_embedding.shard_{i}.*`. Unknown names come back unchanged so that the pre-flight check can report them.
    """
    if key.startswith(_SKIPPED_PREFIXES):
        return None
    key = _MLX_VLM_PLE_SHARD.sub(r".ngram_embedding.shard_\1", key)
    for prefix, repl in (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("language_model.mtp.", "mtp."),
        ("model.mtp.", "mtp."),
    ):
        if key.startswith(prefix):
            return repl + key[len(prefix) :]
    return key


def is_zero_centred_norm(name: str) -> bool:
    """Norms stored as w with effective scale 1 + w (every RMSNorm except the GDN output norm)."""
    return name.endswith(_NORM_SUFFIXES) or name == "model.norm.weight" or name in _MTP_NORMS


_FUSED = re.compile(r"(.*linear_attn)\.in_proj_(qkvz|ba)\.(weight|scales|biases)$")
# Routed experts as HF writes them: one tensor per expert (save_pretrained, the released checkpoints; quantized one
# by one in mlx-vlm's 4-bit MTP drafters, with scales and biases) ...
_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")
# ... or transformers 5's in-memory layout, all experts in one tensor: gate_up_proj [E, 2I, H], down_proj [E, H, I]
_EXPERTS_FUSED = re.compile(r"(.*\.mlp)\.experts\.(gate_up_proj|down_proj)$")


def unfused_names(name: str) -> list[str]:
    """Parameter names a checkpoint tensor (canonical name) feeds: a (Qwen3-Next) fused GDN projection feeds two,
    an expert tensor its stacked `switch_mlp` parameter(s); [name] for everything else."""
    m = _FUSED.match(name)
    if m:
        parts = ("qkv", "z") if m.group(2) == "qkvz" else ("b", "a")
        return [f"{m.group(1)}.in_proj_{p}.{m.group(3)}" for p in parts]
    m = _EXPERT.match(name)
    if m:
        return [f"{m.group(1)}.switch_mlp.{m.group(3)}.{m.group(4)}"]
    m = _EXPERTS_FUSED.match(name)
    if m:
        parts = ("gate_proj", "up_proj") if m.group(2) == "gate_up_proj" else ("down_proj",)
        return [f"{m.group(1)}.switch_mlp.{p}.weight" for p in parts]
    return [name]


class ExpertStacker:
    """Stacks per-expert tensors (`...mlp.experts.{e}.gate_proj.weight`, or its `.scales` / `.biases`, canonical
    names) into `switch_mlp` parameters [experts, out, in] as each projection's experts arrive, so a loader that feeds it shard by shard
    holds at most the unfinished groups' tensors besides the stacked ones.
    """

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.pending: dict[str, dict[int, mx.array]] = {}  # stacked name -> {expert: tensor}

    def add(self, name: str, value: mx.array) -> tuple[str, mx.array] | None:
        """Take one expert tensor; returns (stacked name, [E, out, in]) once its group is complete, else None."""
        m = _EXPERT.match(name)
        if m is None:
            raise ValueError(f"{name} is not a per-expert tensor")
        target, expert = unfused_names(name)[0], int(m.group(2))
        if expert >= self.num_experts:
            raise HeteroError(f"tensor {name}: expert {expert} but config.json says num_experts {self.num_experts}")
        group = self.pending.setdefault(target, {})
        group[expert] = value
        if len(group) < self.num_experts:
            return None
        del self.pending[target]
        return target, mx.stack([group[e] for e in range(self.num_experts)])  # [E, out, in]

    def check_complete(self) -> None:
        """Raise if a projection still misses experts (an incomplete checkpoint)."""
        for target, group in self.pending.items():
            absent = sorted(set(range(self.num_experts)) - set(group))
            more = f" (and {len(absent) - 3} more)" if len(absent) > 3 else ""
            raise HeteroError(f"{target}: the checkpoint has no tensor for expert(s) {absent[:3]}{more} of "
                              f"{self.num_experts}: it is incomplete")


def is_expert_tensor(name: str) -> bool:
    """Whether a (canonical) name is one expert's projection, which `ExpertStacker` stacks."""
    return _EXPERT.match(name) is not None


def _split_fused_experts(out: dict[str, mx.array]) -> None:
    """experts.gate_up_proj [E, 2I, H] -> switch_mlp gate/up [E, I, H] each; experts.down_proj [E, H, I] as is."""
    for name in [n for n in out if _EXPERTS_FUSED.match(n)]:
        value, targets = out.pop(name), unfused_names(name)
        if len(targets) == 2:
            half = value.shape[1] // 2
            out[targets[0]], out[targets[1]] = value[:, :half], value[:, half:]
        else:
            out[targets[0]] = value


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


def hf_conv_layout(weights: dict[str, mx.array], zero_centred: bool) -> bool:
    """Whether the norms are stored zero-centred: original HF checkpoints store conv1d as [C, 1, K] and zero-centred
    norms, converted (MLX) ones [C, K, 1] with the +1 already applied, so the conv layout tells which; a checkpoint
    without a GDN conv (every layer attention) takes `zero_centred`, what its files' writer says
    (`hetero.checkpoint.loader.norms_zero_centred`)."""
    convs = [v for k, v in weights.items() if k.endswith("conv1d.weight")]
    return any(v.shape[-1] != 1 for v in convs) if convs else zero_centred


def sanitize(args: ModelArgs, weights: dict[str, mx.array], zero_centred: bool = True) -> dict[str, mx.array]:
    """Checkpoint tensors -> this model's parameters: rename, skip vision, un-fuse, stack experts, conv layout,
    norm shift.

    Routed experts come per expert (stacked here, lazily; `hetero.checkpoint.loader` stacks them shard by shard before),
    fused (`experts.gate_up_proj`, split here) or already stacked under mlx-lm's `switch_mlp` names.

    The norms' +1 is applied exactly once: where the checkpoint stores them zero-centred (`hf_conv_layout`;
    `zero_centred` for a layout without a GDN conv).
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
        m = _FUSED.match(name)
        if m:
            first, second = unfused_names(name)
            out[first], out[second] = _unfuse(args, m.group(2), out.pop(name))
    return finish(out, args.num_experts, hf_layout, is_zero_centred_norm)


def finish(out: dict[str, mx.array], num_experts: int, hf_layout: bool, zero_centred) -> dict[str, mx.array]:
    """The steps every architecture's `sanitize` ends with, on canonical names: experts stacked (per-expert
    tensors) or split (fused `gate_up_proj`), conv1d [C, 1, K] -> [C, K, 1], and, in an original HF checkpoint
    (`hf_layout`), +1 on the norms `zero_centred(name)` names."""
    experts = [n for n in out if is_expert_tensor(n)]
    if experts:
        stacker = ExpertStacker(num_experts)
        for name in experts:
            done = stacker.add(name, out.pop(name))
            if done is not None:
                out[done[0]] = done[1]
        stacker.check_complete()
    _split_fused_experts(out)
    for name, value in out.items():
        if name.endswith("conv1d.weight") and value.shape[-1] != 1:
            out[name] = value.swapaxes(1, 2)  # [C, 1, K] -> [C, K, 1]
        elif hf_layout and zero_centred(name):
            out[name] = value.astype(mx.float32) + 1.0
    return out


def checkpoint_has_mtp(names: Any) -> bool:
    """Whether a set of checkpoint tensor names carries an MTP head."""
    return any((canonical_name(n) or "").startswith("mtp.") for n in names)
