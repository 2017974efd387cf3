"""Concurrent requests never stall (tests/stress.py, tests/stress_checks.py; the long run is bench/stress.py): a real
`hetero serve` process on the bundled model, real SDK clients on loopback.

- The OpenCode pattern, the stall users met: a streamed chat of ~1,300 tokens (max_tokens 8), and 0.33 s later a
  streamed chat of ~4K tokens (16K in bench/stress.py). Before, the server deadlocked (the first request's prefill
  passed its turn from inside its wavefront while its chunk held the shared second lane, which the second request,
  holding the turn, waited for). Now both end, and the first is never made to wait for the second.
- A short storm per setting (wavefront on and off, --max-batch 1 and 4, the ANE split on and off): every client at
  once, the four APIs streamed and whole, some hanging up mid-stream, some sending garbage; every call checked
  against its bound, its solo answer and the server's own /health and /metrics.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from stress import Call, Server, Setting, draw, send, solo, storm
from stress_checks import Monitor, agree, bound, judge, scrape

TITLE_TOKENS, MAIN_TOKENS, GAP_S = 1300, 4000, 0.33  # (bench/stress.py --opencode: 16K, 50 times)


def _chat(index: int, tokens: int, seed: int) -> Call:
    return Call(index, index, "chat", True, tokens, 8, "answer", 0.0, seed)


def test_opencode_title_then_long_prompt_never_stalls(tmp_path: Path):
    """128-token chunks: each prompt is many chunks, so the first one's prefill is still in flight when the second
    arrives (with 512-token chunks the old code stalled only when the machine was slow enough). bench/stress.py
    --opencode runs it 50 times in a row with the default chunks."""
    setting = Setting("128-token chunks", prefill_chunk=128)
    with Server(setting, tmp_path / "serve.log") as server:
        alone = solo(server, [_chat(0, TITLE_TOKENS, 1), _chat(1, MAIN_TOKENS, 2)])  # each call's own work W
        calls = [_chat(0, TITLE_TOKENS, 10), _chat(1, MAIN_TOKENS, 20)]  # new prompts: nothing cached
        results = {}

        def go(call: Call) -> None:
            results[call.index] = send(server.url, server.model, call, timeout=60)

        title = threading.Thread(target=go, args=(calls[0],))
        title.start()
        threading.Event().wait(GAP_S)
        go(calls[1])
        title.join()
    t, m = results[0], results[1]
    assert t.status == 200 and m.status == 200, (t.error, m.error)
    assert t.ended < m.ended  # the title is not made to wait for the request sent after it
    assert t.latency <= bound(calls[0], calls, results, alone, setting.prefill_chunk)
    assert t.completion_tokens == 8 and m.completion_tokens == 8


SETTINGS = [
    Setting("wavefront, batch 4", max_batch=4, wavefront=True, prefill_chunk=64, prefix_cache_gb=0),
    Setting("no wavefront, batch 1", max_batch=1, wavefront=False, prefill_chunk=64, prefix_cache_gb=0),
    # (128-token chunks: fewer context buckets, so fewer ANE programs to export on first use)
    Setting("split 0.5, batch 4", max_batch=4, wavefront=True, ane_fraction=0.5, prefill_chunk=128, prefix_cache_gb=0),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_a_short_storm_never_stalls_and_answers_as_alone(setting: Setting, tmp_path: Path):
    calls = draw(seed=47, calls=14, clients=5, max_tokens_prompt=400, max_gap=0.3, cancel=0.15, garbage=0.2,
                 max_new=8)
    assert {c.action for c in calls} == {"answer", "cancel", "garbage"}
    with Server(setting, tmp_path / "serve.log") as server:  # no prefix cache: the storm's prompts are the solo ones
        alone = solo(server, calls)
        before = scrape(server.url)
        monitor = Monitor(server, setting, every=0.2)
        results = storm(server, calls, timeout=120)
        monitor.stop()
        mismatch = agree(server, calls, results, alone, before)
        after = scrape(server.url)[0]
    report = judge(setting, calls, results, alone)
    assert not report["failures"], report["failures"]
    assert not monitor.problems and monitor.reads > 0, monitor.problems
    assert not mismatch, mismatch
    # the storm did what its setting names: requests took turns, decoded in a shared batch, prefilled split
    ran = {k: after["requests"][k] - before[0]["requests"][k] for k in ("turn_handovers", "split_prefills")}
    assert ran["turn_handovers"] > 0
    assert (after["batch"] or {}).get("rounds", 0) > (before[0]["batch"] or {}).get("rounds", 0) or setting.max_batch == 1
    assert (ran["split_prefills"] > 0) == (setting.ane_fraction is not None)
