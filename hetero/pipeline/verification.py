"""`--verify`: the split prefill against the GPU-only prefill of the same prompt, judged by the run's own rounding.

A split in bf16 cannot be held to a fixed distance from the GPU-only run in bf16: both carry bf16's rounding, which
depends on the model and the prompt (a 4-bit checkpoint's bf16 run lay 0.135 from its own fp32 run at the last
position), and a constant measured on the project's checkpoints rejected correct splits of others. So each path is
measured against the same prompt computed in fp32 on the GPU lane, from the weights as loaded (`fp32_copy`), and a
split is accepted when it is no farther from that reference than `K` times the GPU-only run's own distance plus
`ANE_FLOOR`, the fp16 share's allowance (the ANE computes fp16 whatever the GPU lane's dtype):

    d(split, fp32) <= K x d(gpu, fp32) + ANE_FLOOR

d is the one distance of `hetero.pipeline.distance`: the largest relative RMS difference of any block (one head's
keys or values over 64 tokens, a head's recurrent state, the last logits) over every array the cache holds and the
last logits,
the arrays the next chunk, turn and decode step read. The report gives it once (`distance`, with `gpu_distance`,
`tolerance` and `worst`, where it lies), and nothing else that measures the same thing another way.

Discrete choices: a router whose k-th and (k+1)-th experts lie within rounding of each other sends a token to
either, and the fp16 share's rounding tips some (a random Qwen3.5-MoE split in fp32 flipped 4 of 1,200 routes, at
margins 1e-5 to 2e-3, and moved the keys of those tokens 7%); QSA's block choice likewise. So the split's choices
are recorded and the reference runs them (`hetero.models.choices.Choices`: routes and QSA selections): the distance
compares the two runs' arithmetic, and `choice_flips` counts the choices the reference would have made otherwise.
The GPU-only run is measured against the reference on its own choices the same way.

`--verify-tol T` compares the split with the GPU-only run (on the split's choices) instead, accepting d <= T. Where
an fp32 copy of the model does not fit in memory, the dtype's fixed tolerance (`hetero.pipeline.verify_tolerance`)
is used that way and the result says so.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from hetero.checkpoint.preflight import build_lazy_model
from hetero.decode.options import DecodeOptions
from hetero.decode.prefill import prefill
from hetero.decode.sampling import Sampler, SamplingParams
from hetero.decode.state import Decoder
from hetero.decode.stepper import Batch
from hetero.errors import AneLaneLost
from hetero.models.cache import KVCache, LayerCache
from hetero.models.choices import Choices
from hetero.models.interface import CausalLM
from hetero.pipeline.distance import distance
from hetero.pipeline.verify_tolerance import verify_tolerance
from hetero.planner import physical_memory_bytes
from hetero.vision.prompt import ImagePrompt

# d(split, fp32) / d(gpu, fp32) measured 1.00-1.02 in bf16 and fp16 on the bundled model and a random checkpoint of
# Qwen3.5's real shapes (docs/planner.md, "Verify against the run's own rounding"); 1.5 leaves room for prompts and
# checkpoints not measured, and stays under the 3.5x and more that a program losing half its output moved them.
K = 1.5
# The fp16 ANE share's allowance: twice the largest relative RMS distance of an fp32 split from fp32 GPU-only measured,
# 3.73e-3 at 16K tokens on bench/ttft.py's model (2.83e-3 since the programs read normed inputs; 4.1e-4 / 3.5e-4 on
# the real-shape and bundled models at 1K / 4K): fp32 GPU-only is its own reference, so this is all an fp32 split
# may differ. It grows slowly with the prompt (docs/planner.md; bench/verify_noise.py).
ANE_FLOOR = 7.5e-3
MEMORY_SHARE = 0.75  # an fp32 copy is made when it and the model fit in this share of physical memory


def arrays_of(logits: mx.array, cache: list[LayerCache]) -> dict[str, np.ndarray]:
    """The compared arrays of a filled cache and its last logits, fp32, by name ("layer 3 keys")."""
    out = {"last logits": np.array(logits[-1].astype(mx.float32))}
    for i, c in enumerate(cache):
        if isinstance(c, KVCache):
            out[f"layer {i} keys"] = np.array(c.keys[:, :, : c.offset].astype(mx.float32))
            out[f"layer {i} values"] = np.array(c.values[:, :, : c.offset].astype(mx.float32))
        else:
            out[f"layer {i} conv window"] = np.array(c.conv.astype(mx.float32))
            out[f"layer {i} recurrent state"] = np.array(c.recurrent.astype(mx.float32))
    return out


def fp32_bytes(model: CausalLM) -> int:
    """What an fp32 copy of `model`'s parameters takes (quantized weights stay packed, their scales widen)."""
    return sum(v.size * (4 if mx.issubdtype(v.dtype, mx.floating) else v.itemsize)
               for _, v in tree_flatten(model.parameters()))


