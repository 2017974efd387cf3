"""What a stress run (tests/stress.py) must show, checked per call and over the server's own reports.

Per call (`judge`):
- no 5xx, ever; garbage gets the 4xx it names; an answer equals its solo answer (a cancelled call excepted);
- it ends within `bound`: its own work W (its solo latency), plus the work queued ahead of it (calls sent before it
  and not done when it was sent), plus, of each call sent after it while it ran, at most a bounded share:
  `LATER_SHARE` times its own work plus one unit of that call (two prefill chunks), or that call's whole work if
  smaller; all times `SLACK_FACTOR`, plus `SLACK_S`. So a call may share the model with later ones, but a call that
  waited for one sent after it (or for nothing: a stall) breaks its bound.
Over the run (`Monitor`, then `agree`): /health and /metrics answer within `HEALTH_S` throughout, their counters
never go back, their gauges stay within the server's limits, and once the server is idle they agree with what the
clients saw (requests finished and cancelled, prompt and generated tokens).
"""

from __future__ import annotations

import statistics
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from stress import GARBAGE, Call, Result, Server, Setting

LATER_SHARE = 4.0  # decode_share / (1 - decode_share) at the default 0.8: what a senior call may take of a junior's time
SLACK_FACTOR = 2.0  # solo latencies are measured one at a time on a shared machine, against a server under load
SLACK_S = 1.0
HEALTH_S = 2.0  # /health and /metrics answer within this, however busy the model is
COUNTERS = ("finished", "cancelled", "turn_handovers", "split_prefills")
METRIC_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                   "vllm:e2e_request_latency_seconds_count", "hetero:requests_cancelled_total")


def scrape(url: str, timeout: float = HEALTH_S) -> tuple[dict, dict[str, float]]:
    """(/health's JSON, /metrics' samples summed over their labels)."""
    health = httpx.get(url + "/health", timeout=timeout).json()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=timeout).text):
        for s in family.samples:
            samples[s.name] = samples.get(s.name, 0.0) + s.value
    return health, samples


class Monitor:
    """Reads /health and /metrics every `every` s on its own thread while a storm runs; `problems` lists what was
    wrong (a slow or failed answer, a counter that went back, a gauge past its limit)."""

    def __init__(self, server: Server, setting: Setting, every: float = 0.5) -> None:
        self.server, self.setting, self.every = server, setting, every
        self.problems: list[str] = []
        self.reads = 0
        self.slowest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        last: dict[str, float] = {}
        workers = max(self.setting.max_concurrent, self.setting.max_batch)
        while not self._stop.wait(self.every):
            t = time.perf_counter()
            try:
                health, m = scrape(self.server.url)
            except (httpx.HTTPError, ValueError) as e:
                self.problems.append(f"/health or /metrics failed: {type(e).__name__}: {e}")
                continue
            took = time.perf_counter() - t
            self.reads, self.slowest = self.reads + 1, max(self.slowest, took)
            if took > HEALTH_S:
                self.problems.append(f"/health and /metrics took {took:.2f} s")
            now = {k: float(health["requests"][k]) for k in COUNTERS}
            now.update({k: m.get(k, 0.0) for k in METRIC_COUNTERS})
            for k, v in now.items():
                if v < last.get(k, 0.0):
                    self.problems.append(f"{k} went back from {last[k]} to {v}")
            last = now
            running, waiting = m.get("vllm:num_requests_running", 0), m.get("vllm:num_requests_waiting", 0)
            batch = (health.get("batch") or {}).get("batch_size", 0)
            if not 0 <= running <= workers or waiting < 0 or not 0 <= batch <= self.setting.max_batch:
                self.problems.append(f"gauges out of range: running {running}, waiting {waiting}, batch {batch}")


def agree(server: Server, calls: list[Call], results: dict[int, Result], alone: dict[int, Result],
          before: tuple[dict, dict[str, float]], wait_s: float = 30.0) -> list[str]:
    """Once the server is idle: what /health and /metrics counted since `before` (a `scrape` taken before the storm)
    against the clients' own counts."""
    deadline = time.time() + wait_s
    while True:
        health, m = scrape(server.url, timeout=10)
        idle = m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0
        if idle or time.time() > deadline:
            break
        time.sleep(0.2)
    m = {k: v - before[1].get(k, 0.0) if k.endswith(("_total", "_count")) else v for k, v in m.items()}
    answered = [c for c in calls if c.action == "answer" and results[c.index].status == 200]
    cancels = [c for c in calls if c.action == "cancel" and results[c.index].status == 200]
    finished = health["requests"]["finished"] - before[0]["requests"]["finished"]
    cancelled = health["requests"]["cancelled"] - before[0]["requests"]["cancelled"]
    problems = [] if idle else ["the server did not go idle after the storm"]
    if finished + cancelled != len(answered) + len(cancels) or finished < len(answered):
        problems.append(f"/health: {finished} finished + {cancelled} cancelled, the clients: {len(answered)} answered "
                        f"+ {len(cancels)} hung up")
    if m.get("vllm:request_success_total", 0) != finished or m.get("vllm:e2e_request_latency_seconds_count") != finished:
        problems.append(f"/metrics' finished requests {m.get('vllm:request_success_total')} != /health's {finished}")
    if m.get("hetero:requests_cancelled_total", 0) != cancelled:
        problems.append(f"/metrics' cancelled {m.get('hetero:requests_cancelled_total')} != /health's {cancelled}")
    for name, mine, extra in (("prompt", "prompt_tokens", "prompt_tokens"),
                              ("generation", "completion_tokens", "completion_tokens")):
        low = sum(getattr(results[c.index], mine) or 0 for c in answered)
        high = low + sum(getattr(alone[c.index], extra) or 0 for c in cancels)
        total = m.get(f"vllm:{name}_tokens_total", 0)
        exact = finished == len(answered)  # no hung-up call finished: the totals are the clients' own
        if not (total == low if exact else low <= total <= high):
            problems.append(f"/metrics' {name} tokens {total:.0f}: the clients' answers say {low}"
                            + ("" if exact else f" to {high}"))
    return problems


