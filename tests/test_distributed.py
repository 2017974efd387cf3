"""Pipeline parallelism across processes (hetero.distributed): 2 and 3 ranks on the loopback address, started by
`mlx.launch` (ring backend), against one process on the bundled model and the tiny fixture; failures reported.

Starting processes is the cost here, so one launch runs many checks: run as a script under mlx.launch, this file
is the driver (every rank loads its share of each model; rank 0 runs the cases, then the same requests in one
process on the whole model, and writes what both gave to a JSON file that the test reads).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring"]
PROMPT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
CASES = [  # (name, generate kwargs): greedy MTP with the copy lane, plain, seeded sampling under MTP
    ("mtp_greedy", dict(max_tokens=20, draft_depth=3)),
    ("plain_greedy", dict(max_tokens=12, mtp=False)),
    ("mtp_sampled", dict(max_tokens=16, draft_depth=2, temperature=0.8, top_p=0.95, seed=7, copy=False)),
]


def _driver(models: list[str], cases: list[str], out: str) -> None:
    """Under mlx.launch: the named `CASES` (chunks of 16 prompt tokens, so the prefill is pipelined) on every
    model, pipelined and in one process; rank 0 writes the results to `out`."""
    import numpy as np

    import hetero
    from hetero.distributed.group import connect
    from hetero.distributed.runtime import PipelineEngine, load_stage, serve

    link = connect(30)
    results = []
    for model in models:
        model = None if model == "bundled" else model
        stage, path, config = load_stage(link, model)
        if not link.first:
            serve(stage)
            continue
        engine = PipelineEngine(stage, path, config, str(model))
        single = hetero.load(model)
        for name, kwargs in CASES:
            if name not in cases:
                continue
            got = engine.generate(PROMPT, prefill_chunk=16, **kwargs)
            want = single.generate(PROMPT, prefill_chunk=16, use_prefix_cache=False, **kwargs)
            ids = engine.encode_prompt(PROMPT) + got.tokens
            logits, ref = engine.logits(ids, 16), single.logits(ids, 16)
            results.append({
                "model": str(model), "case": name, "tokens": got.tokens, "ref_tokens": want.tokens,
                "max_abs_diff": float(np.abs(logits - ref).max()), "ref_max": float(np.abs(ref).max()),
                "mtp": got.stats.get("mtp"), "ref_mtp": want.stats.get("mtp"), "pipeline": got.stats["pipeline"],
                "finish": [got.stats["finish_reason"], want.stats["finish_reason"]],
            })
        if "prefix" in cases:  # a second turn resumes from the first one's checkpoints, on every rank
            from hetero.caches.prefix import PrefixCache

            engine.prefix_cache, single.prefix_cache = PrefixCache(1 << 30), PrefixCache()
            for turn in range(2):
                prompt = PROMPT if turn == 0 else PROMPT + first.text + "\n    def norm(self):\n        return"
                got = engine.generate(prompt, prefill_chunk=16, max_tokens=10, draft_depth=3)
                want = single.generate(prompt, prefill_chunk=16, max_tokens=10, draft_depth=3)
                first = want if turn == 0 else first
                results.append({
                    "model": str(model), "case": f"prefix turn {turn}", "tokens": got.tokens, "ref_tokens": want.tokens,
                    "cached": [got.stats["cached_tokens"], want.stats["cached_tokens"]], "mtp": got.stats.get("mtp"),
                    "ref_mtp": want.stats.get("mtp"), "pipeline": got.stats["pipeline"],
                    "finish": [got.stats["finish_reason"], want.stats["finish_reason"]],
                })
        engine.close()
    if link.first:
        Path(out).write_text(json.dumps(results))
    link.close()


if __name__ == "__main__":
    _driver(sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3])
    sys.exit(0)

import pytest  # noqa: E402

from tiny_checkpoint import write_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("dist") / "tiny", max_context=8192)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    """A random qwen3_5_moe checkpoint in HF layout (zero-centred norms, per-expert tensors) with an MTP head."""
    from test_pipeline_moe import write_moe_checkpoint

    return write_moe_checkpoint(tmp_path_factory.mktemp("dist-moe") / "moe")


def _free_port(n: int) -> int:
    """A first port p with p..p+n-1 free on the loopback address (the ring listens on one port per rank). Drawn from
    the OS's randomness: the suite's processes (xdist workers) never share a seeded generator's sequence."""
    draw = random.SystemRandom()
    for _ in range(100):
        p = draw.randrange(20000, 60000)
        try:
            socks = []
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p + i))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


