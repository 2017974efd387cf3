"""The ANE lane's worker process killed from outside (`kill -9`) during a 16K-token split prefill, as a user's
machine might do to it, against `hetero run` and `hetero serve` started as commands.

    python bench/ane_lane.py                 # 16K tokens
    python bench/ane_lane.py --tokens 8192

1. `hetero run --ane-fraction 0.5 --json` on a 16K prompt, GPU-only first, then split with its worker killed once it
   has computed for a few seconds: the run must exit 0 with the GPU-only run's tokens, one warning line, and the
   failure in its JSON (`ane.lane_failures`).
2. `hetero serve --ane-fraction 0.5`: a 16K completion whose worker is killed mid-prefill must answer what the
   same prompt answers GPU-only (`"ane_fraction": 0`), `/health` must count the failure, and the next new prompt
   must be split by a fresh worker (another pid).
3. The same 16K prompt twice against a split server and a GPU-only one: the split's cold request reports 0 cached
   tokens, its repeat is restored from the checkpoints the split left (no second split), answers as the GPU-only
   server does, and takes about as long as the GPU-only server's repeat (`repeat_vs_gpu_only`).
The model is bench/ttft.py's (the bundled model's layer pattern, wider, random weights, a 32K window) with the
bundled tokenizer. JSON to bench/results/ane_lane.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
from hetero.host.blas import reexec_with_fast_blas  # noqa: E402
from hetero.host.environment import environment

KILL_AFTER_CPU_S = 3.0  # the worker has computed this long: the prefill is well under way
SNIPPET = "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n"


def workers_of(pid: int) -> list[int]:
    """Pids of the ANE lane workers a process started (its children running hetero.coreml.backends.ane_worker)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat[1]) == pid and b"hetero.coreml.backends.ane_worker" in cmd:
                out.append(int(entry.name))
    return out


def cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def kill_worker_when_busy(parent: int, timeout: float = 900.0) -> int:
    """Wait for `parent`'s worker to compute KILL_AFTER_CPU_S seconds, then SIGKILL it; returns its pid."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for pid in workers_of(parent):
            try:
                if cpu_seconds(pid) >= KILL_AFTER_CPU_S:
                    os.kill(pid, signal.SIGKILL)
                    return pid
            except OSError:
                pass
        time.sleep(0.05)
    raise SystemExit("the worker never got busy")


def model_dir(work: Path) -> Path:
    sys.path.insert(0, str(ROOT / "bench"))
    from ttft import build_engine

    engine = build_engine(work)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the bundled tokenizer: same 4096-token vocabulary
        shutil.copy(ROOT / "hetero" / "bundled" / name, engine.path / name)
    return engine.path


def prompt_text(model: Path, tokens: int) -> str:
    from hetero.checkpoint.tokenizer import Tokenizer

    tok, text = Tokenizer.from_dir(model), SNIPPET
    while len(tok.encode(text)) < tokens:
        text += SNIPPET
    return text


def hetero(*args: str) -> list[str]:
    return [sys.executable, "-m", "hetero", *args]


def run_case(model: Path, prompt: str) -> dict:
    """`hetero run` GPU-only, then split with its worker killed: both exit codes, tokens and what was said."""
    base = ["run", "--model", str(model), "--prompt", "-", "--max-tokens", "8", "--json", "--prefill-chunk", "512"]
    t = time.perf_counter()
    gpu = subprocess.run(hetero(*base), input=prompt, capture_output=True, text=True)
    gpu_s = time.perf_counter() - t
    t = time.perf_counter()
    split = subprocess.Popen(hetero(*base, "--ane-fraction", "0.5"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    split.stdin.write(prompt)
    split.stdin.close()
    killed = kill_worker_when_busy(split.pid)
    out, err = split.stdout.read(), split.stderr.read()
    split.wait()
    split_s = time.perf_counter() - t
    g, s = json.loads(gpu.stdout), json.loads(out) if split.returncode == 0 else {}
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    return {"gpu_only_exit": gpu.returncode, "gpu_only_s": round(gpu_s, 2), "split_exit": split.returncode,
            "split_s": round(split_s, 2), "killed_worker": killed, "prompt_tokens": g["prompt_tokens"],
            "same_tokens": s.get("tokens") == g["tokens"], "lane_failures": s.get("ane", {}).get("lane_failures"),
            "warning": warnings, "ok": split.returncode == 0 and s.get("tokens") == g["tokens"]
            and s["ane"]["lane_failures"] == 1 and len(warnings) == 1}


def start_server(model: Path, *flags: str):
    """`hetero serve` on a free loopback port; returns (process, base URL, served model name) once it answers."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(hetero("serve", "--model", str(model), "--port", str(port), "--prefill-chunk", "512",
                                     "--no-session-cache", *flags), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(2400):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return server, url, httpx.get(url + "/v1/models").json()["data"][0]["id"]
        except httpx.HTTPError:
            time.sleep(0.25)
    server.kill()
    raise SystemExit("hetero serve did not start")


