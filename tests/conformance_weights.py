"""Weights for the conformance harness: random, but shaped like a trained model's, on any of transformers' Qwen
models (`randomize`); real LLMs' massive activations added where a draw asks (`add_outliers`); and an MTP head in
the released naming for the Qwen3.5 family (`add_mtp`), which transformers neither builds nor saves.

Trained-like means: zero-centred norms carry noise (`norm_std`), the final norm sits near scale 2 so the logits
spread over a few units, the GDN decays spread from weak (exp(A_log) = 0.05) to strong (5), projections are
N(0, gain^2 / fan_in) so every block moves the residual stream without blowing it up, routers are spread
(`router_gain`) so that top-k choices are clear, the vision tower's LayerNorms sit near 1 with small biases.
Transformers' own init (std 0.02, norms at their identity) gives near-constant logits and near-tied routers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from outliers import inject

_FINAL_NORMS = ("model.norm.weight", "model.language_model.norm.weight")


def _vision(name: str) -> bool:
    return "visual." in name


def _value(name: str, shape: tuple[int, ...], randn, rand, style: dict) -> torch.Tensor | None:
    """The random value of one parameter by its name (None: keep transformers' init)."""
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
    if _vision(name):
        if name.endswith("weight") and "norm" in name:  # LayerNorm: plain scale
            return 1.0 + 0.1 * randn(shape)
        if name.endswith("bias"):
            return 0.05 * randn(shape)
        if "pos_embed" in name:
            return 0.5 * randn(shape)
        return randn(shape) / math.sqrt(shape[-1] if len(shape) == 2 else fan_in)
    if name.endswith("linear_attn.norm.weight"):  # GDN output norm: plain scale w
        return 0.5 + rand(shape)
    if name in _FINAL_NORMS:
        return 1.0 + 0.3 * randn(shape)
    if "norm" in name and len(shape) == 1:  # zero-centred: scale 1 + w
        return style.get("norm_std", 0.3) * randn(shape)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(math.log(0.05), math.log(5.0), generator=randn.gen)
    if name.endswith("dt_bias"):
        return randn(shape)
    if name.endswith("conv1d.weight"):
        return 0.5 * randn(shape)
    if "ngram_embedding" in name:
        return randn(shape)
    if name.endswith("embed_tokens.weight"):
        return style.get("embed_std", 0.2) * randn(shape)
    if name.endswith("lm_head.weight"):
        return 2.0 * randn(shape) / math.sqrt(shape[1])
    if name.endswith("mlp.gate.weight"):  # the router
        return style.get("router_gain", 1.0) * randn(shape) / math.sqrt(shape[-1])
    if name.endswith("_proj.bias"):  # attention biases
        return 0.1 * randn(shape)
    if len(shape) >= 2:  # projections, stacked experts [E, out, in] included
        return style.get("gain", 1.0) * randn(shape) / math.sqrt(shape[-1])
    return None


def randomize(model, seed: int, style: dict) -> None:
    """Overwrite the parameters of a transformers Qwen model (any of this family, tower included) with
    trained-like random values (module docstring), reproducibly from `seed`."""
    gen = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=gen)

    randn.gen = gen
    rand = lambda shape: torch.rand(shape, generator=gen)  # noqa: E731
    with torch.no_grad():
        for name, p in model.named_parameters():
            value = _value(name, tuple(p.shape), randn, rand, style)
            if value is not None:
                p.copy_(value)


def mlp_prefix(model, layer: int) -> str | None:
    """The name prefix of layer `layer`'s dense MLP or shared expert (where massive activations go), or None."""
    names = dict(model.named_parameters())
    for base in ("model.layers.", "model.language_model.layers."):
        for mlp in ("mlp.", "mlp.shared_expert."):
            prefix = f"{base}{layer}.{mlp}"
            if prefix + "gate_proj.weight" in names:
                return prefix
    return None


def add_outliers(model, outliers: dict, seed: int) -> None:
    """Massive activations in `model`'s MLPs (`outliers.inject`): in each layer of outliers["layers"], four channels
    whose gate x up reaches gain^2 t^2 write residual channel outliers["channel"] up to ~outliers["residual"]."""
    state = {k: v.detach().numpy() for k, v in model.named_parameters()}
    edited = dict(state)
    for layer in outliers["layers"]:
        prefix = mlp_prefix(model, layer)
        if prefix is not None:
            edited = inject(edited, [layer], outliers["gain"], seed, mlp=prefix, massive=outliers["channel"],
                            residual=outliers["residual"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if edited[name] is not state[name]:
                p.copy_(torch.from_numpy(np.ascontiguousarray(edited[name])))


def add_mtp(path: Path, seed: int, style: dict) -> None:
    """Write a random MTP head into a saved Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoint under the released names
    (`mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.norm`, `mtp.layers.0.*`, routed experts one by one), with the shapes
    hetero's model gives its head, and declare it (`mtp_num_hidden_layers: 1`)."""
    import hetero  # noqa: F401  (the fast BLAS before MLX)
    from mlx.utils import tree_flatten
    from safetensors.numpy import load_file, save_file

    from hetero.checkpoint.preflight import build_lazy_model
    from hetero.models.qwen3_5.args import ModelArgs

    file = path / "config.json"
    config = json.loads(file.read_text())
    shapes = {**(config.get("text_config") or config), "mtp_num_hidden_layers": 1, "rope_parameters": None,
              "hidden_act": "silu"}  # shapes alone: the fields hetero refuses do not change them
    args = ModelArgs.from_config({**config, **({"text_config": shapes} if "text_config" in config else shapes)})
    head = {k: v for k, v in tree_flatten(build_lazy_model(args, True, set()).parameters()) if k.startswith("mtp.")}
    gen = torch.Generator().manual_seed(seed + 7)
    randn = lambda shape: torch.randn(shape, generator=gen)  # noqa: E731
    randn.gen = gen
    out = {}
    for name, value in head.items():
        shape = tuple(value.shape)
        v = _value(name.replace("switch_mlp", "experts"), shape, randn, lambda s: torch.rand(s, generator=gen), style)
        v = (v if v is not None else torch.zeros(shape)).numpy().astype(np.float32)
        if ".switch_mlp." in name:  # [E, out, in] -> one tensor per expert, as the released checkpoints name them
            base, proj = name.split(".switch_mlp.")
            for e in range(shape[0]):
                out[f"{base}.experts.{e}.{proj}"] = np.ascontiguousarray(v[e])
        else:
            out[name] = v
    weights = load_file(str(path / "model.safetensors"))
    save_file({**weights, **out}, str(path / "model.safetensors"), metadata={"format": "pt"})
    text = config.get("text_config") or config
    text["mtp_num_hidden_layers"] = 1
    file.write_text(json.dumps(config, indent=1))
