"""The conformance harness's whole path for one draw (`conformance_space.Draw`): transformers writes the checkpoint
(`write`), hetero loads it, and `check_text` compares every path with transformers and with each other:

- logits: hetero's one pass against transformers' computed in float64 (the exact result of the function
  transformers defines; its routers' and QSA indexers' choices taken from hetero's where the two tie within
  rounding: `conformance_oracle`), within `TOL` relative at every position (max |ours - exact| / max |exact| per position); on a draw
  so ill-conditioned that an fp32 run of transformers lies farther than TOL / K from it, within K times that
  (`hf_to_fp64`: its fp32 run on the checkpoint's weights, and where a check would fail by that alone, the farthest
  of it and `ROUNDINGS` runs on the weights moved by one fp32 rounding each, `fp32_spread`); the distance to
  transformers' fp32 run is recorded too (`transformers`);
- repeat: a second pass over the same prompt is bitwise the first (nothing in the path is stateful);
- greedy: hetero's greedy tokens are transformers' (the exact argmax at each step, on the same tokens), up to a
  near-tie;
- chunked: chunked prefill at the draw's chunk sizes gives the same logits (the same bound);
- decode: the prompt's last tokens decoded one at a time over the cache give the same logits (the same bound);
- mtp: with an MTP head, speculative greedy decoding at the draw's depth gives the plain greedy tokens;
- split (`check_split`): the split prefill at fraction 0.5 in the draw's dtype passes `--verify` (its arrays and
  its greedy continuation), stays engaged (no lane failure; with massive activations, an effective fraction within
  `ENGAGED` of the same shapes' plan without them).

Each check gives its worst error; `Result.failures` names those past their bound.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import types
from dataclasses import dataclass, field
from pathlib import Path

import hetero  # noqa: F401  (the fast BLAS before MLX)
import mlx.core as mx
import numpy as np
import torch

import conformance_weights as cw
from conformance_oracle import Choices, pinned
from conformance_space import EOS, Draw, expected_refusals, released_form

TOL = 1e-4  # relative, at every position, from transformers' result computed in float64
K = 4  # where transformers' own fp32 run lies farther than TOL / K from its float64 result, hetero may lie K times as far
ROUNDINGS = 2  # fp32 runs of transformers on the weights moved by one rounding each: how far fp32 may land
GREEDY = 8  # greedy tokens compared
ENGAGED = 0.1  # the effective fraction with massive activations against the same shapes' without
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}

torch.set_num_threads(1)  # tiny models: a second torch thread only spins on a shared 2-core machine


@dataclass
class Result:
    """Each check's worst error (`errors`), what failed (`failures`: check -> why), and a refusal (`refused`: the
    one-line HeteroError hetero gave instead of loading or splitting)."""

    errors: dict = field(default_factory=dict)
    failures: dict = field(default_factory=dict)
    refused: dict = field(default_factory=dict)
    split: dict | None = None  # dtype -> the split's report

    def bound(self, check: str, error: float, limit: float) -> None:
        self.errors[check] = max(float(error), self.errors.get(check, 0.0))
        if not error <= limit:  # NaN fails too
            self.failures[check] = f"{error:.3g} > {limit:g}"

    @property
    def ok(self) -> bool:
        return not self.failures

    def refused_as_expected(self, draw: Draw) -> bool:
        """Whether every refusal is one hetero owes this draw (`conformance_space.expected_refusals`: an MLP
        activation other than SiLU, which it does not implement), at load, in one line."""
        owed = expected_refusals(draw)
        return all(what == "load" and "\n" not in why and any(o in why for o in owed)
                   for what, why in self.refused.items())

    def to_json(self) -> dict:
        return {"errors": self.errors, "failures": self.failures, "refused": self.refused, "split": self.split}


# ---------------------------------------------------------------------------------------------------------------
# transformers writes the checkpoint


def _hf_model(draw: Draw):
    """The transformers model of a draw (fp32, eval), weights at transformers' init."""
    import transformers as tf

    text = dict(draw.config)
    arch = draw.arch
    if arch in ("qwen3_5", "vision", "qwen3_5_moe", "qwen4_exp"):
        vocab = text["vocab_size"]
        vision = {k: v for k, v in (draw.vision or {}).items() if k != "image"}
        ids = dict(image_token_id=vocab - 4, video_token_id=vocab - 3, vision_start_token_id=vocab - 2,
                   vision_end_token_id=vocab - 1)
        config_class, model_class = {
            "qwen3_5": (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration),
            "vision": (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration),
            "qwen3_5_moe": (tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration),
            "qwen4_exp": (tf.Qwen4ExpConfig, tf.Qwen4ExpForConditionalGeneration),
        }[arch]
        if arch == "qwen4_exp":
            vision.pop("temporal_patch_size", None), vision.pop("spatial_merge_size", None)
        config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"],
                              **ids)
        return model_class(config)
    config_class, model_class = {
        "qwen3_5_text": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM),
        "qwen3_5_moe_text": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM),
        "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM),
        "qwen3_next_moe": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM),
        "qwen4_exp_text": (tf.Qwen4ExpTextConfig, tf.Qwen4ExpForCausalLM),
    }[arch]
    return model_class(config_class(**text))


