"""Loading a checkpoint that passed the pre-flight check (`hetero.checkpoint.preflight`) into a model: its tensors
under canonical names, experts stacked shard by shard, the architecture's `sanitize`, the weights evaluated in the
compute dtype, the input projections fused."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx

from hetero.checkpoint.dtypes import default_dtype
from hetero.checkpoint.preflight import build_lazy_model, preflight, sanitize_for
from hetero.checkpoint.safetensors import checkpoint_tensors, mtp_drafter, norms_zero_centred, read_index
from hetero.checkpoint.source import read_config, resolve
from hetero.errors import HeteroError
from hetero.models.architectures import architecture, parse_args
from hetero.models.fused import fuse
from hetero.models.interface import Args, CausalLM
from hetero.models.weights import ExpertStacker, canonical_name, checkpoint_has_mtp, is_expert_tensor


def load_weights(path: Path, args: Args | None = None) -> dict[str, mx.array]:
    """All tensors of a checkpoint (after the pre-flight check vouched for the files), under canonical names,
    skipped ones (vision) left out.

    `mx.load` maps tensors lazily. Per-expert tensors (`...mlp.experts.{e}.*`, with `args`) are stacked into
    their `switch_mlp` parameter and evaluated as soon as a projection's experts have all been read, shard by
    shard, so the peak holds the stacked experts plus one projection's worth of single ones, never the whole
    model twice.
    """
    index = path / "model.safetensors.index.json"
    shards = sorted(set(read_index(index).values())) if index.is_file() else sorted(
        p.name for p in path.glob("*.safetensors")
    )
    stacker = ExpertStacker(args.num_experts) if args is not None and args.num_experts else None
    weights: dict[str, mx.array] = {}

    def read(file: Path, prefix: str) -> None:
        try:
            tensors = mx.load(str(file))
        except (RuntimeError, ValueError) as e:
            raise HeteroError(f"cannot read {file}: {e}; re-download it") from None
        for key in list(tensors):
            value = tensors.pop(key)  # the shard's dict must not keep a stacked expert's single tensors alive
            name = canonical_name(prefix + key)
            if name is None:
                continue
            if stacker is None or not is_expert_tensor(name):
                weights[name] = value
            elif (done := stacker.add(name, value)) is not None:
                mx.eval(done[1])  # reads this projection's experts now; their single tensors are dropped
                weights[done[0]] = done[1]

    for shard in shards:
        read(path / shard, "")
    drafter = mtp_drafter(path)
    if drafter is not None and not checkpoint_has_mtp(weights):  # mlx-vlm's drafter folder: the head, unprefixed
        for file in sorted(drafter.glob("*.safetensors")):
            read(file, "mtp.")
    if stacker is not None:
        stacker.check_complete()
    return weights


def load_model(model: str | os.PathLike | None = None, dtype: mx.Dtype | None = None,
               fuse_projections: bool = True) -> tuple[CausalLM, Path, dict]:
    """Check, then load a checkpoint: returns (model with evaluated weights, local directory, config dict).

    With `fuse_projections` (the default) each layer's input projections become one product (`models.fused`); the
    parameters keep the checkpoint's names either way. Load without it to change parameters afterwards (quantize).
    """
    report = preflight(model, dtype)
    if not report.ok:
        raise HeteroError(report.first_problem())
    path = resolve(model, weights=True)
    config = read_config(path)
    args = parse_args(config)
    weights = sanitize_for(args, load_weights(path, args), norms_zero_centred(path))
    quantized = {k[: -len(".scales")] for k in weights if k.endswith(".scales")}
    net = build_lazy_model(args, checkpoint_has_mtp(weights), quantized)
    # what the model reads from the checkpoint's files as needed (Qwen4-Exp's PLE tables) stays there
    architecture(args.model_type).keep_on_disk(net, weights, path, checkpoint_tensors(path)[0])
    net.load_weights(list(weights.items()), strict=True)
    dtype = dtype or default_dtype()
    net.set_dtype(dtype, lambda t: mx.issubdtype(t, mx.floating))
    for i, layer in enumerate(net.layers):  # the decay parameters stay fp32: exp(A_log) feeds the recurrence
        if layer.is_linear:
            layer.linear_attn.A_log = weights[f"model.layers.{i}.linear_attn.A_log"].astype(mx.float32)
    mx.eval(net.parameters())
    net.eval()
    del weights  # the loaded tensors: fusing replaces them with views of the products, one layer at a time
    if fuse_projections:
        fuse(net)
    return net, path, config
