"""hetero against mlx-lm and mlx-vlm on the same checkpoint: plain and speculative greedy decoding, on the user's path.

    python bench/peers.py                                   # bundled model, 1 and 2 threads, 3 rounds
    python bench/peers.py --models bundled large --threads 2 --rounds 3 --tokens 128

Needs the bench install (`pip install -e '.[bench]'`: mlx-lm and mlx-vlm 0.7.10). Rows (each engine's own streaming
generator, greedy, fp32, EOS ignored, `--tokens` tokens after each of three short code prompts):
- hetero `Engine.stream`, plain (`mtp=False`);
- hetero `Engine.stream` with MTP at `--depth` (copy lane off), and with MTP and the copy lane (`copy=True`);
- mlx-lm `stream_generate` (it drops the checkpoint's MTP weights, so plain only);
- mlx-vlm `stream_generate`, plain, and with its Qwen3.5 MTP drafter (`load_drafter(kind="mtp")`, the checkpoint's own
  MTP head) at `draft_block_size` = depth + 1 (the same number of drafts per verify pass).

mlx-vlm's qwen3_5 config wants `mrope_section` in the text config's rope parameters, which a text-only Qwen3.5
checkpoint (the bundled one) lacks: the script writes a copy of the config with it into a temporary directory (the
weights and tokenizer are linked, never modified). For text the three position axes are equal, so any split of the
rotary frequencies gives standard RoPE.

Every measurement is a fresh process (`--worker`) that imports hetero first, so MLX runs on the same BLAS in every
process (hetero/host/blas.py: MKL on x86-64 Linux); each records the BLAS it found. `--threads N` runs it under
`taskset -c 0..N-1` with MKL_NUM_THREADS=OMP_NUM_THREADS=N. A process loads its engine, warms up once (16 tokens),
then decodes the three prompts; its decode tok/s is the time-weighted rate over them (tokens after the first over
the time from the first token to the last, timed around the engine's own generator, detokenization included).
Rounds alternate the engine order (forward, then backward) and the thread counts; reported: the median over rounds,
with the spread. Greedy identity: every engine's tokens on every prompt and round are compared with hetero plain's
first round; any difference is printed, written to the JSON, and makes the script exit with status 1 after writing
its results. An engine that cannot run a model (it fails to load, say) is recorded with its one-line reason and the
run goes on. Writes bench/results/peers.json (peers_<model>.json for the others) and a PNG bar plot beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = "RESULT "  # prefix of the worker's answer line
PROMPTS = (  # short code prompts (the bundled model learned from Python source)
    'import os\nimport sys\n\n\ndef main(argv):\n    """Parse the command line and run."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
)
# engine name -> (library, speculative, copy lane); the order is the table's and a round's
ENGINES = {
    "hetero": ("hetero", False, False),
    "hetero mtp": ("hetero", True, False),
    "hetero mtp+copy": ("hetero", True, True),
    "mlx-lm": ("mlx-lm", False, False),
    "mlx-vlm": ("mlx-vlm", False, False),
    "mlx-vlm mtp": ("mlx-vlm", True, False),
}
REFERENCE = "hetero"  # the engine whose tokens every other one must repeat
# (name in the JSON, numerator, denominator)
RATIOS = (
    ("hetero / mlx-lm", "hetero", "mlx-lm"),
    ("hetero / mlx-vlm", "hetero", "mlx-vlm"),
    ("hetero mtp / mlx-vlm mtp", "hetero mtp", "mlx-vlm mtp"),
    ("hetero mtp+copy / mlx-vlm mtp", "hetero mtp+copy", "mlx-vlm mtp"),
)
WARMUP_TOKENS = 16


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------- pure helpers (tests/test_bench_peers.py)


