"""The two halves of a stepper round around its verify pass (`hetero.decode.stepper`): what each row proposes (its
copy lane's drafts, or the MTP head's, drawn for all drafting rows together) and what each row accepts of them."""

from __future__ import annotations

import mlx.core as mx

from hetero.decode.depth import MAX_DEPTH
from hetero.decode.rows import Round, Row
from hetero.decode.sampling import accept_drafts, accept_greedy, sample, warp
from hetero.models.cache import KVCache, RaggedKV
from hetero.models.interface import CausalLM


def plan(r: Row) -> tuple[int, int]:
    """(MTP draft count, copy-lane draft count) for this round: drafts never overshoot max_tokens or the context."""
    room = min(r.max_tokens - len(r.tokens) - 1, r.parts.max_context - r.decoder.length - 2)
    return max(0, min(r.depth, room)), max(0, min(MAX_DEPTH, 2 * r.depth, room))


def propose(model: CausalLM, rows: list[Row], plans: list[tuple[int, int]]) -> Round:
    """The round's drafts: a row's copy lane proposal when it has one (cut at the first token its grammar forbids,
    as solo's `propose`), else its MTP drafts (`draft`, for all such rows together)."""
    rnd = Round([[] for _ in rows], [None] * len(rows), [False] * len(rows))
    drafting = []
    for i, (r, (k, copy_k)) in enumerate(zip(rows, plans)):
        lane, constraint = r.decoder.lane, r.parts.constraint
        copied = lane.propose(copy_k) if lane is not None and copy_k > 0 else []
        if copied and constraint is not None:
            copied = copied[: constraint.extend(copied)]
        if copied:
            rnd.drafts[i], rnd.copied[i] = copied, True
        elif k > 0:
            drafting.append(i)
    if drafting:
        drafts, logprobs = draft(model, [rows[i] for i in drafting], [plans[i][0] for i in drafting])
        for i, d, q in zip(drafting, drafts, logprobs):
            rnd.drafts[i], rnd.draft_logprobs[i] = d, q
    return rnd


def mtp_caches(rows: list[Row], lengths: list[int]) -> list[RaggedKV] | list[KVCache]:
    """The MTP layers' caches for a pass over the rows: one row's own (the path a request alone takes)."""
    if len(rows) == 1:
        return rows[0].decoder.mtp_cache
    return [RaggedKV([r.decoder.mtp_cache[j] for r in rows], lengths) for j in range(len(rows[0].decoder.mtp_cache))]


def draft(model: CausalLM, rows: list[Row], ks: list[int]) -> tuple[list[list[mx.array]], list[mx.array | None]]:
    """k_i drafts per row from the MTP head, each row with its own sampler: the catch-up over each row's pending
    pairs, then one step per depth for the rows whose k_i goes that far. The drafts stay lazy scalars (a
    grammar's row reads each one as it goes): the verify pass is queued on them, and the round reads them
    with its acceptance, one wait on the model per round."""
    pending = [r.decoder.pending_tokens + [r.decoder.x] for r in rows]  # pairs with pending_hidden
    m = [len(p) for p in pending]
    M = max(m)
    tokens = mx.array([p + [0] * (M - len(p)) for p in pending])  # [B, M]
    if len(rows) == 1:  # nothing to pad
        hidden = rows[0].decoder.pending_hidden[None]  # [1, M, H]
    else:
        hidden = mx.stack([mx.pad(r.decoder.pending_hidden, [(0, M - n), (0, 0)]) for r, n in zip(rows, m)])
    z = model.mtp_hidden(tokens, hidden, mtp_caches(rows, m), last=True)  # [B, 1, H] each row's last pair
    for r in rows:
        r.decoder.pending_tokens, r.decoder.pending_hidden = [], r.decoder.pending_hidden[:0]
    drafts: list[list[mx.array]] = [[] for _ in rows]
    logprobs: list[list[mx.array]] = [[] for _ in rows]
    live = list(range(len(rows)))  # rows still drafting, in z's row order
    ended = set()  # rows whose constraint accepts nothing after their last draft (an EOS draft)
    for j in range(max(ks)):
        logits = model.draft_logits(z)[:, -1]  # [b, V]
        for b, i in enumerate(live):
            if _draw(rows[i], logits[b : b + 1], drafts[i], logprobs[i]):
                ended.add(i)
        keep = [b for b, i in enumerate(live) if ks[i] > j + 1 and i not in ended]
        if not keep:
            break
        live_rows = [rows[live[b]] for b in keep]
        d = mx.stack([drafts[live[b]][-1] for b in keep]).reshape(-1, 1)  # [b', 1]
        z = z if len(keep) == len(live) else z[mx.array(keep)]
        z = model.mtp_hidden(d, z, mtp_caches(live_rows, [1] * len(keep)))  # fed its own post-norm output
        live = [live[b] for b in keep]
    return drafts, [mx.stack(lp) if lp else None for lp in logprobs]


