"""Batched decoding (hetero.decode.stepper) against round-robin turns, with 1, 2, 4 and 8 concurrent greedy requests.

    python bench/batched.py                          # both models; JSON under bench/results/batched.json
    python bench/batched.py --models bundled --batch-sizes 1 2 --tokens 4 --repeats 1   # a smoke run
    python bench/batched.py --models qwen4 --part decode --out bench/results/batched_qwen4.json

For each model (the bundled one, bench/checkpoints.py's ~540 MB random one, or `qwen4`: a random scaled-down
Qwen4-Exp built in memory, `QWEN4`), each decode mode (plain, and MTP
at --depth) and each number n of concurrent requests (prompts of different lengths, every request decoding
--tokens tokens):
  batched      one `Batch`: every round runs one backbone pass for all n requests;
  round-robin  what `hetero serve` did before batching (hetero.decode.turns): n generators, one token each in turn.
Both start once every request has prefilled and produced its first token (round-robin's `generate_tokens` has
queued its next step by then: one step per request ahead, a bias of 1 / (--tokens - 1) in its favour, kept rather
than hidden); reported: aggregate decode tokens/s
(tokens after the first, all requests, over the wall time until the last request finishes), the speedup of
batched over round-robin and over one request alone, and each request's latency (seconds until its last token,
and that over its tokens). Greedy outputs of the two must be identical, request by request, or the run exits
with status 1 after writing its results. Each contender first runs once at full length untimed (every shape it meets is
compiled then); the contenders alternate within each repeat; medians over repeats.

--part attention times the attention layouts alone (the choice hetero.decode.stepper made): per-request attention over
each request's own KV, against one padded call over all requests' KV with a mask, with and without the copy that
gathering per-request caches into the padded layout costs every step.

--part serve times the server's path (`hetero serve` on loopback): one request alone and 4 concurrent ones, with
--max-batch 1 against the default batch, alternated.

--part linear times the large model's weight products with n rows both ways: x @ W.T (MLX's form, sgemm with
M = n) against (W @ x.T).T (M = output channels), the choice hetero.models.linear makes for few rows on the CPU.
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
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkpoints import LARGE, checkpoint  # noqa: E402
from hetero.cli.measure import median_seconds  # noqa: E402
from hetero.decode.sampling import Sampler, SamplingParams  # noqa: E402
from hetero.decode.solo import decode_tokens  # noqa: E402
from hetero.decode.solo import decode_tokens  # noqa: E402
from hetero.decode.stepper import Batch  # noqa: E402
from hetero.engine import load  # noqa: E402
from hetero.host.blas import reexec_with_fast_blas  # noqa: E402
from hetero.host.environment import environment
from hetero.models.qwen3_5 import Model, ModelArgs  # noqa: E402

GREEDY = SamplingParams()

# Qwen4-Exp (Flash-Next's layout) scaled down: 4 hyper-connection streams, QSA on every fourth layer (a budget of 64
# tokens, so the prompts here attend sparsely), PLE on the first two GDN layers, 16 experts top-4 plus a shared one,
# one MTP layer. Random weights in memory (the routed experts start at zero, as SwitchLinear does): the model
# proper, whose decode is what the batch changes, not a checkpoint's loading.
QWEN4 = dict(
    model_type="qwen4_exp_text", hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
    head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    vocab_size=8192, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
    shared_expert_intermediate_size=256, hc_count=4, hc_lowrank=32, ple_layer_ids=[1, 2], ple_embed_dim=128,
    ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=20_000, split_ngram_parts=1, indexer_n_heads=8,
    indexer_head_dim=64, indexer_budget=64, indexer_compress_ratio=4, output_gate_type="sigmoid",
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    mtp_num_hidden_layers=1, eos_token_id=1,  # pads the n-gram context; the runs here stop at their length
)


def qwen4_model():
    """The random `QWEN4` model with its MTP head, fp32."""
    from hetero.models.qwen4_exp.args import Qwen4Args
    from hetero.models.qwen4_exp.model import Model as Qwen4Model

    mx.random.seed(0)
    model = Qwen4Model(Qwen4Args.from_config(QWEN4), with_mtp=True)
    mx.eval(model.parameters())
    return model


def prompts_for(vocab: int, n: int, base: int) -> list[list[int]]:
    """n prompts of different lengths (base, base + 37, ...) of random ids (the models are random or tiny)."""
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, base + 37 * i).tolist() for i in range(n)]


def batched(model, prompts: list[list[int]], tokens: int, depth: int) -> dict:
    batch = Batch(model, max_batch=len(prompts))
    requests = [batch.join(p, Sampler(GREEDY), tokens, set(), depth) for p in prompts]
    t0 = time.perf_counter()
    finish = {}
    rounds = 0
    for _ in batch.drain():
        rounds += 1
        now = time.perf_counter() - t0
        finish.update({id(r): now for r in requests if r.done and id(r) not in finish})
    return {"outputs": [r.tokens for r in requests], "seconds": time.perf_counter() - t0, "rounds": rounds,
            "finish_s": [finish.get(id(r), 0.0) for r in requests]}


def round_robin(model, prompts: list[list[int]], tokens: int, depth: int) -> dict:
    def gen(p):
        if depth == 0:
            return decode_tokens(model, p, Sampler(GREEDY), tokens, set())
        return decode_tokens(model, p, Sampler(GREEDY), tokens, set(), depth=depth, copy=False)

    gens = [gen(p) for p in prompts]
    outputs = [[next(g)] for g in gens]  # prefill and first token, before the clock starts
    t0 = time.perf_counter()
    finish = [0.0] * len(gens)
    live = list(range(len(gens)))
    while live:
        for i in list(live):
            tok = next(gens[i], None)
            if tok is None:
                finish[i] = time.perf_counter() - t0
                live.remove(i)
            else:
                outputs[i].append(tok)
    return {"outputs": outputs, "seconds": time.perf_counter() - t0, "finish_s": finish}


def model_part(name: str, args: argparse.Namespace) -> dict:
    if name == "qwen4":
        model = qwen4_model()
    else:
        path = None if name == "bundled" else str(checkpoint(name, Path(args.workdir)))
        model = load(path, dtype=mx.float32).model  # as bench/mtp.py: fp32 runs fastest on the CPU backend
    kinds = {"plain": ("plain", 0), "mtp": (f"mtp depth {args.depth}", args.depth)}
    modes = dict(kinds[k] for k in args.modes)
    base = args.prompt_tokens
    rows, identical = {}, True
    for mode, depth in modes.items():
        for n in args.batch_sizes:
            prompts = prompts_for(model.args.vocab_size, n, base)
            for warm in (batched, round_robin):  # warm-up at full length: every shape a run meets (each batch size
                warm(model, prompts, args.tokens, depth)  # as rows finish, each verify width) is compiled before timing
            samples: dict[str, list[dict]] = {"batched": [], "round_robin": []}
            for _ in range(args.repeats):
                for kind, fn in (("batched", batched), ("round_robin", round_robin)):
                    samples[kind].append(fn(model, prompts, args.tokens, depth))
            same = all(b["outputs"] == r["outputs"] for b, r in zip(samples["batched"], samples["round_robin"]))
            identical &= same
            decoded = n * (args.tokens - 1)
            row = {"identical": same}
            for kind, runs in samples.items():
                secs = statistics.median(r["seconds"] for r in runs)
                latency = [statistics.median(r["finish_s"][i] for r in runs) for i in range(n)]
                row[kind] = {"aggregate_tps": decoded / secs, "seconds": secs, "latency_s": latency,
                             "latency_ms_per_token": [1e3 * s / (args.tokens - 1) for s in latency]}
            row["speedup_vs_round_robin"] = row["batched"]["aggregate_tps"] / row["round_robin"]["aggregate_tps"]
            rows.setdefault(mode, {})[n] = row
            one = rows[mode].get(1) or rows[mode][min(rows[mode])]
            row["batched_vs_one_request"] = row["batched"]["aggregate_tps"] / one["batched"]["aggregate_tps"]
            print(f"{name} {mode:12s} n={n}: batched {row['batched']['aggregate_tps']:7.1f} tok/s "
                  f"({row['batched_vs_one_request']:.2f}x one request), round-robin "
                  f"{row['round_robin']['aggregate_tps']:7.1f} tok/s, batched/round-robin "
                  f"{row['speedup_vs_round_robin']:.2f}x, identical {same}", flush=True)
    return {"modes": rows, "prompt_tokens": base, "decode_tokens": args.tokens, "greedy_identical": identical}


def attention_part(args: argparse.Namespace) -> dict:
    """Attention alone, the large model's shape (8 query heads, 2 KV heads, head dim 128), S queries per request."""
    H, Hkv, D, S = 8, 2, 128, args.depth + 1
    out = {}
    for n in args.batch_sizes:
        lengths = [args.context * (i + 1) // n for i in range(n)]  # ragged: up to --context
        keys = [mx.random.normal((1, Hkv, L, D)) for L in lengths]
        values = [mx.random.normal((1, Hkv, L, D)) for L in lengths]
        q = mx.random.normal((n, H, S, D))
        Lmax = max(lengths)
        pad = lambda a, L: mx.pad(a, [(0, 0), (0, 0), (0, Lmax - L), (0, 0)])  # noqa: E731
        kp = mx.concatenate([pad(k, L) for k, L in zip(keys, lengths)])
        vp = mx.concatenate([pad(v, L) for v, L in zip(values, lengths)])
        cols = mx.arange(Lmax)[None, None, None, :]  # key position
        rows = (mx.array(lengths)[:, None, None, None] - S + mx.arange(S)[None, None, :, None])  # query position
        mask = (cols <= rows) & (cols < mx.array(lengths)[:, None, None, None])  # [n, 1, S, Lmax]
        mx.eval(keys, values, q, kp, vp, mask)
        scale = D**-0.5
        sdpa = mx.fast.scaled_dot_product_attention

        def per_request():
            mx.eval([sdpa(q[i : i + 1], keys[i], values[i], scale=scale, mask="causal") for i in range(n)])

        def padded_copy():
            k = mx.concatenate([pad(k, L) for k, L in zip(keys, lengths)])
            v = mx.concatenate([pad(v, L) for v, L in zip(values, lengths)])
            mx.eval(sdpa(q, k, v, scale=scale, mask=mask))

        def padded_shared():
            mx.eval(sdpa(q, kp, vp, scale=scale, mask=mask))

        row = {f: median_seconds(fn, args.repeats * 5) * 1e3 for f, fn in
               (("per_request_ms", per_request), ("padded_with_copy_ms", padded_copy),
                ("padded_shared_buffer_ms", padded_shared))}
        out[n] = {"context_lengths": lengths, **row}
        print(f"attention n={n} contexts {lengths}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    return out


def large_weights() -> list[mx.array]:
    """The large model's weight matrices [out, in], random fp32 (what a CPU decode step multiplies by): every
    layer's, and the tied lm_head last."""
    model = Model(ModelArgs.from_config(LARGE), with_mtp=False)
    weights = [w for name, w in tree_flatten(model.parameters()) if w.ndim == 2 and "embed" not in name]
    weights.append(model.model.embed_tokens.weight)  # the tied lm_head
    mx.eval(weights)
    return weights


def linear_part(args: argparse.Namespace) -> dict:
    """Every weight shape of the large model times n rows both ways (hetero.models.linear's choice): x @ W.T, what
    MLX does, against (W @ x.T).T; the products of one decode step, each layer's matrices once."""
    from hetero.models import linear

    weights = large_weights()
    out = {}
    for n in args.batch_sizes + [3, 5, 6]:
        x = {w.shape[1]: mx.random.normal((n, w.shape[1])) for w in weights}
        mx.eval(list(x.values()))
        plain = median_seconds(lambda: mx.eval([x[w.shape[1]] @ w.T for w in weights]), args.repeats * 5)
        transposed = median_seconds(lambda: mx.eval([(w @ x[w.shape[1]].T).T for w in weights]), args.repeats * 5)
        chosen = "transposed" if n in linear.TRANSPOSED_ROWS else "plain"
        out[n] = {"plain_ms": plain * 1e3, "transposed_ms": transposed * 1e3, "hetero_uses": chosen}
    one = out[1]["plain_ms"]
    for n, row in sorted(out.items()):
        row["plain_vs_one_row"], row["transposed_vs_one_row"] = row["plain_ms"] / one, row["transposed_ms"] / one
        print(f"linear n={n}: x @ W.T {row['plain_ms']:.1f} ms ({row['plain_vs_one_row']:.2f}x one row), "
              f"(W @ x.T).T {row['transposed_ms']:.1f} ms ({row['transposed_vs_one_row']:.2f}x); hetero uses "
              f"{row['hetero_uses']}", flush=True)
    return out


def serve_part(args: argparse.Namespace) -> dict:
    """The server's path: `hetero serve` on loopback (uvicorn, the real app) with --max-batch 1 against the default
    batch (`SERVE_MAX_BATCH`), alternated: one request alone (its decode tok/s, from the response's stats), then
    n = 4 concurrent requests (aggregate decode tok/s over the wall time)."""
    import socket
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import uvicorn

    from hetero.server.app import SERVE_MAX_BATCH, ServerSettings, create_app

    engine = load(None, dtype=mx.float32)
    prompts = [engine.tokenizer.decode(p) for p in prompts_for(engine.model.args.vocab_size, 4, args.prompt_tokens)]

    def server(max_batch: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        app = create_app(engine, ServerSettings(port=port, max_batch=max_batch, draft_depth=args.depth,
                                                no_session_cache=True))
        srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=srv.run, daemon=True).start()
        while not srv.started:
            time.sleep(0.02)
        return srv, f"http://127.0.0.1:{port}/v1/completions"

    def one(url: str, prompt: str) -> dict:
        body = {"model": "bundled", "prompt": prompt, "max_tokens": args.tokens, "temperature": 0, "mtp": True}
        r = httpx.post(url, json=body, timeout=600)
        r.raise_for_status()
        return r.json()

    out: dict = {}
    servers = {b: server(b) for b in (1, SERVE_MAX_BATCH)}
    try:
        for b, (_, url) in servers.items():  # warm-up: every shape compiled once
            one(url, prompts[0])
        alone = {b: [] for b in servers}
        together = {b: [] for b in servers}
        for _ in range(args.repeats):
            for b, (_, url) in servers.items():
                alone[b].append(one(url, prompts[0])["hetero"]["decode_tps"])
                t0 = time.perf_counter()
                with ThreadPoolExecutor(len(prompts)) as pool:
                    replies = list(pool.map(lambda p: one(url, p), prompts))
                tokens = sum(r["usage"]["completion_tokens"] - 1 for r in replies)
                together[b].append(tokens / (time.perf_counter() - t0))
        for b in servers:
            out[f"max_batch_{b}"] = {"alone_decode_tps": statistics.median(alone[b]),
                                     "four_aggregate_tps": statistics.median(together[b]),
                                     "alone_runs": alone[b], "four_runs": together[b]}
        base, batched_ = out["max_batch_1"], out[f"max_batch_{SERVE_MAX_BATCH}"]
        out["alone_ratio"] = batched_["alone_decode_tps"] / base["alone_decode_tps"]
        out["four_ratio"] = batched_["four_aggregate_tps"] / base["four_aggregate_tps"]
        print(f"serve, bundled, MTP depth {args.depth}: one request alone {base['alone_decode_tps']:.1f} tok/s with "
              f"--max-batch 1, {batched_['alone_decode_tps']:.1f} with {SERVE_MAX_BATCH} ({out['alone_ratio']:.2f}x); "
              f"4 concurrent {base['four_aggregate_tps']:.1f} / {batched_['four_aggregate_tps']:.1f} aggregate tok/s "
              f"({out['four_ratio']:.2f}x)", flush=True)
    finally:
        for srv, _ in servers.values():
            srv.should_exit = True
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=["bundled", "large", "qwen4"], default=["bundled", "large"])
    ap.add_argument("--part", choices=["decode", "attention", "linear", "serve", "all"], default="all")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded per request")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="the shortest prompt; request i adds 37 i")
    ap.add_argument("--depth", type=int, default=3, help="MTP draft depth")
    ap.add_argument("--modes", nargs="+", choices=["plain", "mtp"], default=["plain", "mtp"],
                    help="decode modes to time (MTP on the random large model accepts almost nothing)")
    ap.add_argument("--context", type=int, default=4096, help="longest context of the attention part")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "hetero-bench"))
    ap.add_argument("--out", default="bench/results/batched.json")
    args = ap.parse_args()
    if args.tokens < 2:
        ap.error("--tokens must be at least 2 (the first token comes from the prefill)")
    reexec_with_fast_blas()
    result: dict = {"environment": environment(), "args": vars(args)}
    if args.part in ("decode", "all"):
        for name in args.models:
            result[name] = model_part(name, args)
    if args.part in ("attention", "all"):
        result["attention"] = attention_part(args)
    if args.part in ("linear", "all"):
        result["linear"] = linear_part(args)
    if args.part in ("serve", "all"):
        result["serve"] = serve_part(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    differ = [name for name in args.models if name in result and not result[name]["greedy_identical"]]
    if differ:  # a speed of wrong output is no result
        sys.exit(f"FAILED: batched greedy output differs from round-robin on {', '.join(differ)}")


if __name__ == "__main__":
    main()
