"""The CPU prefill wavefront (hetero.decode.wavefront): two chunks in flight on two threads, one layer apart, give
the sequential prefill's logits, hiddens and caches (backbone and MTP head), on a tiny qwen4_exp checkpoint (PLE,
QSA dropping keys, numpy attention inside a chunk) and on a tiny qwen3_5 one."""

from __future__ import annotations

import threading

import hetero  # before mlx: the fast BLAS
import mlx.core as mx
import numpy as np
import pytest
import qwen4_checkpoint as qc
from tiny_checkpoint import write_tiny_model

from hetero.checkpoint.loader import load_model
from hetero.decode import wavefront
from hetero.decode.prefill import chunk_edges, prefill
from hetero.models.cache import KVCache, cache_arrays

CHUNK = 40  # >= attention.MIN_QUERIES: a chunk's attention runs its numpy softmax (a host sync inside the layer)


@pytest.fixture(scope="module")
def qwen4(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4wave")
    qc.build(path, ple_layer_ids=(1, 2), seed=3, mtp=True)
    return load_model(path)[0]


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    return load_model(write_tiny_model(tmp_path_factory.mktemp("q35wave")))[0]


def _tokens(n: int, vocab: int, eos: int, seed: int) -> list[int]:
    toks = [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]
    toks[n // 3] = eos  # the PLE n-gram context restarts there
    return toks


def _lanes(model, monkeypatch) -> dict[int, set[str]]:
    """Record which thread ran each chunk's layers (chunk = the cache's offset at layer 0 // CHUNK)."""
    seen: dict[int, set[str]] = {}
    backbone = model.model
    inner = type(backbone).run_layer

    def run_layer(self, i, h, ctx, cache):
        if i == 0:
            seen.setdefault(cache.offset // CHUNK, set()).add(threading.current_thread().name)
        return inner(self, i, h, ctx, cache)

    monkeypatch.setattr(type(backbone), "run_layer", run_layer)
    return seen


def _rows(cache) -> list[np.ndarray]:
    """What a cache holds: attention rows up to its offset, recurrent states, PLE token contexts."""
    out = []
    for c in cache:
        out += [np.array(a) for a in (c.rows(0, c.offset) if isinstance(c, KVCache) else c.state)]
        if getattr(c, "ple", None) is not None:
            out.append(c.ple.context)
    return out


def _both(model, tokens, monkeypatch, **kw):
    """(sequential, wavefront) prefill results: (logits, hidden, every cache array as numpy)."""
    out = []
    for on in ("0", "1"):
        monkeypatch.setenv(wavefront.ENV, on)
        cache = model.make_cache()
        logits, hidden = prefill(model, tokens, cache, CHUNK, **kw)
        out.append((np.array(logits), np.array(hidden), [np.array(a) for a in cache_arrays(cache)]))
    return out


def _same(a, b) -> None:
    (la, ha, ca), (lb, hb, cb) = a, b
    assert la.shape == lb.shape and ha.shape == hb.shape and len(ca) == len(cb)
    np.testing.assert_allclose(lb, la, rtol=0, atol=1e-5 * np.abs(la).max())
    np.testing.assert_allclose(hb, ha, rtol=0, atol=1e-5 * np.abs(ha).max())
    assert (la.argmax(-1) == lb.argmax(-1)).all()
    for x, y in zip(ca, cb):
        assert x.shape == y.shape
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-5 * max(np.abs(x).max(), 1e-6))


def test_qwen4_wavefront_equals_sequential_prefill(qwen4, monkeypatch):
    """Five full chunks and a short tail (compiled steps, on the calling thread), the MTP head's pairs filled: every
    position's logits and hidden and every cache array as the sequential run's; both lanes really ran chunks."""
    assert wavefront.enabled(), "the wavefront needs a CPU device and 2+ cores"
    tokens = _tokens(5 * CHUNK + 5, qc.VOCAB, qc.EOS, 0)
    seen = _lanes(qwen4, monkeypatch)
    seq, wave = _both(qwen4, tokens, monkeypatch, all_logits=True, mtp=True)
    _same(seq, wave)
    lanes = set().union(*seen.values())
    assert lanes == {wavefront.LANE_THREAD, threading.current_thread().name}
    assert wavefront.LANE_THREAD in seen[0] and seen[5] == {threading.current_thread().name}  # short: the caller's


def test_qwen4_wavefront_last_logits_and_greedy_continuation(qwen4, monkeypatch):
    """The default prefill (last position only), then greedy decode steps over each cache: the same tokens."""
    tokens = _tokens(3 * CHUNK, qc.VOCAB, qc.EOS, 1)
    runs = []
    for on in ("0", "1"):
        monkeypatch.setenv(wavefront.ENV, on)
        cache = qwen4.make_cache()
        logits, _ = prefill(qwen4, tokens, cache, CHUNK)
        out = [int(mx.argmax(logits[-1]))]
        for _ in range(8):
            step, _ = qwen4(mx.array([[out[-1]]]), cache)
            out.append(int(mx.argmax(step[0, -1])))
        runs.append((np.array(logits), out))
    assert runs[0][0].shape == runs[1][0].shape == (1, qc.VOCAB)
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=0, atol=1e-5 * np.abs(runs[0][0]).max())
    assert runs[0][1] == runs[1][1]


def test_qwen3_5_wavefront_equals_sequential_prefill(qwen3_5, monkeypatch):
    vocab = qwen3_5.args.vocab_size
    tokens = _tokens(4 * CHUNK + 3, vocab, 2, 2)
    seen = _lanes(qwen3_5, monkeypatch)
    seq, wave = _both(qwen3_5, tokens, monkeypatch, all_logits=True, mtp=True)
    _same(seq, wave)
    assert wavefront.LANE_THREAD in set().union(*seen.values())


def test_wavefront_applies_only_to_two_long_chunks_or_more(qwen4, monkeypatch):
    monkeypatch.setenv(wavefront.ENV, "1")
    assert wavefront.applies(qwen4, chunk_edges(0, 2 * CHUNK, CHUNK))
    assert not wavefront.applies(qwen4, chunk_edges(0, CHUNK + 16, CHUNK))  # the second chunk runs compiled steps
    assert not wavefront.applies(qwen4, chunk_edges(0, CHUNK, CHUNK))
    monkeypatch.setattr(wavefront.os, "sched_getaffinity", lambda pid: {0})  # `taskset -c 0`: one core to run on
    assert not wavefront.applies(qwen4, chunk_edges(0, 4 * CHUNK, CHUNK))
    monkeypatch.undo()
    monkeypatch.setenv(wavefront.ENV, "0")
    assert not wavefront.applies(qwen4, chunk_edges(0, 4 * CHUNK, CHUNK))


def test_chunk_edges_and_progress_as_the_sequential_prefill(qwen4, monkeypatch):
    """`on_chunk` (the prefix cache's checkpoints) sees at every edge n the cache as it stood at n, though the other
    lane has written the next chunk into the first layers already; it and `progress` run on the calling thread, in
    chunk order. A mark cuts a chunk in two, as it does sequentially."""
    tokens = _tokens(4 * CHUNK + 7, qc.VOCAB, qc.EOS, 3)
    runs = []
    for on in ("0", "1"):
        monkeypatch.setenv(wavefront.ENV, on)
        edges, done, threads = {}, [], set()

        def on_chunk(n, at, h):
            threads.add(threading.current_thread().name)
            edges[n] = ([c.offset for c in at], _rows(at), np.array(h))

        def progress(n, total):
            threads.add(threading.current_thread().name)
            done.append(n)

        prefill(qwen4, tokens, qwen4.make_cache(), CHUNK, mtp=True, on_chunk=on_chunk, progress=progress,
                marks=[2 * CHUNK + 9])
        assert threads == {threading.current_thread().name}
        runs.append((edges, done))
    (seq, seq_done), (wave, wave_done) = runs
    assert seq_done == wave_done == [CHUNK, 2 * CHUNK, 2 * CHUNK + 9, 3 * CHUNK, 4 * CHUNK, 4 * CHUNK + 7]
    assert list(seq) == list(wave) == [n for n in seq_done]
    for n, (offsets, arrays, h) in seq.items():
        w_offsets, w_arrays, w_h = wave[n]
        assert w_offsets == offsets and all(o == n for o in offsets[: len(qwen4.layers)])
        np.testing.assert_allclose(w_h, h, rtol=0, atol=1e-5 * np.abs(h).max())
        for x, y in zip(arrays, w_arrays, strict=True):
            np.testing.assert_allclose(y, x, rtol=0, atol=1e-5 * max(np.abs(x).max(), 1e-6))


def test_a_failing_report_stops_both_lanes(qwen4, monkeypatch):
    """A progress callback that raises (a cancelled request) stops the prefill with its error."""
    monkeypatch.setenv(wavefront.ENV, "1")

    def progress(n, total):
        if n > CHUNK:
            raise KeyboardInterrupt("cancelled")

    with pytest.raises(KeyboardInterrupt, match="cancelled"):
        prefill(qwen4, _tokens(6 * CHUNK, qc.VOCAB, qc.EOS, 5), qwen4.make_cache(), CHUNK, progress=progress)


def test_a_failing_lane_raises_on_the_caller(qwen4, monkeypatch):
    """An error in the second lane's chunk reaches the caller; the first lane does not wait forever."""
    monkeypatch.setenv(wavefront.ENV, "1")
    backbone = qwen4.model
    inner = type(backbone).run_layer

    def run_layer(self, i, h, ctx, cache):
        if threading.current_thread().name == wavefront.LANE_THREAD and i == 1:
            raise RuntimeError("lane broke")
        return inner(self, i, h, ctx, cache)

    monkeypatch.setattr(type(backbone), "run_layer", run_layer)
    with pytest.raises(RuntimeError, match="lane broke"):
        prefill(qwen4, _tokens(4 * CHUNK, qc.VOCAB, qc.EOS, 4), qwen4.make_cache(), CHUNK)


def test_the_second_lane_is_one_thread_for_the_process(qwen4, monkeypatch):
    """Every wavefront reuses the same lane thread (a new MLX stream per prefill would leave a thread behind each
    time), and MKL's thread count is back where it was after each."""
    import os

    from hetero.host import blas

    monkeypatch.setenv(wavefront.ENV, "1")
    tokens = _tokens(3 * CHUNK, qc.VOCAB, qc.EOS, 6)
    prefill(qwen4, tokens, qwen4.make_cache(), CHUNK)
    threads = len(os.listdir("/proc/self/task"))
    mkl = blas._state.handle.MKL_Get_Max_Threads() if blas._state.kind == "mkl" else None
    for _ in range(4):
        prefill(qwen4, tokens, qwen4.make_cache(), CHUNK)
    assert len(os.listdir("/proc/self/task")) == threads
    assert [t.name for t in threading.enumerate()].count(wavefront.LANE_THREAD) == 1
    if mkl is not None:
        assert blas._state.handle.MKL_Get_Max_Threads() == mkl


def test_a_lazy_restored_prefix_continues_on_both_lanes(qwen4, monkeypatch):
    """A prefix restored into the cache (the prefix or session cache's arrays, still lazy on the calling thread's
    stream, which the other lane cannot evaluate) continues by wavefront to the sequential run's result."""
    tokens = _tokens(5 * CHUNK, qc.VOCAB, qc.EOS, 7)
    runs = []
    for on in ("0", "1"):
        monkeypatch.setenv(wavefront.ENV, "0")
        cache = qwen4.make_cache()
        _, carry = prefill(qwen4, tokens[:CHUNK], cache, CHUNK, mtp=True)
        for c in cache:  # as a restore leaves them: lazy copies built on this thread
            if isinstance(c, KVCache):
                c.install([c.rows(0, c.offset)])
            else:
                c.conv, c.recurrent = c.conv * 1.0, c.recurrent * 1.0
        monkeypatch.setenv(wavefront.ENV, on)
        logits, _ = prefill(qwen4, tokens[CHUNK:], cache, CHUNK, mtp=True, carry=carry * 1.0, all_logits=True)
        runs.append((np.array(logits), _rows(cache)))
    (a, ca), (b, cb) = runs
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.abs(a).max())
    for x, y in zip(ca, cb, strict=True):
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-5 * max(np.abs(x).max(), 1e-6))


