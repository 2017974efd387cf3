"""What every engine's stream shares (`Engine.stream`, and `PipelineEngine.stream` across mlx.launch ranks): the
prologue that resolves a request for one engine (`open_request`: the checks, the prompt as run, the depth, the options
bound to the room left), and the stats of its `Finished` event (`stream_stats`).

An engine gives the prologue `name`, `model` (`has_mtp`, `args`), `max_context`, `encode_prompt`, `json_grammar`
and `tuned_depth(options)` (what this machine measured for the model, or None). What differs stays the engine's:
where the prompt's cached prefix comes from (one process's prefix cache and split, or a restore all ranks agree on).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hetero.decode.depth import decode_depth
from hetero.decode.options import DecodeOptions
from hetero.decode.records import DecodeTimes
from hetero.decode.request import GenerationRequest
from hetero.errors import HeteroError
from hetero.vision.prompt import ImagePrompt


@dataclass(frozen=True)
class Opening:
    """A request resolved for one engine: the prompt as it runs and how it decodes."""

    ids: list[int]  # the prompt's token ids (an image prompt's placeholders expanded)
    keys: list  # what the prefix cache keys: the ids, with images by their pixels
    options: DecodeOptions  # max_tokens within the room left; a JSON constraint compiled into `grammar`
    depth: int  # the draft depth; 0 decodes plainly
    vision: ImagePrompt | None = None  # the prompt's images
    held: int = 0  # tokens an mlx-lm prompt cache holds before the prompt


def open_request(engine, request: GenerationRequest, held: int = 0, vision: ImagePrompt | None = None) -> Opening:
    """The prologue of `request` on `engine`, after `held` tokens of an mlx-lm prompt cache, with `vision` its
    planned images (the engine checked what it cannot take before): the prompt encoded and checked against the
    vocabulary and the context window, the penalties' logit_bias against the vocabulary, a JSON Schema compiled
    (`Engine.json_grammar`, which refuses a bad one before anything runs), the depth by the one depth policy
    (`depth.decode_depth`), and max_tokens bound to the room left in the window."""
    o = request.options
    ids = vision.tokens if vision is not None else engine.encode_prompt(request.prompt, request.chat, held)
    o.penalties.check_vocab(engine.model.args.vocab_size)
    grammar = engine.json_grammar(o.json_schema) if o.json_schema is not None or o.json_object else o.grammar
    if o.mtp and not engine.model.has_mtp:
        raise HeteroError(f"{engine.name} has no MTP head (no mtp.* tensors); run with --no-mtp")
    depth = decode_depth(engine.model.has_mtp, o.mtp, o.draft_depth, engine.tuned_depth(o))
    options = replace(o, max_tokens=min(o.max_tokens, engine.max_context - held - len(ids)), grammar=grammar,
                      json_schema=None, json_object=False)
    return Opening(ids, vision.cache_keys() if vision is not None else ids, options, depth, vision, held)


def check_context(n: int, held: int, max_context: int) -> None:
    """A one-line HeteroError when `n` prompt tokens after `held` cached ones leave no room in the context window."""
    if held + n >= max_context:
        cached = f" after {held} cached tokens" if held else ""
        raise HeteroError(f"the prompt has {n} tokens{cached} but the model's context window is {max_context}; "
                          "shorten it")


def stream_stats(name: str, opening: Opening, cached: int, generated: int, times: DecodeTimes,
                 peak_memory_bytes: int, mtp: dict | None = None, **extra) -> dict:
    """The stats of a stream's `Finished` event, the keys `hetero run --json` prints: the model, the tokens (prompt,
    cached, generated), why it ended, its speeds, the peak memory; then `extra` (a pipeline's seed and ranks) and
    the `mtp` block of a speculative run."""
    stats = {
        "model": name,
        "prompt_tokens": len(opening.ids),
        "cached_tokens": cached,
        "generated_tokens": generated,
        "finish_reason": times.finish_reason,
        "ttft_s": round(times.ttft_s, 6),
        "prefill_tps": round(times.prefill_tps, 3),
        "decode_tps": round(times.decode_tps, 3),
        "peak_memory_bytes": peak_memory_bytes,
        **extra,
    }
    if mtp is not None:
        stats["mtp"] = mtp
    return stats
