"""Prefill and plain-decode throughput: hetero against its peers, same checkpoint, same run.

    python bench/prefill_decode.py                      # bundled, a ~540 MB random one and a random MoE, 512 / 4K / 16K
    python bench/prefill_decode.py --lengths 512 4096 --models bundled --repeats 3
    python bench/prefill_decode.py --models moe         # the MoE one only (bench/checkpoints.py MOE: 64 experts, top-8)
    python bench/prefill_decode.py --models qwen4       # a random scaled-down Qwen3.8-Flash-Next (bench/checkpoints.py
                                                        # QWEN4), 4K tokens, against transformers and mlx-vlm

The Qwen3.5 family's peer is mlx-lm's `stream_generate`. Qwen4-Exp's are transformers (torch on the CPU, the prompt in
one forward pass, then one cached step per token) and mlx-vlm (its `language_model` with its own cache, the prompt in
steps of 2048 tokens as its server prefills, then one step per token); mlx-lm has no qwen4_exp. Every engine loads the
same files, runs in fp32 (the CPU's fast dtype), gets the same prompts (random token ids), the same threads and BLAS,
a warm-up, and they alternate A B C A B C. Greedy decoding, no EOS stop. Prints the ratios (hetero / the best peer)
and writes JSON to bench/results/prefill_decode.json (`--models qwen4`: prefill_decode_qwen4.json). Every engine
must produce the same tokens: a row where they differ is reported and the run exits with status 1 (a speed of wrong
output is no result), except where experts route (see ROUTING_NEAR_TIES).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hetero.host.blas import reexec_with_fast_blas  # noqa: E402
from hetero.host.environment import environment
from bench.checkpoints import CHECKPOINTS, checkpoint  # noqa: E402
from hetero.checkpoint.loader import load_model  # noqa: E402
from hetero.decode.records import DecodeTimes  # noqa: E402
from hetero.decode.sampling import Sampler, SamplingParams  # noqa: E402
from hetero.decode.solo import decode_tokens  # noqa: E402

# Why an MoE checkpoint's greedy tokens may part: on the same input both engines' routers pick the same experts for
# every token (measured: 2048 tokens x 20 layers, none differ), but a router whose k-th and (k+1)-th probabilities
# are within rounding (5 of those 40,960 within 1e-5 relative) flips on the ~1e-7 differences two engines' sums
# carry, and a token with another expert set moves the logits of later positions by ~0.1 (a dense model has no such
# switch: its tokens stay identical). The speed figures do not depend on it; the test suite checks MoE parity.
ROUTING_NEAR_TIES = "an MoE router near-tie flipped by rounding, not an error; see ROUTING_NEAR_TIES"


def load_transformers(path: Path):
    """transformers' own class for the checkpoint (the config's `architectures`), fp32, on the CPU's threads."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(str(path), dtype=torch.float32).eval()


def run_transformers(model, prompt: list[int], n_tokens: int) -> tuple[float, float, list[int]]:
    """(prefill tok/s, decode tok/s, the greedy tokens): the prompt in one forward pass, then one cached step per
    token; prefill ends with the first token, decode counts the tokens after it."""
    import torch

    with torch.inference_mode():
        start = time.perf_counter()
        out = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        tokens = [int(out.logits[0, -1].argmax())]
        prefilled = time.perf_counter()
        for _ in range(n_tokens - 1):
            out = model(input_ids=torch.tensor([tokens[-1:]]), cache=out.cache, use_cache=True)  # 5.25: `cache`
            tokens.append(int(out.logits[0, -1].argmax()))
        done = time.perf_counter()
    return len(prompt) / (prefilled - start), (n_tokens - 1) / (done - prefilled), tokens


DEFAULT_LENGTHS = {"qwen4": [4096]}  # transformers' dense 16K-token attention would take the hour on two cores
MLX_VLM_PREFILL_STEP = 2048  # mlx-vlm's server prefills in steps of this many tokens (`prefill_step_size`)


def load_mlx_vlm(path: Path):
    """mlx-vlm's model for the checkpoint, in fp32."""
    from mlx_vlm.utils import load_model as vlm_load

    model = vlm_load(path)
    model.set_dtype(mx.float32)
    return model


def run_mlx_vlm(model, prompt: list[int], n_tokens: int) -> tuple[float, float, list[int]]:
    """(prefill tok/s, decode tok/s, the greedy tokens): mlx-vlm's language model over its own cache, the prompt in
    steps of MLX_VLM_PREFILL_STEP tokens, then one step per token."""
    lm = model.language_model
    cache = lm.make_cache()
    start = time.perf_counter()
    for i in range(0, len(prompt), MLX_VLM_PREFILL_STEP):
        logits = lm(mx.array([prompt[i : i + MLX_VLM_PREFILL_STEP]]), cache=cache).logits
        mx.eval(logits)
    tokens = [int(mx.argmax(logits[0, -1]))]
    prefilled = time.perf_counter()
    for _ in range(n_tokens - 1):
        logits = lm(mx.array([tokens[-1:]]), cache=cache).logits
        tokens.append(int(mx.argmax(logits[0, -1])))
    done = time.perf_counter()
    return len(prompt) / (prefilled - start), (n_tokens - 1) / (done - prefilled), tokens


def peers_for(name: str) -> dict:
    """The peers a checkpoint is measured against: peer -> (load(path), run(model, prompt, n_tokens))."""
    if name == "qwen4":  # mlx-lm has no qwen4_exp
        return {"transformers": (load_transformers, run_transformers), "mlx_vlm": (load_mlx_vlm, run_mlx_vlm)}
    return {"mlx_lm": (load_mlx_lm, run_mlx_lm)}


