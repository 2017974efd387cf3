"""A configured split for one engine (`hetero run` / `hetero serve --ane-fraction F`): the planner's `Plan`, made
once, and what the runtime does with it (`auto` and the flag's one entry: `hetero.pipeline.auto`)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from hetero.checkpoint.fingerprint import checkpoint_identity, weights_fingerprint
from hetero.coreml.export import DEFAULT_WEIGHT_FORM, check_weight_form
from hetero.errors import AneLaneLost, AneNonFinite, HeteroError
from hetero.models.cache import LayerCache
from hetero.pipeline.ane_process import JOB_TIMEOUT_S, shared_worker
from hetero.pipeline.calibrate import RANGES_FILE, cached_ranges, calibrate, merge_ranges, plan_shares, saved_ranges
from hetero.pipeline.lanes import DecodeQueue, Trace
from hetero.pipeline.programs import ane_backend, ensure_export, load_programs, model_dir
from hetero.pipeline.split import EdgeFn, SplitPrefill, SplitResult
from hetero.pipeline.vision_lane import VisionLane
from hetero.planner import Plan, context_bucket
from hetero.planner import check_prompt_fits
from hetero.planner.predict import Lanes, gpu_chunk_seconds
from hetero.planner.ranges import Ranges, within_range
from hetero.planner.plan import PlanRequest
from hetero.planner.recommend import split_plan
from hetero.planner.vision import lane_choice, predict_grid
from hetero.profiles import Profile
from hetero.profiles import default_profile_name, load_profile
from hetero.vision.prompt import ImagePrompt

DEFAULT_CHUNK = 256
DEFAULT_VERIFY_TOL: float | None = None  # None: judged against the run's own fp32 reference (hetero.pipeline.verification)
DEFAULT_VERIFY_TOKENS = 32


@dataclass
class PipelineRun:
    """A configured split for one engine: its `Plan` (slices, piece kinds, programs, caps) and the backend that runs
    the ANE's share; it is the `split` a `GenerationRequest` names (`prefill`)."""

    engine: object
    plan: Plan
    backend: str
    effective_fraction: float  # the ANE's share of the FLOPs: at the plan's context, then of the prompt prepared
    trace: Trace | None = None
    last: SplitResult | None = None
    lane: str = "process"  # "process": the ANE's programs run in a worker process; "thread": in this one
    lane_failures: int = 0  # prompts whose worker was lost and which were prefilled GPU-only instead
    last_failure: str | None = None  # what happened to the last worker lost
    ane_loader: str | None = None  # "module:callable" the worker loads programs with instead of the platform's
    ane_timeout_s: float = JOB_TIMEOUT_S  # a worker job that takes longer is a hung worker
    weights: str = DEFAULT_WEIGHT_FORM  # `--ane-weights`: how quantized weights are exported (hetero.coreml.export.WEIGHT_FORMS)
    unranged: Plan | None = None  # the plan before its measured ranges cut it (re-cut when they grow)
    range_tokens: int = 0  # the calibration sample's length (names the saved ranges)
    replans: int = 0  # times the ranges grew past what the split's programs were exported for, and it was re-planned
    _splits: dict = field(default_factory=dict)
    _exports: dict = field(default_factory=dict)  # context bucket -> the export directory its split loaded
    _gpu_only_next: bool = False  # `prepare` lost the worker: the prompt it prepared is prefilled GPU-only
    lane_images: int = 0  # images the ANE lane's vision tower encoded (the others: the GPU tower)
    _vision: tuple | None = None  # (the worker its programs are loaded in, VisionLane)
    vision_choice: list[dict] = field(default_factory=list)  # the last prompt's images: which lane, predicted seconds

    @property
    def requested_fraction(self) -> float:
        return self.plan.requested_fraction

    @property
    def fraction(self) -> float:
        """The fraction actually sliced (after a measured ANE memory cap)."""
        return self.plan.sliced_fraction

    @property
    def chunk(self) -> int:
        return self.plan.chunk

    @property
    def offload(self) -> tuple[str, ...]:
        """The piece kinds the ANE takes a share of."""
        return self.plan.offload

    @property
    def caps(self) -> list[str]:
        """The plan's caps on the pieces that may split (the others never leave the GPU: no news)."""
        never = ("gdn_recurrence", "gdn_out_proj", "lm_head", "mtp", "qsa_indexer", "hyper_connections", "ple")
        return [c for c in self.plan.caps() if not c.startswith(never)]

    def splitter(self, n_tokens: int, check: Callable[[], None] | None = None) -> SplitPrefill:
        """The split prefill for a prompt of `n_tokens` (programs exported for its context bucket on first use;
        `check` runs after each exported program and may raise to stop there)."""
        bucket = context_bucket(n_tokens, self.chunk)
        gone = next((s.worker for s in self._splits.values() if s.worker is not None and not s.worker.alive), None)
        if gone is not None:
            self._splits.clear()  # their worker is gone: the next split loads the programs into a fresh one
            gone.check_alive()  # one that died since its last job is a lost worker (AneLaneLost), reported as such
        if bucket not in self._splits:
            e = self.engine
            out = ensure_export((e.model, e.path, e.config), export_key(e), self.plan, bucket, self.weights, check,
                                reuse=self._exports.get(bucket))
            self._exports[bucket] = out
            name, loader = ane_backend()
            worker = shared_worker(self.ane_loader, self.ane_timeout_s) if self.lane == "process" else None
            programs = load_programs(out, worker.load if worker is not None else loader, check=worker is None)
            self._splits[bucket] = SplitPrefill(e.model, programs, name, worker=worker)
        return self._splits[bucket]

    def vision_lane(self, split: SplitPrefill) -> VisionLane | None:
        """The vision tower's programs on `split`'s ANE lane (None for a checkpoint without a tower)."""
        vision = getattr(self.engine, "vision", None)
        if vision is None:
            return None
        if self._vision is None or self._vision[0] is not split.worker:  # a new worker: load them into it
            loader = split.worker.load if split.worker is not None else ane_backend()[1]
            self._vision = (split.worker, VisionLane(vision.tower, model_dir(export_key(self.engine)), loader,
                                                     check=split.worker is None))
        return self._vision[1]

    def lane_encoders(self, lane: VisionLane, images: ImagePrompt) -> dict:
        """The lane's encoders for the images not encoded yet that the plan's prediction gives the ANE lane
        (`planner.vision.lane_choice`: each image's tower on either lane, against the GPU lane's prefill of the
        text before it); the others are left to the GPU tower. `vision_choice` says, per image, where and why."""
        todo = [i for i, rows in enumerate(images.embeddings) if rows is None]
        lanes, a = Lanes.of(self.plan.profile), lane.tower.args
        times = [predict_grid(a, lanes, images.grids[i]) for i in todo]
        reach = [self.text_before_s(images.spans[i][0], lanes) for i in todo]
        take = lane_choice(times, reach)
        self.vision_choice = [{"image": i, "lane": "ane" if k else "gpu", "predicted_ane_s": t.ane_s,
                               "predicted_gpu_s": t.gpu_s, "predicted_text_before_s": r}
                              for i, t, r, k in zip(todo, times, reach, take)]
        return lane.encoders(images, which={i for i, k in zip(todo, take) if k})

    def text_before_s(self, start: int, lanes: Lanes) -> float | None:
        """The predicted seconds of the GPU lane's prefill of the whole chunks before token `start` (the text the
        lane's tower runs beside), all of every piece on the GPU; None where the profile lacks a rate."""
        tokens = start // self.chunk * self.chunk
        if tokens == 0:
            return 0.0
        per_chunk = gpu_chunk_seconds(self.plan.pieces, self.plan.storage, lanes, tokens, self.chunk)
        return None if per_chunk is None else float(per_chunk.sum())

    def prepare(self, ids: list[int], check: Callable[[], None] | None = None, images: ImagePrompt | None = None
                ) -> None:
        """Export and load the programs the prompt `ids` needs now (with `images`, its images' vision programs),
        so the first token's time excludes it; the effective fraction is then the share of this prompt's prefill
        FLOPs. `check` runs after each program a first-use export writes, and may raise to stop it (a server's
        stop signal)."""
        if len(ids) >= 2 and self.plan.slices:
            try:
                split = self.splitter(len(ids) - 1, check)
                lane = self.vision_lane(split) if images is not None else None
                if lane is not None:
                    self.lane_encoders(lane, images)  # exported and loaded now; encoded when the prompt runs
            except AneLaneLost as e:  # the worker died while its programs loaded: this prompt goes GPU-only
                self.lost(e)
                self._gpu_only_next = True
                return
            self.effective_fraction = self.plan.effective_fraction_at(len(ids) - 1)

    def prefill(
        self, ids: list[int], decode: DecodeQueue | None = None, on_chunk: EdgeFn | None = None,
        images: ImagePrompt | None = None,
    ) -> tuple[list[LayerCache], int, mx.array | None]:
        """Split-prefill all but the last prompt token (which the decode path runs, giving the first logits).

        Returns (cache, tokens in it, carry = post-norm hidden of the last one) for `Engine.stream`; a plan that
        gives the ANE nothing (`auto` chose GPU-only) prefills nothing here: the engine's GPU-only path (the CPU
        wavefront included) runs it. With
        `decode`, the GPU lane interleaves other requests' work while the ANE computes its share; `on_chunk(n,
        cache at n, hidden)` sees every chunk edge (the prefix cache checkpoints them). `images`: the prompt's
        `ImagePrompt` (`ids` are its tokens), prefilled at its 3-D positions; the images not encoded yet are encoded
        by the vision tower's programs on the ANE lane while the GPU lane prefills the text before them (the GPU
        tower encodes any the lane cannot take). When the split fails (0 tokens returned), the lane's embeddings
        are taken back out of `images`: the GPU-only prefill encodes them with the GPU tower.
        """

        model = self.engine.model
        cache = model.make_cache()
        if len(ids) < 2 or not self.plan.slices:  # nothing for the ANE (auto chose GPU-only): the engine's own path
            return cache, 0, None
        if self._gpu_only_next:  # `prepare` lost the worker for this prompt (and said so): no second try
            self._gpu_only_next = False
            return cache, 0, None
        try:
            split = self.splitter(len(ids) - 1)
            # what the ANE lane holds: its worker's footprint, at least every function this prompt loads charged
            worker_bytes = max((split.worker.resident_bytes() or 0) if split.worker is not None else 0,
                               split.programs.charged_bytes(len(ids) - 1))
            check_prompt_fits(model, len(ids), getattr(self.engine, "memory_gb", None), split.in_flight,
                              worker_bytes, split.copied_bytes())
            lane = self.vision_lane(split) if images is not None else None
            encoders = self.lane_encoders(lane, images) if lane is not None else {}
            tower = self.engine.vision.tower if images is not None else None
            self.last = split.run(ids[:-1], cache, mtp=model.has_mtp, logits=False, trace=self.trace, decode=decode,
                                  on_chunk=on_chunk, images=images, encoders=encoders, tower=tower)
            self.lane_images += sum(v["lane"] == "ane" for v in self.last.vision)
        except AneNonFinite as e:  # the prompt passed the planned ranges: measured, merged, re-planned; GPU-only now
            self.out_of_range(e, ids[:-1])
            return model.make_cache(), 0, None
        except AneLaneLost as e:  # nothing of the split is kept: the engine prefills from scratch, GPU-only
            self.lost(e)
            return model.make_cache(), 0, None
        self.refresh(split.observed())
        return cache, len(ids) - 1, self.last.hidden

    def lost(self, e: AneLaneLost) -> None:
        """Count a lost worker and say, once, that its prompt goes GPU-only."""
        self.lane_failures, self.last_failure, self.last = self.lane_failures + 1, str(e), None
        print(f"warning: {e}; this prompt is prefilled GPU-only, the next split starts a new worker", file=sys.stderr)

    def ranges_dir(self):
        """Where the split's ranges are saved (beside its exports)."""
        return model_dir(export_key(self.engine))

    def refresh(self, seen: dict) -> None:
        """Merge what the GPU lane tracked on a prompt's chunks (`SplitPrefill.observed`) into the saved ranges when
        a value passed its saved one (`Ranges.grown`); re-plan when that changes the programs (an output scale)."""
        grown = self.plan.ranges.grown(seen) if self.plan.ranges is not None and self.unranged is not None else None
        if grown is not None:
            self.replan(self._merged(grown))

    def out_of_range(self, e: AneNonFinite, ids: list[int]) -> None:
        """A program returned non-finite values on the prompt `ids`: measure its piece's ranges on the prompt on
        the GPU lane, merge them into the saved ranges, re-plan the split with them (the channels and output scales
        change; only the programs they change are exported again), and say so in one line."""
        self.lane_failures, self.last_failure, self.last = self.lane_failures + 1, str(e), None
        if self.unranged is None or self.plan.ranges is None:
            print(f"warning: {e}; this prompt is prefilled GPU-only", file=sys.stderr)
            return
        shares = plan_shares(self.unranged)
        if e.layer is not None:
            shares = {k: v for k, v in shares.items() if k == (e.layer, e.piece)} or shares
        measured = calibrate(self.engine.model, ids, shares, prior=self.plan.ranges)
        merged = self._merged(measured)
        before = self.plan.ranges.kept_on_gpu()
        changed = self.replan(merged)
        where = f"layer {e.layer}'s {e.piece}" if e.layer is not None else "its pieces"
        kept = {k: v - before.get(k, 0) for k, v in self.plan.ranges.kept_on_gpu().items() if v > before.get(k, 0)}
        what = (f"the split was re-planned ({', '.join(f'{v} more {k} units' for k, v in kept.items())} kept on the "
                f"GPU lane, output scales re-chosen)" if kept else "the split was re-planned (output scales re-chosen)")
        print(f"warning: {e}; this prompt is prefilled GPU-only, its values in {where} were measured and merged "
              f"into {self.ranges_dir() / RANGES_FILE}, and "
              + (what if changed else "they need no other plan (the split is unchanged)"), file=sys.stderr)

    def _merged(self, grown: Ranges) -> Ranges:
        """`grown` merged into the saved ranges (`merge_ranges`); where they cannot be written, into this split's
        alone, said in one warning line."""
        try:
            return merge_ranges(self.ranges_dir(), self.unranged, self.range_tokens, grown, self.plan.ranges)
        except OSError as e:
            print(f"warning: the activation ranges could not be saved in {self.ranges_dir()} ({e}); this split "
                  f"uses them until it ends", file=sys.stderr)
            return self.plan.ranges.merge(grown)

    def replan(self, ranges: Ranges) -> bool:
        """Cut the plan with `ranges`; True when that changes the programs (channels or output scales): the
        splits loaded so far are dropped with their worker, and the next prompt exports and loads the new plan's
        programs (reusing every package the change leaves as it was) into a fresh one."""
        plan = within_range(self.unranged, ranges)
        changed = plan.ranges.digest() != self.plan.ranges.digest() or plan.slices != self.plan.slices
        self.plan = plan
        if changed:
            self.replans += 1
            for worker in {s.worker for s in self._splits.values() if s.worker is not None}:
                worker.close()  # its programs are the old plan's: the next split loads the new ones into a fresh one
            self._splits.clear()
            self.effective_fraction = plan.effective_fraction
        return changed

    def ane_block(self) -> dict:
        return {"backend": self.backend, "lane": self.lane, "weights": self.weights,
                "requested_fraction": self.requested_fraction,
                "effective_fraction": round(self.effective_fraction, 6), "caps": self.caps,
                "lane_failures": self.lane_failures, "last_failure": self.last_failure, "replans": self.replans,
                **({"fp16_headroom_bits": self.plan.ranges.headroom(),
                    "kept_on_gpu_for_range": self.plan.ranges.kept_on_gpu()} if self.plan.ranges is not None else {})}