def write(draw: Draw, path: Path):
    """transformers builds the draw's model, the weights are made trained-like (massive activations where the draw
    has them), `save_pretrained` writes it to `path`, an MTP head is added where drawn; returns the model (fp32,
    eval) as the oracle."""
    torch.manual_seed(draw.seed)
    model = _hf_model(draw).float().eval()
    cw.randomize(model, draw.seed, draw.weights)
    if draw.outliers:
        cw.add_outliers(model, draw.outliers, draw.seed)
    if draw.config.get("tie_word_embeddings"):
        model.tie_weights()
    model.save_pretrained(path)
    if draw.form == "released":
        file = path / "config.json"
        file.write_text(json.dumps(released_form(json.loads(file.read_text())), indent=1))
    if draw.mtp:
        if draw.arch.startswith("qwen4"):
            import qwen4_checkpoint as qc

            qc.add_mtp(path, draw.config, draw.seed)
        else:
            cw.add_mtp(path, draw.seed, draw.weights)
    return model


# ---------------------------------------------------------------------------------------------------------------
# hetero against transformers, and its paths against each other


def prompt_tokens(draw: Draw) -> list[int]:
    """The draw's prompt: seeded random tokens (not the vision placeholders), an EOS a third of the way in (the
    n-gram context of PLE restarts there)."""
    vocab = draw.config["vocab_size"]
    toks = np.random.default_rng(draw.seed).integers(2, vocab - 4, draw.prompt).tolist()
    if draw.prompt >= 3:
        toks[draw.prompt // 3] = EOS
    return toks


@contextlib.contextmanager
def stable_topk():
    """torch's top-k with ties in index order (the lower index first), inside transformers' forward.

    Where scores tie exactly, torch leaves the order of `topk` unspecified (its CPU kernel takes what libstdc++'s
    `nth_element` / `partial_sort` leave, CUDA another), and the QSA indexer's scores tie often: a block whose
    every head's q.k is negative scores relu(.) = 0 exactly, and with a few indexer heads (the released config has
    4) several blocks do, so which of them a query keeps is an accident of the kernel (mlx-vlm's `argpartition` has
    its own). hetero keeps the lower index (`hetero.models.qwen4_exp.qsa.top_blocks`, `hetero.models.moe.route`);
    the oracle is pinned to the same rule, which changes nothing where no scores tie."""
    def topk(x, k, dim=-1, largest=True, sorted=True):
        values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    function, method = torch.topk, torch.Tensor.topk
    torch.topk, torch.Tensor.topk = topk, topk
    try:
        yield
    finally:
        torch.topk, torch.Tensor.topk = function, method


def hf_logits(hf, tokens: list[int]) -> np.ndarray:
    with torch.no_grad(), stable_topk():
        return hf(torch.tensor([tokens]), use_cache=False).logits[0].float().numpy()


def hf_float64(draw: Draw, hf):
    """The same transformers model in float64 (experts run eagerly: torch's grouped products take no float64)."""
    model = _hf_model(draw).double().eval()
    if hasattr(model, "set_experts_implementation") and draw.config.get("num_experts"):
        model.set_experts_implementation("eager")
    model.load_state_dict(hf.state_dict())
    return model


def hf_logits64(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad(), stable_topk():
        return model(torch.tensor([tokens]), use_cache=False).logits[0].numpy()


def fp32_spread(hf, choices: Choices, seq: list[int], exact: np.ndarray, n: int) -> float:
    """How far an fp32 evaluation of the draw may land from `exact` (its first n rows): the farthest of
    transformers' fp32 runs on the checkpoint's weights each moved by one fp32 rounding (a random one of the two
    neighbouring floats), `ROUNDINGS` times.

    One fp32 run is one sample of rounding: on a draw whose massive activations cancel (a residual channel of 1e3
    written in one layer and taken back in another), two correct fp32 evaluations can lie several times apart,
    and transformers' own run may be the lucky one. A backward-stable fp32 evaluation computes the exact function
    of weights moved by about one rounding, so these runs sample the error any correct fp32 path can have."""
    weights = [p for p in hf.parameters() if p.dtype == torch.float32]
    kept = [p.detach().clone() for p in weights]
    worst = 0.0
    try:
        for sample in range(ROUNDINGS):
            g = torch.Generator().manual_seed(sample)
            with torch.no_grad():
                for p, w in zip(weights, kept):
                    up = torch.rand(w.shape, generator=g) < 0.5
                    p.copy_(torch.where(up, torch.nextafter(w, torch.tensor(np.inf)),
                                        torch.nextafter(w, torch.tensor(-np.inf))))
            with pinned(hf, choices):
                worst = max(worst, relative(hf_logits(hf, seq)[:n], exact[:n]))
    finally:
        with torch.no_grad():
            for p, w in zip(weights, kept):
                p.copy_(w)
    return worst


def relative(ours: np.ndarray, ref: np.ndarray) -> float:
    """max over positions of max |ours - ref| / max |ref| at that position ([S, V] each)."""
    scale = np.maximum(np.abs(ref).max(-1), 1e-30)
    return float((np.abs(ours - ref).max(-1) / scale).max())


def _greedy_misses(tokens: list[int], ref: np.ndarray, start: int, tie: float) -> int:
    """How many greedy tokens are not the argmax of `ref` at their step (rows start.. on the same tokens) nor
    within a near-tie of it (`tie` x max |logit|: two runs each within half of it of the exact logits may order
    such a pair either way)."""
    rows = ref[start : start + len(tokens)]  # [n, V]
    best = rows.max(-1)
    ours = rows[np.arange(len(tokens)), tokens]
    return int((best - ours > tie * np.abs(rows).max(-1)).sum())


def check_text(draw: Draw, path: Path, hf, result: Result) -> None:
    """Every check of the module docstring but the split, on the checkpoint at `path` (written by `write`)."""
    from hetero.checkpoint.loader import load_model
    from hetero.decode.prefill import prefill
    from hetero.decode.options import DecodeOptions
    from hetero.decode.solo import decode_tokens

    model = load_model(path, mx.float32)[0]
    toks = prompt_tokens(draw)
    n = len(toks)
    choices = Choices()
    with choices.recording(model):  # its experts and QSA blocks, which the oracle takes at near-ties
        one = np.array(model(mx.array([toks]))[0][0])  # [S, V]
    again = np.array(model(mx.array([toks]))[0][0])
    result.bound("repeat", float(np.abs(one - again).max()), 0.0)
    greedy = list(decode_tokens(model, toks, DecodeOptions(GREEDY), set()))
    seq = toks + greedy[:-1]  # the prompt, then each greedy step's input
    exact_model = hf_float64(draw, hf)
    with pinned(hf, choices):
        ref32 = hf_logits(hf, seq)  # [S + n - 1, V]
    with pinned(exact_model, choices):
        exact = hf_logits64(exact_model, seq)
    result.errors["near_ties"] = choices.ties
    result.errors["transformers"] = relative(one, ref32[:n])
    errors = {"logits": [relative(one, exact[:n])], "chunked": [], "decode": []}
    for chunk in draw.chunks:
        chunked = np.array(prefill(model, toks, model.make_cache(), chunk, all_logits=True)[0])
        errors["chunked"].append(relative(chunked, exact[:n]))
    k = min(8, n - 1)
    if k:
        cache = model.make_cache()
        prefill(model, toks[:-k], cache, 64)
        steps = [np.array(model(mx.array([[t]]), cache)[0][0, 0]) for t in toks[-k:]]
        errors["decode"].append(relative(np.stack(steps), exact[n - k : n]))
    own = relative(ref32[:n], exact[:n])  # fp32's own rounding: one sample of it, then more where it decides
    misses = lambda bound: _greedy_misses(greedy, exact, n - 1, 2 * bound)  # noqa: E731
    if max(max(e, default=0.0) for e in errors.values()) > max(TOL, K * own) or misses(max(TOL, K * own)):
        own = max(own, fp32_spread(hf, choices, seq, exact, n))
    bound = max(TOL, K * own)
    result.errors["hf_to_fp64"] = own
    for check, values in errors.items():
        for value in values:
            result.bound(check, value, bound)
    result.bound("greedy", misses(bound), 0)
    if draw.mtp:
        drafted = list(decode_tokens(model, toks, DecodeOptions(GREEDY), set(), draw.depth))
        differ = sum(a != b for a, b in zip(drafted, greedy)) + abs(len(drafted) - len(greedy))
        result.bound("mtp", differ, 0)


def split_engine(path: Path, dtype: mx.Dtype):
    """The checkpoint loaded in `dtype` as the split takes an engine (its model, config, path and name)."""
    from hetero.checkpoint.loader import load_model

    model, path, config = load_model(path, dtype)
    return types.SimpleNamespace(model=model, config=config, path=path, name=str(path), identity=f"conf-{path.name}")


def split_prompt(draw: Draw) -> list[int]:
    """Three chunks of 64, the last padded, or four QSA budgets: the split's prompt."""
    rng = np.random.default_rng(draw.seed + 1)
    n = max(150, 4 * draw.config.get("indexer_budget", 0) + 3)
    return rng.integers(2, draw.config["vocab_size"] - 4, n).tolist()


def check_split(draw: Draw, path: Path, dtype: str, result: Result, lane: str = "thread") -> None:
    """The split prefill at fraction 0.5, chunk 64, in `dtype`: `--verify` passes, no lane failure, and with
    massive activations the effective fraction stays within ENGAGED of the same shapes' plan without the ranges
    they impose. Errors and failures are named `<dtype> <check>`."""
    from hetero.errors import HeteroError
    from hetero.pipeline import configure, verify

    engine = split_engine(path, DTYPES[dtype])
    try:
        run = configure(engine, 0.5, 64, lane=lane)
    except HeteroError as e:
        result.refused[f"{dtype} split"] = str(e)
        return
    judge_split(draw, run, verify(run, split_prompt(draw), n_tokens=GREEDY), dtype, result)


def judge_split(draw: Draw, run, report: dict, dtype: str, result: Result) -> None:
    """A split's `--verify` report as the draw's split checks, named `<dtype> <check>`."""
    shapes = run.unranged.effective_fraction if run.unranged is not None else run.effective_fraction
    result.split = result.split or {}
    result.split[dtype] = {"effective_fraction": round(run.effective_fraction, 4),
                           "unranged_fraction": round(shapes, 4), "lane_failures": run.lane_failures, **report}
    if "lane_lost" in report:
        result.failures[f"{dtype} split_lane"] = report["lane_lost"]
        return
    result.bound(f"{dtype} split_distance", report["distance"], report["tolerance"])
    if not report["match"]:
        result.failures[f"{dtype} split_verify"] = json.dumps({k: v for k, v in report.items() if k != "vision"})
    if run.lane_failures:
        result.failures[f"{dtype} split_lane"] = str(run.last_failure)
    if run.effective_fraction <= 0:
        result.failures[f"{dtype} split_idle"] = "the split gave the ANE nothing"
    if draw.outliers:
        result.bound(f"{dtype} split_engaged", abs(shapes - run.effective_fraction), ENGAGED)


def checkpoint_name(draw: Draw) -> str:
    """A folder name for the draw's checkpoint: the same for its dtypes (their splits share one export)."""
    weights = {k: v for k, v in draw.to_json().items() if k != "dtype"}
    return f"draw-{draw.seed}-{abs(hash(json.dumps(weights, sort_keys=True))) % 10**8}"


def run_draw(draw: Draw, root: Path, split: tuple[str, ...] = (), lane: str = "thread", numerics: bool = True
             ) -> Result:
    """The whole path for one draw in a folder under `root` (removed after): write, load, check (`numerics`), and
    the split in each dtype of `split`. A one-line HeteroError at load is a refusal, recorded, not a crash."""
    from hetero.errors import HeteroError

    path = Path(root) / checkpoint_name(draw)
    result = Result()
    try:
        hf = write(draw, path)
        vision = draw.arch == "vision"
        if vision:
            import conformance_vision as cv
        try:
            if numerics:
                (cv.check_vision if vision else check_text)(draw, path, hf, result)
            for dtype in split:
                (cv.check_vision_split if vision else check_split)(draw, path, dtype, result, lane)
        except HeteroError as e:  # at load: the split's own refusals are its (`check_split`)
            result.refused["load"] = str(e)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return result
