"""What GET /metrics costs `hetero serve` under load: 64 clients on loopback against the bundled model, with and
without a scraper hitting /metrics back to back, and the scrape's own latency idle and under that load.

    python bench/metrics_scrape.py                  # 64 clients x 1 request of 16 tokens per phase
    python bench/metrics_scrape.py --clients 32 --requests 4

Phases, after a warm-up round: the load alone (first and last, their mean the reference); with a scraper on /metrics back to back; the same scraper on /health (a small JSON page on
the same event loop: the baseline, in the same run); a scraper on /metrics every second. In each, every client
sends `--requests` chat completions one after another (max_tokens `--max-tokens`, EOS held back with logit_bias so
every reply has the same length); the phase's wall time gives the served tokens per second, and the scraper's
latencies are its page's under that load. Everything is bounded (a fixed number of requests and scrapes), and the server
is stopped with SIGTERM at the end. JSON to bench/results/metrics_scrape.json; the exit code does not depend on the
figures.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
NO_EOS = {"0": -100, "2": -100}  # the bundled model's EOS ids
IDLE_SCRAPES = 200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, home: str) -> subprocess.Popen:
    env = {**__import__("os").environ, "HETERO_HOME": home}
    proc = subprocess.Popen([sys.executable, "-m", "hetero", "serve", "--port", str(port), "--no-session-cache",
                             "--draft-depth", "2"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"hetero serve exited with status {proc.returncode} before it was ready")
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("hetero serve was not ready within 120 s")


def latencies(url: str, n: int, stop: threading.Event | None = None, interval: float = 0.0) -> list[float]:
    """Seconds of up to `n` GETs of `url`, `interval` seconds apart (0: back to back), fewer once `stop` is set."""
    out = []
    with httpx.Client(timeout=60) as c:
        for _ in range(n):
            if stop is not None and (stop.wait(interval) if interval else stop.is_set()):
                break
            t0 = time.perf_counter()
            r = c.get(url)
            out.append(time.perf_counter() - t0)
            r.raise_for_status()
    return out


def load(base: str, clients: int, requests: int, max_tokens: int, page: str | None = None,
         interval: float = 0.0) -> dict:
    """One phase: `clients` threads of `requests` chat completions each, with a scraper of `page` (every
    `interval` seconds, 0: back to back) alongside unless None."""
    tokens, failures = [0] * clients, [0]
    stop = threading.Event()

    def client(i: int) -> None:
        with httpx.Client(timeout=600) as c:
            for j in range(requests):
                r = c.post(base + "/v1/chat/completions", json={
                    "model": "bundled", "max_tokens": max_tokens, "logit_bias": NO_EOS,
                    "messages": [{"role": "user", "content": f"client {i} request {j}: tell me about metrics"}]})
                if r.status_code != 200:
                    failures[0] += 1
                    continue
                tokens[i] += r.json()["usage"]["completion_tokens"]

    scrapes: list[float] = []
    scraper = threading.Thread(target=lambda: scrapes.extend(latencies(base + (page or ""), 100_000, stop, interval)))
    workers = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    if page:
        scraper.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    stop.set()
    if page:
        scraper.join()
    out = {"scraper": page, "interval_s": interval if page else None, "wall_s": round(wall, 3),
           "tokens": sum(tokens), "failures": failures[0], "tokens_per_s": round(sum(tokens) / wall, 2)}
    if page:
        out.update(scrapes=len(scrapes), **summary("scrape", scrapes))
    return out


def summary(name: str, xs: list[float]) -> dict:
    xs = sorted(xs)
    return {f"{name}_median_ms": round(1000 * statistics.median(xs), 3),
            f"{name}_p99_ms": round(1000 * xs[min(len(xs) - 1, int(0.99 * len(xs)))], 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=1, help="requests per client per phase")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "metrics_scrape.json")
    a = ap.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as home:
        proc = start_server(port, home)
        try:
            idle = {**summary("metrics_idle", latencies(base + "/metrics", IDLE_SCRAPES)),
                    **summary("health_idle", latencies(base + "/health", IDLE_SCRAPES))}
            run = lambda page=None, interval=0.0: load(base, a.clients, a.requests, a.max_tokens, page, interval)  # noqa: E731
            run()  # warm-up: compiled steps, the batch loop's thread, the first prefills
            phases = {"no scraper": run(), "/metrics back to back": run("/metrics"),
                      "/health back to back": run("/health"), "/metrics every 1 s": run("/metrics", 1.0),
                      "no scraper, again": run()}
            size = len(httpx.get(base + "/metrics").content)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)

    tps = {k: p["tokens_per_s"] for k, p in phases.items()}
    alone = (tps["no scraper"] + tps["no scraper, again"]) / 2  # first and last: drift falls on both sides
    result = {
        "clients": a.clients, "requests_per_client": a.requests, "max_tokens": a.max_tokens,
        "metrics_bytes": size, **idle, "phases": phases,
        "tokens_per_s_no_scraper": round(alone, 2),
        "throughput_vs_no_scraper": {k: round(v / alone, 4) for k, v in tps.items()},
        "metrics_vs_health_back_to_back": round(tps["/metrics back to back"] / tps["/health back to back"], 4),
        "note": "back to back: a scraper far busier than any Prometheus interval, against the same scraper on /health "
                "(a small JSON page on the same event loop) as the baseline; every 1 s: a busy Prometheus",
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "phases"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
