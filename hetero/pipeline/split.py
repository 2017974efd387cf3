"""The split prefill: per chunk and layer, one stage per piece in which the ANE's slice and the GPU's rest run at
once and merge exactly (partial sums, head and row concatenation); K/V of the ANE's heads enter the GPU cache."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import anyio
import mlx.core as mx
import numpy as np

from hetero.cache import LayerCache, cache_arrays
from hetero.models.qwen3_5 import DecoderLayer, Model
from hetero.pipeline.lanes import DecodeQueue, Lane, Stage, Trace, run_stages
from hetero.pipeline.programs import Programs
from hetero.pipeline.shares import GpuAttentionRest, GpuGDNRest, GpuMLPRest, to_bc1s, from_bc1s


@dataclass
class SplitResult:
    """What one split prefill produced, with both lanes' busy time."""

    logits: mx.array | None  # [1, V] of the last position (None when not asked)
    hidden: mx.array  # [1, hidden] post-norm hidden of the last position
    gpu_busy_s: float
    ane_busy_s: float
    wall_s: float

    @property
    def overlap(self) -> float:
        """(gpu_busy + ane_busy - wall) / min(gpu_busy, ane_busy): 1 = the shorter lane fully hidden."""
        short = min(self.gpu_busy_s, self.ane_busy_s)
        return (self.gpu_busy_s + self.ane_busy_s - self.wall_s) / short if short > 0 else 0.0

    def to_dict(self) -> dict:
        return {"gpu_busy_s": round(self.gpu_busy_s, 6), "ane_busy_s": round(self.ane_busy_s, 6),
                "wall_s": round(self.wall_s, 6), "overlap": round(self.overlap, 4)}


