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
from dataclasses import replace

import mlx.core as mx

from hetero.decode.depth import check_depth
from hetero.decode.drafting import accept, ids, plan, propose
from hetero.decode.options import DecodeOptions
from hetero.decode.parts import RowParts
from hetero.decode.penalties import Penalizer, penalizer_for
from hetero.decode.records import DecodeTimes, MTPStats
from hetero.decode.rows import Ahead, Round, Row
from hetero.decode.sampling import Sampler
from hetero.decode.state import Decoder, start
from hetero.errors import HeteroError
from hetero.host.settings import DEFAULT_DRAFT_DEPTH
from hetero.models.cache import GDNCache, RaggedKV, cache_arrays
from hetero.models.interface import CausalLM

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

    def join(self, prompt: list[int], options: DecodeOptions, eos_ids: set[int], depth: int = DEFAULT_DRAFT_DEPTH,
             parts: RowParts = RowParts()) -> Row:
        """Prefill `prompt` alone and add its row; its first token is in `row.tokens` already. `depth` 0 decodes
        plainly, else speculatively with the MTP head (with the copy lane when `options.copy`)."""
        self._check(depth)
        return self.admit(self.prefilled(prompt, options, eos_ids, depth, parts))

    def prefilled(self, prompt: list[int], options: DecodeOptions, eos_ids: set[int], depth: int,
                  parts: RowParts) -> Row:
        """`prompt` prefilled alone (`state.start`) into a row that has emitted its first token, not admitted yet:
        a thread that prefilled it can stream that token at once. Its sampler is `options`' (sampling, seed), its
        penalizer `options.penalties`' over the prompt. A row with nothing to decode (max_tokens <= 0) is done before
        any prefill."""
        times = parts.times if parts.times is not None else DecodeTimes()
        times.start, times.prompt_tokens = times.start or time.perf_counter(), len(prompt)
        parts, sampler = replace(parts, times=times), Sampler(options.sampling, options.seed)
        if options.max_tokens <= 0:
            row = Row(None, sampler, depth, set(eos_ids), options, parts)
            row.finish_reason = times.finish_reason = "length"
            times.first_token = times.end = time.perf_counter()
            return row
        pen = penalizer_for(options.penalties, prompt, self.model.args.vocab_size)
        decoder = start(self.model, prompt, sampler, depth, options, parts, pen)
        return self.row(decoder, sampler, options, eos_ids, depth, parts, pen)

    def row(self, decoder: Decoder, sampler: Sampler, options: DecodeOptions, eos_ids: set[int],
            depth: int = DEFAULT_DRAFT_DEPTH, parts: RowParts = RowParts(), penalizer: Penalizer | None = None) -> Row:
        """A row for a prefilled decoder (`state.start`) whose first token, `decoder.x`, `sampler` drew and did not
        emit yet; it is emitted now (`parts.logprobs` holds its row already, if any), and `parts.on_commit` sees it.
        Not in the batch yet (`admit`): a thread that prefilled it can stream its first token at once.
        `parts.trace` (depth 0) gets each round's token and hidden. `parts.constraint` has consumed `decoder.x`, and
        `penalizer` (`penalties.penalizer_for` over the prompt; None: no penalties) has counted it."""
        self._check(depth, room=False)
        parts = replace(parts, max_context=parts.max_context or self.model.args.max_position_embeddings,
                        times=parts.times or DecodeTimes(start=time.perf_counter()),
                        stats=parts.stats if parts.stats is not None else (MTPStats(depth) if depth else None),
                        trace=parts.trace if not depth else None)
        row = Row(decoder, sampler, depth, set(eos_ids), options, parts, penalizer)
        if parts.on_commit is not None:
            parts.on_commit(decoder, [decoder.x])
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
            rnd = self._propose(rows, [self._plan(r) for r in rows])
            target, hidden, gdn = self._verify(rows, rnd)  # [B, S, V], [B, S, H]
            self._accept(rows, rnd, target)
            self._commit_states(rows, rnd, gdn)
        for i, r in enumerate(rows):
            if r.parts.logprobs is not None:  # the raw target rows of the kept drafts and the new token
                r.parts.logprobs.add(target[i, : rnd.accepted[i] + 1], rnd.drafts[i][: rnd.accepted[i]] + [rnd.next[i]])
        self._commit_rows(rows, rnd, hidden)
        emitted = {}
        for i, r in enumerate(rows):
            if r.parts.stats is not None:
                r.parts.stats.record(len(rnd.drafts[i]), rnd.accepted[i], rnd.copied[i])
            new = rnd.drafts[i][: rnd.accepted[i]] + [rnd.next[i]]
            if r.parts.on_commit is not None:
                r.parts.on_commit(r.decoder, new)
            if r.penalizer is not None:
                r.penalizer.add(new)
            emitted[r] = r.take(new)
            if r.parts.stats is not None:
                r.parts.stats.emitted += len(emitted[r])
        return emitted

    # ------------------------------------------------------------------------------------------------------

    @staticmethod
    def _overlaps(r: Row) -> bool:
        """Whether the row's next pass may be queued before its token is read: plain decoding, where every round
        keeps its one token whatever it is (a grammar's mask and a commit hook need the value first)."""
        return r.depth == 0 and r.parts.constraint is None and r.parts.on_commit is None

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
        if r.parts.logprobs is not None:  # the raw target row of the new token
            r.parts.logprobs.add(ahead.target[0, :1], [t])
        if r.parts.trace is not None:
            r.parts.trace.tokens.append(mx.array(d.x))
            r.parts.trace.hidden.append(ahead.traced)
            mx.eval(ahead.traced)  # read on the request's thread (evaluated already, with its pass)
        d.x = t
        if r.parts.stats is not None:
            r.parts.stats.record(0, 0, False)
        if r.penalizer is not None:
            r.penalizer.add([t])
        out = r.take([t])
        if r.parts.stats is not None:
            r.parts.stats.emitted += len(out)
        return out

    def _solo_pass(self, r: Row, tokens: mx.array) -> Ahead:
        """The backbone pass of a lone row over `tokens` [1, 1] on its own caches, with its draw (unless a
        penalizer draws it) and its trace's hidden, all queued (`mx.async_eval`) at once (see `_solo_round`)."""
        undo = [(c, c.conv, c.recurrent) for c in self._solo[1]]
        hidden = self.model.model(tokens, r.decoder.cache.backbone)  # [1, 1, H]
        target = self.model.logits(hidden)  # [1, 1, V]
        key = r.sampler.key
        drawn = r.sampler(target[0, 0]).reshape(1, 1) if r.penalizer is None else None  # [1, 1]
        traced = hidden[0] if r.parts.trace is not None else None  # [1, H]
        mx.async_eval(drawn if drawn is not None else target, [] if traced is None else traced,
                      target if r.parts.logprobs is not None else [])
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
        rnd.traced = [hidden[i, :1] if r.parts.trace is not None else None for i, r in enumerate(rows)]  # [1, H] each
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
        """The row's draft counts this round (`drafting.plan`; a seam for a test that scripts them)."""
        return plan(r)

    def _propose(self, rows: list[Row], plans: list[tuple[int, int]]) -> Round:
        """The round's drafts (`drafting.propose`; a seam for a bench that fixes them)."""
        return propose(self.model, rows, plans)

    @staticmethod
    def _accept(rows: list[Row], rnd: Round, target: mx.array) -> None:
        """Each row's acceptance (`drafting.accept`; a seam for a bench or test that records it)."""
        accept(rows, rnd, target)

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
            tokens = mx.stack([mx.concatenate([mx.array([r.decoder.x], mx.int32), ids(d), mx.zeros((S - n,), mx.int32)])
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
            if r.parts.trace is not None and not r.depth:
                r.parts.trace.tokens.append(mx.array(d.x))
                r.parts.trace.hidden.append(rnd.traced[i] if rnd.traced is not None else hidden[i, :1])
            if r.depth:
                if not rnd.mtp_ran(i):
                    d.pending_tokens.append(d.x)
                d.pending_tokens += drafts[:a]
                d.pending_hidden = mx.concatenate([d.pending_hidden, hidden[i, : a + 1]])
            if d.lane is not None:
                d.lane.extend(drafts[:a] + [rnd.next[i]])
            d.x = rnd.next[i]
        traced = [r.parts.trace.hidden[-1] for r in rows if r.parts.trace is not None]
        if self._ahead is not None:  # the caches feed the queued pass: evaluated there, or when their row leaves
            mx.eval(traced)  # read on the request's thread
            return
        # computed while the host prepares the next round; a row's arrays are settled (`_settle`) before they may
        # move to another thread, when it leaves
        mx.async_eval([r.decoder.pending_hidden for r in rows], [cache_arrays(r.decoder.cache) for r in rows], traced)


def _settle(rows: list[Row]) -> None:
    """Evaluate the leaving rows' state (caches, pending hiddens, trace): it may move to another thread."""
    mx.eval([(cache_arrays(r.decoder.cache), r.decoder.pending_hidden,
              r.parts.trace.hidden[-1:] if r.parts.trace is not None else []) for r in rows if r.decoder is not None])
