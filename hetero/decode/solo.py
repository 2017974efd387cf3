"""One request decoded alone: a stepper of one row, as a generator of token ids."""

from __future__ import annotations

from collections.abc import Iterator

from hetero.decode.options import DecodeOptions
from hetero.decode.parts import RowParts
from hetero.decode.rows import Row
from hetero.decode.stepper import Batch
from hetero.models.interface import CausalLM


def decode_tokens(model: CausalLM, prompt: list[int], options: DecodeOptions, eos_ids: set[int], depth: int = 0,
                  parts: RowParts = RowParts()) -> Iterator[int]:
    """Yield generated token ids (EOS excluded) until EOS or `options.max_tokens`: plain decoding at `depth` 0, else
    speculative decoding with the MTP head at that depth (and the copy lane when `options.copy`); the same
    distribution either way, and greedy output identical token for token (penalties included).

    `parts.logprobs` may record a few tokens past the last one yielded under MTP (those a round committed after an
    EOS or max_tokens): its i-th item is the i-th token yielded. Closing the generator early leaves `parts.cache`
    holding exactly the committed state.
    """
    batch = Batch(model, max_batch=1)
    row = batch.join(prompt, options, eos_ids, depth, parts)
    try:
        batch.prime()  # the next pass computes while the caller handles the first token
        yield from list(row.tokens)
        while not row.done:
            yield from batch.step().get(row, [])
    finally:
        batch.leave(row)


def batch_generate(model: CausalLM, prompts: list[list[int]], options: list[DecodeOptions], eos_ids: set[int],
                   depths: list[int]) -> list[Row]:
    """Decode every prompt (with its options and depth) in one batch to the end; the rows in prompt order
    (`row.tokens`)."""
    batch = Batch(model, max_batch=max(1, len(prompts)))
    rows = [batch.join(p, o, eos_ids, d) for p, o, d in zip(prompts, options, depths)]
    for _ in batch.drain():
        pass
    return rows
