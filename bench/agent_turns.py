"""A synthetic coding-agent session: per turn TTFT cold vs cached, cached_tokens, and after a restart.

    python bench/agent_turns.py                       # the bundled model, up to 16K tokens
    python bench/agent_turns.py --model DIR --max-tokens 4096

The transcript (chat template) grows each turn by a tool result (held-out standard-library source) and the
model's own reply. Per turn, alternating: a cold run (no prefix cache) and the cached run (RAM prefix cache over a
disk session store); then the engine is rebuilt (empty RAM, same disk) and the same turn is run again: "restart".
Greedy; the cached and restarted replies must equal the cold one: a turn where they differ is reported at once
and the run exits with status 1 after writing its results. Targets (issue 6): a turn that adds ~200
tokens to a 16K transcript reaches its first token in <= 5% of the cold TTFT, after a restart in <= 10%.
Writes bench/results/agent_turns.json and .png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hetero.caches.prefix import PrefixCache  # noqa: E402
from hetero.caches.session import SessionStore  # noqa: E402
from hetero.engine import load  # noqa: E402
from hetero.host.blas import reexec_with_fast_blas  # noqa: E402
from hetero.host.environment import environment
from hetero.training.tokenizer_train import load_corpus  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def tool_results(engine, size: int):
    """Endless ~size-token slices of held-out source text, as a tool would return file contents."""
    _, valid = load_corpus()
    ids = engine.tokenizer.encode(valid)
    i = 0
    while True:
        if i + size > len(ids):
            i = 0
        yield engine.tokenizer.decode(ids[i : i + size])
        i += size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=16384, help="stop when the transcript reaches this length")
    ap.add_argument("--first", type=int, default=1024, help="tokens of the first tool result")
    ap.add_argument("--step", type=int, default=1024, help="tokens added per turn by the tool result")
    ap.add_argument("--last-step", type=int, default=200, help="tokens the final turn adds (the target's case)")
    ap.add_argument("--reply", type=int, default=32, help="max tokens of each reply")
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args()
    reexec_with_fast_blas()
    engine = load(args.model, dtype=mx.float32)
    if engine.max_context < args.max_tokens + args.reply:
        print(f"note: {engine.name} allows {engine.max_context} positions; stopping there", file=sys.stderr)
        args.max_tokens = engine.max_context - args.reply - 1
    store_dir = Path(tempfile.mkdtemp(prefix="hetero-agent-bench-"))
    engine.prefix_cache = PrefixCache(store=SessionStore(store_dir))
    sources = tool_results(engine, args.step)
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Read the module and fix the bug.\n" + next(tool_results(engine, args.first))}]
    rows = []
    gen = dict(max_tokens=args.reply, prefill_chunk=args.chunk)
    engine.generate("warm up", max_tokens=2, use_prefix_cache=False)
    while True:
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        n = len(engine.tokenizer.encode(prompt))
        cold = engine.generate(prompt, use_prefix_cache=False, **gen)
        # a restarted server sees the disk as it was before this turn: snapshot it before the cached run writes
        disk_before = Path(tempfile.mkdtemp(prefix="hetero-agent-restart-")) / "store"
        shutil.copytree(store_dir, disk_before)
        warm = engine.generate(prompt, **gen)
        saved = engine.prefix_cache
        engine.prefix_cache = PrefixCache(store=SessionStore(disk_before))  # restarted: that disk, empty RAM
        restart = engine.generate(prompt, **gen)
        engine.prefix_cache = saved  # continue the session with the original cache
        shutil.rmtree(disk_before.parent, ignore_errors=True)
        row = {"prompt_tokens": n, "cold_ttft_s": cold.stats["ttft_s"], "cached_ttft_s": warm.stats["ttft_s"],
               "cached_tokens": warm.stats["cached_tokens"], "restart_ttft_s": restart.stats["ttft_s"],
               "restart_cached_tokens": restart.stats["cached_tokens"],
               "same_text": cold.text == warm.text == restart.text}
        row["cached_ratio"] = round(row["cached_ttft_s"] / row["cold_ttft_s"], 4)
        row["restart_ratio"] = round(row["restart_ttft_s"] / row["cold_ttft_s"], 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if not row["same_text"]:
            print(f"MISMATCH at {n} prompt tokens: cold {cold.text!r}, cached {warm.text!r}, restarted "
                  f"{restart.text!r}", file=sys.stderr, flush=True)
        if n >= args.max_tokens - args.last_step:
            break
        room = args.max_tokens - n
        size = args.last_step if room <= args.step + args.last_step else args.step
        tool = engine.tokenizer.decode(engine.tokenizer.encode(next(sources))[:size])
        messages += [{"role": "assistant", "content": cold.text}, {"role": "user", "content": tool}]
    last = rows[-1]
    out = {
        "model": engine.name, "max_context": engine.max_context, "chunk": args.chunk, "reply_tokens": args.reply,
        "turns": rows,
        "final_turn": {"prompt_tokens": last["prompt_tokens"], "added_tokens": last["prompt_tokens"] - last["cached_tokens"],
                       "cached_ratio": last["cached_ratio"], "restart_ratio": last["restart_ratio"],
                       "target_cached_ratio": 0.05, "target_restart_ratio": 0.10},
        "environment": environment(),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "agent_turns.json").write_text(json.dumps(out, indent=1))
    plot(rows, RESULTS / "agent_turns.png")
    print(json.dumps(out["final_turn"]))
    bad = [r["prompt_tokens"] for r in rows if not r["same_text"]]
    if bad:
        sys.exit(f"FAILED: the cached or restarted reply differs from the cold one at {bad} prompt tokens")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [r["cold_ttft_s"] for r in rows], "o-", label="cold (full prefill)")
    ax.plot(x, [r["cached_ttft_s"] for r in rows], "o-", label="prefix cache (RAM)")
    ax.plot(x, [r["restart_ttft_s"] for r in rows], "o-", label="after restart (disk)")
    ax.set_xlabel("transcript tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_yscale("log")
    ax.set_title("coding-agent session: TTFT per turn")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