class Launch:
    """`mlx.launch -n N` of a command, its output read as it comes (stdin a pipe left open: the launcher spins
    on a closed one)."""

    def __init__(self, n: int, command: list[str]):
        self.out, self.err = bytearray(), bytearray()
        self.proc = subprocess.Popen(
            [*LAUNCH, "-n", str(n), "--starting-port", str(_free_port(n)), "--", *command], cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "MKL_NUM_THREADS": "1"},
        )
        for stream, buf in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._read, args=(stream, buf), daemon=True).start()

    @staticmethod
    def _read(stream, buf: bytearray) -> None:
        while chunk := stream.read1(65536):
            buf.extend(chunk)

    def wait_for(self, text: str, timeout: float) -> str:
        """stderr once it holds `text` (fails after `timeout` seconds)."""
        end = time.monotonic() + timeout
        while text not in self.err.decode(errors="replace"):
            assert time.monotonic() < end, f"no {text!r} after {timeout} s; stderr: {self.err.decode()[-2000:]}"
            time.sleep(0.05)
        return self.err.decode(errors="replace")

    def finish(self, timeout: float) -> tuple[str, str]:
        try:
            self.proc.wait(timeout)
        finally:
            self.proc.stdin.close()
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        time.sleep(0.1)  # the readers drain the pipes
        return self.out.decode(errors="replace"), self.err.decode(errors="replace")


@pytest.mark.parametrize("ranks,cases", [(2, [c for c, _ in CASES] + ["prefix"]), (3, ["mtp_greedy", "plain_greedy"])])
def test_pipeline_matches_one_process(ranks, cases, fixture_dir, moe_dir, tmp_path):
    """Logits equal to one process within fp32 rounding and identical tokens (greedy, and seeded sampling under
    MTP), MTP on with the copy lane, a second turn restored from each rank's prefix cache, across 2 and 3 ranks
    (3 processes share 2 cores here: fewer cases), on the bundled model, the fixture (3 layers: one per rank at 3
    ranks, one rank with no GDN layer) and, at 2 ranks, an HF-layout MoE checkpoint (zero-centred norms)."""
    out = tmp_path / "results.json"
    models = ["bundled", str(fixture_dir)] + ([str(moe_dir)] if ranks == 2 else [])
    launch = Launch(ranks, [sys.executable, __file__, ",".join(models), ",".join(cases), str(out)])
    _, err = launch.finish(120)
    assert out.is_file(), err[-3000:]
    results = json.loads(out.read_text())
    assert len(results) == len(models) * (len(cases) + ("prefix" in cases))
    for r in results:
        label = f"{r['model']} {r['case']} ({ranks} ranks)"
        assert r["tokens"] == r["ref_tokens"], label
        assert r["finish"][0] == r["finish"][1], label
        assert len(r["tokens"]) > 0, label
        if "cached" in r:  # the same prefix restored as in one process: none on the first turn, most on the second
            assert r["cached"][0] == r["cached"][1], label
            assert (r["cached"][0] > 0) == r["case"].endswith("1"), label
        else:
            assert r["max_abs_diff"] <= 1e-5 * max(1.0, r["ref_max"]), label
        assert r["mtp"] == r["ref_mtp"], label  # the same drafts accepted in the same rounds
        per_rank = r["pipeline"]["per_rank"]
        assert len(per_rank) == ranks and all(p["weight_bytes"] > 0 for p in per_rank), label
        layers = [p["layers"] for p in per_rank]
        assert layers[0][0] == 0 and all(a[1] + 1 == b[0] for a, b in zip(layers, layers[1:])), label
    assert any(r["mtp"] and r["mtp"]["rounds"] and r["mtp"]["mean_accepted_length"] > 1 for r in results)


def test_cli_verify_across_ranks():
    """`mlx.launch -n 2 -- hetero run --verify --json`: rank 0 prints the output and a matching verify block."""
    launch = Launch(2, [sys.executable, "-m", "hetero", "run", "--prompt", "def fib(n):", "--max-tokens", "12",
                        "--draft-depth", "2", "--verify", "--json"])
    out, err = launch.finish(120)
    lines = [l for l in out.splitlines() if l.startswith("{")]
    assert len(lines) == 1, err[-3000:]  # rank 0 alone prints
    result = json.loads(lines[0])
    assert result["verify"]["match"] and result["verify"]["tokens_identical"], result["verify"]
    assert result["verify"]["max_abs_logit_diff"] == 0.0
    assert result["generated_tokens"] == 12 and result["pipeline"]["ranks"] == 2
    assert "serving rank 0" in err


