"""`hetero convert --quantize B`: write an mlx-community-style quantized copy of a checkpoint.

Output: `quantization: {group_size, bits}` in config.json and `.weight` (packed uint32) / `.scales` / `.biases`
per quantized layer, norms already shifted and conv weights in MLX layout, so the loader recognises it as
converted. Tensor names are the ones `mlx_lm.convert -q` writes: Qwen3.5's nested model types (`qwen3_5`,
`qwen3_5_moe`) under `language_model.model.*` / `language_model.lm_head.*`, flat ones (`qwen3_next`, the `_text`
types) under `model.*`; the MTP head, which mlx-lm drops, under the original checkpoint's `mtp.*`.

Mixture-of-experts models: the routed experts are written stacked under mlx-lm's `switch_mlp` names
(`...mlp.switch_mlp.gate_proj.{weight,scales,biases}` [experts, out, in/...]) at the requested bits; the router
(`mlp.gate`) and the shared expert's gate (`shared_expert_gate`) at 8 bits, group 64, as mlx-lm's own predicate
for these models keeps them (their error would pick other experts), recorded per layer in `quantization` under
mlx-lm's module paths (`language_model.model.layers.0.mlp.gate: {group_size: 64, bits: 8}`), which both loaders read.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from hetero.checkpoint.loader import load_model
from hetero.checkpoint.safetensors import FLOAT_DTYPES, checkpoint_tensors
from hetero.checkpoint.source import resolve
from hetero.errors import HeteroError
from hetero.host.progress import ProgressBar
from hetero.models.architectures import architecture
from hetero.models.moe import SwitchLinear

SHARD_BYTES = 5 * 2**30
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja", "special_tokens_map.json")
# in_proj_a / in_proj_b set the GDN decay and write rate: tiny layers whose error would compound over the context
KEEP_FLOAT = ("in_proj_a", "in_proj_b")
# mlx-lm's quant_predicate for Qwen3.5-MoE and Qwen3-Next: the router and the shared expert's gate at 8 bits
ROUTERS = ("mlp.gate", "shared_expert_gate")
ROUTER_QUANT = {"group_size": 64, "bits": 8}
NESTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")  # mlx-lm holds their text model under `language_model`


def quantizable(group_size: int):
    """Predicate for nn.quantize: Linear/Embedding layers and stacked experts (`SwitchLinear`) whose input width
    splits into whole groups; True, or the router's own {group_size, bits} (ROUTER_QUANT, where its width splits
    into groups of 64; else it stays float)."""

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not isinstance(module, (nn.Linear, nn.Embedding, SwitchLinear)) or path.endswith(KEEP_FLOAT):
            return False
        if module.weight.shape[-1] % group_size:
            return False
        if path.endswith(ROUTERS):
            return dict(ROUTER_QUANT) if module.weight.shape[-1] % ROUTER_QUANT["group_size"] == 0 else False
        return True

    return predicate


def mlx_lm_name(name: str, model_type: str | None) -> str:
    """A canonical tensor or module name as mlx-lm names it (module docstring)."""
    if model_type in NESTED_MODEL_TYPES and name.startswith(("model.", "lm_head.")):
        return "language_model." + name
    return name


def stored_float_dtype(path: Path) -> mx.Dtype:
    """The float dtype most of the checkpoint's tensors are stored in (kept for the unquantized ones)."""
    tensors, _ = checkpoint_tensors(path)
    counts = Counter(t.dtype for t in tensors.values() if t.dtype in FLOAT_DTYPES)
    return FLOAT_DTYPES[counts.most_common(1)[0][0]] if counts else mx.float32


def quantize_checkpoint(model: str | None, out: str | os.PathLike, bits: int, group_size: int = 64) -> Path:
    """Quantize `model` to `bits` and write it to `out` (written to a temporary folder, then renamed)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise HeteroError(f"--out {out} exists and is not empty; choose a new directory")
    src = resolve(model)
    if json.loads((src / "config.json").read_text()).get("quantization"):
        raise HeteroError(f"{src} is already quantized; convert from the float checkpoint")
    store_dtype = stored_float_dtype(src)
    net, _, config = load_model(model, dtype=mx.float32, fuse_projections=False)  # nn.quantize replaces them
    model_type = config.get("model_type")
    predicate, per_layer = quantizable(group_size), {}

    def recording(path: str, module: nn.Module) -> bool | dict:
        params = predicate(path, module)
        if isinstance(params, dict):
            per_layer[mlx_lm_name(path, model_type)] = dict(params)
        return params

    nn.quantize(net, group_size=group_size, bits=bits, class_predicate=recording)
    weights = dict(tree_flatten(net.parameters()))
    # what the architecture keeps as stored (Qwen4-Exp's PLE n-gram tables: unquantized), copied from the source
    weights.update(architecture(model_type).stored_as_is(src, checkpoint_tensors(src)[0]))
    weights = {
        mlx_lm_name(k, model_type): v if v.dtype == mx.uint32 or k.endswith("A_log") else v.astype(store_dtype)
        for k, v in weights.items()
    }

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards, current, size = [], {}, 0
    for k in sorted(weights):
        if current and size + weights[k].nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[k] = weights[k]
        size += weights[k].nbytes
    shards.append(current)
    bar = ProgressBar("writing shards")
    names = ["model.safetensors"] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for i, (name, shard) in enumerate(zip(names, shards)):
        mx.save_safetensors(str(tmp / name), shard, metadata={"format": "mlx"})
        bar(i + 1, len(shards))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())}, "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = dict(config)
    config.pop("quantization_config", None)
    config["quantization"] = {"group_size": group_size, "bits": bits, **per_layer}
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out
