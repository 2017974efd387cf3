"""A serial prefill in which exported attention programs, run by the reference executor, replace MLX's
attention layers, and everything else (embeddings, GDN layers, MLPs, final norm, lm_head) runs on MLX.

It checks an export end to end: the programs' outputs feed the rest of the network and their new K/V land in the
MLX cache (the single source of truth), chunk by chunk. No overlap of devices here: that is the pipeline's job.
"""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import numpy as np

from hetero.coreml.backends.reference_executor import ReferenceExecutor
from hetero.coreml.manifest import read_manifest
from hetero.errors import HeteroError
from hetero.models.interface import CausalLM


def attention_programs(export_dir: str | os.PathLike, model: CausalLM, length: int) -> tuple[int, dict[int, list]]:
    """(chunk size, {layer: [(executor, shape, kv range)]}) for the smallest context bucket holding `length`.

    Every attention layer must be covered whole (fraction 1.0): the GPU side of a partial layer is the pipeline's.
    """
    from hetero.coreml.graphs.attention import AttentionShape

    manifest = read_manifest(export_dir)
    chunk = manifest["chunk_size"]
    padded = -(-length // chunk) * chunk
    fits = [c for c in manifest["context_buckets"] if c >= padded]
    if not fits:
        raise HeteroError(f"a {length}-token prompt needs a context bucket of {padded}; the export has {manifest['context_buckets']}")
    layers: dict[int, list] = {}
    for p in manifest["programs"]:
        if p["piece"] == "attention" and p["context"] == min(fits):
            shape = AttentionShape(**p["shape"])
            executor = ReferenceExecutor(Path(export_dir) / p["file"], p.get("function"))  # one function per bucket
            layers.setdefault(p["layer"], []).append((executor, shape, range(*p["part"])))
    n_kv = model.args.num_key_value_heads
    for i, layer in enumerate(model.layers):
        covered = sorted(h for _, _, kv in layers.get(i, []) for h in kv)
        if not layer.is_linear and covered != list(range(n_kv)):
            raise HeteroError(f"layer {i}: the export covers KV heads {covered} of {n_kv}; this prefill needs fraction 1.0")
    return chunk, layers


def _bc1s(h: mx.array, chunk: int) -> np.ndarray:
    """[1, s, hidden] -> (1, hidden, 1, chunk) fp16, zero-padded past s."""
    a = np.array(h[0].astype(mx.float32)).T  # [hidden, s]
    return np.pad(a, ((0, 0), (0, chunk - a.shape[1]))).astype(np.float16)[None, :, None, :]


def _attention_layer(parts: list, layer_cache, h: mx.array, start: int, theta) -> mx.array:
    """One attention layer for the chunk's normed input h [1, s, hidden] at `start` through its programs; writes
    the chunk's K/V."""
    from hetero.coreml.graphs.attention import attention_masks, cache_inputs, rope_tables

    s = h.shape[1]
    total, ks, vs = None, [], []
    for executor, shape, kv in parts:
        keys = layer_cache.keys[:, kv.start : kv.stop, :start] if start else mx.zeros((1, len(kv), 0, shape.head_dim))
        vals = layer_cache.values[:, kv.start : kv.stop, :start] if start else mx.zeros((1, len(kv), 0, shape.head_dim))
        inputs = {"x": _bc1s(h, shape.chunk), **rope_tables(start, shape, theta), **attention_masks(start, shape)}
        inputs.update(cache_inputs(np.array(keys.astype(mx.float32)), np.array(vals.astype(mx.float32)), shape))
        out = executor(inputs)
        part = out["out"][0, :, 0, :s].T.astype(np.float32)  # [s, hidden]
        total = part if total is None else total + part  # partial o_proj sums add up to the layer
        ks.append(out["k_new"][:, :, :s])  # (1, Hkv_part, s, D)
        vs.append(out["v_new"][:, :, :s])
    dtype = h.dtype
    layer_cache.update_and_fetch(mx.array(np.concatenate(ks, 1)).astype(dtype), mx.array(np.concatenate(vs, 1)).astype(dtype))
    return mx.array(total)[None].astype(dtype)  # [1, s, hidden]


def prefill_with_attention_programs(
    model: CausalLM, tokens: list[int], export_dir: str | os.PathLike
) -> tuple[mx.array, mx.array, list]:
    """Prefill `tokens` with every attention layer run by its exported programs (reference executor).

    Returns (logits of the last position [1, V], post-norm hidden [1, hidden], the filled MLX cache).
    """
    chunk, programs = attention_programs(export_dir, model, len(tokens))
    cache = model.make_cache()
    theta = model.args.rotary
    for start in range(0, len(tokens), chunk):
        h = model.model.embed_tokens(mx.array(tokens[start : start + chunk])[None])  # [1, s, hidden]
        for i, layer in enumerate(model.layers):
            if i in programs:
                h = h + _attention_layer(programs[i], cache[i], layer.input_layernorm(h), start, theta)
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            else:
                h = layer(h, cache[i])
        mx.eval(h, *[a for c in cache for a in c.state])
    hidden = model.model.norm(h[:, -1:])  # [1, 1, hidden]
    return model.logits(hidden)[0], hidden[0], cache
