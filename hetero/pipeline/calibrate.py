"""The activation ranges a split is planned with (`hetero.planner.ranges`), measured on the GPU lane.

One GPU-only pass over sample text, layer by layer over the whole text (so each layer's channels are chosen before
the share they leave in is measured): the largest normed input of every piece the plan offloads, each MLP channel's
largest gate, up and silu(gate) x up, each z row's largest value, and the largest output of the share the plan gives
the ANE once its channels are chosen. Cached as JSON next to the split's programs, keyed by the weights and the plan.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from hetero.models import activations as act
from hetero.planner.ranges import BLOCK, CHANNEL_PIECES, SAFE, PieceRange, Ranges, shift_for

RANGES_FILE = "ranges.json"
RANGES_FORMAT = 1


def _max(a: mx.array) -> float:
    return float(mx.abs(a.astype(mx.float32)).max().item())


def _block_for(lin) -> int:
    """Channels move in whole quantization groups of down_proj's input (and the tables' 64 columns)."""
    g = getattr(lin, "group_size", None)
    return BLOCK if g is None else int(np.lcm(BLOCK, g))


def _channel_range(mlp, x: mx.array, units: int, share: int) -> PieceRange:
    """A SwiGLU's channels on normed input x [1, T, hidden]: blocks ordered safe-first, and the output of the first
    `share` channels of that order."""
    gate, up = mlp.gate_proj(x)[0], mlp.up_proj(x)[0]  # [T, I] each
    a = act.silu(gate) * up  # [T, I]
    per_channel = mx.maximum(mx.maximum(mx.abs(gate), mx.abs(up)), mx.abs(a)).astype(mx.float32).max(axis=0)
    block = _block_for(mlp.down_proj)
    if units % block:
        block = BLOCK if units % BLOCK == 0 else units  # a width no group divides: one block
    per_block = np.array(per_channel).reshape(units // block, block).max(axis=1)  # [blocks]
    safe = [int(b) for b in np.flatnonzero(per_block < SAFE)]
    unsafe = [int(b) for b in np.flatnonzero(per_block >= SAFE)]
    r = PieceRange(units, len(safe) * block, _max(x), float(per_block[safe].max()) if safe else 0.0,
                   order=[] if not unsafe else safe + unsafe, block=block)
    chosen = r.channels(0, min(share, r.safe_units))
    if len(chosen):
        idx = mx.array(chosen)
        partial = a[:, idx] @ _down_columns(mlp.down_proj, idx).T  # [T, hidden]
        r.out_max = _max(partial)
        r.out_shift = shift_for(r.out_max)
    return r


def _down_columns(lin, idx: mx.array) -> mx.array:
    """down_proj's columns `idx` as a float matrix [hidden, len(idx)] (dequantized where quantized)."""
    if hasattr(lin, "scales"):
        w = mx.dequantize(lin.weight, lin.scales, lin.biases, lin.group_size, lin.bits)
    else:
        w = lin.weight
    return w[:, idx].astype(mx.float32)


def calibrate(model, ids: list[int], shares: dict[tuple[int, str], int]) -> Ranges:
    """The ranges of the pieces in `shares` ((layer, piece) -> the units the plan gives the ANE) over `ids`."""
    tokens = mx.array(ids)[None]  # [1, T]
    h = model.model.embed_tokens(tokens)  # [1, T, hidden]
    cache = model.make_cache()
    pieces: dict[tuple[int, str], PieceRange] = {}
    for i, layer in enumerate(model.layers):
        x = layer.input_layernorm(h)  # [1, T, hidden]
        if (i, "gdn_in_proj") in shares:
            m = layer.linear_attn
            z = m.in_proj_z(x)[..., : shares[i, "gdn_in_proj"]]  # [1, T, zr]
            r = PieceRange(m.nv * m.dv, m.nv * m.dv, _max(x), _max(z), _max(z))
            r.out_shift = shift_for(r.out_max)
            pieces[i, "gdn_in_proj"] = r
        if (i, "attention") in shares:
            pieces[i, "attention"] = PieceRange(layer.self_attn.n_kv_heads, layer.self_attn.n_kv_heads, _max(x))
        mixer = layer.linear_attn if layer.is_linear else layer.self_attn
        h = h + mixer(x, cache[i])
        x = layer.post_attention_layernorm(h)
        for piece in CHANNEL_PIECES:
            if (i, piece) in shares:
                mlp = layer.mlp.shared_expert if piece == "shared_expert" else layer.mlp
                pieces[i, piece] = _channel_range(mlp, x, mlp.gate_proj.weight.shape[0], shares[i, piece])
        h = h + layer.mlp(x)
        mx.eval(h, *[a for c in cache[: i + 1] for a in c.state if a is not None])
    return Ranges(pieces, len(ids))


def plan_shares(plan) -> dict[tuple[int, str], int]:
    """(layer, piece) -> the units a plan gives the ANE."""
    return {(s.layer, s.piece): s.stop for s in plan.slices}


def _cache_key(shares: dict[tuple[int, str], int], tokens: int) -> dict:
    return {"format": RANGES_FORMAT, "shares": sorted([list(k) + [v] for k, v in shares.items()]), "tokens": tokens}


def saved_ranges(directory: Path, plan, tokens: int) -> Ranges | None:
    """The ranges measured for `plan` over `tokens` sample tokens, if `directory` holds them (never measures)."""
    try:
        saved = json.loads((directory / RANGES_FILE).read_text())
        if saved.get("key") == _cache_key(plan_shares(plan), tokens):
            return Ranges.from_dict(saved["ranges"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def cached_ranges(directory: Path, model, ids: list[int], plan) -> Ranges:
    """The ranges for `plan` from `directory`'s cache, measured (and written atomically) when absent or stale."""
    file = directory / RANGES_FILE
    shares = plan_shares(plan)
    key = _cache_key(shares, len(ids))
    saved = saved_ranges(directory, plan, len(ids))
    if saved is not None:
        return saved
    ranges = calibrate(model, ids, shares)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "ranges": ranges.to_dict()}))
    tmp.replace(file)
    return ranges
