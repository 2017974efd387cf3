"""A long prompt arriving at `hetero serve` while two other requests decode with MTP: its TTFT and the decoders'
speed, with `--ane-fraction auto` against `--ane-fraction 0`, over real HTTP on loopback.

    python bench/mixed_load.py                     # a 16K-token prompt
    python bench/mixed_load.py --tokens 4096

The model is bench/ttft.py's (the bundled layer pattern, wider, random weights) with an MTP layer, and the bundled
model's tokenizer (same vocabulary size). For each setting a fresh server (no session cache, so nothing is
restored) takes two streaming completions with a long max_tokens; once both stream, their tokens per second are
measured alone for a few seconds, then the long prompt (token ids, max_tokens 1) is sent and its TTFT measured,
with the decoders' tokens per second during that prefill. The split's programs are exported before the server
starts (what the first split request would otherwise do). Both settings run with the same `--decode-share` (the
server's default unless given). The exit code does not depend on the targets.
JSON to bench/results/mixed_load.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one BLAS thread per lane, as in bench/ttft.py
os.environ.setdefault("OMP_NUM_THREADS", "1")
from hetero.decode.turns import DECODE_SHARE  # noqa: E402
from hetero.host.blas import reexec_with_fast_blas  # noqa: E402
from hetero.host.environment import environment

TTFT_TARGET = 0.75  # auto / GPU-only TTFT of the long prompt
DECODE_TARGET = 0.8  # decoders' tokens/s during the prefill / alone


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_model(work: Path) -> Path:
    """bench/ttft.py's model with one MTP layer, saved with the bundled tokenizer."""
    import bench.ttft as T
    from hetero.checkpoint.source import BUNDLED_MODEL

    T.SHAPE = dict(T.SHAPE, mtp_num_hidden_layers=1)
    engine = T.build_engine(work)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(BUNDLED_MODEL) / name, engine.path / name)
    return engine.path


def pre_export(model: Path, tokens: int) -> None:
    """Export the split's programs for the long prompt as `--ane-fraction auto` will choose them."""
    import hetero
    from hetero.pipeline import auto_fraction

    engine = hetero.load(model)
    auto_fraction(engine, 512).splitter(tokens - 1)


class Decoder(threading.Thread):
    """One streaming completion; records the arrival time of every text chunk."""

    def __init__(self, base: str, name: str, seed: int, max_tokens: int):
        super().__init__(daemon=True)
        self.base, self.name, self.seed, self.max_tokens = base, name, seed, max_tokens
        self.times: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        import httpx

        body = {"model": self.name, "prompt": f"def f{self.seed}(x):\n", "max_tokens": self.max_tokens,
                "stream": True, "temperature": 0.0}
        with httpx.stream("POST", f"{self.base}/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if self.stop.is_set():
                    return
                if line.startswith("data: {"):
                    self.times.append(time.perf_counter())

    def rate(self, t0: float, t1: float) -> float:
        return sum(t0 <= t < t1 for t in self.times) / (t1 - t0)


def scenario(model: Path, home: str, fraction: str, tokens: int, alone_s: float, seed: int, share: float) -> dict:
    import httpx
    import numpy as np

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "hetero", "serve", "--model", str(model), "--port", str(port), "--no-session-cache",
           "--prefix-cache-max-gb", "0", "--ane-fraction", fraction, "--decode-share", str(share)]
    server = subprocess.Popen(cmd, env=dict(os.environ, HETERO_HOME=home), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise SystemExit(f"the server did not start: {server.stderr.read()}")
        name = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        decoders = [Decoder(base, name, i, 100_000) for i in range(2)]
        for d in decoders:
            d.start()
        deadline = time.perf_counter() + 120
        while min(len(d.times) for d in decoders) < 20:
            if time.perf_counter() > deadline or not all(d.is_alive() for d in decoders):
                raise SystemExit("the decoding requests did not stream")
            time.sleep(0.05)
        t0 = time.perf_counter()
        time.sleep(alone_s)
        t1 = time.perf_counter()
        ids = np.random.default_rng(seed).integers(10, 4000, tokens).tolist()
        r = httpx.post(f"{base}/v1/completions", json={"model": name, "prompt": ids, "max_tokens": 1}, timeout=1200)
        t2 = time.perf_counter()
        if r.status_code != 200:
            raise SystemExit(f"the long prompt failed: {r.status_code} {r.text}")
        for d in decoders:
            d.stop.set()
        alone = sum(d.rate(t0, t1) for d in decoders)
        during = sum(d.rate(t1, t2) for d in decoders)
        return {"ane_fraction": fraction, "ttft_s": t2 - t1, "decode_tps_alone": alone, "decode_tps_during": during,
                "decode_kept": during / alone if alone else None}
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--alone-seconds", type=float, default=5.0)
    p.add_argument("--decode-share", type=float, default=DECODE_SHARE,
                   help="hetero serve --decode-share: the model's time the decoders keep while the prompt prefills")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = p.parse_args()
    reexec_with_fast_blas()
    home = tempfile.mkdtemp(prefix="hetero-mixed-")
    os.environ["HETERO_HOME"] = home
    from hetero.cli.measure import Sizes, measure
    from hetero.host.settings import save_device_profile

    import bench.ttft as T

    model = write_model(Path(home))
    save_device_profile(measure(report=lambda line: print(line, flush=True), sizes=Sizes.for_model(T.SHAPE, 512)))
    pre_export(model, a.tokens)
    runs = {}
    for i, fraction in enumerate(("0", "auto")):
        runs[fraction] = scenario(model, home, fraction, a.tokens, a.alone_seconds, seed=i, share=a.decode_share)
        r = runs[fraction]
        print(f"--ane-fraction {fraction:<4}: {a.tokens}-token prompt TTFT {r['ttft_s']:.2f} s; two decoders "
              f"{r['decode_tps_alone']:.1f} tok/s alone, {r['decode_tps_during']:.1f} during the prefill "
              f"({r['decode_kept']:.2f}x)", flush=True)
    ttft_ratio = runs["auto"]["ttft_s"] / runs["0"]["ttft_s"]
    doc = {"environment": environment(), "tokens": a.tokens, "decode_share": a.decode_share, "runs": runs,
           "target": {"ttft_auto_vs_gpu_only": ttft_ratio, "ttft_at_or_below": TTFT_TARGET,
                      "decode_kept_auto": runs["auto"]["decode_kept"], "decode_kept_at_least": DECODE_TARGET,
                      "met": ttft_ratio <= TTFT_TARGET and runs["auto"]["decode_kept"] >= DECODE_TARGET}}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "mixed_load.json").write_text(json.dumps(doc, indent=1))
    print(f"TTFT auto / GPU-only {ttft_ratio:.2f}x (target <= {TTFT_TARGET}); decoders keep "
          f"{runs['auto']['decode_kept']:.2f}x with auto, {runs['0']['decode_kept']:.2f}x GPU-only "
          f"(target >= {DECODE_TARGET})")


if __name__ == "__main__":
    main()
