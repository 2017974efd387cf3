"""Batched decoding (hetero.decode.stepper): every request of a batch gets exactly the tokens it gets decoding alone.

Solo references are `decode_tokens`: the same stepper with one row (itself checked against plain greedy decoding
by tests/test_speculative.py, and plain greedy against HF transformers and mlx-lm by test_parity.py). Greedy rows
must match
token for token; sampled rows with their own seeded samplers match too (each row draws from its own key stream
in the solo order), which is stronger than matching in distribution. The tiny random models are
tests/test_speculative.py's; `hetero.load()` is the bundled checkpoint.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx.core as mx
import pytest
import tokenizers
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from test_speculative import (
    GREEDY, ScriptedLane, agreeing_model, assert_decoder_matches_reference, plain, random_model, rel_err, tiny_args,
)

import hetero
from hetero.decode.logprobs import LogprobRecorder
from hetero.decode.loop import DecodeLoop, Seat
from hetero.decode.options import DecodeOptions
from hetero.decode.parts import RowParts
from hetero.decode.prefill import prefill
from hetero.decode.records import DecodeTimes, Trace
from hetero.decode.rows import Row
from hetero.decode.sampling import Sampler, SamplingParams
from hetero.decode.solo import batch_generate, decode_tokens
from hetero.decode.state import start
from hetero.decode.stepper import Batch
from hetero.errors import HeteroError
from hetero.models.cache import GDNCache, KVCache, RaggedKV
from hetero.models.qwen3_5 import Model
from oracle64 import f64, forward64, fp32_bound, rel

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [5, 5, 5, 5], [9, 9, 1],
           [4, 9, 2, 7, 1] * 3, [30, 2], [6, 28, 4, 1, 7]]
DEPTHS = [3, 1, 0, 4, 2, 3, 0, 1]
MAX_TOKENS = [40, 25, 30, 33, 12, 37, 21, 28]


@pytest.fixture(scope="module")
def models() -> dict[str, Model]:
    return {"rejecting": random_model(0, 32), "agreeing": agreeing_model(1, 32, alpha=0.2)}


def solo(model: Model, prompt: list[int], max_tokens: int, depth: int, sampling: SamplingParams = GREEDY,
         seed: int | None = None, eos: set[int] = frozenset(), copy: bool = False) -> list[int]:
    return list(decode_tokens(model, prompt, DecodeOptions(max_tokens, sampling, seed, copy=copy), set(eos), depth))


def greedy(limits: list[int], copy: bool = False) -> list[DecodeOptions]:
    """Greedy options for rows of these max_tokens, without the copy lane unless `copy` (these tests say when)."""
    return [DecodeOptions(n, copy=copy) for n in limits]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("name", ["rejecting", "agreeing"])
def test_greedy_batch_equals_solo(models, name, n):
    model = models[name]
    requests = batch_generate(model, PROMPTS[:n], greedy(MAX_TOKENS[:n]), set(), DEPTHS[:n])
    for i, r in enumerate(requests):
        assert r.tokens == solo(model, PROMPTS[i], MAX_TOKENS[i], DEPTHS[i]), f"request {i}"
        assert r.finish_reason == "length" and len(r.tokens) == MAX_TOKENS[i]
    if name == "agreeing" and n >= 4:  # drafts were accepted, and rejected: both commit paths ran in the batch
        assert all(1.3 < r.parts.stats.to_dict()["mean_accepted_length"] < r.depth + 1 for r in requests if r.depth > 1)


def test_seeded_sampling_batch_equals_solo(models):
    """Sampled rows (mixed with a greedy one) draw what they draw alone with the same seed: same distribution."""
    model, params = models["rejecting"], SamplingParams(0.8, top_k=10)
    kinds = [params, params, GREEDY, SamplingParams(1.0, top_p=0.9), params]
    options = [DecodeOptions(n, p, 10 + i, copy=False) for i, (p, n) in enumerate(zip(kinds, MAX_TOKENS))]
    requests = batch_generate(model, PROMPTS[:5], options, set(), DEPTHS[:5])
    for i, r in enumerate(requests):
        assert r.tokens == solo(model, PROMPTS[i], MAX_TOKENS[i], DEPTHS[i], kinds[i], 10 + i), f"request {i}"
    again = batch_generate(model, PROMPTS[:2], [DecodeOptions(40, params, s, copy=False) for s in (99, 98)], set(),
                           [3, 3])
    assert again[0].tokens != again[1].tokens  # each row its own key stream, not a shared one


@pytest.mark.parametrize("name", ["rejecting", "agreeing"])
def test_copy_lane_rows_equal_solo(models, name):
    model = models[name]
    prompts = [[4, 9, 2, 7, 1] * 3, [1, 2, 3] * 4, [8, 6, 4]]
    requests = batch_generate(model, prompts, greedy([60, 45, 50], copy=True), set(), [3, 2, 1])
    for r, p, n, d in zip(requests, prompts, [60, 45, 50], [3, 2, 1]):
        assert r.tokens == solo(model, p, n, d, copy=True)
    assert sum(r.parts.stats.copy_drafted for r in requests) > 0 and sum(r.parts.stats.mtp_rounds for r in requests) > 0


def test_eos_ends_each_row_where_solo_does(models):
    model = models["agreeing"]
    reference = [solo(model, p, 40, d) for p, d in zip(PROMPTS[:4], DEPTHS[:4])]
    eos = {reference[0][17], reference[3][9]}  # inside the outputs; each row stops at its own first EOS
    requests = batch_generate(model, PROMPTS[:4], greedy([40] * 4), eos, DEPTHS[:4])
    for r, p, d in zip(requests, PROMPTS, DEPTHS):
        expected = solo(model, p, 40, d, eos=eos)
        assert r.tokens == expected
        assert r.finish_reason == ("stop" if len(expected) < 40 else "length")
    assert requests[0].finish_reason == "stop"


def test_join_and_leave_between_rounds(models):
    """Rows join a running batch and one is cancelled midway: the others' outputs stay their solo ones, and the
    cancelled one leaves with a cache holding exactly its committed tokens."""
    model = models["agreeing"]
    batch = Batch(model, max_batch=3)
    a = batch.join(PROMPTS[0], DecodeOptions(40, copy=False), set(), 3)
    b = batch.join(PROMPTS[2], DecodeOptions(30, copy=False), set(), 0)
    for _ in range(3):
        batch.step()
    c = batch.join(PROMPTS[3], DecodeOptions(33, copy=False), set(), 4)
    with pytest.raises(HeteroError):
        batch.join(PROMPTS[4], DecodeOptions(5, copy=False), set())  # full
    batch.step()
    batch.step()
    batch.leave(a)
    assert a not in batch.rows and not a.done
    assert a.tokens == solo(model, PROMPTS[0], 40, 3)[: len(a.tokens)]
    assert a.tokens[-1] == a.decoder.x  # every committed token was emitted (no limit reached)
    assert_decoder_matches_reference(model, a.decoder, PROMPTS[0] + a.tokens)
    long_prompt = [(7 * i + 3) % 32 for i in range(23)]  # prefilled in chunks of 4, a round of the others after each
    d = batch.join(long_prompt, DecodeOptions(20, copy=False, prefill_chunk=4), set(), 2,
                   RowParts(progress=lambda *_: batch.step()))
    assert len(b.tokens) > 5 + 5  # b decoded while d prefilled
    for _ in batch.drain():
        pass
    assert b.tokens == solo(model, PROMPTS[2], 30, 0)
    assert c.tokens == solo(model, PROMPTS[3], 33, 4)
    assert d.tokens == solo(model, long_prompt, 20, 2)
    assert not batch.rows and all(r.done for r in (b, c, d))


def test_overlapped_plain_rounds_under_churn(models):
    """All-plain batches queue each round's pass before reading its tokens (`Batch._plain_round`): through joins,
    a cancel, an EOS and a length limit every row still equals its solo run (greedy and seeded sampling), and a row
    that leaves holds exactly its committed tokens, not the queued pass's extra position."""
    model = models["rejecting"]
    sampled = SamplingParams(temperature=0.9, top_p=0.95)
    eos = {solo(model, PROMPTS[5], 40, 0)[11]}  # row e (only) stops at an EOS halfway
    batch = Batch(model, max_batch=4)
    a = batch.join(PROMPTS[0], DecodeOptions(40, copy=False), set(), 0)
    b = batch.join(PROMPTS[1], DecodeOptions(30, sampled, 5, copy=False), set(), 0)
    for _ in range(4):
        batch.step()
    assert batch._ahead is not None  # the next pass is queued
    c = batch.join(PROMPTS[2], DecodeOptions(7, copy=False), set(), 0)  # joins while a pass is queued for a and b
    for _ in range(3):
        batch.step()
    batch.leave(a)  # cancelled with a queued pass that wrote one more KV position
    assert a.tokens == solo(model, PROMPTS[0], 40, 0)[: len(a.tokens)] and not a.done
    assert_backbone_matches(model, a.decoder, PROMPTS[0] + a.tokens)
    e = batch.join(PROMPTS[5], DecodeOptions(40, copy=False), eos, 0)
    for _ in batch.drain():
        pass
    assert b.tokens == solo(model, PROMPTS[1], 30, 0, sampled, 5)
    assert c.tokens == solo(model, PROMPTS[2], 7, 0) and c.finish_reason == "length"
    assert e.tokens == solo(model, PROMPTS[5], 40, 0, eos=eos) and e.finish_reason == "stop"
    for r, p in ((b, PROMPTS[1]), (c, PROMPTS[2])):  # finished rows: caches end at their last committed token
        assert_backbone_matches(model, r.decoder, p + r.tokens)
    assert batch._ahead is None


