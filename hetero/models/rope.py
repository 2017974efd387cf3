"""A config's rotary position embedding as one `Rotary`: the inverse frequencies of the rotated dims and the scale
their cos and sin take, which every place that rotates reads (the attention layers and their mrope, QSA's indexer,
the ANE programs' tables). transformers' rope types (`modeling_rope_utils`):

- default (and mrope, its older name with sections): inv_freq_j = theta^(-2j / dims).
- dynamic: the same up to max_position_embeddings, past which transformers grows theta with the sequence; a
  context here never passes it (the window stops at the model's maximum), so it is the default.
- linear: inv_freq / factor.
- yarn: the frequencies that turn more than `beta_fast` times over original_max_position_embeddings keep
  theta^(-2j/dims) (extrapolated), those that turn fewer than `beta_slow` times take it / factor (interpolated), a
  linear ramp between; cos and sin scaled by the attention factor (0.1 ln(factor) + 1, or the config's
  `attention_factor`, or the ratio of its `mscale` / `mscale_all_dim` factors).

Any other type (longrope, llama3, ...) is refused in one line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from hetero.errors import HeteroError

PLAIN = ("default", "mrope", "dynamic")
SUPPORTED = PLAIN + ("linear", "yarn")


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(rope: dict, dims: int, theta: float, max_position: int) -> tuple[np.ndarray, float]:
    """transformers' `_compute_yarn_parameters`, in float32 as it computes."""
    factor = rope.get("factor")
    original = rope.get("original_max_position_embeddings")
    if original is None:
        raise HeteroError("config.json: a yarn rope needs original_max_position_embeddings in rope_parameters")
    factor = float(factor) if factor is not None else max_position / original
    attention = rope.get("attention_factor")
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention is None:
        attention = (_mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all
                     else _mscale(factor))
    fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction(turns: float) -> float:  # the dim whose wavelength makes `turns` turns over the original context
        return dims * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(fast), correction(slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = np.float32(theta) ** (np.arange(0, dims, 2, dtype=np.float32) / np.float32(dims))  # [dims/2]
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (np.float32(factor) * pos_freqs)
    keep = 1 - np.clip((np.arange(dims // 2, dtype=np.float32) - low) / (high - low), 0, 1)  # 1: extrapolated
    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32), float(attention)


@dataclass(eq=False)
class Rotary:
    """The rotation of the first `dims` features: `inv_freq` [dims/2] float32 and `scale` (cos and sin times it).
    `theta` and `plain` let the default rope take MLX's own kernel (`mx.fast.rope` from its base), bitwise as
    before; a scaled one passes its frequencies."""

    dims: int
    theta: float
    inv_freq: np.ndarray
    scale: float = 1.0
    plain: bool = True

    @classmethod
    def from_config(cls, rope: dict, dims: int, theta: float, max_position: int) -> Rotary:
        """The rope of a config's `rope_parameters` (or `rope_scaling`) dict; one-line HeteroError for a type not
        here or a value that gives no rope."""
        if not isinstance(rope, dict):
            raise HeteroError("config.json: rope_parameters must be an object (rope_type, rope_theta, ...)")
        kind = rope.get("rope_type", rope.get("type", "default")) or "default"
        if kind not in SUPPORTED:
            raise HeteroError(f"unsupported rope type {kind!r} in config.json: hetero implements "
                              f"{', '.join(SUPPORTED)} RoPE")
        try:
            with np.errstate(all="raise"):
                default = 1.0 / np.float32(theta) ** (np.arange(0, dims, 2, dtype=np.float32) / np.float32(dims))
                if kind in PLAIN:
                    return cls(dims, theta, default.astype(np.float32))
                if kind == "linear":
                    inv_freq, scale = (default / np.float32(rope.get("factor", 1.0))).astype(np.float32), 1.0
                else:
                    inv_freq, scale = _yarn(rope, dims, theta, max_position)
        except (TypeError, ValueError, ArithmeticError, FloatingPointError) as e:
            raise HeteroError(f"config.json: the {kind} rope's parameters give no rotation ({e}); fix "
                              "rope_parameters") from None
        if not (np.isfinite(inv_freq).all() and math.isfinite(scale)):
            raise HeteroError(f"config.json: the {kind} rope's parameters give no rotation; fix rope_parameters")
        return cls(dims, theta, inv_freq, scale, plain=False)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        """x [..., S, D] at positions offset.. -> its first `dims` features rotated (NeoX pairing), as `nn.RoPE`."""
        if self.plain:
            return mx.fast.rope(x, self.dims, traditional=False, base=self.theta, scale=1.0, offset=offset)
        if self.scale != 1.0:
            x = mx.concatenate([x[..., : self.dims] * self.scale, x[..., self.dims :]], axis=-1)
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset,
                            freqs=mx.array(1.0 / self.inv_freq))

    def angles(self, positions: mx.array) -> tuple[mx.array, mx.array]:
        """positions [N] or [dims/2, N] (a position per frequency) -> cos, sin [N, dims/2] fp32, scaled."""
        inv = mx.array(self.inv_freq)  # [dims/2]
        pos = positions.astype(mx.float32)
        a = pos[:, None] * inv if pos.ndim == 1 else pos.T * inv  # [N, dims/2]
        return mx.cos(a) * self.scale, mx.sin(a) * self.scale


def rotary_of(rope: dict, dims: int, theta: float, max_position: int) -> Rotary:
    """`Rotary.from_config`, made once per distinct config (a model's layers and programs share it)."""
    if not isinstance(rope, dict):
        return Rotary.from_config(rope, dims, theta, max_position)  # its one-line error
    try:
        key = json.dumps(rope, sort_keys=True)
    except (TypeError, ValueError):
        return Rotary.from_config(rope, dims, theta, max_position)
    return _rotary(key, dims, theta, max_position)


@lru_cache(maxsize=64)
def _rotary(rope: str, dims: int, theta: float, max_position: int) -> Rotary:
    return Rotary.from_config(json.loads(rope), dims, theta, max_position)