class SplitPrefill:
    """Prefill through both lanes with a set of loaded programs; `GPU rest` slices are built once per model."""

    def __init__(self, model: Model, programs: Programs, backend: str = "reference executor"):
        self.model, self.programs, self.backend = model, programs, backend
        self.attn_rest: dict[int, GpuAttentionRest] = {}
        self.mlp_rest: dict[int, GpuMLPRest] = {}
        self.gdn_rest: dict[int, GpuGDNRest] = {}
        self._tables: dict = {}  # (chunk start, program shape) -> RoPE tables and masks of the current chunk
        args = model.args
        for i, layer in enumerate(model.layers):
            k, c, zr = programs.share("attention", i), programs.share("mlp", i), programs.share("gdn_z", i)
            if not layer.is_linear and 0 < k < args.num_key_value_heads:
                self.attn_rest[i] = GpuAttentionRest(layer, k)
            if 0 < c < args.intermediate_size:
                self.mlp_rest[i] = GpuMLPRest(layer, c)
            if layer.is_linear and zr:
                self.gdn_rest[i] = GpuGDNRest(layer, zr)

    def stages(self, tokens: list[int], cache: list[LayerCache], out: dict, mtp: bool, carry: mx.array | None,
               logits: bool) -> Iterator[Stage]:
        """Every stage of the prefill of `tokens` (appended to `cache`); results land in `out`."""
        model, chunk = self.model, self.programs.chunk
        theta = model.args.rope_theta
        st: dict = {"carry": carry}
        base = cache[0].offset
        for lo in range(0, len(tokens), chunk):
            ids = tokens[lo : lo + chunk]
            s = len(ids)

            def embed(ids=ids) -> None:  # every MLX op runs on the GPU lane's thread (streams are per thread)
                st["piece"] = mx.array(ids)[None]  # [1, s]
                st["h"] = model.model.embed_tokens(st["piece"])  # [1, s, hidden]
                mx.eval(st["h"], st["piece"])  # nothing lazy outlives a job: each may run on another thread

            yield Stage(f"embed {base + lo}", gpu=embed)
            for i, layer in enumerate(model.layers):
                yield from self._mixer(i, layer, cache[i], st, s, theta, base + lo)
                yield from self._mlp(i, layer, st, s)
            last = lo + chunk >= len(tokens)

            def finish(last=last) -> None:
                h, piece = model.model.norm(st["h"]), st["piece"]  # [1, s, hidden], [1, s]
                if mtp and model.has_mtp:  # the MTP head's KV: (t_{p+1}, h_p) pairs, as `generate.prefill` does
                    c = st["carry"]
                    pairs_h = h[0, :-1] if c is None else mx.concatenate([c, h[0, :-1]])  # [m, H]
                    pairs_t = piece[0, 1:] if c is None else piece[0]
                    if pairs_t.size:
                        model.mtp_hidden(pairs_t[None], pairs_h[None], cache)
                out["hidden"] = st["carry"] = h[0, -1:]  # evaluated below: the next job may run on another thread
                out["logits"] = model.logits(h[:, -1:])[0] if (logits and last) else None
                mx.eval(out["hidden"], *([out["logits"]] if out["logits"] is not None else []), *cache_arrays(cache))

            yield Stage(f"norm {base + lo}", gpu=finish)

    def _mixer(self, i: int, layer: DecoderLayer, c: LayerCache, st: dict, s: int, theta: float, start: int):
        progs, chunk = self.programs, self.programs.chunk
        label = f"L{i} {'gdn' if layer.is_linear else 'attn'} @{start}"
        if layer.is_linear and i in self.gdn_rest:
            rest, parts = self.gdn_rest[i], progs.gdn_z[i]

            def prep() -> None:
                st["x"] = to_bc1s(st["h"], chunk)

            def ane() -> np.ndarray:
                return np.concatenate([from_bc1s(run({"x": st["x"]})["z"], s) for run, _ in parts], axis=1)  # [s, zr]

            def merge(gpu, ane_z) -> None:
                o, z_rest = gpu
                dtype = st["h"].dtype
                z = mx.array(ane_z)[None].astype(dtype)  # [1, s, zr]
                if z_rest is not None:
                    z = mx.concatenate([z, z_rest], axis=-1)  # [1, s, nv*dv]
                st["h"] = st["h"] + rest.finish(o, z, dtype)
                mx.eval(st["h"])

            yield Stage(label, gpu=lambda: rest(st["h"], c), ane=ane, merge=merge, prep=prep)
        elif not layer.is_linear and i in progs.attention:
            rest, parts = self.attn_rest.get(i), progs.attention[i]

            def prep() -> None:
                from coreml_graphs.attention import attention_masks, cache_inputs, rope_tables

                x = to_bc1s(st["h"], chunk)
                feeds = []
                for _, shape, kv in parts:
                    if start:
                        keys = np.array(c.keys[:, kv.start : kv.stop, :start].astype(mx.float32))  # [1, Kp, T, D]
                        vals = np.array(c.values[:, kv.start : kv.stop, :start].astype(mx.float32))
                    else:
                        keys = vals = np.zeros((1, len(kv), 0, shape.head_dim), np.float32)
                    key = (start, shape)  # every attention layer of a chunk shares its RoPE tables and masks
                    if key not in self._tables:
                        self._tables = {key: {**rope_tables(start, shape, theta), **attention_masks(start, shape)}}
                    feeds.append({"x": x, **self._tables[key], **cache_inputs(keys, vals, shape)})
                st["feeds"] = feeds

            def ane() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
                total, ks, vs = None, [], []
                for (run, _, _), feed in zip(parts, st["feeds"]):
                    r = run(feed)
                    part = from_bc1s(r["out"], s)  # [s, hidden]
                    total = part if total is None else total + part  # partial o_proj sums add up
                    ks.append(r["k_new"][:, :, :s])  # (1, Kp, s, D)
                    vs.append(r["v_new"][:, :, :s])
                return total, np.concatenate(ks, 1), np.concatenate(vs, 1)

            def merge(gpu, ane_out) -> None:
                dtype = st["h"].dtype
                total, k_ane, v_ane = ane_out
                keys, values = mx.array(k_ane).astype(dtype), mx.array(v_ane).astype(dtype)
                out = mx.array(total)[None].astype(dtype)  # [1, s, hidden]
                if gpu is not None:
                    g_out, g_k, g_v = gpu
                    keys = mx.concatenate([keys, g_k], axis=1)  # ANE heads first: [1, Hkv, s, D]
                    values = mx.concatenate([values, g_v], axis=1)
                    out = out + g_out
                c.update_and_fetch(keys, values)  # the GPU cache stays the single source of truth
                st["h"] = st["h"] + out
                mx.eval(st["h"], *c.state)

            gpu = (lambda: rest(st["h"], c)) if rest is not None else None
            yield Stage(label, gpu=gpu, ane=ane, merge=merge, prep=prep)
        else:
            def whole() -> None:
                mixer = layer.linear_attn if layer.is_linear else layer.self_attn
                st["h"] = st["h"] + mixer(layer.input_layernorm(st["h"]), c)
                mx.eval(st["h"], *c.state)

            yield Stage(label, gpu=whole)

    def _mlp(self, i: int, layer: DecoderLayer, st: dict, s: int):
        progs, chunk = self.programs, self.programs.chunk
        label = f"L{i} mlp"
        if i not in progs.mlp:
            def whole() -> None:
                st["h"] = st["h"] + layer.mlp(layer.post_attention_layernorm(st["h"]))
                mx.eval(st["h"])

            yield Stage(label, gpu=whole)
            return
        rest, parts = self.mlp_rest.get(i), progs.mlp[i]

        def prep() -> None:
            st["x"] = to_bc1s(st["h"], chunk)

        def ane() -> np.ndarray:
            return sum(from_bc1s(run({"x": st["x"]})["out"], s) for run, _ in parts)  # [s, hidden]

        def merge(gpu, ane_out) -> None:
            out = mx.array(ane_out)[None].astype(st["h"].dtype)  # [1, s, hidden]
            st["h"] = st["h"] + (out if gpu is None else out + gpu)
            mx.eval(st["h"])

        gpu = (lambda: rest(st["h"])) if rest is not None else None
        yield Stage(label, gpu=gpu, ane=ane, merge=merge, prep=prep)

    def run(self, tokens: list[int], cache: list[LayerCache], mtp: bool = False, carry: mx.array | None = None,
            logits: bool = True, trace: Trace | None = None, decode: DecodeQueue | None = None) -> SplitResult:
        """Prefill `tokens` into `cache` with both lanes; returns the last position's logits and hidden.

        With `decode`, the GPU lane interleaves decode rounds of other requests (see `DecodeQueue`).
        """
        if not tokens:
            raise ValueError("prefill needs at least one token")
        gpu, ane = Lane("GPU (MLX)", 1, trace, dedicated=True), Lane(f"ANE ({self.backend})", 2, trace)
        out: dict = {}
        start = time.perf_counter()
        try:
            anyio.run(run_stages, self.stages(tokens, cache, out, mtp, carry, logits), gpu, ane, decode)
        finally:
            gpu.close()
        wall = time.perf_counter() - start
        return SplitResult(out.get("logits"), out["hidden"], gpu.busy_s, ane.busy_s, wall)
