"""The quality and speed cost of quantized KV (`--kv-bits 8|4`) against full-precision KV, in one process.

    python bench/kv_bits.py                     # JSON under bench/results/kv_bits.json

For each model (the bundled one, and `real27`: a random checkpoint with Qwen3.5-27B's attention and GDN head shapes,
see bench/checkpoints.py) and each prompt length (2K and 16K tokens of the project's own Python sources, which the
bundled model's tokenizer reads as text), every KV setting prefills the same prompt once (chunks of 512, GPU-only
path), then:
- greedy: 24 greedy tokens decoded from its own cache; agreement = positions equal to full KV's 24 (and the
  common prefix);
- KL: teacher-forced along full KV's greedy tokens, KL(full || quantized) of the next-token distributions at the
  prompt's last position and after each of the first 23 tokens (mean and max over those 24), and top-1 agreement;
- speed: plain greedy decoding of `--tokens` tokens from a copy of the prefilled cache (`decode_tokens`, the
  engine's decode path), settings alternated (full, 8, 4, full, ...) `--repeats` times; tok/s = 1 / the median time
  of all their decode steps (robust to the bursts of other work on a shared machine), with the step-time quartiles,
  each run's own tok/s, and the ratio to full KV.
The environment (BLAS, threads, versions) and the machine's load go into the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GREEDY_TOKENS = 24


def text_ids(tokenizer, n: int) -> list[int]:
    """The first n tokens of the project's Python sources, concatenated in a fixed order."""
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "hetero").rglob("*.py")))
    ids = tokenizer.encode(text)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def clone(cache):
    """An independent copy of a prefilled cache (KV rows as stored, GDN arrays are immutable)."""
    from hetero.models.cache import GDNCache, KVCache, ModelCache

    def one(c):
        if isinstance(c, KVCache):
            k = c.like()
            if c.offset:
                k.install([c.rows(0, c.offset)])
            return k
        g = GDNCache()
        g.conv, g.recurrent, g.offset = c.conv, c.recurrent, c.offset
        return g

    return ModelCache([one(c) for c in cache.backbone], [one(c) for c in cache.mtp])


def log_softmax(x):
    import mlx.core as mx

    x = x.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def run_setting(model, ids: list[int], full_tokens: list[int] | None) -> dict:
    """Prefill ids[:-1] + the last token; greedy decode; teacher-forced log-probs along `full_tokens` (or its own)."""
    import mlx.core as mx

    from hetero.decode.prefill import prefill

    cache = model.make_cache()
    t0 = time.perf_counter()
    prefill(model, ids[:-1], cache, 512)
    mx.eval([a for c in cache for a in c.state])
    prefill_s = time.perf_counter() - t0
    base = clone(cache)  # prefilled up to the last prompt token: the speed runs start here
    logits, _ = model(mx.array([ids[-1:]]), cache)  # [1, 1, V]
    own, forced = [], [log_softmax(logits[0, -1])]
    teacher = clone(cache) if full_tokens is not None else None
    for i in range(GREEDY_TOKENS):
        t = int(mx.argmax(logits[0, -1]).item())
        own.append(t)
        logits, _ = model(mx.array([[t]]), cache)
        if teacher is None and i < GREEDY_TOKENS - 1:
            forced.append(log_softmax(logits[0, -1]))
    if teacher is not None:
        for t in full_tokens[: GREEDY_TOKENS - 1]:
            out, _ = model(mx.array([[t]]), teacher)
            forced.append(log_softmax(out[0, -1]))
    mx.eval(forced)
    return {"tokens": own, "logprobs": forced, "base": base, "prefill_s": prefill_s}


def step_times(model, ids: list[int], base, tokens: int) -> list[float]:
    """Seconds between consecutive tokens of one plain greedy decode from a copy of `base` (the first token, which
    also runs the last prompt token, left out)."""
    import mlx.core as mx

    from hetero.decode.sampling import Sampler, SamplingParams
    from hetero.decode.solo import decode_tokens

    cache = clone(base)
    mx.eval([a for c in cache for a in c.state])
    stamps = [time.perf_counter() for _ in decode_tokens(model, ids, Sampler(SamplingParams(0.0)), tokens, set(),
                                                         cache=cache, skip=len(ids) - 1)]
    return [b - a for a, b in zip(stamps, stamps[1:])]