def test_lone_plain_row_gives_way_to_joining_rows(models):
    """A lone plain row decodes on its own caches with its next pass and draw queued (`Batch._solo_round`): a row
    joining drops that pass, putting back the row's GDN state and its sampler's key, and the row goes on in the
    batch and alone again with exactly its solo tokens (seeded sampling), until a cancel leaves its caches holding
    only its committed tokens."""
    model = models["rejecting"]
    sampled = SamplingParams(temperature=0.9, top_p=0.95)
    batch = Batch(model, max_batch=2)
    a = batch.join(PROMPTS[0], DecodeOptions(40, sampled, 3, copy=False), set(), 0)
    for _ in range(3):
        batch.step()
    assert batch._ahead is not None and batch._ahead.drawn is not None  # queued with its draw
    b = batch.join(PROMPTS[2], DecodeOptions(6, copy=False), set(), 0)  # drops a's queued pass and draw
    while not b.done:
        batch.step()
    assert batch.rows == [a]
    for _ in range(4):  # alone again
        batch.step()
    batch.leave(a)  # cancelled with a queued pass
    assert batch._ahead is None and not a.done
    assert a.tokens == solo(model, PROMPTS[0], 40, 0, sampled, 3)[: len(a.tokens)]
    assert b.tokens == solo(model, PROMPTS[2], 6, 0)
    assert_backbone_matches(model, a.decoder, PROMPTS[0] + a.tokens)


