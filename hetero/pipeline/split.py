"""The split prefill as a job graph over (chunk, layer, piece): the ANE lane runs its shares of chunk c while the
GPU lane runs the recurrent and attention work of other chunks and layers; shares merge exactly (partial sums,
head and row concatenation) and K/V of the ANE's heads enter the GPU cache.

Dependencies: a layer's mixer for chunk c needs that layer's state after chunk c-1 (GDN recurrence, attention
KV) and the hidden of chunk c from the layer below; an MLP needs its own layer's mixer output for the same
chunk. At most `in_flight` chunks are in progress at once (each holds its hidden and the pieces' outputs).
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import mlx.core as mx
import numpy as np

from hetero.decode.prefill import mtp_pairs
from hetero.errors import AneLaneLost, AneNonFinite
from hetero.models.cache import GDNCache, KVCache, LayerCache, ModelCache, cache_arrays
from hetero.models.mrope import frequency_positions
from hetero.models.qwen3_5 import DecoderLayer, Model
from hetero.pipeline.ane_process import AneProcess, LaneStats
from hetero.pipeline.lanes import DecodeQueue, Job, Lane, Trace, run_jobs
from hetero.pipeline.layer_io import embed as embed_streams, final_hidden, has_ple, mixer_io, mlp_io, ple
from hetero.pipeline.programs import Programs
from hetero.pipeline.shares import GpuAttentionRest, GpuGDNRest, GpuMLPRest, GpuMoERest, from_bc1s, host, to_bc1s
from hetero.planner import SPLIT_IN_FLIGHT
from hetero.vision.prompt import ImagePrompt


@dataclass
class SplitResult:
    """What one split prefill produced, with both lanes' busy time."""

    logits: mx.array | None  # [1, V] of the last position (None when not asked)
    hidden: mx.array  # [1, hidden] post-norm hidden of the last position
    gpu_busy_s: float
    ane_busy_s: float
    wall_s: float
    ipc_s: float = 0.0  # of the ANE lane's busy time, what crossing to its worker process cost (0 in-thread)
    worker_s: float = 0.0  # the worker's own compute time
    lane: str = "thread"  # where the ANE lane's programs ran: "process" (the worker) or "thread" (in-process)
    vision: list[dict] = field(default_factory=list)  # per image encoded here: where ("ane" / "gpu"), seconds

    @property
    def overlap(self) -> float:
        """(gpu_busy + ane_busy - wall) / min(gpu_busy, ane_busy): 1 = the shorter lane fully hidden."""
        short = min(self.gpu_busy_s, self.ane_busy_s)
        return (self.gpu_busy_s + self.ane_busy_s - self.wall_s) / short if short > 0 else 0.0

    def to_dict(self) -> dict:
        return {"gpu_busy_s": round(self.gpu_busy_s, 6), "ane_busy_s": round(self.ane_busy_s, 6),
                "wall_s": round(self.wall_s, 6), "overlap": round(self.overlap, 4), "lane": self.lane,
                "ipc_s": round(self.ipc_s, 6), "worker_s": round(self.worker_s, 6),
                **({"vision": self.vision} if self.vision else {})}


@dataclass(eq=False)
class Chunk:
    """One chunk in flight: its tokens, absolute start, residual stream and the pieces' partial results."""

    index: int
    ids: list[int]
    start: int
    h: mx.array | None = None  # [1, s, hidden]
    piece: mx.array | None = None  # [1, s] token ids
    host: np.ndarray | None = None  # [1, s] int64 token ids on the host (Qwen4-Exp's PLE hashes them)
    images: ImagePrompt | None = None  # the prompt's images (None: a text prompt)
    positions: mx.array | None = None  # [3, s] 3-D rotary positions (with images; None: 1-D from `start`)
    parts: dict = field(default_factory=dict)  # (layer, piece) -> a share's output, until its merge
    gdn: dict = field(default_factory=dict)  # GDN layer -> (conv, recurrent) as this chunk left them (edge hooks)
    whole: bool = False  # every piece on the GPU lane: text before an image while the ANE lane runs the tower

    @property
    def s(self) -> int:
        return len(self.ids)


