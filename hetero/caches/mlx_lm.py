"""hetero's per-layer caches <-> mlx-lm's prompt caches, and mlx-lm's prompt-cache file format.

mlx-lm (`mlx_lm/models/qwen3_5.py`, `cache.py`) keeps one object per backbone layer:

- attention: `KVCache` with `keys` / `values` [B, Hkv, capacity, D] and `offset` (valid positions), like ours;
- Gated DeltaNet: `ArraysCache(size=2)` with [0] = the conv window [B, K-1, C] (the last K-1 inputs of
  cat(q, k, v), as ours) and [1] = the recurrent state [B, Hv, Dv, Dk] fp32: the transpose of ours
  ([B, Hv, Dk, Dv]). It has no token count: the attention layers' offset is the sequence length.

It has no slot for the MTP head: a cache handed to mlx-lm holds the backbone only, and one taken from mlx-lm
gives the MTP head an empty KV (drafts then see only what follows; acceptance stays exact).

The file format is `mlx_lm.save_prompt_cache`'s: one safetensors file whose tensors are the flattened
`[c.state for c in cache]` ("3.0" = layer 3's keys), where non-array leaves are stored as arrays and listed in
the metadata (int -> "scalar", None -> "none"), and whose metadata is the flattened [user metadata, class names,
["", (tensor name, kind), ...]]. This module writes and reads it without mlx-lm (reading into mlx-lm's classes
needs mlx-lm installed).
"""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from hetero.errors import HeteroError
from hetero.models.cache import GDNCache, KVCache, LayerCache, ModelCache

KV, ARRAYS = "KVCache", "ArraysCache"


def mlx_lm_classes():
    """mlx-lm's (KVCache, ArraysCache), or a HeteroError saying how to get them."""
    try:
        from mlx_lm.models.cache import ArraysCache
        from mlx_lm.models.cache import KVCache as LmKVCache
    except ImportError:
        raise HeteroError("caches in mlx-lm's classes need mlx-lm: pip install mlx-lm") from None
    return LmKVCache, ArraysCache


def _kind(c) -> str:
    """'KVCache' or 'ArraysCache' for a hetero or mlx-lm layer cache (by class name: mlx-lm may be absent)."""
    name = type(c).__name__
    if isinstance(c, GDNCache) or name == ARRAYS:
        return ARRAYS
    if isinstance(c, KVCache) or name == KV:
        return KV
    raise HeteroError(f"a prompt cache layer of type {name}: hetero reads KVCache and ArraysCache layers only "
                      "(no quantized or rotating KV caches)")


def layer_state(c) -> tuple[str, tuple]:
    """(class name, state in mlx-lm's layout) of one hetero or mlx-lm layer cache; arrays are shared, not copied,
    except the GDN state, which is transposed."""
    kind = _kind(c)
    if isinstance(c, KVCache):  # hetero's: keys [B, Hkv, capacity, D]; only `offset` positions are valid
        keys = None if c.keys is None else c.keys[:, :, : c.offset]
        values = None if c.values is None else c.values[:, :, : c.offset]
        return KV, (keys, values, c.offset)
    if isinstance(c, GDNCache):
        state = None if c.recurrent is None else mx.contiguous(c.recurrent.swapaxes(-1, -2))  # -> [B, Hv, Dv, Dk]
        return ARRAYS, ([c.conv, state], None, None)
    return kind, tuple(c.state)


def to_mlx_lm(cache: list[LayerCache], n_layers: int, into: list | None = None) -> list:
    """mlx-lm caches holding what hetero's backbone caches `cache[:n_layers]` hold (the MTP head's are left out).

    With `into` (an mlx-lm cache list of the same layout), its objects are updated in place and returned."""
    LmKVCache, ArraysCache = mlx_lm_classes()
    out = into if into is not None else [None] * n_layers
    for i, c in enumerate(cache[:n_layers]):
        kind, state = layer_state(c)
        if out[i] is None:
            out[i] = LmKVCache() if kind == KV else ArraysCache(size=2)
        target = out[i]
        if _kind(target) != kind:
            raise HeteroError(
                f"prompt cache layer {i} is a {type(target).__name__}; this model's layer {i} needs a {kind}"
            )
        if kind == KV:
            target.keys, target.values, target.offset = state
        else:
            target[0], target[1] = state[0]
    mx.eval(cache_leaves(out))  # nothing lazy: the cache may be read on another thread (MLX streams are per thread)
    return out


def cache_leaves(cache: list) -> list[mx.array]:
    """Every array an mlx-lm or hetero cache list holds."""
    return [a for c in cache for _, a in tree_flatten(layer_state(c)[1]) if isinstance(a, mx.array)]


def check_layout(cache: list, layer_kinds: list[bool]) -> int:
    """The number of tokens an mlx-lm (or hetero) cache holds, after checking it has one layer per backbone layer
    of the right kind (`layer_kinds[i]` True for GDN). Raises HeteroError naming the first mismatch."""
    if len(cache) != len(layer_kinds):
        raise HeteroError(f"the prompt cache has {len(cache)} layers; this model has {len(layer_kinds)} "
                          "(a cache made for another model?)")
    lengths = set()
    for i, (c, linear) in enumerate(zip(cache, layer_kinds)):
        want = ARRAYS if linear else KV
        if _kind(c) != want:
            raise HeteroError(f"prompt cache layer {i} is a {type(c).__name__}; this model's layer {i} needs a {want} "
                              "(a cache made for another model?)")
        if want == KV:
            lengths.add(int(c.offset))
    if len(lengths) > 1:
        raise HeteroError(f"the prompt cache's attention layers hold different token counts {sorted(lengths)}")
    return lengths.pop() if lengths else 0


