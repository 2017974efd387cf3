"""A model loaded by `mlx_lm.load`, run by hetero on the same weight arrays (never copied).

mlx-lm's `qwen3_5` and `qwen3_5_moe` classes use the checkpoint names hetero's model uses
(`model.layers.N.linear_attn.in_proj_qkv`, `model.layers.N.mlp.switch_mlp.gate_proj.weight` [experts, out, in], ...),
norms already shifted by +1 at load and conv1d as [C, K, 1], so hetero's `Model` takes the very `mx.array` objects
of mlx-lm's text model with `Module.update`. hetero's own parameters are lazily initialised and replaced before
anything evaluates them, so they never take memory. Quantized modules (`QuantizedLinear`, `QuantizedEmbedding`,
mlx-lm's `QuantizedSwitchLinear` experts; `mlx_lm.convert -q` keeps MoE routers at 8 bits) are quantized in hetero's
model at the same paths with the same group size, bits and mode first. Every hetero parameter must then have an
mlx-lm tensor of the same name and shape and none may be left over, else the wrapper fails naming them: a mismatch
never leaves hetero's random init in place. mlx-lm builds no MTP head (its sanitize drops `mtp.*`), so neither
does the wrapper.

Refused, with the layout named: mlx-lm's `qwen3_next` (for a dense checkpoint its `sanitize` skips the conv1d
transpose and the norm +1, so it computes a wrong model, tests/test_parity.py measured it; a mixture-of-experts
one keeps the GDN input projections fused, `in_proj_qkvz` / `in_proj_ba` with rows grouped per key head, which
hetero's `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a` could take only as copies),
a config whose `layer_types` differ from the every-`full_attention_interval` rule mlx-lm's qwen3_5 builds its
layers by (mlx-lm ignores `layer_types`), and one whose expert layers or routing differ from what hetero reads in
config.json (mlx-lm makes every layer sparse when num_experts > 0; hetero applies `mlp_only_layers` and
`decoder_sparse_step`).
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
from mlx.utils import tree_flatten, tree_unflatten

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


_LAYOUTS = {"mlx_lm.models.qwen3_5": "qwen3_5", "mlx_lm.models.qwen3_5_moe": "qwen3_5_moe"}  # module -> model_type


def _build(lm: nn.Module) -> MlxLmModel:
    module = type(lm).__module__
    if module == "mlx_lm.models.qwen3_next":
        raise HeteroError(
            "mlx-lm's qwen3_next layout is not supported: for a dense (num_experts 0) checkpoint mlx-lm's sanitize "
            "skips the conv1d [C,1,K] -> [C,K,1] transpose and the norm +1, so its model is wrong, and a mixture-of-"
            "experts one keeps the GDN projections fused (in_proj_qkvz, in_proj_ba), which hetero could take only as "
            "copies; load the checkpoint with hetero.load(path) instead"
        )
    if module not in _LAYOUTS or not hasattr(lm, "language_model"):
        raise HeteroError(f"{module}.{type(lm).__name__}: hetero wraps mlx-lm's qwen3_5 models only (qwen3_5 and "
                          "qwen3_5_moe: Qwen3.5 / Qwen3.6, dense or mixture-of-experts, nested or flat config)")
    text = lm.language_model
    config = {"model_type": _LAYOUTS[module], "text_config": dict(lm.args.text_config)}
    args = ModelArgs.from_config(config)
    _check_layout(text, args, _LAYOUTS[module])
    net = Model(args, with_mtp=False)  # mlx-lm drops mtp.* at load: there is no head to take
    _quantize_like(net, text)
    _take(net, text.parameters(), _LAYOUTS[module])
    net.eval()
    return MlxLmModel(net, config, f"mlx-lm:{module}")


def _check_layout(text: nn.Module, args: ModelArgs, name: str) -> None:
    """Refuse an mlx-lm model whose layers compute another model than the config describes to hetero."""
    theirs = ["linear_attention" if layer.is_linear else "full_attention" for layer in text.layers]
    if theirs != args.layer_types:
        raise HeteroError(
            f"mlx-lm's {name} layout is wrong for this config: it builds layers by full_attention_interval "
            f"({theirs}) and ignores config.json layer_types ({args.layer_types}); load it with hetero.load(path)"
        )
    sparse = [i for i, layer in enumerate(text.layers) if "switch_mlp" in layer.mlp]
    if sparse != args.moe_layers:
        raise HeteroError(
            f"mlx-lm's {name} layout is wrong for this config: its mixture-of-experts layers are {sparse}, config.json "
            f"(num_experts, mlp_only_layers, decoder_sparse_step) makes them {args.moe_layers}; load it with "
            "hetero.load(path)"
        )
    for i in sparse:
        block = text.layers[i].mlp
        if (block.top_k, bool(block.norm_topk_prob)) != (args.num_experts_per_tok, args.norm_topk_prob):
            raise HeteroError(
                f"mlx-lm's {name} layer {i} routes to top {block.top_k} experts with norm_topk_prob "
                f"{block.norm_topk_prob}, config.json says {args.num_experts_per_tok} and {args.norm_topk_prob}"
            )


def _take(net: Model, params: dict, name: str) -> None:
    """Give `net` mlx-lm's arrays themselves; every parameter of hetero's must be replaced by one of the same
    name and shape (a name that maps nowhere would leave a random init in place)."""
    ours, given = dict(tree_flatten(net.parameters())), dict(tree_flatten(params))
    missing, extra = sorted(ours.keys() - given.keys()), sorted(given.keys() - ours.keys())
    if missing or extra:
        raise HeteroError(f"mlx-lm's {name} model does not map onto hetero's: hetero's {missing[:3]} "
                          f"({len(missing)}) have no mlx-lm tensor, mlx-lm's {extra[:3]} ({len(extra)}) no hetero "
                          "parameter")
    kind = lambda a: mx.issubdtype(a.dtype, mx.floating)  # noqa: E731  (packed quantized weights are integers)
    wrong = [f"{k} {tuple(given[k].shape)} for {tuple(ours[k].shape)}" for k in sorted(ours)
             if given[k].shape != ours[k].shape or kind(given[k]) != kind(ours[k])]
    if wrong:
        raise HeteroError(f"mlx-lm's {name} model does not map onto hetero's: {len(wrong)} tensors have another "
                          f"shape or kind than hetero's parameter, e.g. {wrong[0]}")
    net.update(tree_unflatten(list(given.items())))  # the same mx.array objects: no copy (and no empty modules,
    # such as mlx-lm's parameterless SwitchGLU.activation, which a strict update refuses)
    if any(a is not given[k] for k, a in tree_flatten(net.parameters())):
        raise HeteroError(f"mlx-lm's {name} model: hetero's model did not take every mlx-lm array as it is")


def _quantization(m: nn.Module) -> dict | None:
    """An mlx-lm module's quantization (QuantizedLinear, QuantizedEmbedding, its QuantizedSwitchLinear), or None."""
    if "scales" not in m or not hasattr(m, "bits"):
        return None
    return {"group_size": m.group_size, "bits": m.bits, "mode": getattr(m, "mode", "affine")}


def _quantize_like(net: Model, text: nn.Module) -> None:
    """Quantize hetero's modules exactly where (and as) mlx-lm's are, before their weights are taken."""
    theirs = {path: q for path, m in text.named_modules() if (q := _quantization(m)) is not None}

    def predicate(path: str, module: nn.Module):
        if path in theirs and not hasattr(module, "to_quantized"):
            raise HeteroError(f"mlx-lm's model quantizes {path}, which hetero's {type(module).__name__} keeps in float")
        return theirs.get(path, False)

    if theirs:
        nn.quantize(net, class_predicate=predicate)