def bound(c: Call, calls: list[Call], results: dict[int, Result], alone: dict[int, Result], chunk: int) -> float:
    """The latest a call may end, in seconds after it was sent (module docstring)."""
    def work(j: Call) -> float:
        return 0.0 if j.action == "garbage" else alone[j.index].latency or 0.0

    def unit(j: Call) -> float:  # two prefill chunks of j's, or the whole of it
        return 0.0 if j.action == "garbage" else work(j) * min(1.0, 2 * chunk / (alone[j.index].prompt_tokens or j.tokens))

    me = results[c.index]
    if c.action == "garbage":
        return HEALTH_S + SLACK_S
    end = me.ended if me.ended is not None else float("inf")
    ahead = later = 0.0
    for j in calls:
        rj = results.get(j.index)
        if j is c or rj is None:
            continue
        if rj.sent < me.sent and (rj.ended is None or rj.ended > me.sent):
            ahead += work(j)
        elif me.sent < rj.sent < end:
            later += min(work(j), LATER_SHARE * work(c) + unit(j))
    return SLACK_S + SLACK_FACTOR * (work(c) + ahead + later)


def judge(setting: Setting, calls: list[Call], results: dict[int, Result], alone: dict[int, Result]) -> dict:
    """Every call checked (module docstring): the per-call rows, the failures, and the summary figures."""
    rows, failures = [], []
    for c in calls:
        r = results.get(c.index) or Result(c.index)
        b = bound(c, calls, results, alone, setting.prefill_chunk)
        want = GARBAGE[c.garbage][3] if c.action == "garbage" else 200
        solo = alone.get(c.index)
        if c.action == "answer" and solo is not None and solo.status is not None and 400 <= solo.status < 500:
            want = solo.status  # refused alone (a drawn prompt past the context window): refused the same way
        same = c.action != "answer" or r.text == alone[c.index].text
        row = {"index": c.index, "kind": c.kind + (" stream" if c.stream else ""), "action": c.action,
               "prompt_tokens": r.prompt_tokens, "status": r.status, "latency_s": _r(r.latency), "bound_s": _r(b),
               "solo_s": _r(alone[c.index].latency) if c.index in alone else None, "equal_to_solo": same,
               "refused_alone": c.action == "answer" and want != 200}
        rows.append(row)
        if r.status is None:
            failures.append(f"call {c.index} ({row['kind']}, {c.action}) has no answer: {r.error}")
        elif r.status >= 500:
            failures.append(f"call {c.index} ({row['kind']}) got a {r.status}: {r.error or r.text}")
        elif r.status != want:
            failures.append(f"call {c.index} ({row['kind']}, {c.action}) got a {r.status}, not a {want}: "
                            f"{r.error or r.text}")
        if not same:
            failures.append(f"call {c.index} ({row['kind']}) answered {r.text!r}, alone {alone[c.index].text!r}")
        if r.latency is not None and r.latency > b:
            failures.append(f"call {c.index} ({row['kind']}) took {r.latency:.2f} s, past its bound {b:.2f} s")
    return {"setting": setting.name, "calls": len(calls), "failures": failures, "summary": summary(rows), "rows": rows}


def summary(rows: list[dict]) -> dict:
    """Stalls, 5xx, answers unlike solo, the worst wait against its bound, p50/p99 latency per kind."""
    done = [r for r in rows if r["latency_s"] is not None]
    worst = max(done, key=lambda r: r["latency_s"] / r["bound_s"], default=None)
    kinds: dict[str, list[float]] = {}
    for r in done:
        if r["action"] == "answer":
            kinds.setdefault(r["kind"], []).append(r["latency_s"])
    return {
        "stalls": sum(r["latency_s"] is None or r["latency_s"] > r["bound_s"] for r in rows),
        "status_5xx": sum((r["status"] or 0) >= 500 for r in rows),
        "unequal_to_solo": sum(not r["equal_to_solo"] for r in rows),
        "refused_alone_and_in_the_storm": sum(r.get("refused_alone", False) for r in rows),
        "worst_wait": None if worst is None else {k: worst[k] for k in ("index", "kind", "latency_s", "bound_s")}
        | {"ratio": _r(worst["latency_s"] / worst["bound_s"])},
        "latency_s": {k: {"n": len(v), "p50": _r(_pct(v, 50)), "p99": _r(_pct(v, 99))} for k, v in sorted(kinds.items())},
    }


def _pct(values: list[float], p: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1] if len(values) > 1 else values[0]


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