def test_plain_rounds_queue_no_pass_past_a_last_token(models, monkeypatch):
    """Plain rounds queue the next backbone pass before reading their tokens, but none past a row's last token by
    length (it would be dropped unused, and a leaving row's settling waits for it): n tokens alone take n - 1 passes
    after the prefill, the first queued before the first token is handed out (`Batch.prime`, as `decode_tokens`
    does), and a batch whose rows end at different lengths runs one pass per round, with every row's solo tokens."""
    model = models["rejecting"]
    passes = {"solo": 0, "batch": 0}

    def counted(kind, method):
        def wrapper(self, *args):
            passes[kind] += 1
            return method(self, *args)
        return wrapper

    expected = solo(model, PROMPTS[0], 10, 0)
    monkeypatch.setattr(Batch, "_solo_pass", counted("solo", Batch._solo_pass))
    monkeypatch.setattr(Batch, "_verify", counted("batch", Batch._verify))
    batch = Batch(model, max_batch=2)
    a = batch.join(PROMPTS[0], DecodeOptions(10, copy=False), set(), 0)
    batch.prime()
    assert batch._ahead is not None and passes == {"solo": 1, "batch": 0}  # queued before the first token is read
    for _ in batch.drain():
        pass
    assert a.tokens == expected and passes == {"solo": 9, "batch": 0} and batch._ahead is None
    passes.update(solo=0, batch=0)
    b = batch.join(PROMPTS[1], DecodeOptions(6, copy=False), set(), 0)  # 5 rounds together, then c alone for 3
    c = batch.join(PROMPTS[2], DecodeOptions(9, copy=False), set(), 0)
    rounds = sum(1 for _ in batch.drain())
    assert rounds == 8 and passes == {"solo": 3, "batch": 5}
    assert b.tokens == solo(model, PROMPTS[1], 6, 0) and c.tokens == solo(model, PROMPTS[2], 9, 0)


