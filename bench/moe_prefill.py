"""Where an MoE prefill chunk's time goes, and the two changes that cut it (issue 14's prefill target).

    python bench/moe_prefill.py                        # all parts (~5 min on 2 cores)
    python bench/moe_prefill.py --parts forms conv

- `forms`: the routed experts of one MoE block in three exact forms: "sorted" (mlx-lm's: one product per
  (token, expert) pair, ordered by expert), "grouped" with one capacity for every expert (the largest count), and
  "grouped" in buckets of experts of similar counts (`hetero.models.moe.Buckets`, what hetero runs), at
  Qwen3.5-35B-A3B's expert shape (256 experts) and the bench MoE's (64), top-8, a random router.
- `fused`: the routed experts with gate and up fused into one stacked product at load (what hetero runs) against
  the same experts unfused, at a decode step's, a verify pass's and a prefill chunk's token counts.
- `conv`: the GDN's short convolution over a 512-token chunk, MLX's depthwise `nn.Conv1d` against the shifted
  multiply-adds hetero runs (`causal_depthwise_conv`), at the channel counts of the bundled model, the bench MoE and
  Qwen3.5-35B-A3B.
- `pieces`: one 512-token chunk through each kind of block of the bench MoE checkpoint (bench/checkpoints.py MOE),
  hetero against mlx-lm on the same weights: GDN mixer, attention mixer, MoE block; with the model's layer counts,
  the chunk's total per contender (embedding and head aside).
Every figure is the fastest of `--repeats` runs, the contenders alternated run by run, after a warm-up: the fastest
run is the least disturbed on a shared machine. Writes bench/results/moe_prefill.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hetero.host.blas import reexec_with_fast_blas  # noqa: E402  (before MLX)
from hetero.host.environment import environment

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

from bench.checkpoints import MOE, checkpoint  # noqa: E402
from bench.coreml_export import alternate  # noqa: E402
from hetero.checkpoint.source import BUNDLED_MODEL, read_config  # noqa: E402
from hetero.models import moe  # noqa: E402
from hetero.models.fused import fuse  # noqa: E402
from hetero.models.qwen3_5 import ModelArgs, causal_depthwise_conv  # noqa: E402

EXPERT_SHAPES = {  # name: (experts, hidden, expert width, token counts)
    "35b-a3b": (256, 2048, 512, [64, 128, 512]),
    "bench-moe": (64, 1024, 256, [128, 512, 1024]),
}
TOP_K = 8
FUSED_SHAPES = {"qwen4": (128, 256, 128, 10), "35b-a3b": (256, 2048, 512, 8)}  # experts, hidden, width, top-k


def fastest_ms(fns: dict, repeats: int) -> dict:
    """{name: fastest of `repeats` runs in ms}, the functions alternated run by run after one warm-up each."""
    return {name: round(t["min_s"] * 1e3, 2) for name, t in alternate(fns, repeats).items()}


def forms(repeats: int) -> list[dict]:
    rows = []
    for shape, (experts, dims, width, token_counts) in EXPERT_SHAPES.items():
        glu = moe.SwitchGLU(dims, width, experts)
        glu.update({n: {"weight": mx.random.normal(p["weight"].shape) * dims**-0.5} for n, p in glu.children().items()})
        mx.eval(glu.parameters())
        for n in token_counts:
            x = mx.random.normal((1, n, dims))  # [1, N, dims]
            idx = mx.argsort(-mx.random.normal((1, n, experts)), axis=-1)[..., :TOP_K].astype(mx.uint32)  # [1, N, k]
            mx.eval(x, idx)
            flat, tokens = idx.reshape(-1), x.reshape(-1, dims)
            ms = fastest_ms({
                "sorted": lambda: mx.eval(glu(x, idx, "sorted")),
                "one_capacity": lambda: mx.eval(glu._grouped(tokens, flat, TOP_K, max_buckets=1)),
                "buckets": lambda: mx.eval(glu(x, idx, "grouped")),
            }, repeats)
            counts = np.bincount(np.array(flat), minlength=experts)
            row = {"shape": shape, "experts": experts, "tokens": n, "pairs_per_expert": n * TOP_K / experts,
                   "ms": ms, "rows_over_pairs": {
                       "one_capacity": round(experts * int(counts.max()) / flat.size, 3),
                       "buckets": round(moe.Buckets.of(np.array(flat), experts, TOP_K).rows / flat.size, 3)},
                   "buckets_vs_sorted": round(ms["buckets"] / ms["sorted"], 3),
                   "buckets_vs_one_capacity": round(ms["buckets"] / ms["one_capacity"], 3)}
            rows.append(row)
            print(f"forms {shape:9s} {n:5d} tokens ({row['pairs_per_expert']:5.1f}/expert): sorted {ms['sorted']:7.1f} "
                  f"one capacity {ms['one_capacity']:7.1f} buckets {ms['buckets']:7.1f} ms -> buckets/sorted "
                  f"{row['buckets_vs_sorted']:.2f}, buckets/one capacity {row['buckets_vs_one_capacity']:.2f}",
                  flush=True)
    return rows


def fused(repeats: int) -> list[dict]:
    """The routed experts as hetero loads them, gate and up fused into one [E, 2 x width, hidden] stack
    (`fused.fuse`), against the same experts unfused (`fuse_projections=False`), on the same weights and routing:
    a decode step (1 token, "pairs"), a verify pass (4 tokens) and a prefill chunk (512 tokens, "grouped" on the
    CPU), at Qwen3.5-35B-A3B's expert shape (top-8) and the qwen4 bench model's (128 experts of width 128 over
    hidden 256, top-10). Also checks that both give the same numbers (bitwise)."""
    rows = []
    for shape, (experts, dims, width, k) in FUSED_SHAPES.items():
        plain = moe.SwitchGLU(dims, width, experts)
        plain.update({n: {"weight": mx.random.normal(p["weight"].shape) * dims**-0.5}
                      for n, p in plain.children().items()})
        mx.eval(plain.parameters())
        glu = moe.SwitchGLU(dims, width, experts)
        glu.update(plain.parameters())
        fuse(glu)
        for n in (1, 4, 512):
            idx = mx.argsort(-mx.random.normal((1, n, experts)), axis=-1)[..., :k].astype(mx.uint32)  # [1, N, k]
            x = mx.random.normal((1, n, dims))  # [1, N, dims]
            mx.eval(idx, x)
            same = bool(mx.array_equal(glu(x, idx), plain(x, idx)).item())
            ms = fastest_ms({"separate": lambda: mx.eval(plain(x, idx)), "fused": lambda: mx.eval(glu(x, idx))},
                            repeats * (20 if n < 512 else 1))  # a few-token call is short: more runs
            form = glu.form(n, n * k)
            rows.append({"shape": shape, "tokens": n, "form": form, "ms": ms, "same": same,
                         "ratio": round(ms["fused"] / ms["separate"], 3)})
            print(f"fused {shape:9s} {n:5d} tokens ({form:7s}): routed experts, gate and up separate "
                  f"{ms['separate']:7.2f} ms, fused {ms['fused']:7.2f} ms -> {ms['fused'] / ms['separate']:.2f} "
                  f"(same numbers: {same})", flush=True)
    return rows


def conv(repeats: int) -> list[dict]:
    rows = []
    models = {"bundled": ModelArgs.from_config(read_config(BUNDLED_MODEL)), "moe": ModelArgs.from_config(MOE)}
    channels_of = {n: 2 * a.linear_num_key_heads * a.linear_key_head_dim
                   + a.linear_num_value_heads * a.linear_value_head_dim for n, a in models.items()}
    channels_of["35b-a3b"] = 2 * 16 * 128 + 32 * 128  # Qwen3.5-35B-A3B: 16 key heads, 32 value heads of 128
    for name, channels in channels_of.items():
        layer = nn.Conv1d(channels, channels, 4, groups=channels, bias=False)
        x = mx.random.normal((1, 3 + 512, channels))  # [1, K-1+S, C]
        mx.eval(layer.parameters(), x)
        diff = mx.abs(layer(x) - causal_depthwise_conv(x, layer.weight)).max().item()
        ms = fastest_ms({"conv1d": lambda: mx.eval(layer(x)),
                         "shifted_adds": lambda: mx.eval(causal_depthwise_conv(x, layer.weight))}, repeats)
        rows.append({"model": name, "channels": channels, "tokens": 512, "ms": ms, "max_abs_diff": diff,
                     "ratio": round(ms["shifted_adds"] / ms["conv1d"], 3)})
        print(f"conv {name:8s} {channels:5d} channels: conv1d {ms['conv1d']:6.1f} ms, shifted adds "
              f"{ms['shifted_adds']:6.1f} ms "
              f"(max |diff| {diff:.1e})", flush=True)
    return rows


def pieces(repeats: int, workdir: Path) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    from bench.prefill_decode import load_mlx_lm
    from hetero.checkpoint.loader import load_model
    from hetero.models.cache import GDNCache, KVCache

    path = checkpoint("moe", workdir)
    ours, _, _ = load_model(path, dtype=mx.float32)
    theirs, _ = load_mlx_lm(path)
    their_layers = theirs.language_model.model.layers
    x = mx.random.normal((1, 512, ours.args.hidden_size)) * 0.5  # [1, 512, hidden]
    mx.eval(x)
    blocks = {}
    first_attention = next(i for i, layer in enumerate(ours.model.layers) if not layer.is_linear)
    for kind, i in (("gdn", 0), ("attention", first_attention)):
        a, b = ours.model.layers[i], their_layers[i]
        if kind == "gdn":
            fns = {"hetero": lambda: mx.eval(a.linear_attn(a.input_layernorm(x), GDNCache())),
                   "mlx_lm": lambda: mx.eval(b.linear_attn(b.input_layernorm(x), None, make_prompt_cache(theirs)[i]))}
        else:
            fns = {"hetero": lambda: mx.eval(a.self_attn(a.input_layernorm(x), KVCache())),
                   "mlx_lm": lambda: mx.eval(b.self_attn(b.input_layernorm(x), "causal", make_prompt_cache(theirs)[i]))}
        blocks[kind] = fastest_ms(fns, repeats)
    a, b = ours.model.layers[0], their_layers[0]
    blocks["moe"] = fastest_ms({"hetero": lambda: mx.eval(a.mlp(a.post_attention_layernorm(x))),
                                "mlx_lm": lambda: mx.eval(b.mlp(b.post_attention_layernorm(x)))}, repeats)
    n_attention = sum(not layer.is_linear for layer in ours.model.layers)
    counts = {"gdn": len(ours.model.layers) - n_attention, "attention": n_attention, "moe": len(ours.model.layers)}
    totals = {who: round(sum(blocks[k][who] * counts[k] for k in blocks), 1) for who in ("hetero", "mlx_lm")}
    for kind, ms in blocks.items():
        print(f"pieces {kind:9s} x{counts[kind]:2d}: hetero {ms['hetero']:7.1f} ms, mlx-lm {ms['mlx_lm']:7.1f} ms "
              f"-> {ms['mlx_lm'] / ms['hetero']:.2f}x", flush=True)
    print(f"pieces chunk total: hetero {totals['hetero']:.0f} ms, mlx-lm {totals['mlx_lm']:.0f} ms -> "
          f"{totals['mlx_lm'] / totals['hetero']:.2f}x", flush=True)
    return {"tokens": 512, "blocks_ms": blocks, "layers": counts, "chunk_ms": totals,
            "speedup": round(totals["mlx_lm"] / totals["hetero"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["forms", "fused", "conv", "pieces"],
                    choices=["forms", "fused", "conv", "pieces"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "hetero-bench"))
    ap.add_argument("--out", default="bench/results/moe_prefill.json")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    reexec_with_fast_blas()
    mx.random.seed(0)
    out = {"environment": environment(), "args": vars(args)}
    if "forms" in args.parts:
        out["forms"] = forms(args.repeats)
    if "fused" in args.parts:
        out["fused"] = fused(args.repeats)
    if "conv" in args.parts:
        out["conv"] = conv(args.repeats)
    if "pieces" in args.parts:
        out["pieces"] = pieces(args.repeats, Path(args.workdir))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
