"""One request decoded alone: a stepper of one row, as a generator of token ids."""

from __future__ import annotations

from collections.abc import Iterator

from hetero.decode.penalties import Penalties
from hetero.decode.rows import Row
from hetero.decode.sampling import Sampler
from hetero.decode.stepper import Batch
from hetero.models.interface import CausalLM


def decode_tokens(model: CausalLM, prompt: list[int], sampler: Sampler, max_tokens: int, eos_ids: set[int], *,
                  depth: int = 0, copy: bool = True, **options) -> Iterator[int]:
    """Yield generated token ids (EOS excluded) until EOS or `max_tokens`: plain decoding at `depth` 0, else
    speculative decoding with the MTP head at that depth (and the copy lane when `copy`); the same distribution
    either way, and greedy output identical token for token (`penalties` included). `options` are `RowOptions`'
    fields.

    `logprobs` may record a few tokens past the last one yielded under MTP (those a round committed after an EOS or
    max_tokens): its i-th item is the i-th token yielded. Closing the generator early leaves `cache` holding
    exactly the committed state.
    """
    batch = Batch(model, max_batch=1)
    row = batch.join(prompt, sampler, max_tokens, eos_ids, depth, copy, **options)
    try:
        batch.prime()  # the next pass computes while the caller handles the first token
        yield from list(row.tokens)
        while not row.done:
            yield from batch.step().get(row, [])
    finally:
        batch.leave(row)


def batch_generate(
    model: CausalLM,
    prompts: list[list[int]],
    samplers: list[Sampler],
    max_tokens: list[int],
    eos_ids: set[int],
    depths: list[int],
    copy: bool = False,
    penalties: list[Penalties | None] | None = None,
) -> list[Row]:
    """Decode every prompt in one batch to the end; the rows in prompt order (`row.tokens`). `penalties`: one
    per prompt (None: none)."""
    batch = Batch(model, max_batch=max(1, len(prompts)))
    penalties = penalties or [None] * len(prompts)
    rows = [batch.join(p, s, n, eos_ids, d, copy, penalties=pen)
            for p, s, n, d, pen in zip(prompts, samplers, max_tokens, depths, penalties)]
    for _ in batch.drain():
        pass
    return rows