def test_a_primed_pass_gives_way_to_a_joining_row(models):
    """The pass `Batch.prime` queues for a lone row, with its draw, is dropped by a row joining before the first
    round: the row's GDN state and sampler key go back, and both rows get their solo tokens (seeded sampling)."""
    model = models["rejecting"]
    sampled = SamplingParams(temperature=0.9, top_p=0.95)
    batch = Batch(model, max_batch=2)
    a = batch.join(PROMPTS[0], DecodeOptions(20, sampled, 3, copy=False), set(), 0)
    batch.prime()
    assert batch._ahead is not None and batch._ahead.drawn is not None
    b = batch.join(PROMPTS[2], DecodeOptions(6, copy=False), set(), 0)  # the first round drops a's queued pass
    for _ in batch.drain():
        pass
    assert a.tokens == solo(model, PROMPTS[0], 20, 0, sampled, 3)
    assert b.tokens == solo(model, PROMPTS[2], 6, 0)
    assert_backbone_matches(model, a.decoder, PROMPTS[0] + a.tokens)


def assert_backbone_matches(model: Model, decoder, committed: list[int]) -> None:
    """A plain row's backbone caches hold exactly committed[:-1] (decoder.x last): the float64 oracle's arrays of
    them within the fp32 bound (batched rows run other matmul shapes, and so other summation orders, than any
    reference run; see test_speculative.assert_decoder_matches_reference)."""
    assert decoder.x == committed[-1]
    L = len(committed) - 1
    stats = {}
    _, caches = forward64(model, committed[:-1], stats)
    tol = fp32_bound(model.args, L, mtp=False, amplification=stats["amplification"])
    for i, (c, r) in enumerate(zip(decoder.backbone, caches, strict=True)):
        assert c.offset == L, f"layer {i} offset"
        pairs = [(c.recurrent[0], r["recurrent state"]), (c.conv[0], r["conv window"])] if isinstance(c, GDNCache) \
            else [(c.keys[0, :, :L], r["keys"]), (c.values[0, :, :L], r["values"])]
        assert all(rel(f64(x), y) <= tol for x, y in pairs), f"layer {i}"


def test_restored_prefix_and_prefilled_decoder_join(models):
    """A request restored from a checkpoint (cache, skip, carry) and one prefilled elsewhere (`row`, `admit`) decode as cold
    solo runs do; on_commit sees every committed token in order."""
    model = models["agreeing"]
    prompt = PROMPTS[2]
    cache = model.make_cache()
    _, carry = prefill(model, prompt[:6], cache, mtp=True)  # a checkpoint of the first 6 tokens and h_5
    batch = Batch(model)
    committed: list[int] = []
    restored = batch.join(prompt, DecodeOptions(30, copy=False), set(), 2,
                          RowParts(cache=cache, skip=6, carry=carry,
                                   on_commit=lambda decoder, new: committed.extend(new)))
    decoder = start(model, PROMPTS[0], Sampler(GREEDY), 3, DecodeOptions(copy=False))
    added = batch.admit(batch.row(decoder, Sampler(GREEDY), DecodeOptions(25, copy=False), set(), 3))
    for _ in batch.drain():
        pass
    assert restored.tokens == solo(model, prompt, 30, 2) and added.tokens == solo(model, PROMPTS[0], 25, 3)
    assert committed[: len(restored.tokens)] == restored.tokens and committed[-1] == restored.decoder.x


def test_logprobs_per_request_equal_solo(models):
    model = models["agreeing"]
    batch = Batch(model)
    recorders = [LogprobRecorder(3) for _ in range(3)]
    requests = [batch.join(p, DecodeOptions(20, copy=False), set(), d, RowParts(logprobs=rec))
                for p, d, rec in zip(PROMPTS[:3], DEPTHS[:3], recorders)]
    for _ in batch.drain():
        pass
    for r, p, d, rec in zip(requests, PROMPTS, DEPTHS, recorders):
        ref = LogprobRecorder(3)
        if d:
            list(decode_tokens(model, p, DecodeOptions(20, copy=False), set(), d, RowParts(logprobs=ref)))
        else:
            list(decode_tokens(model, p, DecodeOptions(20), set(), parts=RowParts(logprobs=ref)))
        ours, theirs = rec.items[:20], ref.items[:20]
        assert [x.token for x in ours] == [x.token for x in theirs] == r.tokens
        assert [t for x in ours for t, _ in x.top] == [t for x in theirs for t, _ in x.top]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(ours, theirs)) < 1e-4