def _draw(r: Row, logits: mx.array, drafts: list[mx.array], logprobs: list[mx.array]) -> bool:
    """One MTP draft of row `r` from its head logits [1, V], penalized for the drafts before it and masked by its
    grammar, appended to `drafts` (its proposal to `logprobs` when sampled); True when the grammar has ended."""
    params, constraint, pen = r.sampler.params, r.parts.constraint, r.penalizer
    row = logits[0] if pen is None else pen(logits, drafts)[0]  # [V], sees d_0..d_{j-1}
    row = row if constraint is None else constraint.apply(row)
    if params.greedy:
        drafts.append(mx.argmax(row))
    else:
        q = warp(row, params)
        drafts.append(sample(q, r.sampler.next_key()))
        logprobs.append(q)
    if constraint is None:
        return False
    constraint.advance(drafts[-1].item())  # consumed at once: the next draft's mask depends on it
    return constraint.ended


def accept(rows: list[Row], rnd: Round, target: mx.array) -> None:
    """Each row's acceptance with its own sampler: (accepted, next token) into `rnd`, one sync for all rows."""
    decided = []
    for i, r in enumerate(rows):
        row = target[i, : len(rnd.drafts[i]) + 1]  # [k_i+1, V]
        constraint = r.parts.constraint
        if r.penalizer is not None:  # position j given the drafts before it, as each draft was drawn
            row = r.penalizer(row, rnd.drafts[i])
        if constraint is not None:  # position j given x and the drafts before it (the masks they were drawn under)
            row = mx.where(constraint.recent_masks(len(rnd.drafts[i]) + 1), row, -mx.inf)
        d = ids(rnd.drafts[i])  # [k_i]
        if r.depth == 0:  # plain decoding: one draw from the (masked, penalized) row
            decided.append((mx.array(0), r.sampler(row[-1])))
        elif r.sampler.params.greedy:
            decided.append(accept_greedy(row, d))
        else:
            q = rnd.draft_logprobs[i]
            decided.append(accept_drafts(warp(row, r.sampler.params), d, q, r.sampler.next_key()))
    mx.eval(decided, rnd.drafts)  # the one wait of an MTP round: the drafts, the pass and the acceptance
    rnd.drafts = [[int(t) if isinstance(t, int) else int(t.item()) for t in d] for d in rnd.drafts]
    rnd.accepted = [int(n.item()) for n, _ in decided]
    rnd.next = [int(t.item()) for _, t in decided]
    for i, r in enumerate(rows):
        if r.parts.constraint is not None:
            r.parts.constraint.rollback(len(rnd.drafts[i]) - rnd.accepted[i])
            r.parts.constraint.advance(rnd.next[i])


def ids(drafts: list[int | mx.array]) -> mx.array:
    """A row's drafts (ints, or lazy scalars from the MTP head) as token ids [k] (int32)."""
    if all(isinstance(t, int) for t in drafts):
        return mx.array(drafts, dtype=mx.int32)
    return mx.stack([mx.array(t, mx.int32) if isinstance(t, int) else t.astype(mx.int32) for t in drafts])
