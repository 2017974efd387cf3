"""The split prefill as a job graph over (chunk, layer, piece): the ANE lane runs its shares of chunk c while the
GPU lane runs the recurrent and attention work of other chunks and layers; shares merge exactly (partial sums,
head and row concatenation) and K/V of the ANE's heads enter the GPU cache.

Dependencies: a layer's mixer for chunk c needs that layer's state after chunk c-1 (GDN recurrence, attention
KV) and the hidden of chunk c from the layer below; an MLP needs its own layer's mixer output for the same
chunk. At most `in_flight` chunks are in progress at once (each holds its hidden and the pieces' outputs).
"""

from __future__ import annotations

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
from hetero.models.interface import CausalLM
from hetero.pipeline.ane_process import AneProcess, LaneStats
from hetero.pipeline.lanes import DecodeQueue, Job, Lane, Trace, run_jobs
from hetero.pipeline.piece_jobs import Chunk, PieceJobs
from hetero.pipeline.programs import Programs
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


class SplitPrefill:
    """Prefill through both lanes with a set of loaded programs; `GPU rest` slices are built once per model."""

    def __init__(self, model: CausalLM, programs: Programs, backend: str = "reference executor",
                 in_flight: int = SPLIT_IN_FLIGHT, worker: AneProcess | None = None):
        self.model, self.programs, self.backend, self.in_flight = model, programs, backend, in_flight
        self.worker = worker  # the process the programs run in (None: in this process, on the ANE lane's thread)
        self.pieces = PieceJobs(model, programs)  # each layer's pieces: the GPU's rests, the jobs and their merges

    def copied_bytes(self) -> int:
        """What the GPU lane's shares hold beyond the model's weights (gathered, not viewed): the governor counts it."""
        return self.pieces.copied_bytes()

    def observed(self) -> dict[tuple[int, str], tuple[float, float]]:
        """(layer, piece) -> the largest |normed input| and |ANE output| (0 where not tracked) over the last run's
        chunks (`PieceJobs.observed`): what the GPU lane saw of the ranges."""
        return self.pieces.observed()

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
        self.pieces.tables.clear()  # none left by a run that failed: tables are per prompt (its images' positions)
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
                    ch.h, _ = model.model.begin(ch.piece)  # the stream entering layer 0 [1, s, residual width]
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
                new = self.pieces.mixer(i, cache[i], ch, h_job, state.get(i))
                jobs += new
                h_job, state[i] = new[-1], self.pieces.advances_state(i, new)
                if on_chunk is not None and layer.is_linear:
                    state[i].fn = _then_keep_state(state[i].fn, ch, i, cache[i])
                new = self.pieces.mlp(i, ch, h_job)
                jobs += new
                h_job = new[-1]
            last = lo + size >= len(tokens)

            def finish(ch=ch, last=last) -> None:
                h, piece = model.model.end(ch.h), ch.piece  # what logits and the MTP head read [1, s, *], [1, s]
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
                self.pieces.tables.pop(ch.start, None)

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
        self.pieces.seen = {}
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
    """`fn` (the job that advances GDN layer i for chunk `ch`), then its cache's checkpoint as it left it: the
    arrays are replaced, never written in place, so holding them is the snapshot (a PLE layer's state included)."""

    def job() -> None:
        fn()
        ch.gdn[i] = c.checkpoint()

    return job


def _view_at(cache: ModelCache, ch: Chunk) -> ModelCache:
    """The cache as it stood at chunk `ch`'s end n: backbone caches at offset n (attention K/V, and a QSA layer's
    index keys, are only appended to, so the live buffers read up to n; GDN layers from the chunk's checkpoints) and
    the live MTP caches (their edge is this chunk's, as their pairs are filled chunk by chunk)."""
    n = ch.start + ch.s
    view = [c.restored(ch.gdn[i], n) if isinstance(c, GDNCache) else c.up_to(n) for i, c in enumerate(cache.backbone)]
    return ModelCache(view, cache.mtp)
