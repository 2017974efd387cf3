"""hetero as a library for MLX programs: a prefill accelerator that hands back mlx-lm prompt caches, and
`generate` / `stream_generate` shaped like mlx-lm's.

    cache = hetero.prefill(model, ids[:-1])             # model: hetero.load(...) or mlx_lm.load(...)[0]
    for r in mlx_lm.stream_generate(model, tokenizer, ids[-1:], prompt_cache=cache): ...
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx

from hetero.caches.mlx_lm import from_mlx_lm, load_prompt_cache, save_prompt_cache, to_mlx_lm
from hetero.checkpoint.mlx_lm_model import MlxLmModel, is_mlx_lm_model, wrap
from hetero.coreml.export import check_weight_form
from hetero.decode.prefill import prefill as gpu_prefill
from hetero.decode.request import Finished, Prefilled, Token
from hetero.engine import Engine, make_request
from hetero.engine import load
from hetero.errors import AneLaneLost, HeteroError
from hetero.models.cache import ModelCache
from hetero.pipeline import DEFAULT_CHUNK as SPLIT_CHUNK
from hetero.pipeline import split_for
from hetero.pipeline import verify as verify_split
from hetero.validate import AneSplit

DEFAULT_CHUNK = 512

__all__ = ["GenerationResponse", "generate", "load_prompt_cache", "prefill", "prefill_to_file", "save_prompt_cache",
           "stream_generate"]


def _held(model, tokenizer=None) -> Engine | MlxLmModel:
    """An Engine as it is, an mlx-lm model wrapped over its own weights."""
    if isinstance(model, Engine):
        return model
    if is_mlx_lm_model(model):
        held = wrap(model)
        if tokenizer is not None:
            held.tokenizer = tokenizer
        return held
    raise HeteroError(f"hetero.prefill needs a hetero Engine (hetero.load) or a model from mlx_lm.load, "
                      f"not {type(model).__name__}")


def _ids(held: Engine | MlxLmModel, prompt: str | list[int], offset: int) -> list[int]:
    if isinstance(held, Engine):
        return held.encode_prompt(prompt, held=offset)
    if isinstance(prompt, str):
        if held.tokenizer is None:
            raise HeteroError("a text prompt with an mlx-lm model needs its tokenizer: prefill(..., tokenizer=tok)")
        prompt = held.tokenizer.encode(prompt)
    ids = [int(t) for t in (prompt.tolist() if isinstance(prompt, mx.array) else prompt)]
    if not ids:
        raise HeteroError("the prompt is empty: give at least one token")
    if offset + len(ids) >= held.max_context:
        raise HeteroError(f"{offset} cached + {len(ids)} prompt tokens exceed the context window {held.max_context}")
    return ids


def prefill(
    model,
    prompt: str | list[int],
    *,
    ane_fraction: AneSplit | float | str = 0.0,
    cache: list | None = None,
    chunk: int | None = None,
    tokenizer=None,
    verify: bool = False,
    ane_weights: str = "lut",
) -> list:
    """Prefill `prompt` and return the prompt cache, in mlx-lm's own classes (`KVCache` per attention layer,
    `ArraysCache` per GDN layer), so `mlx_lm.stream_generate(model, tokenizer, next_tokens, prompt_cache=cache)`
    continues exactly where the prompt ended.

    `model` is a hetero `Engine` or a model from `mlx_lm.load` (qwen3_5 or qwen3_5_moe, float or quantized; run on
    its own weight arrays, not copies). `prompt` is token ids or text (text with an mlx-lm model needs `tokenizer`).
    With `cache` (an mlx-lm prompt cache, e.g. the previous turn's) the prompt is appended: its objects are updated
    in place and returned. `ane_fraction` F in (0, 1] or "auto" (or an `AneSplit`; 0: GPU-only) prefills
    through the ANE + GPU split (as `hetero run --ane-fraction`, parsed by the same `AneSplit.parse`); `verify`
    then checks that split against the GPU-only prefill of the prompt and raises HeteroError when it does not match.
    `chunk` is the prefill chunk (default 512; 256 for the split). `ane_weights`: the split's Core ML form of
    quantized weights (`--ane-weights`: "lut" or "blockwise", both exact).
    """
    check_weight_form(ane_weights)
    held = _held(model, tokenizer)
    kinds = [layer.is_linear for layer in held.model.layers]
    hcache = from_mlx_lm(cache, kinds) if cache is not None else ModelCache(held.model.make_cache().backbone)
    _prefill_into(held, prompt, hcache, ane_fraction, chunk, verify, ane_weights)
    return to_mlx_lm(hcache, len(kinds), into=cache)


def prefill_to_file(model, prompt: str | list[int], out: str | os.PathLike, *,
                    ane_fraction: AneSplit | float | str = 0.0, chunk: int | None = None, verify: bool = False,
                    metadata: dict[str, str] | None = None, ane_weights: str = "lut") -> int:
    """Prefill `prompt` and write the cache to `out` in mlx-lm's prompt-cache format (`hetero prefill`; needs no
    mlx-lm). Returns the number of tokens the cache holds."""
    check_weight_form(ane_weights)
    held = _held(model)
    hcache = ModelCache(held.model.make_cache().backbone)
    _prefill_into(held, prompt, hcache, ane_fraction, chunk, verify, ane_weights)
    save_prompt_cache(out, hcache, metadata)
    return hcache[0].offset


def _prefill_into(held, prompt, hcache: list, ane_fraction, chunk: int | None, verify: bool,
                  weights: str = "lut") -> None:
    """Prefill `prompt` into hetero's backbone caches `hcache` (which may hold a prefix)."""
    if getattr(held.model, "kv_quant", None) is not None:
        raise HeteroError("hetero.prefill writes mlx-lm's full-precision prompt cache; load the engine without "
                          "kv_bits (mlx-lm quantizes its own cache: kv_bits in mlx_lm.generate)")
    ane = AneSplit.parse(ane_fraction, "ane_fraction")  # before the prompt is tokenized
    ids = _ids(held, prompt, hcache[0].offset)
    if ane.gpu_only:
        gpu_prefill(held.model, ids, hcache, chunk or DEFAULT_CHUNK)
    else:
        _split_prefill(held, ids, hcache, ane, chunk, verify, weights)


