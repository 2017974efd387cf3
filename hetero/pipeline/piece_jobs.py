"""The jobs of one layer's pieces for one chunk of the split prefill (`hetero.pipeline.split`): the ANE lane's
programs, the GPU lane's rest of each split piece (`shares`), and the merge that puts their sum back into the
residual stream.

Every piece reads its input from the residual stream and writes its output back where the architecture's layer
does (`DecoderLayer.mixer_io` / `mlp_io`: a pre-norm add, or a hyper-connection's mix and injection), and a piece the
ANE takes no share of runs as the layer runs it (`mixer_block`, `mlp_block`): the split re-implements nothing of a
layer. The programs read normed inputs (the GPU lane's norms or mixers), bounded however large the residual grows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from hetero.models.cache import LayerCache
from hetero.models.interface import CausalLM, DecoderLayer, Residual
from hetero.models.mrope import frequency_positions
from hetero.pipeline.lanes import Job
from hetero.pipeline.programs import Programs
from hetero.pipeline.shares import GpuAttentionRest, GpuGDNRest, GpuMLPRest, GpuMoERest, from_bc1s, host, to_bc1s
from hetero.vision.prompt import ImagePrompt


@dataclass(eq=False)
class Chunk:
    """One chunk in flight: its tokens, absolute start, residual stream and the pieces' partial results."""

    index: int
    ids: list[int]
    start: int
    h: mx.array | None = None  # [1, s, hidden] (Qwen4-Exp: its hc streams [1, s, hc*d])
    piece: mx.array | None = None  # [1, s] token ids
    host: np.ndarray | None = None  # [1, s] int64 token ids on the host (a PLE layer hashes them)
    images: ImagePrompt | None = None  # the prompt's images (None: a text prompt)
    positions: mx.array | None = None  # [3, s] 3-D rotary positions (with images; None: 1-D from `start`)
    parts: dict = field(default_factory=dict)  # (layer, piece) -> a share's output, until its merge
    gdn: dict = field(default_factory=dict)  # GDN layer -> its cache's checkpoint as this chunk left it (edge hooks)
    whole: bool = False  # every piece on the GPU lane: text before an image while the ANE lane runs the tower

    @property
    def s(self) -> int:
        return len(self.ids)


