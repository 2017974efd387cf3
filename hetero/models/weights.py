"""Checkpoint tensor names every architecture shares: canonical names (HF nested, mlx-lm nested, flat; vision
tensors skipped), the parameters a fused or per-expert tensor feeds, experts stacked, and the steps every
architecture's `sanitize` ends with (`finish`: experts, the conv layout, the zero-centred norms' +1 exactly once)."""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx

from hetero.errors import HeteroError


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


FUSED = re.compile(r"(.*linear_attn)\.in_proj_(qkvz|ba)\.(weight|scales|biases)$")
# Routed experts as HF writes them: one tensor per expert (save_pretrained, the released checkpoints; quantized one
# by one in mlx-vlm's 4-bit MTP drafters, with scales and biases) ...
_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")
# ... or transformers 5's in-memory layout, all experts in one tensor: gate_up_proj [E, 2I, H], down_proj [E, H, I]
_EXPERTS_FUSED = re.compile(r"(.*\.mlp)\.experts\.(gate_up_proj|down_proj)$")


def unfused_names(name: str) -> list[str]:
    """Parameter names a checkpoint tensor (canonical name) feeds: a (Qwen3-Next) fused GDN projection feeds two,
    an expert tensor its stacked `switch_mlp` parameter(s); [name] for everything else."""
    m = FUSED.match(name)
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


def hf_conv_layout(weights: dict[str, mx.array], zero_centred: bool) -> bool:
    """Whether the norms are stored zero-centred: original HF checkpoints store conv1d as [C, 1, K] and zero-centred
    norms, converted (MLX) ones [C, K, 1] with the +1 already applied, so the conv layout tells which; a checkpoint
    without a GDN conv (every layer attention) takes `zero_centred`, what its files' writer says
    (`hetero.checkpoint.safetensors.norms_zero_centred`)."""
    convs = [v for k, v in weights.items() if k.endswith("conv1d.weight")]
    return any(v.shape[-1] != 1 for v in convs) if convs else zero_centred


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