def fp32_copy(model: CausalLM) -> CausalLM:
    """The same model with every floating parameter widened to fp32 (exactly: the values are the loaded ones); a
    table the model reads from the checkpoint's files (Qwen4-Exp's PLE n-gram tables) is read from them too."""
    params = tree_flatten(model.parameters())
    quantized = {k[: -len(".scales")] for k, _ in params if k.endswith(".scales")}
    net = build_lazy_model(model.args, model.has_mtp, quantized)
    copies = dict(net.named_modules())
    for name, module in model.named_modules():  # tables read from the checkpoint's files (Qwen4-Exp's PLE): shared
        if getattr(module, "table", None) is not None and hasattr(module, "use_table"):
            copies[name].use_table(module.table)
    net.load_weights([(k, v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in params],
                     strict=True)
    mx.eval(net.parameters())
    net.eval()
    return net


class FP32Reference:
    """What `verify` measures `engine`'s splits against: its model in fp32 (its own when it runs in fp32, else a copy
    made on first use, or None when the copy does not fit in memory) and the compared arrays of the last prompt it
    ran. Whoever verifies several splits of one engine (`--ane-fraction auto`, a defect hunt) keeps one and lets it go
    when done: the copy and its arrays go with it, and nothing is stored on the engine."""

    def __init__(self, engine):
        self.engine = engine
        self._copy: CausalLM | None = None
        self._truth: tuple[tuple, dict[str, np.ndarray]] | None = None  # (prompt key, arrays)

    def model(self) -> CausalLM | None:
        """The fp32 model, or None when an fp32 copy of the engine's does not fit in memory."""
        model = self.engine.model
        if model.model.norm.weight.dtype == mx.float32:
            return model
        if self._copy is None:
            need = fp32_bytes(model) + sum(v.nbytes for _, v in tree_flatten(model.parameters()))
            if need > MEMORY_SHARE * physical_memory_bytes():
                return None
            self._copy = fp32_copy(model)
        return self._copy

    def arrays(self, reference: CausalLM, ids: list[int], chunk: int, images: ImagePrompt | None = None
               ) -> dict[str, np.ndarray]:
        """The fp32 reference's compared arrays for `ids` (with `images`: the prompt's images, their embeddings as
        the engine's tower made them); the last prompt's are kept (`auto` and a defect hunt verify it again)."""
        key = (tuple(ids if images is None else images.cache_keys()), chunk)  # images by their pixels
        if self._truth is not None and self._truth[0] == key:
            return self._truth[1]
        cache = reference.make_cache()
        truth = arrays_of(prefill(reference, ids, cache, chunk, images=images)[0], cache.backbone)
        self._truth = (key, truth)
        return truth


def greedy_continuation(model: CausalLM, cache: list[LayerCache], logits: mx.array, n: int) -> list[int]:
    """n greedy tokens decoded on the GPU by the stepper from a filled cache and the prompt's last logits [1, V]."""
    decoder = Decoder(model, cache, int(mx.argmax(logits[-1]).item()), mx.zeros((0, model.args.hidden_size)))
    batch = Batch(model, max_batch=1)
    row = batch.admit(batch.row(decoder, Sampler(SamplingParams()), DecodeOptions(n), set(), depth=0))
    for _ in batch.drain():
        pass
    return row.tokens


def _logits_after(model: CausalLM, ids: list[int], more: list[int], chunk: int, images: ImagePrompt | None) -> mx.array:
    """GPU-only last logits [1, V] of the prompt `ids` followed by the tokens `more` (with `images`: the prompt's,
    the tokens after it at the positions its shift gives them)."""
    if images is None:
        return prefill(model, ids + more, model.make_cache(), chunk)[0]
    cache = model.make_cache()
    prefill(model, ids, cache, chunk, images=images)
    return prefill(model, more, cache, chunk)[0]


def _prefill_arrays(model: CausalLM, ids: list[int], chunk: int, images: ImagePrompt | None, choices: Choices
                    ) -> tuple[dict[str, np.ndarray], mx.array, list[LayerCache]]:
    """A GPU-lane prefill of `ids` under `choices` -> (its compared arrays, last logits [1, V], its cache)."""
    cache = model.make_cache()
    with choices.using():
        logits, _ = prefill(model, ids, cache, chunk, images=images)
    return arrays_of(logits, cache.backbone), logits, cache


def _pinned(model: CausalLM, ids: list[int], chunk: int, images: ImagePrompt | None, choices: Choices
            ) -> tuple[dict[str, np.ndarray], int]:
    """`model`'s arrays for `ids` on the choices `choices` recorded, and how many of them it would have made
    otherwise."""
    replay = Choices(model, replay=choices)
    arrays, _, _ = _prefill_arrays(model, ids, chunk, images, replay)
    return arrays, replay.flips


def _against_reference(fp32: FP32Reference, model: CausalLM, reference: CausalLM, ids: list[int], chunk: int,
                       images: ImagePrompt | None, split: dict, split_choices: Choices, gpu: dict,
                       gpu_choices: Choices) -> dict:
    """d(split, fp32) and d(gpu, fp32), each against the fp32 reference on its own choices."""
    if not split_choices.any:  # no router or indexer: the reference is one run, kept for the next verify of the prompt
        truth = gpu if reference is model else fp32.arrays(reference, ids, chunk, images)
        truth_s, flips, truth_g = truth, 0, truth
    else:
        truth_s, flips = _pinned(reference, ids, chunk, images, split_choices)
        same = reference is model or gpu_choices.differs(split_choices) == 0
        truth_g = gpu if reference is model else (truth_s if same else _pinned(reference, ids, chunk, images,
                                                                              gpu_choices)[0])
    d_split, where = distance(split, truth_s)
    d_gpu, _ = distance(gpu, truth_g)
    return {"distance": d_split, "gpu_distance": d_gpu, "worst": where, "choice_flips": flips,
            "tolerance": K * d_gpu + ANE_FLOOR, "reference": "fp32"}


def verify(run, ids: list[int], tol: float | None = None, n_tokens: int = 32, images: ImagePrompt | None = None,
           fp32: FP32Reference | None = None) -> dict:
    """Split prefill of `ids` against the GPU-only prefill (module docstring): the last logits, every cache array,
    and a greedy continuation of `n_tokens` tokens, identical up to a near-tie. `images`: the prompt's
    `ImagePrompt` (`ids` its tokens, its images encoded), which both prefills take.

    A worker lost during the split answers {"match": False, "lane_lost": why} (the split could not be judged).
    `match` is true when the distance passes (against the fp32 reference, or `tol`'s fixed comparison), the
    continuations agree and (with `images`, on a checkpoint with a tower) each image's embeddings from the vision
    tower's programs on the ANE lane agree with the GPU tower's (`vision`: cosine and PSNR per image,
    `hetero.pipeline.vision_lane.COSINE` / `PSNR`). `fp32`: the reference to measure against, kept by a
    caller that verifies several splits (None: one made for this check). A near-tie: where the continuations first
    part, the GPU-only run's token leads the split's by at most 2 x the accepted distance x max |logit|; two runs
    within it of each other may order such a pair either way, so the comparison stops there (`greedy_tie_at`).
    """
    model = run.engine.model
    split_cache = model.make_cache()
    split_choices = Choices(model)
    vision = None
    try:
        splitter = run.splitter(len(ids))
        with split_choices.using():
            res = splitter.run(ids, split_cache, mtp=False, logits=True, images=images)
        lane = run.vision_lane(splitter) if images is not None else None
        if lane is not None:  # the ANE lane's vision tower against the GPU tower, image by image
            vision = lane.verify(images)
    except AneLaneLost as e:  # nothing to judge: said once (as any lost worker is), and no match
        run.lost(e)
        return {"match": False, "lane_lost": str(e)}
    split = arrays_of(res.logits, split_cache.backbone)
    gpu_choices = Choices(model)
    gpu, ref, gpu_cache = _prefill_arrays(model, ids, run.chunk, images, gpu_choices)
    fp32 = fp32 if fp32 is not None else FP32Reference(run.engine)
    reference = fp32.model() if tol is None else None
    if reference is None:  # the fixed comparison: asked for, or no room for the fp32 reference
        basis = "--verify-tol" if tol is not None else "dtype table (no room for an fp32 copy of the model)"
        tol = verify_tolerance(model.model.norm.weight.dtype) if tol is None else tol
        pinned, flips = _pinned(model, ids, run.chunk, images, split_choices) if split_choices.any else (gpu, 0)
        d, where = distance(split, pinned)
        report = {"distance": d, "gpu_distance": 0.0, "worst": where, "choice_flips": flips, "tolerance": tol,
                  "reference": basis}
    else:
        report = _against_reference(fp32, model, reference, ids, run.chunk, images, split, split_choices, gpu,
                                    gpu_choices)
    bound = report["tolerance"]
    report.update({k: round(report[k], 6) for k in ("distance", "gpu_distance", "tolerance")})
    ours = greedy_continuation(model, split_cache, res.logits, n_tokens)
    theirs = greedy_continuation(model, gpu_cache, ref, n_tokens)
    same = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), len(ours))
    gap = None
    if same < n_tokens:  # the GPU-only logits where the two parted (the same tokens before it on both sides)
        step = ref if same == 0 else _logits_after(model, ids, theirs[:same], run.chunk, images)
        s = np.array(step[-1].astype(mx.float32))  # [V]
        gap = float(s[theirs[same]] - s[ours[same]]) / max(float(np.abs(s).max()), 1e-30)
    tie = gap is not None and gap <= 2 * bound
    if vision is not None:
        report["vision"] = vision
    vision_ok = vision is None or all(v["ok"] for v in vision)
    arrays_ok = report["distance"] <= bound
    return {"match": bool(arrays_ok and (same == n_tokens or tie) and vision_ok), **report,
            "greedy_match_tokens": same, "greedy_compared_tokens": n_tokens, "greedy_tie_at": same if tie else None,
            "greedy_gap": None if gap is None else round(gap, 6)}