class PieceJobs:
    """The split pieces of a model for a set of loaded programs: the GPU's rest of each (weights sliced once),
    and per (chunk, layer) the jobs that run and merge them."""

    def __init__(self, model: CausalLM, programs: Programs):
        self.model, self.programs = model, programs
        self.attn_rest: dict[int, GpuAttentionRest] = {}
        self.mlp_rest: dict[int, GpuMLPRest] = {}
        self.gdn_rest: dict[int, GpuGDNRest] = {}
        self.moe_rest: dict[int, GpuMoERest] = {}  # MoE layers whose shared expert the ANE takes a share of
        self.tables: dict = {}  # chunk start -> {program shape: RoPE tables and masks} (filled on the ANE lane)
        # (layer, piece) -> running largest |normed input| and |ANE output| over a run's chunks: MLX scalars, each
        # evaluated with its chunk on the GPU lane and read once the run is done (`observed`)
        self.seen: dict[tuple[int, str], list] = {}
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

    def advances_state(self, i: int, new: list[Job]) -> Job:
        """Of layer i's mixer jobs `new`, the one that advances its cache: a split GDN's recurrence (the first; its
        output merge only reads the state), else the last."""
        return new[0] if i in self.gdn_rest and self.model.layers[i].is_linear else new[-1]

    # The mixer ---------------------------------------------------------------------------------------------

    def mixer(self, i: int, c: LayerCache, ch: Chunk, h_job: Job, prev: Job | None) -> list[Job]:
        """Jobs of layer i's mixer for chunk `ch`, after `h_job` (its input) and `prev` (the layer's last state
        update); the last job returned leaves the mixer block's output in `ch.h`."""
        layer = self.model.layers[i]
        if layer.is_linear and i in self.gdn_rest and not ch.whole:
            return self._gdn(i, layer, c, ch, h_job, prev)
        if not layer.is_linear and i in self.programs.attention and not ch.whole:
            return self._attention(i, layer, c, ch, h_job, prev)

        def whole() -> None:
            ch.h = layer.mixer_block(ch.h, c, ch.host, ch.positions)
            mx.eval(ch.h, *c.state)

        after = (h_job,) if prev is None else (h_job, prev)
        return [Job(_label(i, layer, ch), "gpu", whole, after, (ch.index, i, 0))]

    def _gdn(self, i: int, layer: DecoderLayer, c: LayerCache, ch: Chunk, h_job: Job, prev: Job | None) -> list[Job]:
        """A GDN layer whose z rows the ANE shares: the GPU's recurrence (everything that feeds the state) and the
        ANE's z rows, merged into the gated norm and out_proj."""
        rest, parts, size = self.gdn_rest[i], self.programs.gdn_in_proj[i], self.programs.chunk
        label = _label(i, layer, ch)
        rank = lambda step: (ch.index, i, step)  # noqa: E731
        norm = self.normed(f"{label} norm", layer.mixer_io, ch, (i, "x"), self._pre_mixer_after(layer, h_job, prev),
                           rank(0), (i, "gdn_in_proj"), self._pre_mixer(layer, c, ch))
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
            seen = self.track((i, "gdn_in_proj"), 1, z)
            z = z.astype(dtype)
            if z_rest is not None:
                z = mx.concatenate([z, z_rest], axis=-1)  # [1, s, nv*dv]
            ch.h = layer.mixer_io.write(ch.h, rest.finish(o, z, dtype), ctx)
            mx.eval(ch.h, seen)

        g, a = Job(label, "gpu", gpu, state, rank(0)), Job(f"{label} z", "ane", ane, (norm,), rank(0))
        return [g, norm, a, Job(f"{label} merge", "gpu", merge, (g, a), rank(1))]

    def _attention(self, i: int, layer: DecoderLayer, c: LayerCache, ch: Chunk, h_job: Job, prev: Job | None
                   ) -> list[Job]:
        """An attention layer whose KV-head groups the ANE shares: the ANE's heads and the GPU's rest each give a
        partial o_proj sum and their new K/V, merged by head into the GPU cache (the single source of truth). A
        layer that selects its keys (QSA) selects them on the GPU first, for both lanes' heads."""
        rest, parts = self.attn_rest.get(i), self.programs.attention_at(i, ch.start)
        size, label, theta = self.programs.chunk, _label(i, layer, ch), self.model.args.rotary  # tables' frequencies
        rank = lambda step: (ch.index, i, step)  # noqa: E731
        norm = self.normed(f"{label} norm", layer.mixer_io, ch, (i, "x"), (h_job,), rank(0), (i, "attention"))
        state = (norm,) if prev is None else (norm, prev)  # both read the cache as the last chunk left it
        indexer = layer.self_attn.indexer  # a QSA layer's key selection comes first (None: every causal key)
        if indexer is not None:
            state = (self._select(f"{label} index", indexer, c, ch, i, state, rank(0)),)

        def ane() -> None:
            # coremltools (which the graphs import, 4-8 s) loads with the first program, not with the pipeline
            from hetero.coreml.graphs.attention import attention_masks, cache_inputs, rope_tables, selected_masks

            x = to_bc1s(ch.parts[i, "x"][1], size)
            D = parts[0][1].head_dim
            k_all = np.empty((1, sum(len(kv) for *_, kv in parts), ch.s, D), np.float32)  # [1, Kp, s, D]
            v_all, total, h0 = np.empty_like(k_all), None, 0
            for run, shape, kv in parts:
                keys, vals = _cached_heads(c, kv, ch.start, shape.head_dim)
                key = (ch.start, shape)  # every attention layer of a chunk shares its RoPE tables and masks
                tables = self.tables.setdefault(ch.start, {})
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
            ch.h = layer.mixer_io.write(ch.h, out, ctx)
            mx.eval(ch.h, *c.state)

        shares = [Job(f"{label} heads", "ane", ane, state, rank(0))]
        if rest is not None:
            shares.append(Job(label, "gpu", gpu, state, rank(0)))
        first = [norm] if indexer is None else [norm, state[0]]
        return first + shares + [Job(f"{label} merge", "gpu", merge, tuple(shares), rank(1))]

    def _rope_positions(self, ch: Chunk, shape) -> np.ndarray | None:
        """Each rotary frequency's positions [R/2, S] for chunk `ch`'s attention programs (from its stream of the
        prompt's 3-D positions, numpy only: this runs on the ANE lane), or None for a text prompt (1-D tables)."""
        if ch.images is None or not shape.rotary_dims // 2:
            return None
        positions = ch.images.positions[:, ch.start : ch.start + ch.s]  # [3, s]
        return frequency_positions(positions, shape.rotary_dims, self.model.args.mrope_section, shape.chunk)

    @staticmethod
    def _select(label: str, indexer, c: LayerCache, ch: Chunk, i: int, after: tuple, rank: tuple) -> Job:
        """A GPU job leaving a QSA layer's selection for chunk `ch` in `ch.parts[i, "index"]`: (the chunk's raw
        index keys, which the merge appends to the cache; the keys each query may attend to [1, s, T], and the same
        on the host [s, T] for the ANE's masks), exactly as the layer selects them (`Indexer.choose`)."""

        def job() -> None:
            k, chosen = indexer.choose(ch.parts[i, "x"][0], c, ch.start)  # [1, s, Di], [1, s, T]
            mx.eval(k, chosen)
            ch.parts[i, "index"] = (k, chosen, np.array(chosen[0]))

        return Job(label, "gpu", job, after, rank)

    @staticmethod
    def _pre_mixer(layer: DecoderLayer, c: LayerCache, ch: Chunk):
        """h -> the layer's update before its mixer (a PLE layer's; None where there is none): advances its cache."""
        return (lambda h: layer.before_mixer(h, ch.host, c)) if layer.pre_mixer_state else None

    @staticmethod
    def _pre_mixer_after(layer: DecoderLayer, h_job: Job, prev: Job | None) -> tuple:
        """What a mixer's input job waits for: its input, and where the update before the mixer carries state (a
        PLE layer: the last chunk's tokens and conv inputs) the last chunk's state update too."""
        return (h_job,) if prev is None or not layer.pre_mixer_state else (h_job, prev)

    # The MLP -----------------------------------------------------------------------------------------------

    def mlp(self, i: int, ch: Chunk, h_job: Job) -> list[Job]:
        """Jobs of layer i's MLP for chunk `ch` after `h_job`; the last one leaves the layer's output in `ch.h`."""
        layer = self.model.layers[i]
        if i in self.moe_rest and not ch.whole:
            return self._moe(i, layer, ch, h_job)
        if i in self.programs.mlp and not ch.whole:
            return self._dense(i, layer, ch, h_job)

        def whole() -> None:
            ch.h = layer.mlp_block(ch.h)
            mx.eval(ch.h)

        return [Job(f"L{i} mlp @{ch.start}", "gpu", whole, (h_job,), (ch.index, i, 2))]

    def _dense(self, i: int, layer: DecoderLayer, ch: Chunk, h_job: Job) -> list[Job]:
        """A dense MLP whose channels the ANE shares: each lane's channels give a partial down_proj sum."""
        rest, parts, size = self.mlp_rest.get(i), self.programs.mlp[i], self.programs.chunk
        label = f"L{i} mlp @{ch.start}"
        rank = lambda step: (ch.index, i, step)  # noqa: E731
        norm = self.normed(f"{label} norm", layer.mlp_io, ch, (i, "mlp x"), (h_job,), rank(2), (i, "mlp"))

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
            seen = self.track((i, "mlp"), 1, out)
            out = out.astype(ch.h.dtype)
            ch.h = layer.mlp_io.write(ch.h, out if rest is None else out + ch.parts.pop((i, "mlp gpu")), ctx)
            mx.eval(ch.h, seen)

        shares = [Job(f"{label} channels", "ane", ane, (norm,), rank(2))]
        if rest is not None:
            shares.append(Job(label, "gpu", gpu, (norm,), rank(2)))
        return [norm] + shares + [Job(f"{label} merge", "gpu", merge, tuple(shares), rank(3))]

    def _moe(self, i: int, layer: DecoderLayer, ch: Chunk, h_job: Job) -> list[Job]:
        """An MoE layer's MLP: the ANE's shared-expert channels as the MLP program, the rest (router, routed experts,
        the other shared channels, the gate logit) on the GPU, merged as the dense MLP's partial sums are, then
        gated; the last job leaves the layer's output in `ch.h`."""
        size, parts, rest = self.programs.chunk, self.programs.shared_expert[i], self.moe_rest[i]
        label = f"L{i} moe @{ch.start}"
        rank = lambda step: (ch.index, i, step)  # noqa: E731
        io = layer.mlp_io
        norm = self.normed(f"{label} norm", io, ch, (i, "moe x"), (h_job,), rank(2), (i, "shared_expert"))

        def ane() -> None:
            x = to_bc1s(ch.parts[i, "moe x"][1], size)
            ch.parts[i, "shared ane"] = sum(from_bc1s(run({"x": x})["out"], ch.s) for run, _ in parts)  # [s, hidden]

        def gpu() -> None:
            ch.parts[i, "moe gpu"] = rest(ch.parts[i, "moe x"][0])

        def merge() -> None:
            ctx = ch.parts.pop((i, "moe x"))[2]
            routed, shared_rest, gate = ch.parts.pop((i, "moe gpu"))
            shared = mx.array(ch.parts.pop((i, "shared ane")))[None]  # [1, s, hidden] fp32
            seen = self.track((i, "shared_expert"), 1, shared)
            shared = shared.astype(ch.h.dtype)
            if shared_rest is not None:
                shared = shared + shared_rest  # the shared expert's partial down_proj sums add up
            ch.h = io.write(ch.h, rest.finish(routed, shared, gate), ctx)
            mx.eval(ch.h, seen)

        shares = [Job(f"{label} shared channels", "ane", ane, (norm,), rank(2)),
                  Job(label, "gpu", gpu, (norm,), rank(2))]
        return [norm] + shares + [Job(f"{label} merge", "gpu", merge, tuple(shares), rank(3))]

    # Inputs and ranges -------------------------------------------------------------------------------------

    def normed(self, label: str, io: Residual, ch: Chunk, key: tuple, after: tuple, rank: tuple, piece: tuple,
               pre=None) -> Job:
        """A GPU job leaving a piece's input in `ch.parts[key]`: (x in the model's dtype for the GPU's share, x in
        fp32 for the ANE lane to read without an MLX op, what `io.write` needs to merge the output back). Its
        largest value is tracked for `piece`. `pre` (h -> h) runs first: the layer's update before its mixer."""

        def job() -> None:
            if pre is not None:
                ch.h = pre(ch.h)
            x, ctx = io.read(ch.h)  # [1, s, hidden]
            x32 = x if x.dtype == mx.float32 else x.astype(mx.float32)
            mx.eval(ch.h, x, x32, self.track(piece, 0, x32), *([] if ctx is None else [ctx]))
            ch.parts[key] = (x, x32, ctx)

        return Job(label, "gpu", job, after, rank)

    def track(self, piece: tuple, which: int, a: mx.array) -> mx.array:
        """Fold max|a| into `piece`'s running maximum `which` (0: normed input, 1: ANE output): one lazy reduction,
        returned for the caller to evaluate with its chunk (GPU lane only; nothing waits on it)."""
        seen = self.seen.setdefault(piece, [None, None])
        m = mx.abs(a).max()
        seen[which] = m if seen[which] is None else mx.maximum(seen[which], m)
        return seen[which]

    def observed(self) -> dict[tuple[int, str], tuple[float, float]]:
        """(layer, piece) -> the largest |normed input| and |ANE output| (0 where not tracked) over the last run's
        chunks: one read of values evaluated with the chunks."""
        keys = sorted(self.seen)
        flat = [v if v is not None else mx.array(0.0) for k in keys for v in self.seen[k]]
        values = np.array(mx.stack(flat)).reshape(-1, 2).tolist() if flat else []
        return {k: (v[0], v[1]) for k, v in zip(keys, values)}


def _label(i: int, layer: DecoderLayer, ch: Chunk) -> str:
    return f"L{i} {'gdn' if layer.is_linear else 'attn'} @{ch.start}"


def _cached_heads(c: LayerCache, kv: range, start: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The GPU cache's K/V of KV heads `kv` before position `start`, as fp32 numpy [1, Kp, start, D] (read on the
    ANE lane: an fp32 cache is viewed without an MLX op; the merge that writes the next chunk waits for this)."""
    if not start:
        empty = np.zeros((1, len(kv), 0, head_dim), np.float32)
        return empty, empty
    return tuple(host(a)[:, kv.start : kv.stop, :start] for a in (c.keys, c.values))