def test_edge_requests(models):
    model = models["rejecting"]
    batch = Batch(model)
    none = batch.join([1, 2], DecodeOptions(0, copy=False), set())
    one = batch.join([1, 2], DecodeOptions(1, copy=False), set())
    first_eos = batch.join([3], DecodeOptions(10, copy=False), {solo(model, [3], 1, 0)[0]})
    assert none.tokens == [] and one.tokens == solo(model, [1, 2], 1, 3) and first_eos.tokens == []
    assert (none.finish_reason, one.finish_reason, first_eos.finish_reason) == ("length", "length", "stop")
    assert batch.rows == [] and batch.step() == {}
    with pytest.raises(HeteroError):
        Batch(model, max_batch=0)
    with pytest.raises(HeteroError):
        batch.join([1], DecodeOptions(4, copy=False), set(), 16)


def test_plain_batch_of_a_model_without_mtp_head():
    headless = Model(tiny_args(32))
    mx.eval(headless.parameters())
    prompts, limits = PROMPTS[:3], [20, 9, 15]
    requests = batch_generate(headless, prompts, greedy(limits), set(), [0, 0, 0])
    for r, p, n in zip(requests, prompts, limits):
        assert r.tokens == plain(headless, p, n)
    with pytest.raises(HeteroError):
        Batch(headless).join([1], DecodeOptions(4, copy=False), set(), 2)


@pytest.mark.parametrize("S", [3, 20])  # the compiled few-token pieces, and the plain path past RECURRENT_MAX_TOKENS
def test_ragged_attention_equals_each_row_alone(models, S):
    """An attention layer over rows of different real lengths and cache lengths equals each row run alone."""
    layer = models["rejecting"].layers[1]
    lengths, history = [S, 1, S - 1], [5, 0, 12]
    x = mx.random.normal((3, S, 32), key=mx.random.key(0))
    alone, rows = [], []
    for i, (n, h) in enumerate(zip(lengths, history)):
        past = mx.random.normal((1, h, 32), key=mx.random.key(i + 1)) if h else None
        ref, mine = KVCache(), KVCache()
        if past is not None:
            layer(past, ref)
            layer(past, mine)
        alone.append(layer(x[i : i + 1, :n], ref)[0])  # [n, H]
        rows.append((mine, ref))
    out = layer(x, RaggedKV([m for m, _ in rows], lengths))  # [3, S, H]
    for i, (n, (mine, ref)) in enumerate(zip(lengths, rows)):
        assert rel_err(out[i, :n], alone[i]) <= 1e-5, f"row {i}"
        assert mine.offset == ref.offset == history[i] + n
        assert rel_err(mine.keys[:, :, : mine.offset], ref.keys[:, :, : ref.offset]) <= 1e-5


class ScriptedBatch(Batch):
    """A batch whose rounds do what the test says: per row, how many drafts (from the MTP head or a scripted copy
    lane), how many of them are accepted and the next token."""

    def __init__(self, model: Model):
        super().__init__(model)
        self.script: dict[Row, tuple[int, bool, int, int]] = {}  # (k, from the copy lane, accepted, next)
        self.drafted: dict[Row, list[int]] = {}

    def _plan(self, r):
        k, from_copy, _, _ = self.script[r]
        return (0 if from_copy else k), (k if from_copy else 0)

    def _accept(self, rows, rnd, target):
        self.drafted = dict(zip(rows, rnd.drafts))
        rnd.accepted = [self.script[r][2] for r in rows]
        rnd.next = [self.script[r][3] for r in rows]


