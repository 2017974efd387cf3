"""A model loaded by `mlx_lm.load`, run by hetero on the same weight arrays (never copied).

mlx-lm's `qwen3_5` classes use the checkpoint names hetero's model uses (`model.layers.N.linear_attn.in_proj_qkv`,
...), norms already shifted by +1 at load and conv1d as [C, K, 1], so hetero's `Model` takes the very `mx.array`
objects of mlx-lm's text model with `Module.update`. hetero's own parameters are lazily initialised and replaced
before anything evaluates them, so they never take memory.

Refused, with the layout named: mlx-lm's `qwen3_next` (for a dense checkpoint its `sanitize` skips the conv1d
transpose and the norm +1, so it computes a wrong model; tests/test_parity.py measured it), mixture-of-experts
layers (hetero runs dense MLPs), and a config whose `layer_types` differ from the every-`full_attention_interval`
rule mlx-lm's qwen3_5 builds its layers by (mlx-lm ignores `layer_types`).
"""

from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from hetero.errors import HeteroError
from hetero.models.qwen3_5 import Model, ModelArgs

_WRAPPED: dict[int, tuple[weakref.ref, "MlxLmModel"]] = {}  # id(mlx-lm model) -> (its weakref, the wrapper)


@dataclass(eq=False)
class MlxLmModel:
    """hetero's view of an mlx-lm model: what the split runtime needs of an engine (model, config, path, identity,
    a fingerprint of the weights), with `tokenizer` set when the caller gave one."""

    model: Model
    config: dict
    source: str
    tokenizer: object | None = None
    memory_gb: float | None = None
    _fingerprint: str | None = field(default=None, repr=False)

    @property
    def path(self) -> Path:
        return Path(self.source)

    @property
    def name(self) -> str:
        return self.source

    @property
    def identity(self) -> str:
        digest = hashlib.sha256(json.dumps(self.config, sort_keys=True, default=str).encode()).hexdigest()[:12]
        return f"mlx-lm@{digest}"

    @property
    def weights_fingerprint(self) -> str:
        """sha256 of every weight byte (the split's exported programs are keyed by it); computed once."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for name, a in tree_flatten(self.model.parameters()):
                h.update(f"{name}:{a.shape}:{a.dtype}".encode())
                h.update(np.asarray(mx.view(mx.contiguous(a), mx.uint8)).tobytes())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    @property
    def max_context(self) -> int:
        return self.model.args.max_position_embeddings


def is_mlx_lm_model(obj) -> bool:
    return isinstance(obj, nn.Module) and type(obj).__module__.startswith("mlx_lm.")


def wrap(lm: nn.Module) -> MlxLmModel:
    """The hetero model over `lm`'s weights (built once per mlx-lm model object)."""
    held = _WRAPPED.get(id(lm))
    if held is not None and held[0]() is lm:
        return held[1]
    wrapped = _build(lm)
    _WRAPPED[id(lm)] = (weakref.ref(lm, lambda _, key=id(lm): _WRAPPED.pop(key, None)), wrapped)
    return wrapped


def _build(lm: nn.Module) -> MlxLmModel:
    module = type(lm).__module__
    if module == "mlx_lm.models.qwen3_next":
        raise HeteroError(
            "mlx-lm's qwen3_next layout is not supported: for a dense (num_experts 0) checkpoint mlx-lm's sanitize "
            "skips the conv1d [C,1,K] -> [C,K,1] transpose and the norm +1, so its model is wrong, and a mixture-of-"
            "experts one is not a model hetero runs; load the checkpoint with hetero.load(path) instead"
        )
    if module != "mlx_lm.models.qwen3_5" or not hasattr(lm, "language_model"):
        raise HeteroError(f"{module}.{type(lm).__name__}: hetero wraps mlx-lm's qwen3_5 models only "
                          "(Qwen3.5 / Qwen3.6, nested or flat config)")
    text = lm.language_model
    config = {"model_type": "qwen3_5", "text_config": dict(lm.args.text_config)}
    args = ModelArgs.from_config(config)
    if args.moe_layers:
        raise HeteroError(f"mlx-lm's qwen3_5 model with {args.num_experts} experts: mixture-of-experts layers are "
                          "not supported by hetero")
    theirs = ["linear_attention" if layer.is_linear else "full_attention" for layer in text.layers]
    if theirs != args.layer_types:
        raise HeteroError(
            f"mlx-lm's qwen3_5 layout is wrong for this config: it builds layers by full_attention_interval "
            f"({theirs}) and ignores config.json layer_types ({args.layer_types}); load it with hetero.load(path)"
        )
    net = Model(args, with_mtp=False)
    _quantize_like(net, text)
    params = text.parameters()
    ours = {k for k, _ in tree_flatten(net.parameters())}
    given = {k for k, _ in tree_flatten(params)}
    if ours != given:
        missing, extra = sorted(ours - given)[:3], sorted(given - ours)[:3]
        raise HeteroError(f"mlx-lm's qwen3_5 model does not map onto hetero's: missing {missing}, unexpected {extra}")
    net.update(params)  # the same mx.array objects: no copy
    net.eval()
    return MlxLmModel(net, config, f"mlx-lm:{module}")


def _quantize_like(net: Model, text: nn.Module) -> None:
    """Quantize hetero's modules exactly where (and as) mlx-lm's are, before their weights are taken."""
    theirs = dict(text.named_modules())

    def predicate(path: str, _module: nn.Module):
        m = theirs.get(path)
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return {"group_size": m.group_size, "bits": m.bits, "mode": getattr(m, "mode", "affine")}
        return False

    if any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in theirs.values()):
        nn.quantize(net, class_predicate=predicate)
