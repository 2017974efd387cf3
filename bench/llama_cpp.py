"""llama.cpp's CPU build against hetero on one checkpoint: prefill and decode, same machine, same run.

    python bench/llama_cpp.py                          # bundled model: build once (cached), convert, measure
    python bench/llama_cpp.py --model large            # the ~270M random checkpoint of bench/checkpoints.py
    python bench/llama_cpp.py --model moe              # the random Qwen3.5-MoE checkpoint (llama.cpp's qwen35moe)
    python bench/llama_cpp.py --threads 1 2 --repeats 3 --depths 16000 30000 --types f32 f16

llama.cpp is never vendored or committed: the script downloads the `llama-cpp-python` source package from PyPI
(it carries llama.cpp's source, convert_hf_to_gguf.py and gguf-py), builds llama-bench, llama-completion and
llama-tokenize with CMake (CPU only, Release, GGML_NATIVE) into ~/.cache/hetero-bench/llama.cpp-py<version>/
and converts the checkpoint to GGUF with that version's converter (backbone only: --no-mtp). A second run reuses
the build and the GGUF. The converter imports torch and transformers: run it from the test install (README). A
version whose llama.cpp lacks the Qwen3.5 architecture (qwen35), or a converter that
refuses the checkpoint (the MoE one needs qwen35moe), makes the script say so and exit with status 2.

Measured, alternating llama.cpp and hetero (A B A B), at each thread count (default 1 and all cores; llama.cpp
gets -t N, hetero's BLAS gets MKL_NUM_THREADS=N / OMP_NUM_THREADS=N; MLX itself runs on one thread):
Every llama-bench row runs with flash attention off and on (-fa 0,1), and the faster counts (both are kept in the
JSON): on this CPU on wins prefill, off wins decode over a long cache by about 4x.
- prefill of 512 and 4,096 random tokens: llama-bench pp512 / pp4096 against hetero's prefill (generate_tokens);
- decode from an empty context (128 tokens on the bundled model, 32 on the others): llama-bench tg (random input
  tokens, no sampling) against hetero's plain greedy decode after a one-token prompt;
- decode at depth (--depths, default 16,000 and 30,000 tokens on the bundled model, none on the others): llama-bench
  -d D -n 64 (64 tokens decoded after D tokens of context) against hetero's plain greedy decode of 64 tokens after a
  random prompt of D tokens (only the decode is timed on both sides);
- decode on text: held-out standard-library source as prompts, greedy, up to 128 tokens, stopping at EOS:
  llama-completion --temp 0 (its eval + sampling time) against hetero plain and hetero with MTP at the depth
  `hetero tune` saved (else the default 3), both through Engine.generate. The generated texts are compared
  (greedy output identity) and so are the prompt tokenizations (llama-tokenize against hetero's tokenizer).
Prints the ratios hetero / llama.cpp and writes bench/results/llama_cpp.json (llama_cpp_<model>.json for the
others). A text mismatch is reported, not fatal: both run fp32 and argmax ties or rounding differences can diverge
after many tokens. A random checkpoint's text need not be valid UTF-8: both sides' bytes are decoded with U+FFFD
for what is not.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON = "0.3.36"  # the newest sdist on PyPI (Dec 2026); it vendors llama.cpp 0c1e57098, which has qwen35
TARGETS = ["llama-bench", "llama-completion", "llama-tokenize"]
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF",
]
PROMPT_LENGTHS = (512, 4096)
DEPTH_TOKENS = 64  # tokens decoded after each depth's context
# per checkpoint: tokens decoded from an empty context, default depths, default text prompts
MODELS = {
    "bundled": {"decode_tokens": 128, "depths": (16000, 30000), "prompts": 3},
    "large": {"decode_tokens": 32, "depths": (), "prompts": 1},
    "moe": {"decode_tokens": 32, "depths": (), "prompts": 1},
}
RESULT = "RESULT "  # prefix of the worker's answer lines (anything else it prints is passed through)


def log(msg: str) -> None:
    print(msg, flush=True)


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hetero-bench"


# ---------------------------------------------------------------- llama.cpp: source, build, GGUF


def fetch_source(version: str, root: Path) -> Path:
    """The extracted sdist of llama-cpp-python `version` (downloaded and unpacked once)."""
    src = root / f"llama.cpp-py{version}"
    if (src / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        log(f"llama.cpp source: reusing {src}")
        return src
    sdists = root / "sdist"
    sdists.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{version}.tar.gz"
    if not (sdists / name).is_file():
        log(f"llama.cpp source: pip download --no-binary :all: --no-deps llama-cpp-python=={version}")
        t0 = time.perf_counter()
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(sdists),
             f"llama-cpp-python=={version}"], capture_output=True, text=True,
        )
        if r.returncode != 0 or not (sdists / name).is_file():
            sys.exit(f"could not download the llama-cpp-python {version} sdist:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
        log(f"  downloaded {name} ({(sdists / name).stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.0f} s")
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".extract-"))
    with tarfile.open(sdists / name) as tar:
        tar.extractall(tmp, filter="data")
    (top,) = list(tmp.iterdir())
    top.rename(src)
    tmp.rmdir()
    log(f"llama.cpp source: unpacked into {src}")
    return src


def llama_cpp_commit(src: Path, version: str) -> str | None:
    """The llama.cpp commit that this llama-cpp-python release vendors, from its CHANGELOG."""
    text = (src / "CHANGELOG.md").read_text(errors="replace")
    section = text.split(f"## [{version}]", 1)[-1].split("\n## [", 1)[0]
    m = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section)
    return m.group(1) if m else None


def supports_qwen35(llama: Path) -> tuple[bool, str]:
    """Whether this llama.cpp runs and converts Qwen3.5 hybrid models, and what was looked for."""
    arch = (llama / "src" / "llama-arch.cpp").read_text(errors="replace")
    converters = [llama / "convert_hf_to_gguf.py", *sorted((llama / "conversion").glob("*.py"))]
    conv = any("Qwen3_5ForConditionalGeneration" in p.read_text(errors="replace") for p in converters if p.is_file())
    has_arch = '"qwen35"' in arch
    return has_arch and conv, f"runtime arch qwen35: {has_arch}, converter Qwen3_5ForConditionalGeneration: {conv}"


def build(src: Path, jobs: int) -> dict:
    """Build the llama.cpp tools once (CMake + Ninja if present); later calls reuse the build."""
    llama, out = src / "vendor" / "llama.cpp", src / "build"
    stamp = out / "hetero-build.json"
    bins = {t: out / "bin" / t for t in TARGETS}
    try:
        done = json.loads(stamp.read_text())
    except (OSError, json.JSONDecodeError):
        done = None
    if done and done.get("flags") == CMAKE_FLAGS and done.get("targets") == TARGETS and all(b.is_file() for b in bins.values()):
        log(f"llama.cpp build: reusing {out} (built in {done['seconds']:.0f} s with -j{done['jobs']})")
        return {**done, "reused": True}
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = ["cmake", "-S", str(llama), "-B", str(out), *generator, *CMAKE_FLAGS]
    make = ["cmake", "--build", str(out), "-j", str(jobs), "--target", *TARGETS]
    log(f"llama.cpp build: {' '.join(configure)}\n                  {' '.join(make)}")
    t0 = time.perf_counter()
    for cmd in (configure, make):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"llama.cpp build failed: {' '.join(cmd)}\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    seconds = time.perf_counter() - t0
    done = {"flags": CMAKE_FLAGS, "targets": TARGETS, "jobs": jobs, "seconds": seconds,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    stamp.write_text(json.dumps(done, indent=1))
    log(f"llama.cpp build: done in {seconds:.0f} s ({', '.join(TARGETS)})")
    return {**done, "reused": False}


# Runs the vendored convert_hf_to_gguf.py. The bundled model's tokenizer is a BPE of its own whose pre-tokenizer
# is HF's plain ByteLevel with the GPT-2 split regex; the converter only knows pre-tokenizers by the hash of
# reference tokenizations, so an unknown hash falls back to llama.cpp's "gpt-2" pre-tokenizer (the same regex).
_CONVERT = """
import runpy, sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        print("hetero bench: unknown BPE pre-tokenizer hash; using llama.cpp's gpt-2 (plain ByteLevel regex)")
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def plain_byte_level(model: Path) -> bool:
    pre = json.loads((model / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


def fingerprint(model: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        h.update((model / name).read_bytes())
    return h.hexdigest()[:12]


def convert(src: Path, model: Path, name: str, dtype: str) -> Path:
    """GGUF of checkpoint `name` at `model` at `dtype` (f32 / f16 / bf16), converted once per weights fingerprint."""
    out = src / "gguf" / f"{name}-{fingerprint(model)}-{dtype}.gguf"
    if out.is_file():
        log(f"GGUF {dtype}: reusing {out}")
        return out
    if not plain_byte_level(model):
        sys.exit("the checkpoint's tokenizer is not a plain ByteLevel BPE: its llama.cpp pre-tokenizer is unknown")
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"llama.cpp's convert_hf_to_gguf.py imports {' and '.join(missing)}, which this venv lacks: install "
                 f"the test extras (pip install torch==2.13.0 -e \".[test]\") and run again")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    cmd = [sys.executable, "-c", _CONVERT, str(src / "vendor" / "llama.cpp"), str(model), "--outtype", dtype,
           "--no-mtp", "--outfile", str(tmp)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=src / "vendor" / "llama.cpp")
    if r.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        print(f"llama.cpp's convert_hf_to_gguf.py refused the {name} checkpoint ({dtype}), so llama.cpp cannot run it "
              f"here:\n{r.stdout[-2000:]}{r.stderr[-3000:]}", file=sys.stderr)
        sys.exit(2)
    tmp.rename(out)
    note = " (gpt-2 pre-tokenizer fallback)" if "gpt-2 (plain ByteLevel" in r.stdout else ""
    log(f"GGUF {dtype}: converted in {time.perf_counter() - t0:.0f} s -> {out}{note}")
    return out


# ---------------------------------------------------------------- llama.cpp: runs


def llama_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OMP_NUM_THREADS")}
    return env


def llama_bench(binary: Path, ggufs: dict[str, Path], threads: int, decode_tokens: int, depths: tuple[int, ...]
                ) -> list[dict]:
    """llama-bench rows: prefill of PROMPT_LENGTHS and decode from an empty context for every GGUF, then (f32 only)
    decode of DEPTH_TOKENS after each depth."""
    def run(cmd: list[str]) -> list[dict]:
        r = subprocess.run(cmd, capture_output=True, text=True, env=llama_env())
        if r.returncode != 0:
            sys.exit(f"llama-bench failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
        return json.loads(r.stdout)

    common = [str(binary), "-t", str(threads), "-r", "1", "-fa", "0,1", "-o", "json"]
    rows = run([*common, "-m", ",".join(str(p) for p in ggufs.values()), "-p", ",".join(map(str, PROMPT_LENGTHS)),
                "-n", str(decode_tokens)])
    if depths:
        rows += run([*common, "-m", str(ggufs["f32"]), "-p", "0", "-n", str(DEPTH_TOKENS),
                     "-d", ",".join(map(str, depths))])
    return rows


def bench_rates(runs: list[dict], typ: str, n_prompt: int = 0, n_gen: int = 0, n_depth: int = 0) -> dict:
    """tok/s of the llama-bench rows of this GGUF type and shape, by flash-attention setting ("fa_off", "fa_on")."""
    return {f"fa_{'on' if r['flash_attn'] in (1, True) else 'off'}": r["avg_ts"] for r in runs
            if r["model_filename"].endswith(f"-{typ}.gguf") and r["n_prompt"] == n_prompt and r["n_gen"] == n_gen
            and r.get("n_depth", 0) == n_depth}


def bench_rate(runs: list[dict], typ: str, n_prompt: int = 0, n_gen: int = 0, n_depth: int = 0) -> float:
    """llama.cpp at its best for this shape: the faster of flash attention on and off. (On this CPU, on is
    faster for prefill, off for decode over a long cache: 319 against 84 tok/s at 16K on the bundled model.)"""
    return max(bench_rates(runs, typ, n_prompt, n_gen, n_depth).values())


def llama_tokenize(binary: Path, gguf: Path, text: str) -> list[int]:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    try:
        r = subprocess.run([str(binary), "-m", str(gguf), "-f", f.name, "--ids", "--log-disable"],
                           capture_output=True, text=True, env=llama_env())
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        sys.exit(f"llama-tokenize failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


_PERF = re.compile(r"(prompt eval|eval|sampling) time =\s*([\d.]+) ms(?: /\s*(\d+) (?:tokens|runs))?")


def llama_complete(binary: Path, gguf: Path, text: str, threads: int, max_tokens: int) -> dict:
    """Greedy completion of `text`: the generated text and the timings llama.cpp prints. The output is read as
    bytes and decoded with U+FFFD for invalid UTF-8, as hetero decodes tokens (a random checkpoint writes any
    byte sequence)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    cmd = [str(binary), "-m", str(gguf), "-f", f.name, "-n", str(max_tokens), "--temp", "0", "-t", str(threads),
           "-tb", str(threads), "-no-cnv", "--no-display-prompt", "-c", "4096", "--seed", "0"]
    try:
        r = subprocess.run(cmd, capture_output=True, env=llama_env())
    finally:
        os.unlink(f.name)
    stdout, stderr = (b.decode("utf-8", errors="replace") for b in (r.stdout, r.stderr))
    if r.returncode != 0:
        sys.exit(f"llama-completion failed: {' '.join(cmd)}\n{stderr[-3000:]}")
    out = stdout.removesuffix("\n\n")  # printed after every generation
    stopped = out.endswith(" [end of text]\n")
    if stopped:
        out = out[: -len(" [end of text]\n")]
    perf = {}
    for kind, ms, n in _PERF.findall(stderr):
        perf.setdefault(kind, (float(ms), int(n or 0)))
    eval_ms, runs = perf.get("eval", (0.0, 0))
    sample_ms = perf.get("sampling", (0.0, 0))[0]
    pp_ms, pp_n = perf.get("prompt eval", (0.0, 0))
    return {
        "text": out, "stopped_at_eos": stopped, "eval_runs": runs, "eval_ms": eval_ms, "sampling_ms": sample_ms,
        "decode_tps_eval": runs / eval_ms * 1e3 if eval_ms else 0.0,
        "decode_tps": runs / (eval_ms + sample_ms) * 1e3 if eval_ms else 0.0,  # eval + sampling, as hetero's
        "prefill_tps": pp_n / pp_ms * 1e3 if pp_ms else 0.0, "prompt_tokens": pp_n,
    }


# ---------------------------------------------------------------- hetero: a worker process per thread count


def worker(model_path: str) -> None:
    """Answer JSON requests on stdin with one RESULT line each; BLAS threads come from the environment."""
    sys.path.insert(0, str(ROOT))
    from hetero.host.blas import reexec_with_fast_blas
    from hetero.host.environment import environment

    reexec_with_fast_blas()
    import mlx.core as mx
    import numpy as np

    from hetero.decode.records import DecodeTimes
    from hetero.decode.sampling import Sampler, SamplingParams
    from hetero.decode.solo import decode_tokens
    from hetero.engine import DEFAULT_DRAFT_DEPTH, load
    from hetero.host.settings import PLAIN, tuned_depth

    engine = load(model_path, dtype=mx.float32)
    model, vocab = engine.model, engine.model.args.vocab_size
    tuned = tuned_depth(engine.identity)
    depth = tuned if isinstance(tuned, int) else DEFAULT_DRAFT_DEPTH
    depth_note = ("tuned" if isinstance(tuned, int) else
                  "default (hetero tune saved off: plain won)" if tuned == PLAIN else "default (never tuned)")
    rng = np.random.default_rng(0)

    def timed(prompt_len: int, new_tokens: int) -> DecodeTimes:
        """Plain greedy decoding of `new_tokens` after a random prompt of `prompt_len` tokens."""
        times = DecodeTimes()
        for _ in decode_tokens(model, rng.integers(3, vocab, prompt_len).tolist(), Sampler(SamplingParams()),
                               new_tokens, set(), times=times):
            pass
        return times

    def synthetic(decode: int, depths: list[int]) -> dict:
        return {"prefill_tps": {str(n): timed(n, 1).prefill_tps for n in PROMPT_LENGTHS},
                "decode_tps": timed(1, decode).decode_tps,
                "depth_decode_tps": {str(d): timed(d, DEPTH_TOKENS).decode_tps for d in depths}}

    def text(prompts: list[str], max_tokens: int) -> list[dict]:
        rows = []
        for p in prompts:
            row = {"prompt_ids": engine.tokenizer.encode(p)}
            for name, kw in (("plain", dict(mtp=False)), ("mtp", dict(mtp=True, draft_depth=depth))):
                r = engine.generate(p, max_tokens=max_tokens, use_prefix_cache=False, **kw)
                row[name] = {"text": r.text, "tokens": r.tokens, "decode_tps": r.stats["decode_tps"],
                             "prefill_tps": r.stats["prefill_tps"], "finish_reason": r.stats["finish_reason"]}
                if "mtp" in r.stats:
                    row[name]["mean_accepted_length"] = r.stats["mtp"]["mean_accepted_length"]
            rows.append(row)
        return rows

    synthetic(8, [])  # warm-up: compiles the step functions, faults the weights in
    engine.generate("def f(x):", max_tokens=8, mtp=True, draft_depth=depth, use_prefix_cache=False)
    hello = {"environment": environment(), "mtp_depth": depth, "mtp_depth_source": depth_note}
    print(RESULT + json.dumps(hello), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        ans = (synthetic(req["decode_tokens"], req["depths"]) if req["op"] == "synthetic"
               else text(req["prompts"], req["max_tokens"]))
        print(RESULT + json.dumps(ans), flush=True)


class Worker:
    def __init__(self, threads: int, model_path: Path):
        env = dict(os.environ, MKL_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", str(model_path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.hello = self._read()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
            print(line, end="")
        sys.exit(f"the hetero worker exited with status {self.proc.wait()}")

    def ask(self, **req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# ---------------------------------------------------------------- prompts, comparison, report


def text_prompts(n: int, chars: int) -> list[str]:
    """n pieces of held-out standard-library source (the bundled model never trained on them), cut at lines."""
    sys.path.insert(0, str(ROOT))
    from hetero.training.tokenizer_train import load_corpus

    _, valid = load_corpus()
    docs = [d for d in valid.split("<|endoftext|>") if len(d) > 4 * chars]
    step = max(1, len(docs) // n)
    prompts = []
    for d in docs[::step][:n]:
        start = d.find("\ndef ")
        start = start + 1 if start >= 0 else 0
        piece = d[start : start + chars]
        piece = piece[: piece.rfind("\n")].rstrip()  # whole lines, no trailing newline (llama.cpp -f strips it)
        prompts.append(piece)
    return prompts


def first_difference(a, b) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile") if f in have]
    except OSError:
        pass
    return []


def med(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "runs": xs}


def spread(v: dict) -> str:
    digits = 0 if v["median"] >= 100 else 1
    return f"{v['median']:7.{digits}f} ({min(v['runs']):.{digits}f}-{max(v['runs']):.{digits}f})"


def report(result: dict) -> None:
    """Print the medians (min-max over the rounds), the ratios hetero / llama.cpp and the identity checks."""
    env, args = result["environment"], result["args"]
    types = env["llama_cpp"]["gguf_types"]
    n_dec = result["decode_tokens"]
    log("")
    log(f"llama.cpp {env['llama_cpp']['commit']} (llama-cpp-python {env['llama_cpp']['llama_cpp_python_sdist']}) vs "
        f"hetero, {result['model']} model, fp32; tok/s, median (min-max) of {args['repeats']} rounds; llama.cpp "
        f"at its best of flash attention on and off")
    for row in result["rows"]:
        L, H, R = row["llama_cpp"], row["hetero"], row["ratios"]
        t = row["threads"]
        for n in PROMPT_LENGTHS:
            log(f"  {t} thr  prefill {n:<5d}   hetero         {spread(H[f'prefill{n}'])}  llama.cpp {spread(L[f'pp{n}_f32'])}"
                f"  -> {R[f'prefill{n}']:.2f}x")
        log(f"  {t} thr  decode tg{n_dec:<6d} hetero         {spread(H['decode_plain'])}  llama.cpp "
            f"{spread(L['tg_f32'])}  -> {R['decode_plain']:.2f}x")
        for d in result["depths"]:
            log(f"  {t} thr  decode @ {d:<6d} hetero         {spread(H[f'depth{d}'])}  llama.cpp "
                f"{spread(L[f'depth{d}'])}  -> {R[f'depth{d}']:.2f}x")
        if "text_decode_plain" in H:
            log(f"  {t} thr  text decode     hetero         {spread(H['text_decode_plain'])}  llama.cpp "
                f"{spread(L['text_decode'])}  -> {R['text_decode_plain']:.2f}x")
            log(f"  {t} thr  text decode     hetero MTP d={env['hetero_mtp_depth']} {spread(H['text_decode_mtp'])}"
                f"  -> {R['text_decode_mtp']:.2f}x (accepted length {H['mtp_mean_accepted_length']:.2f})")
        for typ in types:
            if typ != "f32":
                log(f"  {t} thr  llama.cpp {typ}: " + ", ".join(
                    f"pp{n} {L[f'pp{n}_{typ}']['median']:.0f}" for n in PROMPT_LENGTHS) +
                    f", tg{n_dec} {L[f'tg_{typ}']['median']:.0f}")
    tok = result["prompt_tokenization"]
    if tok:
        log(f"prompt tokenization, llama-tokenize vs hetero: identical {[t['same'] for t in tok]} "
            f"({[t['tokens'] for t in tok]} tokens)")
    identity = result["greedy_identity"]
    if identity:
        log(f"greedy identity (llama-completion --temp 0 vs hetero plain, per prompt and thread count): "
            f"{[e['same_text'] for e in identity]}")
    for e in identity:
        if not e["same_text"]:
            log(f"  prompt {e['prompt']} @ {e['threads']} thr differs at char {e['first_char_difference']}: "
                f"llama.cpp {e['llama_text_there']!r} / hetero {e['hetero_text_there']!r}")
    if identity:
        log(f"hetero MTP output equals its plain output: {all(e['mtp_same_as_plain'] for e in identity)}")


def summarize(t: int, s: dict, types: list[str], depths: tuple[int, ...], with_text: bool) -> tuple[dict, list[dict]]:
    """One thread count's row (medians over rounds, ratios) and its greedy-identity entries."""
    row = {"threads": t, "llama_cpp": {}, "hetero": {}}
    L, H = row["llama_cpp"], row["hetero"]
    for typ in types:
        for n in PROMPT_LENGTHS:
            L[f"pp{n}_{typ}"] = med([bench_rate(runs, typ, n_prompt=n) for runs in s["llama_bench"]])
        L[f"tg_{typ}"] = med([bench_rate(runs, typ, n_gen=s["decode_tokens"]) for runs in s["llama_bench"]])
    for d in depths:
        L[f"depth{d}"] = med([bench_rate(runs, "f32", n_gen=DEPTH_TOKENS, n_depth=d) for runs in s["llama_bench"]])
    L["by_flash_attention"] = {  # the f32 rows by setting, per round
        **{f"pp{n}": [bench_rates(runs, "f32", n_prompt=n) for runs in s["llama_bench"]] for n in PROMPT_LENGTHS},
        "tg": [bench_rates(runs, "f32", n_gen=s["decode_tokens"]) for runs in s["llama_bench"]],
        **{f"depth{d}": [bench_rates(runs, "f32", n_gen=DEPTH_TOKENS, n_depth=d) for runs in s["llama_bench"]]
           for d in depths},
    }
    for d in depths:
        H[f"depth{d}"] = med([h["depth_decode_tps"][str(d)] for h in s["hetero"]])
    for n in PROMPT_LENGTHS:
        H[f"prefill{n}"] = med([h["prefill_tps"][str(n)] for h in s["hetero"]])
    H["decode_plain"] = med([h["decode_tps"] for h in s["hetero"]])
    row["ratios"] = {
        **{f"prefill{n}": H[f"prefill{n}"]["median"] / L[f"pp{n}_f32"]["median"] for n in PROMPT_LENGTHS},
        "decode_plain": H["decode_plain"]["median"] / L["tg_f32"]["median"],
        **{f"depth{d}": H[f"depth{d}"]["median"] / L[f"depth{d}"]["median"] for d in depths},
    }
    identity = []
    if not with_text:
        return row, identity
    # decode on text: the median over rounds of the mean over prompts
    L["text_decode"] = med([statistics.mean(x["decode_tps"] for x in rnd) for rnd in s["llama_text"]])
    L["text_decode_eval_only"] = med([statistics.mean(x["decode_tps_eval"] for x in rnd) for rnd in s["llama_text"]])
    for mode in ("plain", "mtp"):
        H[f"text_decode_{mode}"] = med([statistics.mean(x[mode]["decode_tps"] for x in rnd) for rnd in s["hetero_text"]])
    H["mtp_mean_accepted_length"] = statistics.mean(x["mtp"]["mean_accepted_length"] for rnd in s["hetero_text"] for x in rnd)
    row["ratios"]["text_decode_plain"] = H["text_decode_plain"]["median"] / L["text_decode"]["median"]
    row["ratios"]["text_decode_mtp"] = H["text_decode_mtp"]["median"] / L["text_decode"]["median"]
    # greedy identity on the text prompts (first round; later rounds must repeat it)
    for i, (lt, ht) in enumerate(zip(s["llama_text"][0], s["hetero_text"][0])):
        same = lt["text"] == ht["plain"]["text"]
        entry = {"threads": t, "prompt": i, "same_text": same, "mtp_same_as_plain": ht["mtp"]["tokens"] == ht["plain"]["tokens"],
                 "hetero_tokens": len(ht["plain"]["tokens"]), "llama_eval_runs": lt["eval_runs"],
                 "llama_stopped_at_eos": lt["stopped_at_eos"], "hetero_finish": ht["plain"]["finish_reason"]}
        if not same:
            k = first_difference(lt["text"], ht["plain"]["text"])
            entry["first_char_difference"] = k
            entry["llama_text_there"] = lt["text"][max(0, k - 40): k + 40]
            entry["hetero_text_there"] = ht["plain"]["text"][max(0, k - 40): k + 40]
        identity.append(entry)
    return row, identity


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="bundled",
                    help="checkpoint: the bundled model, or bench/checkpoints.py's large / moe random ones")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "hetero-bench"),
                    help="where the large / moe checkpoints are written (once)")
    ap.add_argument("--llama-cpp-python", default=LLAMA_CPP_PYTHON, help="sdist version that carries llama.cpp")
    ap.add_argument("--threads", nargs="+", type=int, default=sorted({1, os.cpu_count() or 1}))
    ap.add_argument("--types", nargs="+", default=["f32", "f16"], choices=["f32", "f16", "bf16"],
                    help="GGUF weight types for llama-bench; f32 is the one compared (hetero runs fp32)")
    ap.add_argument("--depths", nargs="*", type=int, help="context lengths for decode at depth (default per model)")
    ap.add_argument("--repeats", type=int, default=5, help="measured rounds per contender (each warms up first)")
    ap.add_argument("--prompts", type=int, help="text prompts for the decode-on-text rows (default per model; 0: none)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs for the build")
    ap.add_argument("--cache", default=str(cache_root()), help="where the source, build and GGUFs live")
    ap.add_argument("--out", help="result JSON (default bench/results/llama_cpp.json, llama_cpp_<model>.json)")
    ap.add_argument("--report", metavar="JSON", help="only print the summary of a JSON this script wrote")
    ap.add_argument("--worker", metavar="MODEL", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    if args.report:
        try:
            result = json.loads(Path(args.report).read_text())
        except (OSError, ValueError) as e:
            sys.exit(f"--report {args.report}: cannot read it as JSON ({type(e).__name__}: {e})")
        if not (isinstance(result, dict) and {"model", "rows", "environment", "args"} <= result.keys()):
            sys.exit(f"--report {args.report}: not a result this script wrote (run it without --report first)")
        return report(result)
    if any(t < 1 for t in args.threads) or args.repeats < 1 or any(d < 1 for d in args.depths or []):
        ap.error("--threads, --repeats and --depths take positive numbers")
    defaults = MODELS[args.model]
    depths = tuple(args.depths) if args.depths is not None else defaults["depths"]
    n_prompts = args.prompts if args.prompts is not None else defaults["prompts"]
    decode = defaults["decode_tokens"]
    out = Path(args.out or ROOT / "bench" / "results" /
               ("llama_cpp.json" if args.model == "bundled" else f"llama_cpp_{args.model}.json"))

    root = Path(args.cache)
    root.mkdir(parents=True, exist_ok=True)
    src = fetch_source(args.llama_cpp_python, root)
    llama = src / "vendor" / "llama.cpp"
    commit = llama_cpp_commit(src, args.llama_cpp_python)
    ok, what = supports_qwen35(llama)
    if not ok:
        print(f"llama-cpp-python {args.llama_cpp_python} vendors llama.cpp {commit or '(unknown commit)'}, which does "
              f"not support the Qwen3.5 architecture ({what}). Try a newer --llama-cpp-python.", file=sys.stderr)
        sys.exit(2)
    log(f"llama.cpp {commit} (from llama-cpp-python {args.llama_cpp_python}): {what}")
    built = build(src, args.jobs)
    if "f32" not in args.types:
        args.types = ["f32", *args.types]
    sys.path.insert(0, str(ROOT))
    import hetero  # noqa: F401  (before mlx, which bench.checkpoints imports: puts the fast BLAS under it)
    from bench.checkpoints import checkpoint

    model_path = checkpoint(args.model, Path(args.workdir))
    ggufs = {t: convert(src, model_path, args.model, t) for t in args.types}
    bins = src / "build" / "bin"

    prompts = text_prompts(n_prompts, 900) if n_prompts else []
    log(f"starting hetero workers on the {args.model} model (threads {args.threads}) ...")
    workers = {t: Worker(t, model_path) for t in args.threads}
    depth = workers[args.threads[0]].hello["mtp_depth"]

    # tokenizations: llama.cpp's against hetero's
    tokenization = []
    if prompts:
        hetero_ids = workers[args.threads[0]].ask(op="text", prompts=prompts, max_tokens=1)
        for p, h in zip(prompts, hetero_ids):
            ids = llama_tokenize(bins / "llama-tokenize", ggufs["f32"], p)
            tokenization.append({"tokens": len(ids), "same": ids == h["prompt_ids"],
                                 "first_difference": first_difference(ids, h["prompt_ids"])})
        log(f"prompt tokenization identical: {[t['same'] for t in tokenization]} ({[t['tokens'] for t in tokenization]} tokens)")

    samples = {t: {"llama_bench": [], "hetero": [], "llama_text": [], "hetero_text": [], "decode_tokens": decode}
               for t in args.threads}
    for rep in range(args.repeats):
        for t in args.threads:  # alternate A B A B
            s = samples[t]
            s["llama_bench"].append(llama_bench(bins / "llama-bench", ggufs, t, decode, depths))
            s["hetero"].append(workers[t].ask(op="synthetic", decode_tokens=decode, depths=list(depths)))
            if prompts:
                s["llama_text"].append([llama_complete(bins / "llama-completion", ggufs["f32"], p, t, decode)
                                        for p in prompts])
                s["hetero_text"].append(workers[t].ask(op="text", prompts=prompts, max_tokens=decode))
            log(f"round {rep + 1}/{args.repeats}, {t} thread(s): done")
    env = workers[args.threads[0]].hello["environment"]
    depth_source = workers[args.threads[0]].hello["mtp_depth_source"]
    for w in workers.values():
        w.close()

    rows, identity = [], []
    for t in args.threads:
        row, ident = summarize(t, samples[t], args.types, depths, bool(prompts))
        rows.append(row)
        identity += ident

    first = samples[args.threads[0]]["llama_bench"][0][0]
    result = {
        "model": args.model, "decode_tokens": decode, "depths": list(depths), "depth_tokens": DEPTH_TOKENS,
        "environment": {
            "cpu": cpu_model(), "cpu_flags": cpu_flags(), "cpus": os.cpu_count(), "threads": args.threads,
            "llama_cpp": {"llama_cpp_python_sdist": args.llama_cpp_python, "commit": commit,
                          "build_commit": first.get("build_commit"), "cpu_info": first.get("cpu_info"),
                          "backends": first.get("backends"), "flash_attn": first.get("flash_attn"),
                          "n_batch": first.get("n_batch"), "n_ubatch": first.get("n_ubatch"),
                          "cmake_flags": CMAKE_FLAGS, "targets": TARGETS, "build_seconds": built["seconds"],
                          "build_jobs": built["jobs"], "build_reused": built["reused"],
                          "gguf_types": args.types, "gguf_note": "backbone only (--no-mtp); gpt-2 pre-tokenizer"},
            "hetero": env, "hetero_mtp_depth": depth, "hetero_mtp_depth_source": depth_source,
        },
        "prompt_tokenization": tokenization,
        "rows": rows,
        "greedy_identity": identity,
        "args": {k: v for k, v in vars(args).items() if k != "worker"},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    log(f"wrote {out}")
    report(result)


if __name__ == "__main__":
    main()