@settings(max_examples=20, deadline=None, database=None)
@given(data=st.data())
def test_rollback_per_request(models, data):
    """After any per-row drafts and forced acceptances, every row's caches equal a run over its committed tokens
    alone: each row rolled back on its own, whatever the other rows kept."""
    model, V = models["rejecting"], 32
    token = st.integers(0, V - 1)
    batch = ScriptedBatch(model)
    n = data.draw(st.integers(1, 4), label="requests")
    rows, committed = [], []
    for i in range(n):
        prompt = data.draw(st.lists(token, min_size=1, max_size=10), label=f"prompt {i}")
        r = batch.join(prompt, DecodeOptions(1000, copy=False), set(), 4)
        r.decoder.lane = ScriptedLane()
        rows.append(r)
        committed.append(prompt + [r.decoder.x])
    for _ in range(data.draw(st.integers(1, 4), label="rounds")):
        for i, r in enumerate(rows):
            k = data.draw(st.integers(0, 4), label="k")
            from_copy = k > 0 and data.draw(st.booleans(), label="copy lane")
            copied = data.draw(st.lists(token, min_size=k, max_size=k), label="copied") if from_copy else []
            r.decoder.lane.next = copied
            accepted, nxt = data.draw(st.integers(0, k), label="accepted"), data.draw(token, label="next")
            batch.script[r] = (k, from_copy, accepted, nxt)
        batch.step()
        for i, r in enumerate(rows):
            k, _, a, nxt = batch.script[r]
            assert len(batch.drafted[r]) == k
            committed[i] += batch.drafted[r][:a] + [nxt]
            assert_decoder_matches_reference(model, r.decoder, committed[i])


def test_bundled_model_greedy_batch_equals_solo():
    engine = hetero.load()
    texts = ["def fib(n):", "The quick brown fox jumps over the lazy dog and then", "import numpy as np\n",
             "Once upon a time", "class Stack:\n    def push(self, x):", "# TODO", "SELECT * FROM users WHERE",
             "Dear Sir or Madam,"]
    prompts = [engine.encode_prompt(t) for t in texts]
    depths, limits = [3, 2, 0, 4, 1, 3, 0, 2], [20, 31, 12, 25, 16, 9, 18, 22]
    alone = [solo(engine.model, p, n, d, eos=engine.eos_ids) for p, n, d in zip(prompts, limits, depths)]
    for n in (1, 2, 4, 8):
        requests = batch_generate(engine.model, prompts[:n], greedy(limits[:n]), engine.eos_ids, depths[:n])
        assert [r.tokens for r in requests] == alone[:n], n


# ----------------------------------------------------------------------------------------------------------
# The decode loop: jobs on their own threads, one shared batch


