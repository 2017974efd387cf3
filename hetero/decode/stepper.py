"""The stepper: the one place tokens are made. A round moves a set of rows (requests) forward together.

A solo request is a batch of one (`solo.decode_tokens`), plain decoding is depth 0, and the copy lane, JSON
constraints, logprobs and commit hooks are per-row options. A decode pass is bound by reading the weights; B rows
decoding together read them once per round instead of B times. Each row keeps its own caches in the solo layout
(`model.make_cache()`), its own sampler, draft depth and limits, and gets exactly the tokens it would get decoding
alone: the same drafts, the same acceptance draws from its own key stream. One round (DESIGN.md section 3):

  draft   rows with a copy-lane proposal take it; the rows that draft with the MTP head run it together: the
          catch-up over each row's pending (token, hidden) pairs, padded to the longest (every pair writes its
          keys; only each row's last pair goes on to the first draft, `mtp_hidden(last=True)`), then one step
          per depth for the rows whose depth k_i goes that far.
  verify  one backbone pass over tokens [B, S], row i = [x_i, d_i...] padded to S = max(k_i + 1). GDN layers
          run on the rows' states stacked [B, ...], recording every step; attention layers write and read
          each row's own KV at its own length (`RaggedKV`, `DecoderLayer._ragged_attention`;
          Qwen4-Exp's QSA selects its keys row by row too, `QSAAttention._ragged`).
  accept  row by row, `accept_greedy` / `accept_drafts` with the row's own sampler; depth 0 draws its token.
          A row's penalties (`hetero.decode.penalties`) penalize each verify position for the drafts before it,
          as they penalize each MTP draft step, so the output law stays plain penalized decoding's.
  commit  row by row: KV trimmed to the row's length, GDN state and conv window as recorded after the row's
          own last kept token (one gather per layer re-stacks them; Qwen4-Exp's PLE token context and conv
          window, stacked for the pass, split back the same way), MTP KV trimmed, pending pairs queued.

Padding sits after a row's real tokens: nothing causal in the row reads it, and it writes no KV. With every
row at one token (plain decoding, or no drafts anywhere) the pass records nothing, and plain rows without a
grammar or a commit hook queue the next round's pass before their tokens are read (`_plain_round`), so the model
computes while the caller detokenizes; no pass is queued past a row's last token by length. A lone such row (solo
decoding, `Engine.stream`) needs none of a round's records: it decodes on its own caches, its draw made and queued
with its pass, its first pass queued before its first token is handed out (`prime`), as the bare step loop runs
(`_solo_round`). Rows join (prefilled
alone, `start`) and leave between rounds; the rows' caches always hold their committed state (views into the
batch's stacked GDN arrays), so a request that leaves takes a complete cache with it.

Attention layout: per-row attention over each request's own cache (not a padded [B, Hkv, L_max, D] copy of all
caches with a mask): it copies no KV, and each request's attention runs the very shapes and kernel it runs
alone. The projections, MLPs, GDN layers and lm_head, where the weights are read, run over the whole batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import mlx.core as mx

from hetero.decode.depth import MAX_DEPTH, check_depth
from hetero.decode.logprobs import LogprobRecorder
from hetero.decode.options import RowOptions
from hetero.decode.penalties import Penalizer, penalizer_for
from hetero.decode.records import DecodeTimes, MTPStats, Trace
from hetero.decode.rows import Ahead, CommitFn, Round, Row
from hetero.decode.sampling import Sampler, accept_drafts, accept_greedy, sample, warp
from hetero.decode.state import Decoder, start
from hetero.errors import HeteroError
from hetero.host.settings import DEFAULT_DRAFT_DEPTH
from hetero.models.cache import GDNCache, KVCache, RaggedKV, cache_arrays
from hetero.models.interface import CausalLM
from hetero.tools.constrained import Constraint

MAX_BATCH = 8


class Batch:
    """Rows decoding together, one round at a time (`step`); `join` and `leave` between rounds."""

    def __init__(self, model: CausalLM, max_batch: int = MAX_BATCH) -> None:
        if max_batch < 1:
            raise HeteroError(f"--max-batch must be at least 1, got {max_batch}")
        self.model, self.max_batch = model, max_batch
        self.rows: list[Row] = []
        self.rounds = 0
        self._stacked_for: list[Row] = []  # the rows (in order) that `_stacked` holds
        self._stacked: dict[int, tuple[mx.array, mx.array]] = {}  # GDN layer -> (conv [B, K-1, C], state [B, ...])
        self._ahead: Ahead | None = None  # the next plain round's pass, already computing
        self._solo: tuple[Row, list[GDNCache]] | None = None  # the last lone plain row and its GDN caches

    @property
    def full(self) -> bool:
        return len(self.rows) >= self.max_batch

    def join(self, prompt: list[int], sampler: Sampler, max_tokens: int, eos_ids: set[int],
             depth: int = DEFAULT_DRAFT_DEPTH, copy: bool = False, **options) -> Row:
        """Prefill `prompt` alone and add its row; its first token is in `row.tokens` already. `depth` 0 decodes
        plainly, else speculatively with the MTP head (with the copy lane when `copy`); `options` are
        `RowOptions`' fields."""
        self._check(depth)
        return self.admit(self.prefilled(prompt, sampler, max_tokens, eos_ids, depth, copy, RowOptions(**options)))

    def prefilled(self, prompt: list[int], sampler: Sampler, max_tokens: int, eos_ids: set[int], depth: int,
                  copy: bool, o: RowOptions) -> Row:
        """`prompt` prefilled alone (`state.start`) into a row that has emitted its first token, not admitted yet:
        a thread that prefilled it can stream that token at once. A row with nothing to decode (max_tokens <= 0)
        is done before any prefill."""
        times = o.times if o.times is not None else DecodeTimes()
        times.start, times.prompt_tokens = times.start or time.perf_counter(), len(prompt)
        if max_tokens <= 0:
            row = Row(None, sampler, depth, 0, set(eos_ids), 0, times=times)
            row.finish_reason = times.finish_reason = "length"
            times.first_token = times.end = time.perf_counter()
            return row
        pen = penalizer_for(o.penalties, prompt, self.model.args.vocab_size)
        decoder = start(self.model, prompt, sampler, depth, o.cache, o.chunk, o.progress, copy, o.skip, o.carry,
                        o.on_chunk, o.constraint, o.logprobs, o.marks, o.trace, o.mtp_prefill, pen, o.images)
        return self.row(decoder, sampler, max_tokens, eos_ids, depth, o.max_context, times, o.stats, o.on_commit,
                        o.logprobs, o.trace, o.constraint, pen)

    def row(
        self,
        decoder: Decoder,
        sampler: Sampler,
        max_tokens: int,
        eos_ids: set[int],
        depth: int = DEFAULT_DRAFT_DEPTH,
        max_context: int | None = None,
        times: DecodeTimes | None = None,
        stats: MTPStats | None = None,
        on_commit: CommitFn | None = None,
        logprobs: LogprobRecorder | None = None,
        trace: Trace | None = None,
        constraint: Constraint | None = None,
        penalizer: Penalizer | None = None,
    ) -> Row:
        """A row for a prefilled decoder (`state.start`) whose first token, `decoder.x`, is sampled and not emitted
        yet; it is emitted now (`logprobs` holds its row already, if any), and `on_commit` sees it. Not in the batch
        yet (`admit`): a thread that prefilled it can stream its first token at once. `trace` (depth 0) gets each
        round's token and hidden. `constraint` has consumed `decoder.x`, and `penalizer` (`penalties.penalizer_for`
        over the prompt; None: no penalties) has counted it."""
        self._check(depth, room=False)
        row = Row(decoder, sampler, depth, max_tokens, set(eos_ids), max_context or self.model.args.max_position_embeddings,
                  stats=stats if stats is not None else (MTPStats(depth) if depth else None),
                  times=times or DecodeTimes(start=time.perf_counter()), on_commit=on_commit,
                  logprobs=logprobs, trace=trace if not depth else None, constraint=constraint, penalizer=penalizer)
        if on_commit is not None:
            on_commit(decoder, [decoder.x])
        row.take([decoder.x])
        return row

    def admit(self, row: Row) -> Row:
        """Put a row made by `row` into the batch (unless it is done already) for the next round."""
        if not row.done:
            self._check(row.depth)
            self.rows.append(row)
        return row

    def _check(self, depth: int, room: bool = True) -> None:
        if room and self.full:
            raise HeteroError(f"the batch is full ({self.max_batch} requests)")
        if depth and not self.model.has_mtp:
            raise HeteroError("this checkpoint has no MTP head: join with depth 0 (plain decoding)")
        if depth != 0:  # 0: plain decoding, no draft depth
            check_depth(depth, "draft depth")

    def leave(self, request: Row) -> None:
        """Drop a request (cancelled or done) before the next round; its caches hold its committed state."""
        self._drop_ahead()
        if request in self.rows:
            self.rows.remove(request)
        self._stacked, self._stacked_for = {}, []  # rebuilt from the remaining rows' own caches
        self._solo = None
        _settle([request])

    def prime(self) -> None:
        """Queue the next round's pass now when a lone plain row takes the solo round (`_solo_round`): the caller's
        handling of the tokens the row has already (its first, from the prefill) then overlaps that pass, as it
        overlaps the next pass in every later round; the bare step loop queues its first step before it reads the
        prefill's token too. A no-op for anything else; a row that joins or leaves before the next `step` drops
        the queued pass as it drops any other (`_drop_ahead`)."""
        if len(self.rows) == 1 and self._ahead is None and self._alone(self.rows[0]):
            r = self.rows[0]
            self._ahead = self._solo_pass(r, mx.array([[r.decoder.x]]))

    def drain(self) -> Iterator[dict[Row, list[int]]]:
        """Rounds until every request is done (`step`'s results)."""
        while self.rows:
            yield self.step()

    def step(self) -> dict[Row, list[int]]:
        """One round for every request: {request: tokens it emitted}. Finished requests leave the batch."""
        rows = list(self.rows)
        if not rows:
            return {}
        if self._ahead is not None and self._ahead.rows != rows:  # a request joined or left since it was queued
            self._drop_ahead()
        if len(rows) == 1 and self._alone(rows[0]):
            emitted = {rows[0]: self._solo_round(rows[0])}
        else:
            emitted = self._batch_round(rows)
        self.rounds += 1
        self.rows = [r for r in self.rows if not r.done]
        if len(self.rows) < len(rows):  # the queued pass ran a finished row one token too far
            self._drop_ahead()
            _settle([r for r in rows if r.done])
        if not self.rows:
            self._stacked, self._stacked_for, self._solo = {}, [], None
        return emitted

    def _batch_round(self, rows: list[Row]) -> dict[Row, list[int]]:
        """One round of several rows, or of a row with drafts or options a plain lone round does not take."""
        if all(self._overlaps(r) for r in rows):
            rnd, target, hidden = self._plain_round(rows)
        else:
            self._drop_ahead()
            plans = [self._plan(r) for r in rows]
            rnd = self._propose(rows, plans)
            target, hidden, gdn = self._verify(rows, rnd)  # [B, S, V], [B, S, H]
            self._accept(rows, rnd, target)
            self._commit_states(rows, rnd, gdn)
        for i, r in enumerate(rows):
            if r.logprobs is not None:  # the raw target rows of the kept drafts and the new token
                r.logprobs.add(target[i, : rnd.accepted[i] + 1], rnd.drafts[i][: rnd.accepted[i]] + [rnd.next[i]])
        self._commit_rows(rows, rnd, hidden)
        emitted = {}
        for i, r in enumerate(rows):
            if r.stats is not None:
                r.stats.record(len(rnd.drafts[i]), rnd.accepted[i], rnd.copied[i])
            new = rnd.drafts[i][: rnd.accepted[i]] + [rnd.next[i]]
            if r.on_commit is not None:
                r.on_commit(r.decoder, new)
            if r.penalizer is not None:
                r.penalizer.add(new)
            emitted[r] = r.take(new)
            if r.stats is not None:
                r.stats.emitted += len(emitted[r])
        return emitted

    # ------------------------------------------------------------------------------------------------------

    @staticmethod
    def _overlaps(r: Row) -> bool:
        """Whether the row's next pass may be queued before its token is read: plain decoding, where every round
        keeps its one token whatever it is (a grammar's mask and a commit hook need the value first)."""
        return r.depth == 0 and r.constraint is None and r.on_commit is None

    def _alone(self, r: Row) -> bool:
        """Whether a lone row takes the solo plain round (`_solo_round`): it overlaps, and its GDN caches carry no
        state beyond (conv, recurrent) that a dropped pass would have to restore (Qwen4-Exp's PLE). Decided once
        per row (`_solo` keeps the row and its GDN caches)."""
        if self._solo is not None and self._solo[0] is r:
            return True
        backbone = r.decoder.cache.backbone
        if not self._overlaps(r) or any(getattr(c, "ple", None) is not None for c in backbone):
            return False
        self._solo = (r, [c for c in backbone if isinstance(c, GDNCache)])
        return True

    def _solo_round(self, r: Row) -> list[int]:
        """A plain round of a lone row, on its own caches, shaped as the bare step loop: no round record, no GDN
        caches rebuilt or committed, one `async_eval` per token.

        The pass over x, queued by the last round (or by `prime`, or run now), drew this round's token with it; the
        next pass is queued over that draw before it is read (unless the token is the row's last by length), so
        `drawn.item()` waits for the draw alone and the host does this token's bookkeeping (and its caller's, until
        the next `step`) while the model runs the next pass. The
        queued pass leaves the row's caches one token ahead; `_drop_ahead` puts them (and the sampler's key) back."""
        self._stacked, self._stacked_for = {}, []  # the batched rounds' stacked GDN states: stale from here on
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            ahead = self._solo_pass(r, mx.array([[r.decoder.x]]))
        drawn = ahead.drawn
        if drawn is None:  # a penalizer counts x first: the draw is made now, queued ahead of the next pass
            drawn = r.sampler(r.penalizer(ahead.target[0, :1])[0]).reshape(1, 1)  # [1, 1]
            mx.async_eval(drawn)
        if len(r.tokens) + 1 < r.max_tokens:  # no pass past the row's last token: `_settle` would wait for it
            self._ahead = self._solo_pass(r, drawn)
        t = drawn.item()  # the draw itself: an op on it (a slice) would queue behind the pass and wait for it
        d = r.decoder
        if r.logprobs is not None:  # the raw target row of the new token
            r.logprobs.add(ahead.target[0, :1], [t])
        if r.trace is not None:
            r.trace.tokens.append(mx.array(d.x))
            r.trace.hidden.append(ahead.traced)
            mx.eval(ahead.traced)  # read on the request's thread (evaluated already, with its pass)
        d.x = t
        if r.stats is not None:
            r.stats.record(0, 0, False)
        if r.penalizer is not None:
            r.penalizer.add([t])
        out = r.take([t])
        if r.stats is not None:
            r.stats.emitted += len(out)
        return out

    def _solo_pass(self, r: Row, tokens: mx.array) -> Ahead:
        """The backbone pass of a lone row over `tokens` [1, 1] on its own caches, with its draw (unless a
        penalizer draws it) and its trace's hidden, all queued (`mx.async_eval`) at once (see `_solo_round`)."""
        undo = [(c, c.conv, c.recurrent) for c in self._solo[1]]
        hidden = self.model.model(tokens, r.decoder.cache.backbone)  # [1, 1, H]
        target = self.model.logits(hidden)  # [1, 1, V]
        key = r.sampler.key
        drawn = r.sampler(target[0, 0]).reshape(1, 1) if r.penalizer is None else None  # [1, 1]
        traced = hidden[0] if r.trace is not None else None  # [1, H]
        mx.async_eval(drawn if drawn is not None else target, [] if traced is None else traced,
                      target if r.logprobs is not None else [])
        return Ahead([r], target, hidden, undo=undo, drawn=drawn, key=key, traced=traced)

    def _plain_round(self, rows: list[Row]) -> tuple[Round, mx.array, mx.array]:
        """A round of plain rows, overlapped: this round's pass (queued by
        the last round, or run now), each row's draw, and the next round's pass over those draws queued before the
        draws are read, so the host prepares and reads while the model computes. Returns (round, logits [B, 1, V],
        hidden [B, 1, H])."""
        rnd = Round.plain(len(rows))
        ahead, self._ahead = self._ahead, None
        target, hidden, gdn = (ahead.target, ahead.hidden, ahead.gdn) if ahead is not None else self._verify(rows, rnd)
        drawn = mx.stack([r.sampler(target[i, 0] if r.penalizer is None else r.penalizer(target[i, :1])[0])
                          for i, r in enumerate(rows)]).reshape(-1, 1)  # [B, 1]
        # the traced rows' hiddens are sliced and evaluated with the draw, ahead of the next pass: evaluating them
        # after it is queued would wait for that pass and leave the model idle while the host reads this round
        rnd.traced = [hidden[i, :1] if r.trace is not None else None for i, r in enumerate(rows)]  # [1, H] each
        mx.async_eval(drawn, [h for h in rnd.traced if h is not None])  # reading them never waits for the next pass
        self._commit_states(rows, rnd, gdn)  # every row keeps its one token: no value needed
        if all(len(r.tokens) + 1 < r.max_tokens for r in rows):  # a row ending here would drop the pass unused
            self._ahead = Ahead(rows, *self._verify(rows, rnd, drawn))
            mx.async_eval(self._ahead.target, self._ahead.hidden)
        rnd.next = [int(t) for (t,) in drawn.tolist()]  # `drawn` itself: a slice of it would queue behind the pass
        rnd.accepted = [0] * len(rows)
        return rnd, target, hidden

    def _drop_ahead(self) -> None:
        """Forget the queued pass: the KV position it wrote into each of its rows' caches."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        if ahead.undo is not None:  # a lone row's GDN caches and sampler, as before the pass and its draw
            for c, conv, recurrent in ahead.undo:
                c.conv, c.recurrent, c.offset = conv, recurrent, c.offset - 1
            ahead.rows[0].sampler.key = ahead.key
        for l, layer in enumerate(self.model.layers):
            if not layer.is_linear:
                for r in ahead.rows:
                    r.decoder.cache[l].trim_to(r.decoder.cache[l].offset - 1)

    @staticmethod
    def _plan(r: Row) -> tuple[int, int]:
        """(MTP draft count, copy-lane draft count) for this round: drafts never overshoot max_tokens or the context."""
        room = min(r.max_tokens - len(r.tokens) - 1, r.max_context - r.decoder.length - 2)
        return max(0, min(r.depth, room)), max(0, min(MAX_DEPTH, 2 * r.depth, room))

    def _propose(self, rows: list[Row], plans: list[tuple[int, int]]) -> Round:
        rnd = Round([[] for _ in rows], [None] * len(rows), [False] * len(rows))
        drafting = []
        for i, (r, (k, copy_k)) in enumerate(zip(rows, plans)):
            lane = r.decoder.lane
            copied = lane.propose(copy_k) if lane is not None and copy_k > 0 else []
            if copied and r.constraint is not None:  # cut at the first token the grammar forbids (solo's `propose`)
                copied = copied[: r.constraint.extend(copied)]
            if copied:
                rnd.drafts[i], rnd.copied[i] = copied, True
            elif k > 0:
                drafting.append(i)
        if drafting:
            drafts, logprobs = self._draft([rows[i] for i in drafting], [plans[i][0] for i in drafting])
            for i, d, q in zip(drafting, drafts, logprobs):
                rnd.drafts[i], rnd.draft_logprobs[i] = d, q
        return rnd

    def _mtp_caches(self, rows: list[Row], lengths: list[int]) -> list[RaggedKV] | list[KVCache]:
        """The MTP layers' caches for a pass over the rows: one row's own (the path a request alone takes)."""
        if len(rows) == 1:
            return rows[0].decoder.mtp_cache
        return [RaggedKV([r.decoder.mtp_cache[j] for r in rows], lengths)
                for j in range(len(rows[0].decoder.mtp_cache))]

    def _draft(self, rows: list[Row], ks: list[int]) -> tuple[list[list[mx.array]], list[mx.array | None]]:
        """k_i drafts per row from the MTP head, each row with its own sampler: the catch-up over each row's pending
        pairs, then one step per depth for the rows whose k_i goes that far. The drafts stay lazy scalars (a
        grammar's row reads each one as it goes): the verify pass is queued on them, and the round reads them
        with its acceptance, one wait on the model per round."""
        model = self.model
        pending = [r.decoder.pending_tokens + [r.decoder.x] for r in rows]  # pairs with pending_hidden
        m = [len(p) for p in pending]
        M = max(m)
        tokens = mx.array([p + [0] * (M - len(p)) for p in pending])  # [B, M]
        if len(rows) == 1:  # nothing to pad
            hidden = rows[0].decoder.pending_hidden[None]  # [1, M, H]
        else:
            hidden = mx.stack([mx.pad(r.decoder.pending_hidden, [(0, M - n), (0, 0)]) for r, n in zip(rows, m)])
        z = model.mtp_hidden(tokens, hidden, self._mtp_caches(rows, m), last=True)  # [B, 1, H] each row's last pair
        for r in rows:
            r.decoder.pending_tokens, r.decoder.pending_hidden = [], r.decoder.pending_hidden[:0]
        drafts: list[list[mx.array]] = [[] for _ in rows]
        logprobs: list[list[mx.array]] = [[] for _ in rows]
        live = list(range(len(rows)))  # rows still drafting, in z's row order
        ended = set()  # rows whose constraint accepts nothing after their last draft (an EOS draft)
        for j in range(max(ks)):
            logits = model.draft_logits(z)[:, -1]  # [b, V]
            for b, i in enumerate(live):
                params, constraint, pen = rows[i].sampler.params, rows[i].constraint, rows[i].penalizer
                row = logits[b] if pen is None else pen(logits[b : b + 1], drafts[i])[0]  # sees d_0..d_{j-1}
                row = row if constraint is None else constraint.apply(row)
                if params.greedy:
                    drafts[i].append(mx.argmax(row))
                else:
                    q = warp(row, params)
                    drafts[i].append(sample(q, rows[i].sampler.next_key()))
                    logprobs[i].append(q)
                if constraint is not None:  # consumed at once: the next draft's mask depends on it
                    constraint.advance(drafts[i][-1].item())
                    if constraint.ended:
                        ended.add(i)
            keep = [b for b, i in enumerate(live) if ks[i] > j + 1 and i not in ended]
            if not keep:
                break
            live_rows = [rows[live[b]] for b in keep]
            d = mx.stack([drafts[live[b]][-1] for b in keep]).reshape(-1, 1)  # [b', 1]
            z = z if len(keep) == len(live) else z[mx.array(keep)]
            z = model.mtp_hidden(d, z, self._mtp_caches(live_rows, [1] * len(keep)))  # fed its own post-norm output
            live = [live[b] for b in keep]
        return drafts, [mx.stack(lp) if lp else None for lp in logprobs]

    def _gdn_rows(self, rows: list[Row], layer: int) -> tuple[mx.array, mx.array]:
        """The rows' conv windows and states of one GDN layer, stacked [B, ...] (kept from the last round when the
        rows are the same)."""
        same = len(rows) == len(self._stacked_for) and all(a is b for a, b in zip(rows, self._stacked_for))
        if same and layer in self._stacked:
            return self._stacked[layer]
        caches = [r.decoder.cache[layer] for r in rows]
        if len(caches) == 1:
            return caches[0].conv, caches[0].recurrent
        return mx.concatenate([c.conv for c in caches]), mx.concatenate([c.recurrent for c in caches])

    def _verify(self, rows: list[Row], rnd: Round,
                tokens: mx.array | None = None) -> tuple[mx.array, mx.array, dict[int, GDNCache]]:
        """One backbone pass over every row's [x, drafts] (or `tokens` [B, 1], rows without drafts): (logits
        [B, S, V], hiddens [B, S, H], GDN caches)."""
        lengths = [len(d) + 1 for d in rnd.drafts]
        S = max(lengths)
        if tokens is None and all(isinstance(t, int) for d in rnd.drafts for t in d):
            tokens = mx.array([[r.decoder.x] + d + [0] * (S - n) for r, d, n in zip(rows, rnd.drafts, lengths)])
        elif tokens is None:  # MTP drafts still lazy: the pass is queued on them [B, S]
            tokens = mx.stack([mx.concatenate([mx.array([r.decoder.x], mx.int32), _ids(d), mx.zeros((S - n,), mx.int32)])
                               for r, d, n in zip(rows, rnd.drafts, lengths)])
        caches: list[GDNCache | RaggedKV] = []
        gdn: dict[int, GDNCache] = {}
        for l, layer in enumerate(self.model.layers):
            if layer.is_linear:
                c = gdn[l] = GDNCache()
                c.conv, c.recurrent = self._gdn_rows(rows, l)
                ple = getattr(rows[0].decoder.cache[l], "ple", None)
                if ple is not None:  # Qwen4-Exp PLE state: the pass runs on the rows' stacked copy, split at commit
                    c.ple = ple.stack([r.decoder.cache[l].ple for r in rows])
                if S > 1:
                    c.start_recording()
                    if ple is not None:
                        c.ple.start_recording()
                caches.append(c)
            else:
                caches.append(rows[0].decoder.cache[l] if len(rows) == 1 else  # one row: its own KV, all real
                              RaggedKV([r.decoder.cache[l] for r in rows], lengths))
        hidden = self.model.model(tokens, caches)  # [B, S, H]
        return self.model.logits(hidden), hidden, gdn

    @staticmethod
    def _accept(rows: list[Row], rnd: Round, target: mx.array) -> None:
        """Each row's acceptance with its own sampler: (accepted, next token) into `rnd`, one sync for all rows."""
        decided = []
        for i, r in enumerate(rows):
            row = target[i, : len(rnd.drafts[i]) + 1]  # [k_i+1, V]
            if r.penalizer is not None:  # position j given the drafts before it, as each draft was drawn
                row = r.penalizer(row, rnd.drafts[i])
            if r.constraint is not None:  # position j given x and the drafts before it (the masks they were drawn under)
                row = mx.where(r.constraint.recent_masks(len(rnd.drafts[i]) + 1), row, -mx.inf)
            d = _ids(rnd.drafts[i])  # [k_i]
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
            if r.constraint is not None:
                r.constraint.rollback(len(rnd.drafts[i]) - rnd.accepted[i])
                r.constraint.advance(rnd.next[i])

    def _commit_states(self, rows: list[Row], rnd: Round, gdn: dict[int, GDNCache]) -> None:
        """Keep each row's x and first a_i drafts in its backbone caches (`Decoder.commit`, row by row); a round
        without drafts keeps each row's one token before `rnd.accepted` is known."""
        kept = [a + 1 for a in rnd.accepted] if rnd.accepted else [1] * len(rows)  # tokens each row keeps of its pass
        self._stacked = {}
        for l, c in gdn.items():
            if c.recording and len(rows) == 1:  # one row: the recorded state itself, no gather
                state, conv = c.recorded_states[kept[0] - 1], c.recorded_conv_in[:, kept[0] : kept[0] + c.conv.shape[1]]
            elif c.recording:  # row i's state after its own token kept[i]; the conv window ending there
                window = c.conv.shape[1]
                state = mx.concatenate([c.recorded_states[n - 1][i : i + 1] for i, n in enumerate(kept)])
                conv = mx.concatenate([c.recorded_conv_in[i : i + 1, n : n + window] for i, n in enumerate(kept)])
            else:
                state, conv = c.recurrent, c.conv
            self._stacked[l] = (conv, state)
            for i, r in enumerate(rows):
                own = r.decoder.cache[l]
                own.conv, own.recurrent = (conv, state) if len(rows) == 1 else (conv[i : i + 1], state[i : i + 1])
                own.offset += kept[i]
            ple = getattr(c, "ple", None)
            if ple is not None:  # Qwen4-Exp: each row's PLE state as after its own last kept token
                for r, own_ple in zip(rows, ple.split(kept)):
                    r.decoder.cache[l].ple = own_ple
        self._stacked_for = list(rows)
        for l, layer in enumerate(self.model.layers):
            if not layer.is_linear:
                for i, r in enumerate(rows):
                    own = r.decoder.cache[l]  # the pass wrote len(drafts) + 1 positions
                    own.trim_to(own.offset - len(rnd.drafts[i]) - 1 + kept[i])

    def _commit_rows(self, rows: list[Row], rnd: Round, hidden: mx.array) -> None:
        """The rest of each row's commit: MTP caches, pending pairs, copy lane, trace; its next token becomes x."""
        for i, r in enumerate(rows):
            d, drafts, a = r.decoder, rnd.drafts[i], rnd.accepted[i]
            for c in d.mtp_cache:  # drop the draft chain's speculative positions, keep the catch-up
                c.trim_to(c.offset - (len(drafts) - 1 if rnd.mtp_ran(i) else 0))
            if r.trace is not None and not r.depth:
                r.trace.tokens.append(mx.array(d.x))
                r.trace.hidden.append(rnd.traced[i] if rnd.traced is not None else hidden[i, :1])
            if r.depth:
                if not rnd.mtp_ran(i):
                    d.pending_tokens.append(d.x)
                d.pending_tokens += drafts[:a]
                d.pending_hidden = mx.concatenate([d.pending_hidden, hidden[i, : a + 1]])
            if d.lane is not None:
                d.lane.extend(drafts[:a] + [rnd.next[i]])
            d.x = rnd.next[i]
        if self._ahead is not None:  # the caches feed the queued pass: evaluated there, or when their row leaves
            mx.eval([r.trace.hidden[-1] for r in rows if r.trace is not None])  # read on the request's thread
            return
        # computed while the host prepares the next round; a row's arrays are settled (`_settle`) before they may
        # move to another thread, when it leaves
        mx.async_eval([r.decoder.pending_hidden for r in rows], [cache_arrays(r.decoder.cache) for r in rows],
                      [r.trace.hidden[-1] for r in rows if r.trace is not None])


def _settle(rows: list[Row]) -> None:
    """Evaluate the leaving rows' state (caches, pending hiddens, trace): it may move to another thread."""
    mx.eval([(cache_arrays(r.decoder.cache), r.decoder.pending_hidden, r.trace.hidden[-1:] if r.trace else [])
             for r in rows if r.decoder is not None])


def _ids(drafts: list[int | mx.array]) -> mx.array:
    """A row's drafts (ints, or lazy scalars from the MTP head) as token ids [k] (int32)."""
    if all(isinstance(t, int) for t in drafts):
        return mx.array(drafts, dtype=mx.int32)
    return mx.stack([mx.array(t, mx.int32) if isinstance(t, int) else t.astype(mx.int32) for t in drafts])
