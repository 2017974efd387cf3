"""What the layers above the decode step cost: the bare step loop against every path a user's tokens take.

    python bench/overhead.py                                  # bundled model, the machine's threads
    python bench/overhead.py --threads 1 --out bench/results/overhead_1thread.json
    python bench/overhead.py --models bundled large           # bench/checkpoints.py's random large model too
    python bench/overhead.py --tokens 16 --rounds 1 --concurrency 2   # a smoke run

In one run, for plain decoding and MTP at --depth (the copy lane on, as `hetero run` and `hetero serve` decode),
greedy, EOS ignored (the engine's `eos_ids` emptied), --tokens tokens after each of three short code prompts:
  step_loop     the bare compiled step loop: the model's forward and an argmax per token, the next step queued
                with `mx.async_eval` before this token is read (mlx-lm's loop); for MTP the stepper's own loop
                (`Batch.step` on one row), the innermost MTP loop there is. A fair floor for plain decoding: it
                reads every token id from MLX (what a stop check needs), queues its first step before it reads
                the prefill's token and no step past its last token, as `decode_tokens` does; what it skips (the
                EOS and length checks, the sampler object, the row's times) is microseconds a token;
  decode_tokens `hetero.decode.solo.decode_tokens`, the generator every engine path wraps;
  stream        `Engine.stream`: the events a library user reads, text detokenized;
  generate      `Engine.generate` with an `on_text` callback (`should_stop` polled per token, as the server does);
  serve         one streamed request through `hetero serve`'s app (uvicorn, its own process, loopback), the SSE
                read by an httpx client in this process;
  serve_xN      N concurrent streamed requests (--concurrency), the aggregate;
  batch_xN      the stepper alone with N rows (`Batch.step`), the aggregate, for the batched rows.
Each run starts SETTLE_S after the last one (the idle process's BLAS threads spin for a while after their work).
Decode tok/s counts the tokens after the first over the time from the first token's arrival to the last one's
(the aggregate rows: all requests' tokens after their first, from the earliest first token to the latest last
one). The server streams text, not tokens: each SSE piece is counted as the tokens its text needed (its token
index in the step loop's greedy tokens, detokenized as the engine does), since a token often decodes to no text
alone (a multibyte character split across tokens; about half the random large model's tokens): counting pieces
as tokens read its server at half speed. Layers alternate within each round, each prompt once per layer per
round; reported: medians over rounds and prompts, and each layer's ratio to the step loop of the same mode, both
as the ratio of the medians and as the median (with the interquartile range) of each run's ratio to the step loop's
run of the same round and prompt, a few seconds earlier (the machine's slow spells then touch both sides of a ratio).
The in-process layers also report their calling thread's CPU time over their tokens (the same prompt's prefill
included in each): the host work on the path, as noisy as the rates.
Every layer's tokens must equal the step loop's (the server's text the step loop's text); the run exits with
status 1 after writing its JSON otherwise.
The BLAS and its threads are recorded (hetero.host.environment); the server process inherits them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [  # short code prompts: what the run decoded after
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import json\n\n\ndef load_config(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def quicksort(xs):\n",
    "fn main() {\n    let v = vec![1, 2, 3];\n",
    "SELECT name, count(*) FROM users\n",
    "#include <stdio.h>\n\nint main(void) {\n",
    "async function fetchJson(url) {\n",
]

# Intel OpenMP's threads spin for 200 ms (KMP_BLOCKTIME) after their last parallel region: the bench process and the
# server process alternate, so each run starts once the other's threads are asleep, not sharing the cores with them
SETTLE_S = 0.3

SERVER = """
import hetero  # first: the BLAS under MLX
import sys
import mlx.core as mx
import uvicorn
from hetero.engine import load
from hetero.server.app import ServerSettings, create_app
path, port, depth, batch = sys.argv[1] or None, int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
engine = load(path, dtype=mx.float32)
engine.eos_ids = set()  # EOS ignored, as every other layer of the bench
app = create_app(engine, ServerSettings(port=port, max_batch=batch, max_concurrent=batch, draft_depth=depth,
                                        no_session_cache=True))
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
"""


# the layers that run in this process: their calling thread's CPU time per token is the host work on the path
# (graph building, MLX's scheduling of it, its waits' wake-ups, and every Python line around the step); it swings
# with the machine as tok/s does (by a third between runs of one process here), so it is context, not a figure to
# rank layers by
IN_PROCESS = ("step_loop", "decode_tokens", "stream", "generate")


def spread(runs: list[float], base: list[float]) -> tuple[float, float]:
    """The interquartile range of a layer's run-by-run ratios to the step loop's run of the same round and prompt."""
    q = statistics.quantiles([a / b for a, b in zip(runs, base)], n=4)
    return q[0], q[2]


def tps(times: list[float]) -> float:
    """Decode tok/s from each token's arrival time: the tokens after the first over the span."""
    return (len(times) - 1) / (times[-1] - times[0])