def run_jobs(loop: DecodeLoop, model: Model, jobs: list[tuple[list[int], int, int]], cancel_after: dict[int, int]):
    """Each job on its own thread: its turn for the prefill (given up at the handover, taken again at the end), then
    its stream's tokens; job i stops reading after cancel_after[i] tokens."""
    outputs: dict[int, list[int]] = {}
    times: dict[int, DecodeTimes] = {}
    errors: list[BaseException] = []

    def job(i: int, prompt: list[int], max_tokens: int, depth: int) -> None:
        ticket = object()
        loop.turns.enter(ticket)
        try:
            out, times[i] = [], DecodeTimes()
            stream = loop.generate_tokens(model, prompt, DecodeOptions(max_tokens, copy=False), set(), depth,
                                          RowParts(times=times[i]), job=ticket)
            for t in stream:
                out.append(t)
                if len(out) == cancel_after.get(i, -1):
                    stream.close()
                    break
            outputs[i] = out
        except BaseException as e:  # noqa: BLE001  (reported by the test)
            errors.append(e)
        finally:
            loop.turns.leave(ticket)

    threads = [threading.Thread(target=job, args=(i, *j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return outputs, times


def test_decode_loop_batches_jobs_from_their_threads(models):
    model = models["agreeing"]
    loop = DecodeLoop(model, max_batch=3)
    jobs = [(PROMPTS[i], MAX_TOKENS[i], DEPTHS[i]) for i in range(5)]  # 5 jobs, 3 at a time in the batch
    outputs, times = run_jobs(loop, model, jobs, cancel_after={1: 4})
    for i, (p, n, d) in enumerate(jobs):
        expected = solo(model, p, n, d)
        assert outputs[i] == (expected[:4] if i == 1 else expected), f"job {i}"
        assert times[i].generated == len(outputs[i]) and times[i].end >= times[i].first_token > 0
        assert times[i].finish_reason == "length"  # the cancelled job's is its caller's to set
    health = loop.health()
    assert health["rounds"] > 0 and max(health["recent_batch_sizes"]) <= 3
    assert max(n for _, n in loop.sizes) >= 2  # requests did share rounds
    loop.close()


def test_decode_loop_under_churn(models):
    """8 jobs, 3 at a time in the batch, half of them cut at different points: no job hangs, the rest are exact."""
    model = models["rejecting"]
    loop = DecodeLoop(model, max_batch=3)
    jobs = [(PROMPTS[i], 15 + 3 * i, (i % 3)) for i in range(8)]
    cuts = {0: 1, 3: 2, 5: 7, 6: 3}
    outputs, _ = run_jobs(loop, model, jobs, cancel_after=cuts)
    for i, (p, n, d) in enumerate(jobs):
        expected = solo(model, p, n, d)
        assert outputs[i] == expected[: cuts.get(i, n)], f"job {i}"
    deadline = time.time() + 10
    while loop.health()["batch_size"]:  # the last cut request leaves at the loop's next pass
        assert time.time() < deadline
        time.sleep(0.01)
    loop.close()


def test_decode_loop_closed_fails_its_streams(models):
    model = models["rejecting"]
    loop = DecodeLoop(model)
    stream = loop.generate_tokens(model, PROMPTS[0], DecodeOptions(1000, copy=False), set(), 2)
    assert len([next(stream) for _ in range(3)]) == 3
    loop.close()
    with pytest.raises(HeteroError):
        for _ in stream:
            pass
    with pytest.raises(HeteroError):  # a loop that is closed takes no new request
        list(loop.generate_tokens(model, PROMPTS[1], DecodeOptions(10), set(), 0))


def test_decode_loop_plain_jobs_fill_the_trace(models):
    """Plain (depth 0) requests record what generate_tokens' trace records, for the engine's checkpoints."""
    model = models["rejecting"]
    loop = DecodeLoop(model)
    traces = [Trace(), Trace()]
    streams = [loop.generate_tokens(model, p, DecodeOptions(12), set(), 0, RowParts(trace=tr))
               for p, tr in zip(PROMPTS[:2], traces)]
    outs = [list(s) for s in streams]  # one after the other: the loop thread serves each in turn
    for p, out, tr in zip(PROMPTS, outs, traces):
        ref = Trace()
        assert out == list(decode_tokens(model, p, DecodeOptions(12), set(), parts=RowParts(trace=ref)))
        assert [int(t.item()) for t in tr.tokens] == [int(t.item()) for t in ref.tokens][: len(tr.tokens)]
        assert len(tr.hidden) == len(tr.tokens) + 1 and len(tr.tokens) >= len(ref.tokens) - 1
        for a, b in zip(tr.hidden, ref.hidden):
            assert rel_err(a, b) <= 1e-5
    loop.close()


# ----------------------------------------------------------------------------------------------------------
# The server: `--max-batch N`


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    from hetero.checkpoint.tokenizer import Tokenizer
    from hetero.engine import Engine

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(32)}, unk_token="t0"))
    return Engine(models["agreeing"], Tokenizer(tok), {"model_type": "qwen3_5_text"}, tmp_path_factory.mktemp("e"), "tiny")


