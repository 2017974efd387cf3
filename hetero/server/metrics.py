"""GET /metrics: what the server is doing, in Prometheus' text format (`prometheus_client`).

Each server has its own `CollectorRegistry` (never the process-wide one: several servers in one process, as in the
tests, count apart). Two kinds of series:
- per request, updated when a job finishes (`Metrics.observe`, the runner's `on_outcome`): token counters, the
  time histograms, MTP's drafted and accepted tokens;
- read at scrape time from the counters the server already keeps for /health (`_Live`): requests running and
  waiting, the prefix and session caches, the decode batch, the ANE lane.
Names are vLLM's where the meaning is the same (`vllm:num_requests_running`, `vllm:prompt_tokens_total`, ...), so
dashboards made for vLLM read them; what vLLM has no series for is under `hetero:`. Every series carries the served
model's name as `model_name`, as vLLM's do.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hetero.engine import Engine
from hetero.server.runner import Outcome, Runner, Timing

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0, 640.0, 2560.0)  # seconds: a decode step to a long agent prompt's prefill
TOKEN_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5)  # seconds per output token


class Metrics:
    """The /metrics registry of one server: `runner`'s and `engine`'s live counters plus what `observe` adds up."""

    def __init__(self, engine: Engine, runner: Runner, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, label = self.registry, ["model_name"]

        def counter(name: str, doc: str, labels: list[str] = label) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=r)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.cached_tokens = counter("vllm:prompt_tokens_cached",
                                     "Prompt tokens of finished requests restored from the prefix or session cache.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens of finished requests.")
        self.success = counter("vllm:request_success", "Finished requests, by finish reason (stop, length).",
                               label + ["finished_reason"])
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first generated text.", LATENCY_BUCKETS)
        self.per_token = histogram("vllm:request_time_per_output_token_seconds",
                                   "A request's mean seconds per output token after the first.", TOKEN_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Seconds from a request's arrival to its end.",
                             LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Seconds a request waited for a worker (past --max-concurrent).", LATENCY_BUCKETS)
        self.drafts = counter("vllm:spec_decode_num_drafts", "MTP draft rounds (verify passes that checked drafts).")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Tokens the MTP head drafted.")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Drafted tokens the verify pass accepted.")
        self.accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Drafted tokens accepted at each draft position (0 = the first).",
                                        label + ["position"])
        self.verify_passes = counter("hetero:mtp_verify_passes",
                                     "Speculative decode passes (tokens per pass = hetero:mtp_emitted_tokens_total / "
                                     "this).")
        self.emitted = counter("hetero:mtp_emitted_tokens", "Tokens emitted by speculative decode passes.")
        for c in (self.prompt_tokens, self.cached_tokens, self.generation_tokens, self.drafts, self.draft_tokens,
                  self.accepted, self.verify_passes, self.emitted):
            c.labels(model_name)  # present (at 0) before the first request, as Prometheus' rate() wants
        r.register(_Live(engine, runner, model_name))

    def observe(self, o: Outcome, t: Timing) -> None:
        """Add one finished request (on its worker thread: prometheus_client's metrics are thread-safe)."""
        name = self.model_name
        prompt, cached, generated = o.usage
        self.prompt_tokens.labels(name).inc(prompt)
        self.cached_tokens.labels(name).inc(cached)
        self.generation_tokens.labels(name).inc(generated)
        self.success.labels(name, o.finish).inc()
        self.e2e.labels(name).observe(t.end - t.submitted)
        self.queue.labels(name).observe(t.started - t.submitted)
        if t.first_text is not None:
            self.ttft.labels(name).observe(t.first_text - t.submitted)
            if generated > 1:
                self.per_token.labels(name).observe((t.end - t.first_text) / (generated - 1))
        mtp = o.stats.get("mtp") or {}  # (MTPStats.to_dict's raw counts)
        accepted = mtp.get("accepted_by_depth", [])
        self.drafts.labels(name).inc(mtp.get("mtp_rounds", 0))
        self.draft_tokens.labels(name).inc(sum(mtp.get("drafted_by_depth", [])))
        self.accepted.labels(name).inc(sum(accepted))
        for i, n in enumerate(accepted):
            self.accepted_per_pos.labels(name, str(i)).inc(n)
        self.verify_passes.labels(name).inc(mtp.get("rounds", 0))
        self.emitted.labels(name).inc(mtp.get("emitted", 0))

    def text(self) -> bytes:
        """The exposition text of every series."""
        return generate_latest(self.registry)


class _Live(Collector):
    """The series read at scrape time from what the server keeps anyway (the counters /health reports)."""

    def __init__(self, engine: Engine, runner: Runner, model_name: str):
        self.engine, self.runner, self.model_name = engine, runner, model_name

    def collect(self) -> Iterator[Metric]:
        runner, name = self.runner, [self.model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric(name, value)
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric(name, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests on a worker: generating, or waiting for their turn on "
                    "the model.", runner.running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting for a worker (past --max-concurrent).",
                    runner.waiting)
        yield counter("hetero:requests_cancelled", "Requests stopped because their client went away.",
                      runner.cancelled)
        pc = self.engine.prefix_cache
        if pc is not None:
            yield counter("hetero:prefix_cache_hits", "Prompts that resumed from a cached prefix (RAM or disk).",
                          pc.hits)
            yield counter("hetero:prefix_cache_misses", "Prompts with no cached prefix.", pc.misses)
            yield gauge("hetero:prefix_cache_bytes", "Bytes the RAM prefix cache holds.", pc.nbytes)
            yield gauge("hetero:prefix_cache_max_bytes", "The RAM prefix cache's limit (--prefix-cache-max-gb).",
                        pc.max_bytes)
            store = pc.store
            if store is not None:
                yield counter("hetero:session_cache_hits", "Prompts that resumed from an entry of the disk session "
                              "cache.", pc.disk_hits)
                yield gauge("hetero:session_cache_bytes", "Bytes the disk session cache holds.", store.nbytes)
                yield gauge("hetero:session_cache_entries", "Entries in the disk session cache.", len(store.entries))
        loop = runner.loop
        if loop is not None:
            yield gauge("hetero:decode_batch_size", "Requests in the shared decode pass now.", len(loop.batch.rows))
            yield gauge("hetero:decode_batch_max", "The most requests a decode pass shares (--max-batch).",
                        loop.max_batch)
            yield counter("hetero:decode_batch_rounds", "Batched decode rounds run.", loop.rounds)
            yield counter("hetero:decode_batch_rows", "Request rows over all batched decode rounds (mean batch size "
                          "= this / hetero:decode_batch_rounds_total).", loop.rows_total)
        split = runner.split
        if split is not None:
            yield counter("hetero:ane_prefills", "Prompts prefilled through the ANE + GPU split.",
                          runner.split_prefills)
            yield counter("hetero:ane_lane_failures", "Prompts whose ANE worker was lost (prefilled GPU-only "
                          "instead).", split.lane_failures)
            yield counter("hetero:ane_busy_seconds", "Seconds the ANE lane spent computing.", runner.ane_busy_s)
