"""Build a Qwen4-Exp model from a checkpoint folder (config.json + safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from hetero.models.qwen4_exp.args import Qwen4Args
from hetero.models.qwen4_exp.model import Model, sanitize


def load(path: str | Path, dtype: mx.Dtype = mx.float32) -> Model:
    """config.json + *.safetensors in `path` -> the model with its weights (in `dtype`)."""
    path = Path(path)
    args = Qwen4Args.from_config(json.loads((path / "config.json").read_text()))
    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in sanitize(args, weights).items()}
    model = Model(args)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model