def test_server_batches_concurrent_requests(engine):
    """Concurrent completions through `create_app(max_batch=3)` get their single-request answers, MTP and plain
    alike, also when sent again and restored from the prefix cache that the batch's rounds checkpointed; /health
    shows the rounds they shared."""
    from hetero.caches.prefix import PrefixCache
    from hetero.server import create_app

    engine.prefix_cache = PrefixCache(1 << 28)
    app = create_app(engine, max_concurrent=2, max_batch=3, prefill_chunk=8)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.02)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    bodies = [{"prompt": p, "max_tokens": n, "temperature": 0, "mtp": d > 0}
              for p, n, d in zip(PROMPTS[:5], MAX_TOKENS[:5], DEPTHS[:5])]
    try:
        def ask(body: dict) -> tuple[str, int]:
            r = httpx.post(url + "/v1/completions", json={"model": "tiny", **body}, timeout=120)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            return r.json()["choices"][0]["text"], usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)

        with ThreadPoolExecutor(5) as pool:
            first = list(pool.map(ask, bodies))
            again = list(pool.map(ask, bodies))
        health = httpx.get(url + "/health").json()
        long = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 900, "mtp": True, "stream": True}
        with ThreadPoolExecutor(1) as pool:
            beside = pool.submit(ask, bodies[3])  # decodes in the batch while the stream is cut
            with httpx.stream("POST", url + "/v1/completions", json=long, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break  # the first token arrived; hang up
            assert beside.result()[0] == first[3][0]
        deadline = time.time() + 20
        while httpx.get(url + "/health").json()["requests"]["cancelled"] == 0:
            assert time.time() < deadline, "the batched generation was not cancelled"
            time.sleep(0.05)
    finally:
        server.should_exit = True
        thread.join(10)
        engine.prefix_cache = None
    texts = [t for t, _ in first]
    assert [t for t, _ in again] == texts and sum(c for _, c in again) > 0
    for body, text in zip(bodies, texts):
        alone = engine.generate(body["prompt"], max_tokens=body["max_tokens"], mtp=body["mtp"], copy=True,
                                use_prefix_cache=False)
        assert text == alone.text
    assert health["batch"]["max_batch"] == 3 and health["batch"]["rounds"] > 0
    # some rounds were shared: over every round so far (the history holds 512), not only the latest 32, which the
    # longest request may have decoded alone after the others ended
    assert health["batch"]["rounds"] <= 512 and health["batch"]["mean_batch_size"] > 1


# ----------------------------------------------------------------------------------------------------------
# JSON-constrained requests in a batch


def test_constrained_requests_in_a_batch_equal_solo():
    """Constrained rows (plain and MTP, greedy and seeded sampling, copy lane on) beside unconstrained ones: each
    gets its solo constrained output token for token, and the JSON validates."""
    import json

    import jsonschema
    from test_constrained import PERSON, SCHEMAS, constraint

    engine = hetero.load()
    prompts = [engine.encode_prompt(f"Answer in JSON: {w}", chat=True) for w in ("a person", "a colour", "numbers",
                                                                                  "tags", "a story")]
    schemas = [PERSON, SCHEMAS["enum"], SCHEMAS["array"], SCHEMAS["nested"], None]  # None: unconstrained
    depths, seeds = [3, 0, 2, 3, 0], [None, 7, 3, None, None]
    params = [SamplingParams() if s is None else SamplingParams(temperature=1.0) for s in seeds]

    def options(i):
        return DecodeOptions(60, params[i], seeds[i])

    def grammar(i):
        return constraint(engine, schemas[i]) if schemas[i] is not None else None

    alone = []
    for i, p in enumerate(prompts):
        alone.append(list(decode_tokens(engine.model, p, options(i), engine.eos_ids, depths[i],
                                        RowParts(constraint=grammar(i)))))
    batch = Batch(engine.model, max_batch=len(prompts))
    requests = [batch.join(p, options(i), engine.eos_ids, depths[i], RowParts(constraint=grammar(i)))
                for i, p in enumerate(prompts)]
    for _ in batch.drain():
        pass
    assert [r.tokens for r in requests] == alone
    for i, r in enumerate(requests[:4]):
        assert r.finish_reason == "stop", engine.tokenizer.decode(r.tokens)
        jsonschema.validate(json.loads(engine.tokenizer.decode(r.tokens)), schemas[i])


def test_constrained_request_through_the_decode_loop():
    """engine.generate with a JSON schema and a `batch` seat decodes in the loop's batch, with the solo answer."""
    from test_constrained import PERSON

    engine = hetero.load()
    prompt = engine.encode_prompt("Answer in JSON: a person", chat=True)
    alone = engine.generate(prompt, max_tokens=60, mtp=True, draft_depth=3, json_schema=PERSON)
    loop = DecodeLoop(engine.model, max_batch=2)
    try:
        shared = engine.generate(prompt, max_tokens=60, mtp=True, draft_depth=3, json_schema=PERSON,
                                 batch=Seat(loop))
    finally:
        loop.close()
    assert shared.tokens == alone.tokens and loop.rounds > 0


def test_a_closed_stream_returns_once_its_request_left_the_batch(models):
    """A job that stops reading gets control back only after the loop dropped its request (with the pass queued for
    it): its caches then hold its committed state, which the server's end-of-turn checkpoint captures right after
    (it once found them a token ahead, while the loop still held the row)."""
    model = models["agreeing"]
    loop = DecodeLoop(model, max_batch=2)
    cache = model.make_cache()
    stream = loop.generate_tokens(model, PROMPTS[0], DecodeOptions(200, copy=False), set(), 0, RowParts(cache=cache))
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert loop.health()["batch_size"] == 0  # no polling: gone when close returned
    kv = [c.offset for c, layer in zip(cache, model.layers) if not layer.is_linear]
    gdn = [c.offset for c, layer in zip(cache, model.layers) if layer.is_linear]
    assert len(set(kv + gdn)) == 1  # every layer at the same committed position
    loop.close()