def measure(engine, n: int, settings: list[int | None], tokens: int, repeats: int) -> dict:
    import mlx.core as mx

    from hetero.models.kv_quant import kv_quant, use_kv_quant

    model = engine.model
    ids = text_ids(engine.tokenizer, n)
    runs = {}
    for bits in settings:  # None first: the others are compared with it
        use_kv_quant(model, kv_quant(bits))
        full = runs.get(None)
        runs[bits] = run_setting(model, ids, None if full is None else full["tokens"])
    full = runs[None]
    rows = []
    for bits in settings:
        r = runs[bits]
        pairs = list(zip(full["logprobs"], r["logprobs"]))
        kl = [float(mx.sum(mx.exp(p) * (p - q)).item()) for p, q in pairs]  # fp32: values near 1e-7 are rounding
        top1 = sum(int(mx.argmax(p).item()) == int(mx.argmax(q).item()) for p, q in pairs)
        same = [a == b for a, b in zip(full["tokens"], r["tokens"])]
        prefix = next((i for i, s in enumerate(same) if not s), len(same))
        rows.append({"kv_bits": bits, "greedy_agreement": sum(same), "greedy_common_prefix": prefix,
                     "greedy_of": GREEDY_TOKENS, "kl_mean": statistics.mean(kl), "kl_max": max(kl),
                     "teacher_forced_top1": top1, "prefill_s": round(r["prefill_s"], 3),
                     "kv_bytes": sum(a.nbytes for c in r["base"] if hasattr(c, "like") for a in c.rows(0, c.offset))})
    steps: dict = {bits: [] for bits in settings}  # every decode step's time, per setting
    runs_tps: dict = {bits: [] for bits in settings}
    for _ in range(repeats):  # alternated: full, 8, 4, full, 8, 4, ...
        for bits in settings:
            use_kv_quant(model, kv_quant(bits))
            dt = step_times(model, ids, runs[bits]["base"], tokens)
            steps[bits] += dt
            runs_tps[bits].append(round(len(dt) / sum(dt), 2))
    use_kv_quant(model, None)
    base_tps = 1 / statistics.median(steps[None])
    for row in rows:
        dt = sorted(steps[row["kv_bits"]])
        tps = 1 / statistics.median(dt)
        row.update(decode_tps=round(tps, 2), decode_ratio_to_full=round(tps / base_tps, 3),
                   step_ms_quartiles=[round(1e3 * dt[len(dt) // 4], 2), round(1e3 * dt[len(dt) // 2], 2),
                                      round(1e3 * dt[3 * len(dt) // 4], 2)],
                   decode_tps_runs=runs_tps[row["kv_bits"]])
    return {"prompt_tokens": n, "settings": rows, "load": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["bundled", "real27"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 16384])
    ap.add_argument("--tokens", type=int, default=33, help="tokens per decode-speed run")
    ap.add_argument("--repeats", type=int, default=5, help="alternated decode-speed runs per setting")
    ap.add_argument("--workdir", default="/tmp/hetero-bench", help="where the random checkpoint is written once")
    ap.add_argument("--out", default="bench/results/kv_bits.json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import hetero  # before MLX: the fast BLAS under it
    from bench.checkpoints import checkpoint
    from hetero.host.environment import environment

    result = {"greedy_tokens": GREEDY_TOKENS, "environment": environment(), "models": []}
    for name in args.models:
        engine = hetero.load(checkpoint(name, Path(args.workdir)))
        engine.generate([5, 6, 7], max_tokens=4, mtp=False)  # warm-up
        entry = {"model": name, "config": {k: engine.model.args.__dict__.get(k) for k in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")},
            "rows": []}
        for n in args.contexts:
            row = measure(engine, n, [None, 8, 4], args.tokens, args.repeats)
            entry["rows"].append(row)
            for s in row["settings"]:
                print(f"{name} {n:6d} kv_bits={s['kv_bits']}: greedy {s['greedy_agreement']}/{GREEDY_TOKENS} "
                      f"(prefix {s['greedy_common_prefix']}), KL mean {s['kl_mean']:.2e} max {s['kl_max']:.2e}, "
                      f"top-1 {s['teacher_forced_top1']}/{GREEDY_TOKENS}, decode {s['decode_tps']} tok/s "
                      f"({s['decode_ratio_to_full']}x), prefill {s['prefill_s']} s", flush=True)
        result["models"].append(entry)
        Path(args.out).write_text(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