def test_dead_rank_is_reported():
    """A rank killed mid-prefill: rank 0 stops at once with one clear line, well within the timeout."""
    launch = Launch(2, [sys.executable, "-m", "hetero", "run", "--prompt", "x = 1\n" * 3000, "--max-tokens", "4",
                        "--prefill-chunk", "64", "--dist-timeout", "30"])
    err = launch.wait_for("serving rank 0", 60)
    pid = int(err.split("pid ")[1].split(":")[0])
    launch.wait_for("prefill [", 60)  # rank 0 is well into the request
    os.kill(pid, signal.SIGKILL)
    _, err = launch.finish(60)  # only a hang fails here: how fast rank 0 stops is shown by which line it printed
    # whichever comes first: MLX's "connection lost" error, or mlx.launch's SIGTERM (it stops the others at once);
    # never the watchdog's "no progress ... for 30 s", the only way a lost rank is reported without either
    lines = [l for l in err.splitlines() if l.startswith("hetero: error: rank 0: ")]
    assert len(lines) == 1, err[-2000:]
    assert "the pipeline lost a rank" in lines[0] or "another rank failed or was killed" in lines[0], lines[0]
    assert "Traceback" not in err


def test_hung_rank_is_reported():
    """A rank that stops answering (SIGSTOP): rank 0's watchdog reports it after --dist-timeout seconds. The timeout
    also bounds joining the ring: at 3 s, a machine busy enough to start one rank's Python 3 s after the other's
    failed the join before the test began (seen with the suite's two workers on a shared machine); 10 s spares that
    and still names its own clock."""
    launch = Launch(2, [sys.executable, "-m", "hetero", "run", "--prompt", "x = 1\n" * 3000, "--max-tokens", "4",
                        "--prefill-chunk", "64", "--dist-timeout", "10"])
    err = launch.wait_for("serving rank 0", 60)
    pid = int(err.split("pid ")[1].split(":")[0])
    launch.wait_for("prefill [", 60)
    assert "no progress from the other ranks" not in launch.err.decode(errors="replace")  # not before the stop
    os.kill(pid, signal.SIGSTOP)
    try:
        # the line names the 10 s it waited (the watchdog's own clock); 60 s only guards against a hang
        launch.wait_for("no progress from the other ranks for 10 s", 60)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the launcher may have ended it already
            os.kill(pid, signal.SIGKILL)
    _, err = launch.finish(20)
    assert "Traceback" not in err


def test_missing_rank_is_reported(tmp_path):
    """Rank 0 started alone (its peer never connects): a clear line after the timeout, not a hang."""
    port = _free_port(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    # timeout=60 only guards against a hang; the line below says it gave up after its own 2 s
    proc = subprocess.run([sys.executable, "-m", "hetero", "run", "--prompt", "hi", "--dist-timeout", "2"], cwd=ROOT,
                          env={**os.environ, "MLX_RANK": "0", "MLX_HOSTFILE": str(hostfile)}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert "rank 0: not every rank connected within 2 s (rank 1 at 127.0.0.1:" in proc.stderr, proc.stderr


def test_bad_launch_environment(tmp_path):
    """MLX_RANK without a host file is refused in one line."""
    proc = subprocess.run([sys.executable, "-m", "hetero", "run", "--prompt", "hi"], cwd=ROOT,
                          env={**os.environ, "MLX_RANK": "0"}, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "hetero: error: a distributed run needs both MLX_RANK and MLX_HOSTFILE (got MLX_RANK='0', MLX_HOSTFILE=''): "
        "start every rank with `mlx.launch --backend ring --hosts IP1,IP2 -- hetero run ...`"
    ]


def test_an_image_under_mlx_launch_says_to_run_without_it(tmp_path):
    """`hetero run --image` under mlx.launch is refused in one line saying what to run instead (before any rank
    connects or the image is read)."""
    proc = subprocess.run([sys.executable, "-m", "hetero", "run", "--prompt", "hi", "--image", "x.png"], cwd=ROOT,
                          env={**os.environ, "MLX_RANK": "0", "MLX_HOSTFILE": os.devnull}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "hetero: error: --image under mlx.launch: the ranks prefill text only; run the same hetero run command "
        "without mlx.launch (one process, the vision tower included)"], proc.stderr
