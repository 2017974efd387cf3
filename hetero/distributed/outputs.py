"""A request's output options in a pipelined run: the JSON constraint and per-token logprobs.

Sampling happens on the last rank, so both live there. Rank 0 compiles the request's JSON Schema to a grammar
(`Engine.json_grammar`, which also refuses a bad schema before anything runs) and the request's options carry the
grammar text and the logprobs count; the last rank builds the `Constraint` and the `LogprobRecorder` the single-process
decoders take. After every COMMIT message the last rank sends rank 0 the committed tokens' logprob rows
(`send_logprobs`), which rank 0 reads right after that COMMIT (`recv_logprobs`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from hetero.decode.logprobs import LogprobRecorder, TokenLogprob
from hetero.distributed.request import Request
from hetero.distributed.stage import Stage
from hetero.tools.constrained import Constraint, grammar_tokenizer


def last_rank_options(stage: Stage, request: Request) -> tuple[Constraint | None, LogprobRecorder | None]:
    """Last rank: the request's constraint (None without a grammar) and logprob recorder (None without logprobs)."""
    constraint, grammar = None, request.options.grammar
    if grammar is not None:
        if stage.grammar_tokenizer is None:  # llguidance's vocabulary, built on the first constrained request
            stage.grammar_tokenizer = grammar_tokenizer(stage.path / "tokenizer.json", stage.args.vocab_size,
                                                        set(request.eos))
        constraint = Constraint(stage.grammar_tokenizer, grammar, set(request.eos))
    top = request.options.logprobs
    return constraint, (LogprobRecorder(top) if top is not None else None)


def row_width(top: int) -> int:
    """Floats per token in a logprobs message: its logprob, then `top` ids, then their logprobs."""
    return 1 + 2 * top


def send_logprobs(stage: Stage, items: list[TokenLogprob], top: int) -> None:
    """Last rank: the committed tokens' logprobs to rank 0, one row each [n, 1 + 2 * top] fp32 (ids are exact
    in fp32: vocabularies stay far below 2**24)."""
    rows = np.zeros((len(items), row_width(top)), dtype=np.float32)
    for i, item in enumerate(items):
        rows[i, 0] = item.logprob
        for j, (tid, lp) in enumerate(item.top):
            rows[i, 1 + j], rows[i, 1 + top + j] = tid, lp
    stage.link.send(mx.array(rows), 0)


def recv_logprobs(stage: Stage, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Rank 0: the rows `send_logprobs` sent for the just committed `tokens`, as TokenLogprobs."""
    rows = np.array(stage.link.recv((len(tokens), row_width(top)), mx.float32, stage.link.size - 1))  # [n, 1 + 2 top]
    return [TokenLogprob(t, float(r[0]), tuple((int(r[1 + j]), float(r[1 + top + j])) for j in range(top)))
            for t, r in zip(tokens, rows)]