def run_hetero(model, prompt: list[int], n_tokens: int) -> tuple[float, float, list[int]]:
    """(prefill tok/s, decode tok/s, the greedy tokens)."""
    times = DecodeTimes()
    tokens = list(decode_tokens(model, prompt, Sampler(SamplingParams()), n_tokens, set(), times=times))
    return times.prefill_tps, times.decode_tps, tokens


def run_mlx_lm(loaded, prompt: list[int], n_tokens: int) -> tuple[float, float, list[int]]:
    """(prefill tok/s, decode tok/s, the greedy tokens)."""
    from mlx_lm import stream_generate

    model, tokenizer = loaded
    last, tokens = None, []
    for last in stream_generate(model, tokenizer, prompt, max_tokens=n_tokens):
        tokens.append(int(last.token))
    return last.prompt_tps, last.generation_tps, tokens


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (a length difference counts); None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def load_mlx_lm(path: Path):  # -> (model, tokenizer)
    from mlx_lm import load

    model, tokenizer = load(str(path))
    model.set_dtype(mx.float32)  # the same compute dtype as hetero on the CPU
    tokenizer._eos_token_ids = set()  # never stop early: both decode exactly decode_tokens
    return model, tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["bundled", "large", "moe"], choices=list(CHECKPOINTS))
    ap.add_argument("--lengths", nargs="+", type=int, default=None,
                    help="prompt lengths (default: 512 4096 16384; qwen4: 4096)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="measured runs per contender (after one warm-up)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "hetero-bench"))
    ap.add_argument("--out", default=None, help="JSON file (default: bench/results/prefill_decode.json; "
                    "--models qwen4 alone: prefill_decode_qwen4.json)")
    args = ap.parse_args()
    reexec_with_fast_blas()

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    for name in args.models:
        path = checkpoint(name, workdir)
        ours, _, _ = load_model(path, dtype=mx.float32)
        peers = {peer: (load(path), run) for peer, (load, run) in peers_for(name).items()}
        vocab = ours.args.vocab_size
        warm = rng.integers(3, vocab, 128).tolist()
        run_hetero(ours, warm, 4)
        for model, run in peers.values():
            run(model, warm, 4)
        routed = bool(ours.args.num_experts)
        for length in args.lengths or DEFAULT_LENGTHS.get(name, [512, 4096, 16384]):
            prompt = rng.integers(3, vocab, length).tolist()
            samples = {"hetero": [], **{peer: [] for peer in peers}}
            for _ in range(args.repeats):  # alternate A B C A B C
                samples["hetero"].append(run_hetero(ours, prompt, args.decode_tokens))
                for peer, (model, run) in peers.items():
                    samples[peer].append(run(model, prompt, args.decode_tokens))
            row = {"model": name, "prompt_tokens": length, "decode_tokens": args.decode_tokens, "peers": list(peers)}
            diffs = [first_difference(h[2], p[2]) for peer in peers for h, p in zip(samples["hetero"], samples[peer])]
            row["same_tokens"] = all(d is None for d in diffs)
            if not row["same_tokens"]:
                row["first_difference"] = min(d for d in diffs if d is not None)
                print(f"{'MISMATCH' if not routed else 'note'}: {name} {length} tok: hetero and {'/'.join(peers)} "
                      f"differ from generated token {row['first_difference']}"
                      + (f" ({ROUTING_NEAR_TIES})" if routed else ""), file=sys.stderr, flush=True)
                row["exact_expected"] = not routed
            for who, runs in samples.items():
                pre, dec = [r[0] for r in runs], [r[1] for r in runs]
                row[who] = {
                    "prefill_tps": statistics.median(pre), "prefill_tps_runs": pre,
                    "decode_tps": statistics.median(dec), "decode_tps_runs": dec,
                }
            best = max(peers, key=lambda peer: row[peer]["prefill_tps"])  # the peer hetero must beat
            row["best_peer"] = best
            row["prefill_ratio"] = row["hetero"]["prefill_tps"] / row[best]["prefill_tps"]
            row["decode_ratio"] = row["hetero"]["decode_tps"] / max(row[p]["decode_tps"] for p in peers)
            row["ratios"] = {p: {"prefill": row["hetero"]["prefill_tps"] / row[p]["prefill_tps"],
                                 "decode": row["hetero"]["decode_tps"] / row[p]["decode_tps"]} for p in peers}
            rows.append(row)
            theirs = ", ".join(f"{p} {row[p]['prefill_tps']:.1f}" for p in peers)
            theirs_dec = ", ".join(f"{p} {row[p]['decode_tps']:.1f}" for p in peers)
            print(
                f"{name:8s} {length:6d} tok | prefill hetero {row['hetero']['prefill_tps']:9.1f} tok/s, {theirs} -> "
                f"{row['prefill_ratio']:.2f}x | decode hetero {row['hetero']['decode_tps']:7.1f}, {theirs_dec} -> "
                f"{row['decode_ratio']:.2f}x",
                flush=True,
            )
        del ours, peers
    if args.out is None:  # Qwen4-Exp's peers differ: its rows get their own file
        args.out = f"bench/results/prefill_decode{'_qwen4' if args.models == ['qwen4'] else ''}.json"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = environment()
    for package in ("torch", "transformers", "mlx_vlm"):  # the peers' versions, where they ran
        if package in sys.modules:
            env["versions"][package] = getattr(sys.modules[package], "__version__", "?")
    out.write_text(json.dumps({"environment": env, "rows": rows, "args": vars(args)}, indent=1))
    print(f"wrote {out}")
    bad = [f"{r['model']}@{r['prompt_tokens']}" for r in rows if not r["same_tokens"] and r.get("exact_expected", True)]
    if bad:
        sys.exit(f"FAILED: hetero and mlx-lm produced different tokens for {', '.join(bad)}")


if __name__ == "__main__":
    main()