def configure(
    engine, fraction: float, chunk: int = DEFAULT_CHUNK, trace: Trace | None = None,
    offload: tuple[str, ...] | None = None, profile: Profile | None = None, lane: str = "process",
    weights: str = DEFAULT_WEIGHT_FORM,
) -> PipelineRun:
    """A PipelineRun for `fraction` of the piece kinds in `offload` (default: those whose share shortens the
    predicted prefill, `hetero.planner.recommend.split_plan`): the one place a split's `Plan` is made, by the
    planner for `profile` (default: this machine's measured profile, else the planner's default chip). Only a
    per-process ANE weight limit that a profile measured shrinks the slices; none is documented. `weights`: the
    form quantized weights are exported in (`--ane-weights`: `lut` or `blockwise`, both exact)."""
    check_weight_form(weights)

    if chunk <= 0 or chunk % 64:
        raise HeteroError(f"--prefill-chunk {chunk}: the split prefill needs a positive multiple of 64")
    profile = profile or load_profile(default_profile_name())
    context = min(4096, engine.model.args.max_position_embeddings)
    if lane not in ("process", "thread"):
        raise HeteroError(f"the ANE lane runs in a 'process' or a 'thread', not {lane!r}")
    plan = unranged = split_plan(PlanRequest(engine.config, profile, fraction, context, chunk), offload)
    ids = calibration_ids(engine) if plan.slices else []
    if plan.slices:  # keep the ANE inside fp16: ranges measured on the GPU lane (hetero.planner.ranges)
        ranges = cached_ranges(model_dir(export_key(engine)), engine.model, ids, plan)
        plan = within_range(plan, ranges)
    return PipelineRun(engine, plan, ane_backend()[0], plan.effective_fraction, trace, lane=lane, weights=weights,
                       unranged=unranged if plan.slices else None, range_tokens=len(ids))