class SplitPrefill:
    """Prefill through both lanes with a set of loaded programs; `GPU rest` slices are built once per model."""

    def __init__(self, model: Model, programs: Programs, backend: str = "reference executor",
                 in_flight: int = SPLIT_IN_FLIGHT, worker: AneProcess | None = None):
        self.model, self.programs, self.backend, self.in_flight = model, programs, backend, in_flight
        self.worker = worker  # the process the programs run in (None: in this process, on the ANE lane's thread)
        self.attn_rest: dict[int, GpuAttentionRest] = {}
        self.mlp_rest: dict[int, GpuMLPRest] = {}
        self.gdn_rest: dict[int, GpuGDNRest] = {}
        self.moe_rest: dict[int, GpuMoERest] = {}  # MoE layers whose shared expert the ANE takes a share of
        self._tables: dict = {}  # chunk start -> {program shape: RoPE tables and masks} (filled on the ANE lane)
        # (layer, piece) -> running largest |normed input| and |ANE output| over a run's chunks: MLX scalars, each
        # evaluated with its chunk on the GPU lane and read once the run is done (`observed`)
        self._seen: dict[tuple[int, str], list] = {}
        args = model.args
        for i, layer in enumerate(model.layers):
            k, c, zr = programs.share("attention", i), programs.share("mlp", i), programs.share("gdn_in_proj", i)
            if not layer.is_linear and 0 < k < args.num_key_value_heads:
                self.attn_rest[i] = GpuAttentionRest(layer, k)
            if 0 < c < args.intermediate_size:
                self.mlp_rest[i] = GpuMLPRest(layer, programs.ane_units("mlp", i))
            if layer.is_linear and zr:
                self.gdn_rest[i] = GpuGDNRest(layer, zr)
            if programs.share("shared_expert", i):  # the router and the routed experts always stay: a rest to run
                self.moe_rest[i] = GpuMoERest(layer, programs.ane_units("shared_expert", i))

    def copied_bytes(self) -> int:
        """What the GPU lane's shares hold beyond the model's weights (gathered, not viewed): the governor counts it."""
        rests = [*self.attn_rest.values(), *self.mlp_rest.values(), *self.gdn_rest.values(), *self.moe_rest.values()]
        return sum(r.copied for r in rests)

    def jobs(self, tokens: list[int], cache: list[LayerCache], out: dict, mtp: bool, carry: mx.array | None,
             logits: bool, on_chunk: EdgeFn | None = None, images: ImagePrompt | None = None,
             encoders: dict | None = None, tower=None) -> list[Job]:
        """The whole prefill of `tokens` (appended to `cache`) as a job graph; results land in `out`.

        `images` (the prompt's `ImagePrompt`) puts the images' embeddings in place of their tokens (an image not
        encoded yet: by its `encoders` job on the ANE lane, else by `tower` on the GPU lane; see `run`) and gives
        every chunk its 3-D rotary positions: the GPU lane's attention and MTP head rotate by them,
        the ANE's attention programs get RoPE tables computed from them (the same programs).

        `on_chunk(n, cache_at_n, hidden)` sees the state at every chunk edge n, as `decode.prefill.prefill`'s hook does
        (the prefix cache checkpoints it), on the GPU lane once the chunk is done: layers below may already hold
        later chunks, so it gets a view of the cache as it stood at n (attention KV read up to n, each GDN layer's
        state as its chunk left it, the MTP head's KV at n - 1)."""
        model, size = self.model, self.programs.chunk
        base = cache[0].offset
        st = {"carry": carry}
        self._tables.clear()  # none left by a run that failed: tables are per prompt (its images' positions)
        jobs: list[Job] = []
        state: dict[int, Job] = {}  # layer -> the job that last advanced its cache
        finished: list[Job] = []  # per chunk: its final-norm job
        lane = self._tower_jobs(images, encoders or {}, out)
        jobs += lane.values()
        first = min((images.spans[i][0] for i in lane), default=0)  # the first image the ANE lane encodes
        for c, lo in enumerate(range(0, len(tokens), size)):
            ch = Chunk(c, tokens[lo : lo + size], base + lo, images=images)
            ch.whole = ch.start + ch.s <= first  # text before it: the GPU lane alone, meanwhile
            needs = [i for i, (a, b) in enumerate(images.spans) if a < ch.start + ch.s and b > ch.start
                     and images.embeddings[i] is None] if images is not None else []

            def embed(ch=ch, needs=needs) -> None:  # every MLX op runs on the GPU lane's thread (per-thread streams)
                ch.piece = mx.array(ch.ids)[None]  # [1, s]
                ch.host = np.array(ch.ids, dtype=np.int64)[None]  # [1, s]
                if images is None:
                    ch.h = embed_streams(model, ch.piece)  # [1, s, hidden] (Qwen4-Exp: its hc streams [1, s, hc*d])
                else:  # the images' rows in place, and the chunk's 3-D positions [3, s]
                    for i in needs:  # the lane's embeddings, or (no lane for it, or it failed) the GPU tower's
                        if images.embeddings[i] is None:  # (an image across a chunk edge: the first chunk's job)
                            self._take_image(images, i, out, tower)
                    ch.h, ch.positions = images.inputs(model.model.embed_tokens, ch.start, ch.start + ch.s)
                mx.eval(ch.h, ch.piece, *([] if ch.positions is None else [ch.positions]))  # nothing lazy outlives a job

            window = (finished[c - self.in_flight],) if c >= self.in_flight else ()
            window += tuple(lane[i] for i in needs if i in lane)
            h_job = Job(f"embed @{ch.start}", "gpu", embed, window, (c, -1, 0))
            jobs.append(h_job)
            for i, layer in enumerate(model.layers):
                new = self._mixer(i, layer, cache[i], ch, h_job, state.get(i))
                jobs += new
                h_job = new[-1]
                # a split GDN's state advances in its recurrence job (the first); the output merge only reads it
                state[i] = new[0] if (layer.is_linear and i in self.gdn_rest) else new[-1]
                if on_chunk is not None and layer.is_linear:
                    state[i].fn = _then_keep_state(state[i].fn, ch, i, cache[i])
                new = self._mlp(i, layer, ch, h_job)
                jobs += new
                h_job = new[-1]
            last = lo + size >= len(tokens)

            def finish(ch=ch, last=last) -> None:
                h, piece = final_hidden(model, ch.h), ch.piece  # [1, s, hidden] (Qwen4-Exp: [1, s, hc*d]), [1, s]
                if mtp and model.has_mtp:  # the MTP head's KV: (t_{p+1}, h_p) pairs, as `decode.prefill.prefill` fills it
                    pairs = None
                    if images is not None:  # the 3-D positions of the pairs' p
                        first = ch.start - (st["carry"] is not None)
                        pairs = mx.array(images.positions[:, first : ch.start + ch.s - 1])  # [3, m]
                    mtp_pairs(model, piece, h, st["carry"], cache, pairs)
                out["hidden"] = st["carry"] = h[0, -1:]  # evaluated below: the next job may run on another thread
                out["logits"] = model.logits(h[:, -1:])[0] if (logits and last) else None
                mx.eval(out["hidden"], *([out["logits"]] if out["logits"] is not None else []), *cache_arrays(cache))
                if on_chunk is not None:
                    on_chunk(ch.start + ch.s, _view_at(cache, ch), out["hidden"])
                ch.h = ch.piece = ch.positions = ch.host = None  # the chunk's buffers go now
                ch.parts.clear()
                ch.gdn.clear()
                self._tables.pop(ch.start, None)

            after = (h_job, finished[-1]) if finished else (h_job,)  # the MTP KV and the carry go chunk by chunk
            finished.append(Job(f"norm @{ch.start}", "gpu", finish, after, (c, len(model.layers), 0)))
            jobs.append(finished[-1])
        return jobs

    def _tower_jobs(self, images: ImagePrompt | None, encoders: dict, out: dict) -> dict[int, Job]:
        """Image -> the ANE job that encodes it (`encoders[i]()` -> [tokens, out_hidden] fp32) ahead of every other
        ANE job: it starts as the prefill does, while the GPU lane prefills the text before the image. A
        non-finite result from a lane still alive (in this process) leaves the image to the GPU tower; a lost
        worker is the split's failure."""
        if images is None:
            return {}
        out["lane images"], out["vision"] = {}, []

        def job(i: int, encode) -> None:
            start = time.perf_counter()
            try:
                out["lane images"][i] = encode()
            except AneNonFinite as e:
                if self.worker is not None:  # the worker killed itself on them: the lane is lost
                    raise AneLaneLost(str(e)) from None
                print(f"warning: {e}; the GPU tower encodes it", file=sys.stderr)
                return
            out["vision"].append({"image": i, "lane": "ane", "tokens": len(out["lane images"][i]),
                                  "seconds": round(time.perf_counter() - start, 6)})

        return {i: Job(f"vision image {i}", "ane", lambda i=i, e=e: job(i, e), (), (-1, i, 0))
                for i, e in encoders.items() if images.embeddings[i] is None}

    def _take_image(self, images: ImagePrompt, i: int, out: dict, tower) -> None:
        """Image i's embeddings into the prompt (GPU lane): the lane's, else the GPU tower's (`tower`)."""
        rows = out.get("lane images", {}).pop(i, None)
        if rows is not None:
            images.embeddings[i] = mx.array(rows)  # [tokens, out_hidden] fp32 (fp16 values)
            out.setdefault("from lane", []).append(i)
            return
        if tower is None:
            raise ValueError(f"image {i} is not encoded and the split has no tower for it")
        start = time.perf_counter()
        images.encode_image(tower, i)
        lo, hi = images.spans[i]
        out.setdefault("vision", []).append({"image": i, "lane": "gpu", "tokens": hi - lo,
                                             "seconds": round(time.perf_counter() - start, 6)})

    def _mixer(self, i: int, layer: DecoderLayer, c: LayerCache, ch: Chunk, h_job: Job, prev: Job | None) -> list[Job]:
        """Jobs of layer i's mixer for chunk `ch`, after `h_job` (its input) and `prev` (the layer's last state
        update); the last job returned leaves the mixer's output in `ch.h`."""
        progs, size = self.programs, self.programs.chunk
        label = f"L{i} {'gdn' if layer.is_linear else 'attn'} @{ch.start}"
        after = (h_job,) if prev is None else (h_job, prev)
        rank = lambda step: (ch.index, i, step)  # noqa: E731
        if layer.is_linear and i in self.gdn_rest and not ch.whole:
            rest, parts = self.gdn_rest[i], progs.gdn_in_proj[i]
            norm = self._normed(f"{label} norm", mixer_io(layer), ch, (i, "x"), self._ple_after(layer, h_job, prev),
                                rank(0), (i, "gdn_in_proj"), self._ple(layer, c, ch))
            state = (norm,) if prev is None else (norm, prev)  # the recurrence continues the last chunk's state

            def gpu() -> None:
                ch.parts[i, "gdn"] = rest(ch.parts[i, "x"][0], c)

            def ane() -> None:
                x = to_bc1s(ch.parts[i, "x"][1], size)
                zs = [from_bc1s(run({"x": x})["z"], ch.s) for run, _ in parts]  # [s, rows of each part]
                ch.parts[i, "z"] = np.concatenate(zs, 1)  # [s, zr]

            def merge() -> None:
                o, z_rest = ch.parts.pop((i, "gdn"))
                ctx = ch.parts.pop((i, "x"))[2]
                dtype = ch.h.dtype
                z = mx.array(ch.parts.pop((i, "z")))[None]  # [1, s, zr] fp32
                seen = self._track((i, "gdn_in_proj"), 1, z)
                z = z.astype(dtype)
                if z_rest is not None:
                    z = mx.concatenate([z, z_rest], axis=-1)  # [1, s, nv*dv]
                ch.h = mixer_io(layer).write(ch.h, rest.finish(o, z, dtype), ctx)
                mx.eval(ch.h, seen)

            g, a = Job(label, "gpu", gpu, state, rank(0)), Job(f"{label} z", "ane", ane, (norm,), rank(0))
            return [g, norm, a, Job(f"{label} merge", "gpu", merge, (g, a), rank(1))]
        if not layer.is_linear and i in progs.attention and not ch.whole:
            rest, parts = self.attn_rest.get(i), progs.attention_at(i, ch.start)
            theta = self.model.args.rotary  # the rope tables' frequencies (and a yarn rope's scale)
            norm = self._normed(f"{label} norm", mixer_io(layer), ch, (i, "x"), (h_job,), rank(0), (i, "attention"))
            state = (norm,) if prev is None else (norm, prev)  # both read the cache as the last chunk left it
            indexer = getattr(layer.self_attn, "indexer", None)  # Qwen4-Exp's QSA: its selection comes first
            if indexer is not None:
                state = (self._select(f"{label} index", indexer, c, ch, i, state, rank(0)),)

            def ane() -> None:
                from hetero.coreml.graphs.attention import attention_masks, cache_inputs, rope_tables, selected_masks

                x = to_bc1s(ch.parts[i, "x"][1], size)
                D = parts[0][1].head_dim
                k_all = np.empty((1, sum(len(kv) for *_, kv in parts), ch.s, D), np.float32)  # [1, Kp, s, D]
                v_all, total, h0 = np.empty_like(k_all), None, 0
                for run, shape, kv in parts:
                    keys, vals = _cached_heads(c, kv, ch.start, shape.head_dim)
                    key = (ch.start, shape)  # every attention layer of a chunk shares its RoPE tables and masks
                    tables = self._tables.setdefault(ch.start, {})
                    if key not in tables:
                        tables[key] = {**rope_tables(ch.start, shape, theta, self._rope_positions(ch, shape)),
                                       **attention_masks(ch.start, shape)}
                    masks = {} if indexer is None else selected_masks(ch.start, shape, ch.parts[i, "index"][2])
                    r = run({"x": x, **tables[key], **masks, **cache_inputs(keys, vals, shape)})
                    part = from_bc1s(r["out"], ch.s)  # [s, hidden]
                    total = part if total is None else total + part  # partial o_proj sums add up
                    # copied out before the next program runs: a worker's outputs are views of a reused buffer
                    k_all[:, h0 : h0 + len(kv)] = r["k_new"][:, :, : ch.s]  # (1, heads of this part, s, D)
                    v_all[:, h0 : h0 + len(kv)] = r["v_new"][:, :, : ch.s]
                    h0 += len(kv)
                ch.parts[i, "ane"] = total, k_all, v_all

            def gpu() -> None:
                chosen = None if indexer is None else ch.parts[i, "index"][1]
                ch.parts[i, "gpu"] = rest(ch.parts[i, "x"][0], c, ch.positions, chosen)

            def merge() -> None:
                dtype = ch.h.dtype
                ctx = ch.parts.pop((i, "x"))[2]
                total, k_ane, v_ane = ch.parts.pop((i, "ane"))
                keys, values = mx.array(k_ane).astype(dtype), mx.array(v_ane).astype(dtype)
                out = mx.array(total)[None].astype(dtype)  # [1, s, hidden]
                if rest is not None:
                    g_out, g_k, g_v = ch.parts.pop((i, "gpu"))
                    keys = mx.concatenate([keys, g_k], axis=1)  # ANE heads first: [1, Hkv, s, D]
                    values = mx.concatenate([values, g_v], axis=1)
                    out = out + g_out
                c.update_and_fetch(keys, values)  # the GPU cache stays the single source of truth
                if indexer is not None:
                    c.update_index(ch.parts.pop((i, "index"))[0])  # the chunk's raw index keys [1, s, Di]
                ch.h = mixer_io(layer).write(ch.h, out, ctx)
                mx.eval(ch.h, *c.state)

            shares = [Job(f"{label} heads", "ane", ane, state, rank(0))]
            if rest is not None:
                shares.append(Job(label, "gpu", gpu, state, rank(0)))
            first = [norm] if indexer is None else [norm, state[0]]
            return first + shares + [Job(f"{label} merge", "gpu", merge, tuple(shares), rank(1))]

        def whole() -> None:
            io = mixer_io(layer)
            ch.h = ple(layer, ch.h, ch.host, c)  # Qwen4-Exp's PLE layers: before the mixer
            x, ctx = io.read(ch.h)
            if layer.is_linear:
                out = layer.linear_attn(x, c)
            elif ch.positions is not None:
                out = layer.self_attn(x, c, ch.positions)
            else:
                out = layer.self_attn(x, c)  # 1-D positions from the cache's offset
            ch.h = io.write(ch.h, out, ctx)
            mx.eval(ch.h, *c.state)

        return [Job(label, "gpu", whole, after, rank(0))]

    def _rope_positions(self, ch: Chunk, shape) -> np.ndarray | None:
        """Each rotary frequency's positions [R/2, S] for chunk `ch`'s attention programs (from its stream of the
        prompt's 3-D positions, numpy only: this runs on the ANE lane), or None for a text prompt (1-D tables)."""
        if ch.images is None or not shape.rotary_dims // 2:
            return None
        positions = ch.images.positions[:, ch.start : ch.start + ch.s]  # [3, s]
        return frequency_positions(positions, shape.rotary_dims, self.model.args.mrope_section, shape.chunk)

    def _mlp(self, i: int, layer: DecoderLayer, ch: Chunk, h_job: Job) -> list[Job]:
        """Jobs of layer i's MLP for chunk `ch` after `h_job`; the last one leaves the layer's output in `ch.h`."""
        progs, size = self.programs, self.programs.chunk
        label = f"L{i} mlp @{ch.start}"
        rank = lambda step: (ch.index, i, step)  # noqa: E731
        if i in self.moe_rest and not ch.whole:
            return self._moe(i, ch, h_job)
        if i not in progs.mlp or ch.whole:
            def whole() -> None:
                io = mlp_io(layer)
                x, ctx = io.read(ch.h)
                ch.h = io.write(ch.h, layer.mlp(x), ctx)
                mx.eval(ch.h)

            return [Job(label, "gpu", whole, (h_job,), rank(2))]
        rest, parts = self.mlp_rest.get(i), progs.mlp[i]
        norm = self._normed(f"{label} norm", mlp_io(layer), ch, (i, "mlp x"), (h_job,), rank(2), (i, "mlp"))

        def ane() -> None:
            x = to_bc1s(ch.parts[i, "mlp x"][1], size)
            ch.parts[i, "mlp ane"] = sum(from_bc1s(run({"x": x})["out"], ch.s) for run, _ in parts)  # [s, hidden]

        def gpu() -> None:
            out = rest.partial(ch.parts[i, "mlp x"][0])  # [1, s, hidden]
            mx.eval(out)
            ch.parts[i, "mlp gpu"] = out

        def merge() -> None:
            ctx = ch.parts.pop((i, "mlp x"))[2]
            out = mx.array(ch.parts.pop((i, "mlp ane")))[None]  # [1, s, hidden] fp32
            seen = self._track((i, "mlp"), 1, out)
            out = out.astype(ch.h.dtype)
            ch.h = mlp_io(layer).write(ch.h, out if rest is None else out + ch.parts.pop((i, "mlp gpu")), ctx)
            mx.eval(ch.h, seen)

        shares = [Job(f"{label} channels", "ane", ane, (norm,), rank(2))]
        if rest is not None:
            shares.append(Job(label, "gpu", gpu, (norm,), rank(2)))
        return [norm] + shares + [Job(f"{label} merge", "gpu", merge, tuple(shares), rank(3))]

    def _moe(self, i: int, ch: Chunk, h_job: Job) -> list[Job]:
        """Jobs of MoE layer i's MLP for chunk `ch` after `h_job`: the ANE's shared-expert channels as the MLP
        program, the rest (router, routed experts, the other shared channels, the gate logit) on the GPU, merged
        as the dense MLP's partial sums are, then gated; the last job leaves the layer's output in `ch.h`."""
        size, parts, rest = self.programs.chunk, self.programs.shared_expert[i], self.moe_rest[i]
        label = f"L{i} moe @{ch.start}"
        rank = lambda step: (ch.index, i, step)  # noqa: E731

        io = mlp_io(self.model.layers[i])
        norm = self._normed(f"{label} norm", io, ch, (i, "moe x"), (h_job,), rank(2), (i, "shared_expert"))

        def ane() -> None:
            x = to_bc1s(ch.parts[i, "moe x"][1], size)
            ch.parts[i, "shared ane"] = sum(from_bc1s(run({"x": x})["out"], ch.s) for run, _ in parts)  # [s, hidden]

        def gpu() -> None:
            ch.parts[i, "moe gpu"] = rest(ch.parts[i, "moe x"][0])

        def merge() -> None:
            ctx = ch.parts.pop((i, "moe x"))[2]
            routed, shared_rest, gate = ch.parts.pop((i, "moe gpu"))
            shared = mx.array(ch.parts.pop((i, "shared ane")))[None]  # [1, s, hidden] fp32
            seen = self._track((i, "shared_expert"), 1, shared)
            shared = shared.astype(ch.h.dtype)
            if shared_rest is not None:
                shared = shared + shared_rest  # the shared expert's partial down_proj sums add up
            ch.h = io.write(ch.h, rest.finish(routed, shared, gate), ctx)
            mx.eval(ch.h, seen)

        shares = [Job(f"{label} shared channels", "ane", ane, (norm,), rank(2)),
                  Job(label, "gpu", gpu, (norm,), rank(2))]
        return [norm] + shares + [Job(f"{label} merge", "gpu", merge, tuple(shares), rank(3))]

    def _normed(self, label: str, io, ch: Chunk, key: tuple, after: tuple, rank: tuple, piece: tuple,
                pre=None) -> Job:
        """A GPU job leaving a piece's normed input in `ch.parts[key]`: (x in the model's dtype for the GPU's share,
        x in fp32 for the ANE lane to read without an MLX op, what `io.write` needs to merge the output back: see
        `layer_io`). The programs read normed inputs (Qwen4-Exp: the hyper-connection's mixed input): bounded
        however large the residual stream grows, and no epsilon enters them. Its largest value is tracked for
        `piece`. `pre` (h -> h) runs first: a Qwen4-Exp PLE layer's update before its mixer."""

        def job() -> None:
            if pre is not None:
                ch.h = pre(ch.h)
            x, ctx = io.read(ch.h)  # [1, s, hidden]
            x32 = x if x.dtype == mx.float32 else x.astype(mx.float32)
            mx.eval(ch.h, x, x32, self._track(piece, 0, x32), *([] if ctx is None else [ctx]))
            ch.parts[key] = (x, x32, ctx)

        return Job(label, "gpu", job, after, rank)

    @staticmethod
    def _select(label: str, indexer, c: LayerCache, ch: Chunk, i: int, after: tuple, rank: tuple) -> Job:
        """A GPU job leaving a QSA layer's selection for chunk `ch` in `ch.parts[i, "index"]`: (the chunk's raw
        index keys [1, s, Di], which the merge appends to the cache; the keys each query may attend to [1, s, T]
        (causal included), and the same on the host [s, T] for the ANE's masks). The indexer reads the mixer's
        input and the cache's index keys as the last chunk left them, exactly as the layer does."""

        def job() -> None:
            q, k = indexer.project(ch.parts[i, "x"][0])  # [1, s, Hi, Di], [1, s, Di]
            old = c.index_keys[:, : ch.start] if c.index_keys is not None and ch.start else None
            keys = k if old is None else mx.concatenate([old, k], axis=1)  # [1, T, Di]
            chosen = indexer.select(q, keys, ch.start)  # [1, s, T]
            mx.eval(k, chosen)
            ch.parts[i, "index"] = (k, chosen, np.array(chosen[0]))

        return Job(label, "gpu", job, after, rank)

    @staticmethod
    def _ple(layer, c: LayerCache, ch: Chunk):
        """h -> h + PLE(h) on a Qwen4-Exp PLE layer (None elsewhere): advances its PLE cache."""
        return (lambda h: ple(layer, h, ch.host, c)) if has_ple(layer) else None

    @staticmethod
    def _ple_after(layer, h_job: Job, prev: Job | None) -> tuple:
        """What a mixer's input job waits for: its input, and on a PLE layer the last chunk's state update too (the
        PLE cache carries the last chunk's tokens and conv inputs)."""
        return (h_job,) if prev is None or not has_ple(layer) else (h_job, prev)

    def _track(self, piece: tuple, which: int, a: mx.array) -> mx.array:
        """Fold max|a| into `piece`'s running maximum `which` (0: normed input, 1: ANE output): one lazy reduction,
        returned for the caller to evaluate with its chunk (GPU lane only; nothing waits on it)."""
        seen = self._seen.setdefault(piece, [None, None])
        m = mx.abs(a).max()
        seen[which] = m if seen[which] is None else mx.maximum(seen[which], m)
        return seen[which]

    def observed(self) -> dict[tuple[int, str], tuple[float, float]]:
        """(layer, piece) -> the largest |normed input| and |ANE output| (0 where not tracked) over the last run's
        chunks: one read of values evaluated with the chunks."""
        keys = sorted(self._seen)
        flat = [v if v is not None else mx.array(0.0) for k in keys for v in self._seen[k]]
        values = np.array(mx.stack(flat)).reshape(-1, 2).tolist() if flat else []
        return {k: (v[0], v[1]) for k, v in zip(keys, values)}

    def run(self, tokens: list[int], cache: list[LayerCache], mtp: bool = False, carry: mx.array | None = None,
            logits: bool = True, trace: Trace | None = None, decode: DecodeQueue | None = None,
            on_chunk: EdgeFn | None = None, images: ImagePrompt | None = None, encoders: dict | None = None,
            tower=None) -> SplitResult:
        """Prefill `tokens` into `cache` with both lanes; returns the last position's logits and hidden.

        With `decode`, the GPU lane interleaves decode rounds of other requests (see `DecodeQueue`); `on_chunk`
        sees the cache at every chunk edge (see `jobs`). `images`: the prompt's `ImagePrompt` (its images encoded,
        `tokens` a prefix of its tokens); the attention caches then hold its position shift, as after
        `decode.prefill.prefill`. `encoders` (image -> a callable the ANE lane runs: `VisionLane.encoders`) encode
        those of its images not encoded yet on the ANE lane as the prefill starts; the chunks of text before them
        run whole on the GPU lane meanwhile. Any other image not encoded yet is encoded by `tower` (the GPU tower)
        when its chunk is reached. If the prefill fails, the lane's embeddings are taken back out of `images`.
        """
        if not tokens:
            raise ValueError("prefill needs at least one token")
        if images is not None:
            if list(tokens) != images.tokens[cache[0].offset : cache[0].offset + len(tokens)]:
                raise ValueError("the split's tokens are not its ImagePrompt's")
            for c in cache:
                if isinstance(c, KVCache):
                    c.shift = images.delta  # decoding continues at the positions after the images
        where = "worker process" if self.worker is not None else "in-thread"
        gpu, ane = Lane("GPU (MLX)", 1, trace, dedicated=True), Lane(f"ANE ({self.backend}, {where})", 2, trace)
        out: dict = {}
        self._seen = {}
        before = self.worker.stats.since(LaneStats()) if self.worker is not None else None
        if self.worker is not None:
            self.worker.trace = trace
        start = time.perf_counter()
        try:
            anyio.run(run_jobs, self.jobs(tokens, cache, out, mtp, carry, logits, on_chunk, images, encoders, tower),
                      gpu, ane, decode)
        except BaseException:
            for i in out.get("from lane", []):  # a GPU-only rerun encodes them with the GPU tower
                images.embeddings[i] = None
            raise
        finally:
            gpu.close()
            if self.worker is not None:
                self.worker.trace = None
        wall = time.perf_counter() - start
        res = SplitResult(out.get("logits"), out["hidden"], gpu.busy_s, ane.busy_s, wall,
                          vision=sorted(out.get("vision", []), key=lambda v: v["image"]))
        if before is not None:
            spent = self.worker.stats.since(before)
            res.ipc_s, res.worker_s, res.lane = spent.ipc_s, spent.compute_s, "process"
        return res