def _split_prefill(held, ids: list[int], hcache: list, ane: AneSplit, chunk: int | None, verify: bool,
                   weights: str = "lut") -> None:

    if ane.auto and getattr(held, "tokenizer", None) is None:
        raise HeteroError('ane_fraction="auto" with an mlx-lm model needs its tokenizer: prefill(..., tokenizer=tok)')
    runs = vars(held).setdefault("split_runs", {})  # lives as long as the engine / the wrapped mlx-lm model
    key = (ane, chunk or SPLIT_CHUNK, weights)
    if key not in runs:  # configured once per model: "auto" recommends and verifies on a calibration prompt
        runs[key] = split_for(held, ane, chunk or SPLIT_CHUNK, weights)
    run = runs[key]
    before = [(c, c.offset, list(vars(c).items())) for c in hcache]  # GDN states are replaced, never written in place
    try:
        # chunks start at the prefix's end, so the last one reaches the prompt's end rounded up to a whole chunk
        reach = hcache[0].offset + -(-len(ids) // run.chunk) * run.chunk
        run.splitter(reach).run(ids, hcache, mtp=False, logits=False)
    except AneLaneLost as e:  # the caches are the caller's: back to the prefix they held, then prefill GPU-only
        for c, offset, fields in before:
            vars(c).update(fields)
            c.offset = offset
        run.lost(e)
        gpu_prefill(held.model, ids, hcache, chunk or DEFAULT_CHUNK)
        return
    if verify:
        check = verify_split(run, ids)
        if not check["match"] and "lane_lost" not in check:  # a lost worker was said and the prefill stands
            raise HeteroError(f"the split prefill at ane_fraction {ane} does not match the GPU-only one: {check}")


# ----------------------------------------------------------------------------------------------------------
# mlx-lm-shaped generation


@dataclass
class GenerationResponse:
    """One streamed token, with the fields of mlx-lm's `GenerationResponse` (`peak_memory` in GB).

    `logprobs` is this token's log-probability under the raw model distribution (mlx-lm gives the whole vector);
    `top_logprobs` the most likely alternatives when `logprobs=N` was asked. `finish_reason` is None until the
    last response ("stop" or "length")."""

    text: str
    token: int | None
    logprobs: float | None
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def _engine(model, dtype: mx.Dtype | None = None) -> Engine:
    """An Engine as it is; a checkpoint path (or None: the bundled model) loaded in `dtype` (None: the default)."""
    if isinstance(model, Engine):
        if dtype is not None and model.model.model.norm.weight.dtype != dtype:
            raise HeteroError(f"dtype={dtype} for an engine already loaded in {model.model.model.norm.weight.dtype}: "
                              "pass a checkpoint path, or hetero.load(path, dtype)")
        return model
    if model is None or isinstance(model, (str, os.PathLike)):

        return load(model, dtype)
    raise HeteroError(f"hetero.generate needs a hetero Engine (hetero.load) or a checkpoint path, not "
                      f"{type(model).__name__}; an mlx-lm model can still prefill with hetero.prefill")


def _generate_kwargs(kwargs: dict) -> dict:
    """mlx-lm's argument names -> Engine.generate's; an mlx-lm sampler object is refused (MTP needs the warps)."""
    if "sampler" in kwargs or "logits_processors" in kwargs:
        raise HeteroError("pass temp / top_p / top_k / min_p instead of an mlx-lm sampler: hetero samples (and accepts "
                          "MTP drafts) from the warped distribution itself")
    names = {"temp": "temperature", "draft_depth": "draft_depth"}
    return {names.get(k, k): v for k, v in kwargs.items()}


def stream_generate(model, tokenizer=None, prompt: str | list[int] = "", max_tokens: int = 256,
                    **kwargs) -> Iterator[GenerationResponse]:
    """Like `mlx_lm.stream_generate`: yields a `GenerationResponse` per generated token.

    `model` is a hetero Engine (or a checkpoint path, loaded in `dtype`: an mx.Dtype, default the platform's);
    `tokenizer` is ignored (the engine's is used: the argument
    is there so mlx-lm call sites keep their shape). Keyword arguments: `temp`, `top_p`, `top_k`, `min_p`, `seed`,
    `prompt_cache` (an mlx-lm cache holding the tokens before `prompt`), `mtp`, `draft_depth`, `logprobs` (N top
    alternatives), `chat`, `images` (see `GenerationRequest`), and any other `Engine.generate` argument. MTP decoding is on when the model has a head.
    """
    engine = _engine(model, kwargs.pop("dtype", None))
    args = _generate_kwargs(kwargs)
    args.setdefault("logprobs", 0)
    request = make_request(prompt, max_tokens, **args)
    n_prompt = 0  # from the stream's `Prefilled`: the prompt as run (images' placeholders expanded)
    start = time.perf_counter()
    pending: Token | None = None
    text, count, first = "", 0, 0.0

    def response(finish: str | None) -> GenerationResponse:
        gen_s = time.perf_counter() - first
        prompt_tps = n_prompt / (first - start) if first > start else 0.0
        gen_tps = (count - 1) / gen_s if count > 1 and gen_s > 0 else 0.0
        lp = pending.logprob if pending is not None else None
        token, logprob, top = (lp.token, lp.logprob, lp.top) if lp is not None else (None, None, ())
        return GenerationResponse(text, token, logprob, False, n_prompt, prompt_tps, count, gen_tps,
                                  mx.get_peak_memory() / 1e9, finish, top)

    events = engine.stream(request)
    try:
        for event in events:
            if isinstance(event, Prefilled):
                n_prompt = event.prompt_tokens
            elif isinstance(event, Token):
                if pending is not None:
                    yield response(None)
                    text = ""
                pending, count = event, count + 1
                text += event.text
                first = first or time.perf_counter()
            elif isinstance(event, Finished):
                text += event.text
                yield response(event.finish_reason)
    finally:
        events.close()


def generate(model, tokenizer=None, prompt: str | list[int] = "", verbose: bool = False, max_tokens: int = 256,
             **kwargs) -> str:
    """Like `mlx_lm.generate`: the generated text (with `verbose`, streamed to stdout with a summary); a checkpoint
    path loads in `dtype` (an mx.Dtype keyword, default the platform's)."""
    engine = _engine(model, kwargs.pop("dtype", None))
    args = _generate_kwargs(kwargs)
    if verbose:
        args["on_text"] = lambda t: print(t, end="", flush=True)
    result = engine.generate(prompt, max_tokens=max_tokens, **args)
    if verbose:
        s = result.stats
        print(f"\n==========\nPrompt: {s['prompt_tokens']} tokens, {s['prefill_tps']:.3f} tokens-per-sec\n"
              f"Generation: {s['generated_tokens']} tokens, {s['decode_tps']:.3f} tokens-per-sec\n"
              f"Peak memory: {s['peak_memory_bytes'] / 1e9:.3f} GB")
    return result.text