def export_key(engine) -> str:
    """What names an engine's exports and ranges: its identity and the weights as loaded (an Engine records their
    fingerprint at load; they are what is exported, not the files now)."""
    return f"{engine.identity}-{getattr(engine, 'weights_fingerprint', None) or weights_fingerprint(engine.path)}"


def measured_ranges(name: str, config: dict, path, plan: Plan) -> Ranges | None:
    """The activation ranges a split run of the checkpoint at `path` (loaded as `name`) measured for `plan`'s
    shares, or None where none has been measured yet (`hetero plan` reads them; it never loads the weights)."""
    return saved_ranges(model_dir(f"{checkpoint_identity(name, config)}-{weights_fingerprint(path)}"), plan,
                        RANGE_TOKENS)


CALIBRATION = "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n" * 4
RANGE_TOKENS = 512  # the activation ranges' sample: two of the default chunks


def calibration_ids(engine) -> list[int]:
    """The sample the activation ranges are measured on: code text through the engine's tokenizer (seeded random
    tokens for an engine without one), `RANGE_TOKENS` long."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        return np.random.default_rng(0).integers(0, engine.model.args.vocab_size, RANGE_TOKENS).tolist()
    ids = tokenizer.encode(CALIBRATION)
    return (ids * (RANGE_TOKENS // max(len(ids), 1) + 1))[:RANGE_TOKENS]