class Pauses:
    """A `Pause` that is always wanted and records, at each call, which layer jobs were in flight then."""

    def __init__(self, model, monkeypatch) -> None:
        self.active, self.calls, self.lock = 0, [], threading.Lock()
        inner = type(model.model).run_layer

        def run_layer(backbone, i, h, ctx, cache):
            with self.lock:
                self.active += 1
            try:
                return inner(backbone, i, h, ctx, cache)
            finally:
                with self.lock:
                    self.active -= 1

        monkeypatch.setattr(type(model.model), "run_layer", run_layer)

    def wanted(self) -> bool:
        return True

    def __call__(self, prefilling: bool = False) -> None:
        assert prefilling
        self.calls.append((self.active, threading.current_thread().name))


@pytest.mark.parametrize("n", [2 * CHUNK + 20, 5 * CHUNK + 7])
def test_a_pause_runs_only_where_neither_lane_holds_work(qwen4, monkeypatch, n):
    """With another job always waiting, the wavefront gives the model away between segments only: each pause runs
    on the calling thread with no layer job in flight on either lane (and outside any lane job, so it may pass the
    turn), the reports still come in chunk order before it, and the result is the sequential prefill's."""
    from hetero.decode.prefill import Progress

    tokens = _tokens(n, qc.VOCAB, qc.EOS, 8)
    edges = chunk_edges(0, n, CHUNK)
    seq = _both(qwen4, tokens, monkeypatch, mtp=True)[0]
    monkeypatch.setenv(wavefront.ENV, "1")
    pauses = Pauses(qwen4, monkeypatch)
    done: list[int] = []
    cache = qwen4.make_cache()
    logits, hidden = prefill(qwen4, tokens, cache, CHUNK, mtp=True,
                             progress=Progress(lambda k, total: done.append(k), pauses))
    assert done == edges[1:]
    assert pauses.calls and all(c == (0, threading.current_thread().name) for c in pauses.calls)
    _same(seq, (np.array(logits), np.array(hidden), [np.array(a) for a in cache_arrays(cache)]))