def stop_server(server) -> None:
    server.send_signal(signal.SIGINT)
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()


def cache_case(model: Path, prompt: str) -> dict:
    """The same prompt twice against a split server and a GPU-only one: the cold request reports 0 cached tokens,
    the repeat restores from the checkpoints the split left, and takes what the GPU-only server's repeat takes."""
    import httpx

    out = {}
    for name, flags in (("split", ("--ane-fraction", "0.5")), ("gpu_only", ())):
        server, url, model_name = start_server(model, *flags)
        try:
            rows = []
            for _ in range(2):
                t = time.perf_counter()
                r = httpx.post(url + "/v1/completions", timeout=900,
                               json={"model": model_name, "prompt": prompt, "max_tokens": 1}).json()
                rows.append({"s": round(time.perf_counter() - t, 3), "text": r["choices"][0]["text"],
                             "cached_tokens": r["usage"]["prompt_tokens_details"]["cached_tokens"],
                             "prompt_tokens": r["usage"]["prompt_tokens"]})
            out[name] = {"cold": rows[0], "repeat": rows[1],
                         "split_prefills": httpx.get(url + "/health").json()["requests"]["split_prefills"]}
        finally:
            stop_server(server)
    split, gpu = out["split"], out["gpu_only"]
    out["repeat_vs_gpu_only"] = round(split["repeat"]["s"] / gpu["repeat"]["s"], 3)
    out["ok"] = (split["cold"]["cached_tokens"] == 0 and split["repeat"]["cached_tokens"] > 0
                 and split["split_prefills"] == 1 and split["repeat"]["text"] == gpu["repeat"]["text"])
    return out


def serve_case(model: Path, prompt: str, second: str) -> dict:
    """`hetero serve`: a completion whose worker is killed mid-prefill, then the next split on a fresh worker."""
    import httpx

    server, url, name = start_server(model, "--ane-fraction", "0.5")
    try:
        ask = lambda text, **kw: httpx.post(url + "/v1/completions", timeout=900, json={  # noqa: E731
            "model": name, "prompt": text, "max_tokens": 8, **kw}).json()
        import threading

        answer, t = {}, time.perf_counter()
        client = threading.Thread(target=lambda: answer.update(ask(prompt)))
        client.start()
        killed = kill_worker_when_busy(server.pid)
        client.join()
        killed_s = time.perf_counter() - t
        exact = ask(prompt, ane_fraction=0)  # GPU-only (restored from the checkpoints the fallback prefill left)
        health = httpx.get(url + "/health").json()
        ask(second)
        fresh = workers_of(server.pid)
        after = httpx.get(url + "/health").json()
    finally:
        stop_server(server)
    text = answer["choices"][0]["text"]
    return {"answer_s": round(killed_s, 2), "killed_worker": killed, "fresh_workers": fresh,
            "same_text_as_gpu_only": text == exact["choices"][0]["text"],
            "lane_failures": health["ane"]["lane_failures"], "split_prefills_after_next": after["requests"]["split_prefills"],
            "ok": text == exact["choices"][0]["text"] and health["ane"]["lane_failures"] == 1
            and after["requests"]["split_prefills"] == 1 and bool(fresh) and killed not in fresh}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = p.parse_args()
    reexec_with_fast_blas()
    home = Path(tempfile.mkdtemp(prefix="hetero-ane-lane-"))
    os.environ["HETERO_HOME"] = str(home)  # exports and settings of this run only
    model = model_dir(home)
    prompt = prompt_text(model, a.tokens - 8)
    result = {"environment": environment(), "tokens": a.tokens, "kill_after_worker_cpu_s": KILL_AFTER_CPU_S}
    result["run"] = run_case(model, prompt)
    print(f"hetero run: {result['run']}", flush=True)
    result["serve"] = serve_case(model, prompt, prompt_text(model, 2048).replace("key", "name"))
    print(f"hetero serve: {result['serve']}", flush=True)
    result["cache"] = cache_case(model, prompt.replace("value", "rest"))  # a prompt no server has seen
    print(f"the same prompt twice: {result['cache']}", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ane_lane.json").write_text(json.dumps(result, indent=1))
    if not (result["run"]["ok"] and result["serve"]["ok"] and result["cache"]["ok"]):
        sys.exit("a killed ANE worker lost a request or changed its answer, or the split broke the cache (see above)")


if __name__ == "__main__":
    main()