def mrope_section(text_config: dict) -> list[int]:
    """A 3-axis M-RoPE split of the rotary frequency pairs of `text_config` (head_dim x partial_rotary_factor / 2),
    in Qwen3.5's proportions ([11, 11, 10] for its 64 rotary dims)."""
    rope = text_config.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", text_config.get("partial_rotary_factor", 1.0))
    head_dim = text_config.get("head_dim") or text_config["hidden_size"] // text_config["num_attention_heads"]
    pairs = int(head_dim * factor) // 2
    first = -(-pairs // 3)  # ceil
    return [first, first, pairs - 2 * first]


def with_mrope_section(config: dict) -> dict:
    """`config` (a checkpoint's config.json, nested under text_config or flat) with `mrope_section` added to its
    rope parameters, as mlx-vlm's qwen3_5 config requires; the input is left unchanged, and an existing section kept."""
    out = json.loads(json.dumps(config))
    text = out.get("text_config", out)
    rope = dict(text.get("rope_parameters") or {"rope_type": "default", "rope_theta": text.get("rope_theta", 10000.0),
                                                 "partial_rotary_factor": text.get("partial_rotary_factor", 0.25)})
    rope.setdefault("mrope_section", mrope_section({**text, "rope_parameters": rope}))
    text["rope_parameters"] = rope
    return out


def mlx_vlm_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of checkpoint `src` at `dst` that mlx-vlm loads: config.json rewritten by `with_mrope_section`, the
    tokenizer's files by `padded_tokenizer`, every other file a symbolic link to `src`'s (nothing under `src` is
    written)."""
    dst.mkdir(parents=True, exist_ok=True)
    rewritten = ("config.json", "tokenizer.json", "tokenizer_config.json")
    for f in Path(src).iterdir():
        if f.name not in rewritten and f.is_file() and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    config = json.loads((Path(src) / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(with_mrope_section(config), indent=2))
    files = {name: json.loads((Path(src) / name).read_text()) for name in rewritten[1:]}
    padded = padded_tokenizer(*files.values(), (config.get("text_config") or config)["vocab_size"])
    for name, content in zip(files, padded):
        (dst / name).write_text(json.dumps(content))
    return dst


def padded_tokenizer(tokenizer: dict, tokenizer_config: dict, vocab_size: int) -> tuple[dict, dict]:
    """A tokenizer's tokenizer.json and tokenizer_config.json with special tokens added so that it names every id
    below `vocab_size`. The large random checkpoint borrows the bundled tokenizer (4,096 tokens) for a vocabulary
    of 8,192, and its greedy tokens go past the tokenizer's end, where mlx-vlm's streaming detokenizer indexes out
    of its list. No id the tokenizer had changes, so every engine still decodes the same token ids."""
    tokenizer, tokenizer_config = json.loads(json.dumps(tokenizer)), json.loads(json.dumps(tokenizer_config))
    known = set(tokenizer["model"]["vocab"].values()) | {t["id"] for t in tokenizer["added_tokens"]}
    decoder = tokenizer_config.setdefault("added_tokens_decoder", {})
    for i in range(vocab_size):
        if i not in known:
            token = {"content": f"<|bench_pad_{i}|>", "single_word": False, "lstrip": False, "rstrip": False,
                     "normalized": False, "special": True}
            tokenizer["added_tokens"].append({"id": i, **token})
            decoder[str(i)] = token
    return tokenizer, tokenizer_config


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the token lists differ (a length difference counts at the shorter's end); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mismatches(reference: list[list[int]], runs: dict[str, list[list[list[int]]]]) -> list[dict]:
    """Every (engine, round, prompt) whose tokens differ from `reference` (one token list per prompt): where they
    first differ and both sides' tokens from there. `runs[engine][round][prompt]` is a token list."""
    found = []
    for engine, rounds in runs.items():
        for r, outputs in enumerate(rounds):
            for p, (want, got) in enumerate(zip(reference, outputs)):
                k = first_difference(want, got)
                if k is not None:
                    found.append({"engine": engine, "round": r, "prompt": p, "first_difference": k,
                                  "reference_tokens": want[k:k + 8], "tokens": got[k:k + 8],
                                  "reference_length": len(want), "length": len(got)})
    return found


def decode_rate(prompts: list[dict]) -> float:
    """Time-weighted decode tok/s over one process's prompts: tokens after each first one over the time they took."""
    tokens = sum(p["tokens_timed"] for p in prompts)
    seconds = sum(p["decode_s"] for p in prompts)
    return tokens / seconds if seconds > 0 else 0.0


def thread_command(threads: int, cpus: int | None) -> tuple[list[str], dict[str, str]]:
    """(command prefix, environment) that give a process `threads` cores and BLAS threads: `taskset -c 0..N-1`
    where taskset exists and the machine has more cores than that, and MKL_NUM_THREADS = OMP_NUM_THREADS = N."""
    env = {"MKL_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    prefix = []
    if shutil.which("taskset") and (cpus or 0) > threads:
        prefix = ["taskset", "-c", ",".join(str(i) for i in range(threads))]
    return prefix, env


# ---------------------------------------------------------------- the worker: one engine in a fresh process


def _timed(stream, token_of) -> tuple[list[int], list[float]]:
    """Drain `stream`; token_of(item) is a generated token id or None. Returns the ids and when each arrived."""
    tokens, stamps = [], []
    for item in stream:
        t = token_of(item)
        if t is not None:
            tokens.append(int(t))
            stamps.append(time.perf_counter())
    return tokens, stamps


def _hetero(path: str | None, speculative: bool, copy: bool, depth: int):
    import mlx.core as mx

    import hetero
    from hetero.decode.request import Finished, GenerationRequest, Token

    engine = hetero.load(path, dtype=mx.float32)
    engine.eos_ids = set()  # EOS ignored: every engine decodes exactly the tokens asked for
    last = {}

    def token_of(event):
        if isinstance(event, Finished):
            last["stats"] = event.stats
        return event.id if isinstance(event, Token) else None

    def generate(ids: list[int], n: int) -> tuple[list[int], list[float], dict]:
        request = GenerationRequest(ids, max_tokens=n, mtp=speculative, draft_depth=depth if speculative else None,
                                    copy=copy, use_prefix_cache=False)
        tokens, stamps = _timed(engine.stream(request), token_of)
        mtp = last["stats"].get("mtp")
        return tokens, stamps, {"mean_accepted_length": mtp["mean_accepted_length"]} if mtp else {}

    return generate


def _mlx_lm(path: str):
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    model, tokenizer = load(path)
    model.set_dtype(mx.float32)
    tokenizer.eos_token_ids = set()

    def generate(ids: list[int], n: int) -> tuple[list[int], list[float], dict]:
        tokens, stamps = _timed(stream_generate(model, tokenizer, ids, max_tokens=n), lambda r: r.token)
        return tokens, stamps, {}

    return generate


def _mlx_vlm(path: str, speculative: bool, depth: int):
    import mlx.core as mx
    from mlx_vlm import load, stream_generate

    model, processor = load(path)
    model.set_dtype(mx.float32)
    tokenizer = getattr(processor, "tokenizer", processor)
    tokenizer.stopping_criteria = lambda token: False  # EOS ignored
    options = {}
    drafter = None
    if speculative:
        from mlx_vlm.speculative.drafters import load_drafter

        drafter, kind = load_drafter(path, kind="mtp")
        drafter.set_dtype(mx.float32)
        options = {"draft_model": drafter, "draft_kind": kind, "draft_block_size": depth + 1}

    def generate(ids: list[int], n: int) -> tuple[list[int], list[float], dict]:
        # one result per token, then a closing one (finish_reason set) that repeats the last token
        stream = stream_generate(model, processor, "", input_ids=mx.array([ids]), max_tokens=n, temperature=0.0,
                                 **options)
        tokens, stamps = _timed(stream, lambda r: r.token if r.finish_reason is None else None)
        extra = {}
        if drafter is not None and drafter.accept_lens:
            extra["mean_accepted_length"] = 1 + statistics.mean(drafter.accept_lens)
        return tokens, stamps, extra

    return generate


def worker(spec: dict) -> None:
    """Load one engine, warm it up, decode every prompt; print one RESULT line."""
    import hetero  # noqa: F401  (first: the fast BLAS under MLX in this process, whichever engine it runs)
    import hetero.host.blas

    library, speculative, copy = ENGINES[spec["engine"]]
    t0 = time.perf_counter()
    if library == "hetero":
        generate = _hetero(spec["hetero_path"], speculative, copy, spec["depth"])
    elif library == "mlx-lm":
        generate = _mlx_lm(spec["path"])
    else:
        generate = _mlx_vlm(spec["vlm_path"], speculative, spec["depth"])
    load_s = time.perf_counter() - t0
    generate(spec["prompts"][0], WARMUP_TOKENS)
    prompts = []
    for ids in spec["prompts"]:
        t0 = time.perf_counter()
        tokens, stamps, extra = generate(ids, spec["tokens"])
        prompts.append({"tokens": tokens, "ttft_s": stamps[0] - t0 if stamps else None,
                        "tokens_timed": max(0, len(tokens) - 1),
                        "decode_s": stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0, **extra})
    print(RESULT + json.dumps({
        "decode_tps": decode_rate(prompts), "load_s": load_s, "prompts": prompts, "blas": hetero.host.blas.describe(),
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }), flush=True)


def measure(spec: dict, threads: int, timeout: float) -> dict:
    """Run one worker in a fresh process with `threads` cores and BLAS threads; its result, or {"error": one line}."""
    prefix, env = thread_command(threads, os.cpu_count())
    env = {**os.environ, **env, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    cmd = [*prefix, sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    try:
        out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in out.stdout.splitlines() if line.startswith(RESULT)]
    if out.returncode != 0 or not lines:
        return {"error": failure_line(out.stderr + out.stdout, out.returncode)}
    return json.loads(lines[-1][len(RESULT):])


def failure_line(output: str, status: int) -> str:
    """One line for a failed worker: its last line (the exception), with where a traceback says it was raised."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if not lines:
        return f"exit status {status}"
    frames = [m for line in lines if (m := re.match(r'File "(.+)", line (\d+), in (\S+)', line))]
    where = ""
    if frames:
        file, line, func = frames[-1].groups()
        where = f" (in {func}, {'/'.join(Path(file).parts[-2:])}:{line})"
    return (lines[-1] + where)[:300]


# ---------------------------------------------------------------- the run


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def run_model(name: str, path: Path, args: argparse.Namespace, workdir: Path) -> dict:
    from hetero.checkpoint.source import BUNDLED_MODEL
    from hetero.checkpoint.tokenizer import Tokenizer

    vlm_path = mlx_vlm_checkpoint(path, workdir / f"mlx-vlm-{name}")
    tokenizer = Tokenizer.from_dir(path)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    spec = {"path": str(path), "vlm_path": str(vlm_path), "prompts": prompts, "tokens": args.tokens,
            "depth": args.depth, "hetero_path": None if Path(path) == Path(BUNDLED_MODEL) else str(path)}
    engines = list(args.engines)
    runs = {t: {e: [] for e in engines} for t in args.threads}
    failed: dict[int, dict[str, str]] = {t: {} for t in args.threads}
    for r in range(args.rounds):
        order = engines if r % 2 == 0 else engines[::-1]
        for t in (args.threads if r % 2 == 0 else args.threads[::-1]):
            for e in order:
                if e in failed[t]:
                    continue
                res = measure({**spec, "engine": e}, t, args.timeout)
                if "error" in res:
                    failed[t][e] = res["error"]
                    log(f"{name}, {t} thread(s), {e}: FAILED: {res['error']}")
                    continue
                runs[t][e].append(res)
                log(f"{name} round {r + 1}/{args.rounds}, {t} thread(s), {e:16s} {res['decode_tps']:7.1f} tok/s "
                    f"(load {res['load_s']:.1f} s)")

    rows, problems = {}, []
    for t in args.threads:
        ref = runs[t].get(REFERENCE) or []
        if not ref:
            problems.append({"threads": t, "problem": f"no {REFERENCE} run to compare the others with"})
        tokens = {e: [[p["tokens"] for p in res["prompts"]] for res in rs] for e, rs in runs[t].items() if rs}
        found = mismatches(tokens[REFERENCE][0], tokens) if ref else []
        for m in found:
            m["threads"] = t
        problems.extend(found)
        table = {}
        for e in engines:
            if e in failed[t] and not runs[t][e]:
                table[e] = {"failed": failed[t][e]}
                continue
            rs = runs[t][e]
            row = {"decode_tps": spread([res["decode_tps"] for res in rs]),
                   "ttft_s": statistics.median(p["ttft_s"] for res in rs for p in res["prompts"]),
                   "load_s": statistics.median(res["load_s"] for res in rs),
                   "greedy_identical": not any(m["engine"] == e for m in found),
                   "blas": sorted({res["blas"] for res in rs}), "affinity": rs[0]["affinity"]}
            if e in failed[t]:
                row["failed_later"] = failed[t][e]
            accepted = [p["mean_accepted_length"] for res in rs for p in res["prompts"] if "mean_accepted_length" in p]
            if accepted:
                row["mean_accepted_length"] = statistics.mean(accepted)
            table[e] = row
        ratios = {}
        for label, a, b in RATIOS:
            if "decode_tps" in table.get(a, {}) and "decode_tps" in table.get(b, {}):
                ratios[label] = table[a]["decode_tps"]["median"] / table[b]["decode_tps"]["median"]
        blas = sorted({b for row in table.values() for b in row.get("blas", [])})
        rows[str(t)] = {"engines": table, "ratios": ratios, "blas": blas, "same_blas": len(blas) == 1}
    return {"model": name, "path": str(path), "prompts": list(PROMPTS), "prompt_tokens": [len(p) for p in prompts],
            "tokens": args.tokens, "depth": args.depth, "rounds": args.rounds, "threads": rows,
            "mismatches": problems}


def report(result: dict) -> None:
    log(f"\n{result['model']} model: decode tok/s, median of {result['rounds']} rounds (min-max), "
        f"{result['tokens']} greedy tokens after each of {len(result['prompts'])} prompts, EOS ignored, "
        f"MTP depth {result['depth']}")
    for t, block in result["threads"].items():
        log(f"  {t} thread(s)")
        for e, row in block["engines"].items():
            if "failed" in row:
                log(f"    {e:16s} failed: {row['failed']}")
                continue
            d = row["decode_tps"]
            acc = f"  accepted length {row['mean_accepted_length']:.2f}" if "mean_accepted_length" in row else ""
            same = "same tokens" if row["greedy_identical"] else "TOKENS DIFFER"
            log(f"    {e:16s} {d['median']:7.1f}  ({d['min']:.1f}-{d['max']:.1f})  {same}{acc}")
        log("    " + ", ".join(f"{k} {v:.2f}x" for k, v in block["ratios"].items()))
        log(f"    BLAS: {block['blas'][0]}" if block["same_blas"] else f"    NOTE: DIFFERENT BLAS: {block['blas']}")
    for m in result["mismatches"]:
        log(f"  MISMATCH: {json.dumps(m)}")


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = list(result["threads"])
    engines = [e for e in ENGINES if e in result["threads"][threads[0]]["engines"]]
    width = 0.8 / len(engines)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, e in enumerate(engines):
        rows = [result["threads"][t]["engines"].get(e, {}) for t in threads]
        med = [r["decode_tps"]["median"] if "decode_tps" in r else 0 for r in rows]
        lo = [m - r["decode_tps"]["min"] if "decode_tps" in r else 0 for m, r in zip(med, rows)]
        hi = [r["decode_tps"]["max"] - m if "decode_tps" in r else 0 for m, r in zip(med, rows)]
        ax.bar([k + i * width for k in range(len(threads))], med, width, yerr=[lo, hi], capsize=3, label=e)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(threads))], [f"{t} thread(s)" for t in threads])
    ax.set_ylabel("decode tok/s (median, min-max)")
    ax.set_title(f"{result['model']} model: hetero vs mlx-lm / mlx-vlm, greedy, {result['tokens']} tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=["bundled", "large"], default=["bundled"],
                    help="the bundled model, or bench/checkpoints.py's large random one")
    ap.add_argument("--threads", nargs="+", type=int, default=sorted({1, min(2, os.cpu_count() or 1)}),
                    help="cores and BLAS threads per process (taskset + MKL_NUM_THREADS)")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds (one process per engine per round)")
    ap.add_argument("--tokens", type=int, default=128, help="greedy tokens decoded after each prompt")
    ap.add_argument("--depth", type=int, default=3, help="MTP draft depth (mlx-vlm: draft_block_size depth + 1)")
    ap.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one measuring process may take")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "hetero-bench"),
                    help="where the large checkpoint and the mlx-vlm config copies are written")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    if any(t < 1 for t in args.threads) or args.rounds < 1 or args.tokens < 2 or args.depth < 1:
        ap.error("--threads, --rounds and --depth take positive numbers, --tokens at least 2")
    if REFERENCE not in args.engines:
        args.engines = [REFERENCE, *args.engines]  # the greedy reference always runs
    sys.path.insert(0, str(ROOT))
    import hetero  # noqa: F401  (before MLX, which bench.checkpoints imports: the fast BLAS under it)
    from bench.checkpoints import checkpoint
    from hetero.host.environment import environment

    env = environment()
    from importlib import metadata

    for dist in ("mlx-lm", "mlx-vlm"):
        try:
            env["versions"][dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env["versions"][dist] = None
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(args.workdir)
    failed_identity = False
    with tempfile.TemporaryDirectory(prefix="hetero-peers-") as tmp:
        for name in args.models:
            result = run_model(name, checkpoint(name, workdir), args, Path(tmp))
            result["environment"] = env
            result["args"] = {k: v for k, v in vars(args).items() if k != "worker"}
            stem = "peers" if name == "bundled" else f"peers_{name}"
            (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
            plot(result, out_dir / f"{stem}.png")
            report(result)
            log(f"wrote {out_dir / (stem + '.json')} and {stem}.png")
            failed_identity |= bool(result["mismatches"])
    if failed_identity:
        sys.exit("greedy tokens differ between engines (MISMATCH lines above, `mismatches` in the JSON)")


if __name__ == "__main__":
    main()
