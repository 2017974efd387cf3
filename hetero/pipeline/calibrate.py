"""The activation ranges a split is planned with (`hetero.planner.ranges`), measured on the GPU lane.

One GPU-only pass over sample text, layer by layer over the whole text (so each layer's channels are chosen before
the share they leave in is measured): the largest normed input of every piece the plan offloads, each MLP channel's
largest gate, up and silu(gate) x up, each z row's largest value, and the largest output of the share the plan gives
the ANE once its channels are chosen. Cached as JSON next to the split's programs, keyed by the weights and the plan,
written atomically under a lock; `merge_ranges` folds later measurements in (a prompt that drove a program past fp16,
measured the same way with the saved ranges as prior; the GPU lane's per-chunk tracking), never shrinking them.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np

from hetero.models import activations as act
from hetero.planner.ranges import BLOCK, CHANNEL_PIECES, PieceRange, Ranges, shift_for

RANGES_FILE = "ranges.json"
RANGES_FORMAT = 2  # 2: every MLP block's largest value kept (`block_max`), so measurements merge
STEP = 2048  # tokens a measurement runs through a layer at once


def _max(a: mx.array) -> float:
    return float(mx.abs(a.astype(mx.float32)).max().item())


def _block_for(lin) -> int:
    """Channels move in whole quantization groups of down_proj's input (and the tables' 64 columns)."""
    g = getattr(lin, "group_size", None)
    return BLOCK if g is None else int(np.lcm(BLOCK, g))


def _channel_range(mlp, xs: list[mx.array], units: int, share: int, prior: PieceRange | None) -> PieceRange:
    """A SwiGLU's channels on the normed inputs `xs` (the text's steps, [1, t, hidden] each): blocks ordered
    safe-first by their largest values (the larger of these and `prior`'s, where given), and the output of the first
    `share` channels of that order."""
    per_channel = None  # [I]
    for x in xs:
        gate, up = mlp.gate_proj(x)[0], mlp.up_proj(x)[0]  # [t, I] each
        m = mx.maximum(mx.maximum(mx.abs(gate), mx.abs(up)), mx.abs(act.silu(gate) * up)).astype(mx.float32).max(0)
        per_channel = m if per_channel is None else mx.maximum(per_channel, m)
        mx.eval(per_channel)
    block = _block_for(mlp.down_proj)
    if units % block:
        block = BLOCK if units % BLOCK == 0 else units  # a width no group divides: one block
    per_block = np.array(per_channel).reshape(units // block, block).max(axis=1)  # [blocks]
    if prior is not None and len(prior.block_max) == len(per_block):
        per_block = np.maximum(per_block, prior.block_max)
    r = PieceRange.by_blocks(units, block, max(_max(x) for x in xs), per_block.tolist())
    chosen = r.channels(0, min(share, r.safe_units))
    if len(chosen):
        idx = mx.array(chosen)
        down = _down_columns(mlp.down_proj, idx)  # [hidden, share]
        for x in xs:
            a = act.silu(mlp.gate_proj(x)[0][:, idx]) * mlp.up_proj(x)[0][:, idx]  # [t, share]
            r.out_max = max(r.out_max, _max(a @ down.T))  # [t, hidden]
        r.out_shift = shift_for(r.out_max)
    return r


def _down_columns(lin, idx: mx.array) -> mx.array:
    """down_proj's columns `idx` as a float matrix [hidden, len(idx)] (dequantized where quantized)."""
    if hasattr(lin, "scales"):
        w = mx.dequantize(lin.weight, lin.scales, lin.biases, lin.group_size, lin.bits)
    else:
        w = lin.weight
    return w[:, idx].astype(mx.float32)


def calibrate(model, ids: list[int], shares: dict[tuple[int, str], int], prior: Ranges | None = None,
              step: int = STEP) -> Ranges:
    """The ranges of the pieces in `shares` ((layer, piece) -> the units the plan gives the ANE) over `ids`.

    Layer by layer over the whole text, each layer in steps of `step` tokens (through the layer's cache, as a
    prefill runs them: a long prompt's intermediates never exist all at once); the layers above the last piece
    measured are not run. With `prior`, channel blocks are chosen by the larger of its maxima and these, so the
    share whose output is measured is the one `prior.merge(result)` chooses. The pieces' inputs are what the split's
    programs read (`DecoderLayer.mixer_io` / `mlp_io`: the normed input, or Qwen4-Exp's hyper-connection mix after
    its PLE update)."""
    tokens = mx.array(ids)[None]  # [1, T]
    steps = range(0, len(ids), step)
    hs = [model.model.begin(tokens[:, lo : lo + step])[0] for lo in steps]  # [1, t, hidden] (Qwen4-Exp: [1, t, hc*d])
    host = [np.array(ids[lo : lo + step], dtype=np.int64)[None] for lo in steps]  # [1, t]
    cache = model.make_cache()
    pieces: dict[tuple[int, str], PieceRange] = {}
    last = max((layer for layer, _ in shares), default=-1)
    for i, layer in enumerate(model.layers[: last + 1]):
        for k in range(len(hs)):  # in order: each step's PLE continues the state the last one left
            hs[k] = layer.before_mixer(hs[k], host[k], cache[i])
        io = layer.mixer_io
        xs, ctxs = zip(*[io.read(h) for h in hs])  # [1, t, hidden] each
        if (i, "gdn_in_proj") in shares:
            m = layer.linear_attn
            z = max(_max(m.in_proj_z(x)[..., : shares[i, "gdn_in_proj"]]) for x in xs)  # over [1, t, zr]
            r = PieceRange(m.nv * m.dv, m.nv * m.dv, max(_max(x) for x in xs), z, z)
            r.out_shift = shift_for(r.out_max)
            pieces[i, "gdn_in_proj"] = r
        if (i, "attention") in shares:
            pieces[i, "attention"] = PieceRange(layer.self_attn.n_kv_heads, layer.self_attn.n_kv_heads,
                                                max(_max(x) for x in xs))
        for k, x in enumerate(xs):  # in order: each step continues the cache the last one left
            hs[k] = io.write(hs[k], layer.mixer(x, cache[i]), ctxs[k])
            mx.eval(hs[k], *[a for a in cache[i].state if a is not None])
        io = layer.mlp_io
        xs, ctxs = zip(*[io.read(h) for h in hs])
        for piece in CHANNEL_PIECES:
            if (i, piece) in shares:
                mlp = layer.mlp.shared_expert if piece == "shared_expert" else layer.mlp
                pieces[i, piece] = _channel_range(mlp, xs, mlp.gate_proj.weight.shape[0], shares[i, piece],
                                                  prior.get(i, piece) if prior is not None else None)
        for k, x in enumerate(xs):
            hs[k] = io.write(hs[k], layer.mlp(x), ctxs[k])
            mx.eval(hs[k])
    return Ranges(pieces, len(ids))


def plan_shares(plan) -> dict[tuple[int, str], int]:
    """(layer, piece) -> the units a plan gives the ANE."""
    return {(s.layer, s.piece): s.stop for s in plan.slices}


def _cache_key(shares: dict[tuple[int, str], int], tokens: int) -> dict:
    return {"format": RANGES_FORMAT, "shares": sorted([list(k) + [v] for k, v in shares.items()]), "tokens": tokens}


def _read(file: Path) -> dict | None:
    """The saved ranges file's content; None when there is none. A damaged one (half-written by a copy, edited,
    truncated) is said in one warning line and read as none: it is measured again, never trusted."""
    try:
        saved = json.loads(file.read_text())
        Ranges.from_dict(saved["ranges"])
        if not isinstance(saved["key"], dict):
            raise TypeError("no key")
        return saved
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        print(f"warning: {file} is damaged ({type(e).__name__}); ignored, the ranges are measured again",
              file=sys.stderr)
        return None


def saved_ranges(directory: Path, plan, tokens: int) -> Ranges | None:
    """The ranges measured for `plan` over `tokens` sample tokens (and merged since), if `directory` holds them
    (never measures)."""
    saved = _read(directory / RANGES_FILE)
    if saved is not None and saved["key"] == _cache_key(plan_shares(plan), tokens):
        return Ranges.from_dict(saved["ranges"])
    return None


def _write(file: Path, key: dict, ranges: Ranges) -> None:
    """Write the ranges file atomically: a temporary file in the same folder, flushed, then renamed over it (a
    reader sees the old file or the new one, never half of one)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=RANGES_FILE + ".", suffix=".tmp", dir=file.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "ranges": ranges.to_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def _locked(directory: Path):
    """The ranges file of `directory` for one process at a time (engines in other processes merge into it too)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / (RANGES_FILE + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cached_ranges(directory: Path, model, ids: list[int], plan) -> Ranges:
    """The ranges for `plan` from `directory`'s cache, measured (and written atomically) when absent or stale."""
    shares = plan_shares(plan)
    saved = saved_ranges(directory, plan, len(ids))
    if saved is not None:
        return saved
    ranges = calibrate(model, ids, shares)
    with _locked(directory):
        _write(directory / RANGES_FILE, _cache_key(shares, len(ids)), ranges)
    return ranges


def merge_ranges(directory: Path, plan, tokens: int, grown: Ranges, current: Ranges | None = None) -> Ranges:
    """Merge `grown` (values measured or tracked since the ranges were saved) into the saved ranges of `plan`'s
    shares over `tokens` sample tokens, under the lock and atomically; returns what is saved now. Monotone: whatever
    another process merged meanwhile is kept (`Ranges.merge`); with none saved (or a damaged file), `grown` merged
    into `current` (the ranges the split runs with) is saved."""
    key = _cache_key(plan_shares(plan), tokens)
    with _locked(directory):
        saved = _read(directory / RANGES_FILE)
        base = Ranges.from_dict(saved["ranges"]) if saved is not None and saved["key"] == key else current
        merged = base.merge(grown) if base is not None else grown
        _write(directory / RANGES_FILE, key, merged)
    return merged