def from_mlx_lm(cache: list, layer_kinds: list[bool], n_mtp: int = 0) -> ModelCache:
    """hetero caches (backbone, then `n_mtp` empty MTP caches) holding what an mlx-lm prompt cache holds.

    K/V and the conv window are shared with it (hetero writes new positions into new arrays); the GDN state is
    transposed to hetero's [B, Hv, Dk, Dv] fp32."""
    n = check_layout(cache, layer_kinds)
    out: list[LayerCache] = []
    for c in cache:
        if _kind(c) == KV:
            kv = KVCache()
            if c.keys is not None and c.offset:
                kv.keys, kv.values, kv.offset = c.keys, c.values, int(c.offset)
            out.append(kv)
        else:
            g = GDNCache()
            conv, state = c[0], c[1]
            if (conv is None) != (state is None) or (conv is None and n):
                raise HeteroError("a GDN layer of the prompt cache lacks its conv window or recurrent state")
            if conv is not None:
                g.conv = conv
                g.recurrent = mx.contiguous(state.astype(mx.float32).swapaxes(-1, -2))  # [B, Hv, Dk, Dv]
            g.offset = n
            out.append(g)
    mx.eval([a for c in out for a in c.state])
    return ModelCache(out, [KVCache() for _ in range(n_mtp)])


# ----------------------------------------------------------------------------------------------------------
# Files


def save_prompt_cache(file: str | os.PathLike, cache: list, metadata: dict[str, str] | None = None) -> None:
    """Write `cache` (mlx-lm or hetero layer caches; hetero's MTP caches must be left out) in the file format of
    `mlx_lm.save_prompt_cache`, so `mlx_lm.load_prompt_cache` and `mlx_lm.generate --prompt-cache-file` read it."""
    states, classes = [], []
    for c in cache:
        kind, state = layer_state(c)
        states.append(state)
        classes.append(kind)
    tensors: dict[str, mx.array] = {}
    kinds: list = [""]  # mlx-lm's marker list starts with "" (an empty list would vanish when flattened)
    for name, leaf in tree_flatten(states):
        if isinstance(leaf, mx.array):
            tensors[name] = leaf
        elif leaf is None:
            tensors[name], kind = mx.array([]), "none"
            kinds.append((name, kind))
        elif isinstance(leaf, (bool, int, float)):
            tensors[name] = mx.array(leaf)
            kinds.append((name, "scalar"))
        else:
            raise HeteroError(f"prompt cache entry {name} is a {type(leaf).__name__}: not storable")
    meta = {k: str(v) for k, v in (metadata or {"format": "hetero"}).items()}
    path = Path(file)
    if path.suffix != ".safetensors":
        raise HeteroError(f"{path}: a prompt-cache file's name must end in .safetensors (mlx-lm reads it by that)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial.safetensors")  # MLX keeps a .safetensors name as is
    try:
        mx.save_safetensors(str(tmp), tensors, dict(tree_flatten([meta, classes, kinds])))
        os.replace(tmp, path)  # atomic: a reader finds the old file or the whole new one, never half of one
    finally:
        tmp.unlink(missing_ok=True)


def read_prompt_cache(file: str | os.PathLike) -> tuple[list[tuple[str, list]], dict[str, str]]:
    """([(class name, state), ...] per layer, user metadata) from a file in mlx-lm's prompt-cache format."""
    try:
        arrays, raw = mx.load(str(file), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise HeteroError(f"cannot read the prompt cache {file}: {e}") from None
    try:
        meta, classes, kinds = tree_unflatten(list(raw.items()))
        leaves: dict = dict(arrays)
        for name, kind in kinds[1:]:
            leaves[name] = {"scalar": lambda a: a.item(), "none": lambda a: None}[kind](leaves[name])
        states = tree_unflatten(list(leaves.items()))
    except (ValueError, KeyError, TypeError) as e:
        raise HeteroError(f"{file} is not a prompt-cache file (mlx_lm.save_prompt_cache's format): {e!r}") from None
    if isinstance(meta, list):  # no user metadata: the flattened tree started at index 1
        meta = {}
    for i, name in enumerate(classes):
        if name not in (KV, ARRAYS):
            raise HeteroError(f"{file}: layer {i} is a {name}; hetero reads KVCache and ArraysCache layers only")
    return list(zip(classes, states)), dict(meta)


def load_prompt_cache(file: str | os.PathLike, return_metadata: bool = False):
    """A prompt-cache file as a list of mlx-lm caches (and its metadata), as `mlx_lm.load_prompt_cache` gives."""
    LmKVCache, ArraysCache = mlx_lm_classes()
    layers, meta = read_prompt_cache(file)
    cache = []
    for kind, state in layers:
        if kind == KV:
            c = LmKVCache()
            c.keys, c.values, c.offset = state[0], state[1], int(state[2])
        else:
            c = ArraysCache(size=len(state[0]))
            for j, a in enumerate(state[0]):
                c[j] = a
        cache.append(c)
    return (cache, meta) if return_metadata else cache