EdgeFn = Callable[[int, list, mx.array], None]  # (n, the cache as it stood at n, post-norm hidden h_{n-1} [1, H])


def _then_keep_state(fn: Callable[[], None], ch: Chunk, i: int, c: GDNCache) -> Callable[[], None]:
    """`fn` (the job that advances GDN layer i for chunk `ch`), then a reference to the state it left: the
    arrays are replaced, never written in place, so holding them is the snapshot."""

    def job() -> None:
        fn()
        p = getattr(c, "ple", None)  # Qwen4-Exp's PLE layers: their PLE state too
        ch.gdn[i] = (c.conv, c.recurrent, None if p is None else (p.context, p.conv))

    return job


def _view_at(cache: ModelCache, ch: Chunk) -> ModelCache:
    """The cache as it stood at chunk `ch`'s end n: backbone caches at offset n (attention K/V are only appended
    to, so the live buffers read up to n; GDN layers from the chunk's snapshots) and the live MTP caches (their
    edge is this chunk's, as their pairs are filled chunk by chunk). Qwen4-Exp's: GDN layers with their PLE state
    from the snapshots, QSA layers with their index keys up to n."""
    n, view = ch.start + ch.s, []
    for i, c in enumerate(cache.backbone):
        if isinstance(c, GDNCache):
            at = copy.copy(c)  # its own class (Qwen4-Exp's carries the PLE state)
            at.conv, at.recurrent, ple_state = ch.gdn[i]
            if ple_state is not None:
                at.ple = copy.copy(c.ple)
                at.ple.context, at.ple.conv = ple_state
        else:
            at = c.like() if hasattr(c, "index_keys") else KVCache()  # a QSA layer's keeps its index keys
            at.keys, at.values = c.keys, c.values
            if getattr(c, "index_keys", None) is not None:
                at.index_keys = c.index_keys[:, :n]  # [1, n, Di]
        at.offset = n
        view.append(at)
    return ModelCache(view, cache.mtp)


def _cached_heads(c: LayerCache, kv: range, start: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The GPU cache's K/V of KV heads `kv` before position `start`, as fp32 numpy [1, Kp, start, D] (read on the
    ANE lane: an fp32 cache is viewed without an MLX op; the merge that writes the next chunk waits for this)."""
    if not start:
        empty = np.zeros((1, len(kv), 0, head_dim), np.float32)
        return empty, empty
    return tuple(host(a)[:, kv.start : kv.stop, :start] for a in (c.keys, c.values))