class Layers:
    """Each layer of one model and mode: `run(layer, prompt index)` -> (tokens or text, tok/s)."""

    def __init__(self, engine, depth: int, tokens: int, url: str | None, served: str = ""):
        from hetero.decode.sampling import SamplingParams

        self.engine, self.model, self.depth, self.n, self.url = engine, engine.model, depth, tokens, url
        self.served = served  # the model name the server answers to
        self.ids = [engine.encode_prompt(p) for p in PROMPTS]
        self.greedy = SamplingParams()
        self.reference: dict[int, list[int]] = {}  # prompt -> greedy tokens (the step loop's, the batch's rows)

    # -- the layers ---------------------------------------------------------------------------------------------

    def step_loop(self, i: int):
        if self.depth:
            out, rate = self._stepper([self.ids[i]])
            self.reference[i] = out
            return out, rate
        import mlx.core as mx

        from hetero.decode.prefill import prefill

        model, cache = self.model, self.model.make_cache()
        logits, _ = prefill(model, self.ids[i], cache)  # [1, V]
        y = mx.argmax(logits[-1])

        def step(y):
            logits, _ = model(y.reshape(1, 1), cache)  # [1, 1, V]
            return mx.argmax(logits[0, -1])

        out, times = [], []
        for k in range(self.n):
            nxt = step(y) if k + 1 < self.n else None
            if nxt is not None:
                mx.async_eval(nxt)  # queued before this token is read
            out.append(y.item())
            times.append(time.perf_counter())
            y = nxt
        self.reference[i] = out
        return out, tps(times)

    def decode_tokens(self, i: int):
        from hetero.decode.sampling import Sampler
        from hetero.decode.solo import decode_tokens

        out, times = [], []
        for t in decode_tokens(self.model, self.ids[i], Sampler(self.greedy), self.n, set(), depth=self.depth,
                               copy=True):
            out.append(t)
            times.append(time.perf_counter())
        return out, tps(times)

    def stream(self, i: int):
        from hetero.decode.request import Token

        out, times = [], []
        for event in self.engine.stream(self._request(i)):
            if isinstance(event, Token):
                out.append(event.id)
                times.append(time.perf_counter())
        return out, tps(times)

    def generate(self, i: int):
        times, text = [], []

        def should_stop() -> bool:
            times.append(time.perf_counter())
            return False

        r = self.engine.generate(self.ids[i], max_tokens=self.n, on_text=text.append, should_stop=should_stop,
                                 **self._options())
        return r.tokens, tps(times)

    def serve(self, i: int):
        text, times, marks = self._sse(i)
        return text, (marks[-1] - marks[0]) / (times[-1] - times[0])

    def serve_many(self, n: int):
        with ThreadPoolExecutor(n) as pool:
            runs = list(pool.map(self._sse, [k % len(PROMPTS) for k in range(n)]))
        first = min(t[0] for _, t, _ in runs)
        last = max(t[-1] for _, t, _ in runs)
        return [text for text, _, _ in runs], sum(m[-1] - m[0] for _, _, m in runs) / (last - first)

    def batch_many(self, n: int):
        out, rate = self._stepper([self.ids[k % len(PROMPTS)] for k in range(n)])
        for k, tokens in enumerate(out):
            self.reference.setdefault(k % len(PROMPTS), tokens)
        return out, rate

    # -- helpers ------------------------------------------------------------------------------------------------

    def _options(self) -> dict:
        return dict(mtp=bool(self.depth), draft_depth=self.depth or None, copy=True, use_prefix_cache=False)

    def _request(self, i: int):
        from hetero.decode.request import GenerationRequest

        return GenerationRequest(self.ids[i], self.n, self.greedy, **self._options())

    def _stepper(self, prompts: list[list[int]]):
        """The stepper's rounds over one row per prompt: (tokens of each, aggregate tok/s) (solo: one row's)."""
        from hetero.decode.sampling import Sampler
        from hetero.decode.stepper import Batch

        batch = Batch(self.model, max_batch=len(prompts))
        rows = [batch.join(p, Sampler(self.greedy), self.n, set(), self.depth, copy=True) for p in prompts]
        t0 = time.perf_counter()
        while batch.rows:
            batch.step()
        seconds = time.perf_counter() - t0
        out = [r.tokens for r in rows]
        rate = sum(len(t) - 1 for t in out) / seconds
        return (out[0] if len(prompts) == 1 else out), rate

    def _sse(self, i: int) -> tuple[str, list[float], list[int]]:
        """One streamed completion: its text, each text chunk's arrival time and the index of the token whose
        decoding completed it (`_marks`)."""
        import httpx

        body = {"model": self.served, "prompt": self.ids[i], "max_tokens": self.n, "temperature": 0, "stream": True,
                "mtp": bool(self.depth)}
        text, times = [], []
        with httpx.stream("POST", self.url, json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                piece = json.loads(line[6:])["choices"]
                if piece and piece[0].get("text"):
                    text.append(piece[0]["text"])
                    times.append(time.perf_counter())
        return "".join(text), times, self._marks(i, text)

    def _marks(self, i: int, pieces: list[str]) -> list[int]:
        """For each received text piece, the index of the token after which the engine's detokenizer had its text:
        the prompt's reference tokens (which the served text must equal) detokenized one by one, as the server
        does. A piece needs every token up to the first one whose text reaches its end."""
        import bisect

        tokens = self.reference[i]  # set by the step loop or the batch, which run before the server each round
        detok, ends, emitted = self.engine.tokenizer.detokenizer(), [], 0
        for t in tokens:
            emitted += len(detok.add(t))
            ends.append(emitted)
        ends[-1] += len(detok.finalize())  # the tail the stream sends after the last token
        marks, done = [], 0
        for piece in pieces:
            done += len(piece)
            marks.append(min(bisect.bisect_left(ends, done), len(tokens) - 1))
        return marks


def start_server(path: str | None, depth: int, batch: int) -> tuple[subprocess.Popen, str, str]:
    """A `hetero serve` process on a free port: (process, its completions URL, the model name it serves)."""
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", SERVER, path or "", str(port), str(depth), str(batch)], cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                served = httpx.get(base + "/v1/models", timeout=5).json()["data"][0]["id"]  # the checkpoint's name
                return proc, base + "/v1/completions", served
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit("the server process exited before it served")
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not come up in 60 s")


def model_part(name: str, args: argparse.Namespace) -> dict:
    import mlx.core as mx

    from bench.checkpoints import checkpoint
    from hetero.engine import load

    path = None if name == "bundled" else str(checkpoint(name, Path(args.workdir)))
    engine = load(path, dtype=mx.float32)
    engine.eos_ids = set()  # EOS ignored: every run decodes --tokens tokens
    server, url, served = start_server(path, args.depth, max(args.concurrency))
    result: dict = {}
    identical = True
    try:
        modes = {"plain": ("plain", 0), "mtp": (f"mtp depth {args.depth}", args.depth)}
        for mode, depth in (modes[m] for m in args.modes):
            L = Layers(engine, depth, args.tokens, url, served)
            solo = ["step_loop", "decode_tokens", "stream", "generate", "serve"]
            layers = {k: (lambda i, k=k: getattr(L, k)(i)) for k in solo}
            for n in args.concurrency:
                layers[f"batch_x{n}"] = lambda i, n=n: L.batch_many(n)
                layers[f"serve_x{n}"] = lambda i, n=n: L.serve_many(n)
            for fn in layers.values():  # warm-up: every shape compiled, the server's first request served
                fn(0)
            runs: dict[str, list[float]] = {k: [] for k in layers}
            outputs: dict[str, dict[int, object]] = {k: {} for k in layers}
            host: dict[str, list[float]] = {k: [] for k in IN_PROCESS}
            for _ in range(args.rounds):
                for i in range(3):
                    for k, fn in layers.items():
                        if "_x" in k and i:  # the concurrent rows run all their prompts at once: once a round
                            continue
                        time.sleep(SETTLE_S)  # the other process's BLAS threads stop spinning first
                        cpu = time.thread_time()
                        out, rate = fn(i)
                        if k in host:
                            host[k].append((time.thread_time() - cpu) / args.tokens * 1e6)
                        runs[k].append(rate)
                        outputs[k][i] = out
            base = {i: outputs["step_loop"][i] for i in range(3)}
            text = {i: engine.tokenizer.decode(base[i]) for i in range(3)}
            checks = {
                "decode_tokens": all(outputs["decode_tokens"][i] == base[i] for i in range(3)),
                "stream": all(outputs["stream"][i] == base[i] for i in range(3)),
                "generate": all(outputs["generate"][i] == base[i] for i in range(3)),
                "serve": all(outputs["serve"][i] == text[i] for i in range(3)),
            }
            for n in args.concurrency:
                solo_tokens = [base[k % len(PROMPTS)] if k % len(PROMPTS) < 3 else None for k in range(n)]
                batch_out = outputs[f"batch_x{n}"][0]
                # rows beyond the three solo prompts: the batch's own tokens stand for solo (checked against serve)
                checks[f"batch_x{n}"] = all(s is None or s == b for s, b in zip(solo_tokens, batch_out))
                checks[f"serve_x{n}"] = all(engine.tokenizer.decode(b) == t
                                            for b, t in zip(batch_out, outputs[f"serve_x{n}"][0]))
            med = {k: statistics.median(v) for k, v in runs.items()}
            paired = {k: statistics.median(a / b for a, b in zip(runs[k], runs["step_loop"])) for k in solo}
            row = {"median_tps": med, "ratio_to_step_loop": {k: v / med["step_loop"] for k, v in med.items()},
                   "paired_ratio_to_step_loop": paired, "paired_spread": {k: spread(runs[k], runs["step_loop"])
                                                                          for k in solo},
                   "host_us_per_token": {k: statistics.median(v) for k, v in host.items()},
                   "runs": runs, "host_runs": host, "identical": checks}
            row["stream_vs_step_loop"] = med["stream"] / med["step_loop"]
            row["serve_vs_stream"] = med["serve"] / med["stream"]
            for n in args.concurrency:
                row[f"serve_x{n}_vs_serve"] = med[f"serve_x{n}"] / med["serve"]
                row[f"batch_x{n}_vs_step_loop"] = med[f"batch_x{n}"] / med["step_loop"]
            identical &= all(checks.values())
            result[mode] = row
            print(f"{name} {mode}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()), flush=True)
            print("   paired with the step loop run before them: " + ", ".join(
                f"{k} {v:.3f} [{row['paired_spread'][k][0]:.2f}-{row['paired_spread'][k][1]:.2f}]"
                for k, v in paired.items() if k != "step_loop") + "; calling thread's CPU per token (us): "
                + ", ".join(f"{k} {v:.0f}" for k, v in row["host_us_per_token"].items()), flush=True)
            print(f"   stream/step_loop {row['stream_vs_step_loop']:.3f}, serve/stream {row['serve_vs_stream']:.3f}, "
                  + ", ".join(f"serve_x{n}/serve {row[f'serve_x{n}_vs_serve']:.2f}" for n in args.concurrency)
                  + f"; identical {checks}", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    result["greedy_identical"] = identical
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=["bundled", "large"], default=["bundled"])
    ap.add_argument("--threads", type=int, choices=[1, 2], default=None,
                    help="BLAS threads (MKL_NUM_THREADS / OMP_NUM_THREADS; default: the library's, every core)")
    ap.add_argument("--tokens", type=int, default=128, help="greedy tokens per request")
    ap.add_argument("--depth", type=int, default=3, help="MTP draft depth")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds (each runs every layer on 3 prompts)")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[4, 8], help="concurrent requests / batch rows")
    ap.add_argument("--modes", nargs="+", choices=["plain", "mtp"], default=["plain", "mtp"],
                    help="plain decoding, MTP at --depth, or both")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "hetero-bench"))
    ap.add_argument("--out", default="bench/results/overhead.json")
    args = ap.parse_args()
    if args.tokens < 2:
        ap.error("--tokens must be at least 2 (the first token comes from the prefill)")
    if args.rounds < 1 or min(args.concurrency) < 1:
        ap.error("--rounds and --concurrency must be at least 1")
    if args.threads is not None:
        for var in ("MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    import hetero  # noqa: F401  first: the fast BLAS under MLX (before anything that may import torch)
    from hetero.host.blas import reexec_with_fast_blas
    from hetero.host.environment import environment

    reexec_with_fast_blas()
    result: dict = {"environment": environment(), "args": vars(args), "cpus": os.cpu_count(),
                    "note": "a machine shared with other jobs: medians of alternated rounds"}
    for name in args.models:
        result[name] = model_part(name, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    differ = [n for n in args.models if not result[n]["greedy_identical"]]
    if differ:
        sys.exit(f"FAILED: a layer's greedy output differs from the step loop's on {', '.join(differ)}")


if __name__ == "__main__":
    main()