def test_two_prefills_taking_turns_both_end(qwen3_5, monkeypatch):
    """The server's OpenCode stall, on the library's own parts: two prompts of several chunks each prefill on two
    threads by wavefront, taking turns on the model (`Turns`) between chunks. Before, the first job passed its turn
    from inside its wavefront while its chunk held the shared second lane; the second job, holding the turn, waited
    for that lane: neither could go on. Now both end, each with its solo result."""
    from hetero.decode.prefill import Progress
    from hetero.decode.turns import Turn, Turns

    monkeypatch.setenv(wavefront.ENV, "1")
    prompts = [_tokens(n, 256, 1, seed) for n, seed in ((3 * CHUNK + 5, 9), (6 * CHUNK, 10))]
    solo = [np.array(prefill(qwen3_5, p, qwen3_5.make_cache(), CHUNK)[0]) for p in prompts]
    turns, out, errors = Turns(), {}, []

    def job(i: int) -> None:
        try:
            turns.enter(i)
            try:
                progress = Progress(lambda k, total: None, Turn(turns, i))
                out[i] = np.array(prefill(qwen3_5, prompts[i], qwen3_5.make_cache(), CHUNK, progress=progress)[0])
            finally:
                turns.leave(i)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=job, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "the two prefills wait on each other"
    assert not errors and turns.handovers > 0  # they did take turns
    for i in (0, 1):
        np.testing.assert_allclose(out[i], solo[i], rtol=0, atol=1e-5 * np.abs(solo[i]).max())
