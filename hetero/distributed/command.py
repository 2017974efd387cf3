"""`hetero run` when `mlx.launch` started it on more than one rank: rank 0 prints the output, the others serve;
`pipelined`, the start every pipelined command shares (join, load the rank's share, serve or lead)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import numpy as np

import hetero
from hetero.decode.options import DecodeOptions
from hetero.distributed.group import connect
from hetero.distributed.runtime import PipelineEngine, load_stage, serve
from hetero.errors import HeteroError
from hetero.host.progress import ProgressBar
from hetero.validate import read_prompt

VERIFY_RTOL = 1e-4  # pipelined logits against one process: fp32 rounding at most (the same ops run on each rank)


def run_pipelined(args: argparse.Namespace, options: DecodeOptions) -> int | None:
    """Run `hetero run` (its decode `options` from its flags) across the ranks; None when the group has one rank (the
    caller runs in-process)."""
    if not args.ane_fraction.gpu_only or args.trace:
        raise HeteroError("--ane-fraction and --trace are not available in a pipelined (mlx.launch) run")
    return pipelined(args.model, args.dist_timeout, lambda engine: _run(engine, args, options))


def pipelined(model: str | None, dist_timeout: float, lead: Callable[[PipelineEngine], int]) -> int | None:
    """Join the ranks (`dist_timeout`: `--dist-timeout`) and load this rank's share of `model`; rank 0 runs
    `lead(engine)` on the pipelined engine, then stops the others, which serve it meanwhile. None when the group
    has one rank."""
    link = connect(dist_timeout)
    if link is None:
        return None
    try:
        try:
            stage, path, config = load_stage(link, model)
        except HeteroError as e:
            if link.first:
                raise
            raise HeteroError(f"rank {link.rank}: {e}") from None  # every rank says it; rank 0's line comes unprefixed
        span = f"layers {stage.share.layers.start}..{stage.share.layers.stop - 1}"
        if not link.first:
            print(f"[hetero rank {link.rank}/{link.size} pid {os.getpid()}: {span}, serving rank 0]", file=sys.stderr,
                  flush=True)
            serve(stage)
            return 0
        engine = PipelineEngine(stage, path, config, "bundled" if model is None else str(model))
        try:
            return lead(engine)
        finally:
            engine.close()
    finally:
        link.close()


def _run(engine: PipelineEngine, args: argparse.Namespace, options: DecodeOptions) -> int:

    prompt = read_prompt(args.prompt)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = engine.generate(prompt, options=options, chat=args.chat, on_text=None if args.json else write,
                             progress=ProgressBar("prefill"))
    status, extra = 0, {}
    if args.verify:
        extra["verify"] = verify(engine, args, prompt, result, options)
        status = 0 if extra["verify"]["match"] else 3
    s = result.stats
    if args.json:
        print(json.dumps({"text": result.text, "tokens": result.tokens, **s, **extra}))
        return status
    sys.stdout.write("\n")
    mtp = s.get("mtp")
    spec = f"; MTP depth {mtp['depth']}, {mtp['mean_accepted_length']} tokens/pass" if mtp and mtp["rounds"] else ""
    ranks = ", ".join(f"rank {r}: layers {p['layers'][0]}..{p['layers'][1]}, peak {p['peak_memory_bytes'] / 1e6:.1f} MB"
                      for r, p in enumerate(s["pipeline"]["per_rank"]))
    print(f"[{s['prompt_tokens']} prompt tokens, {s['generated_tokens']} generated; TTFT {s['ttft_s']:.3f}s, prefill "
          f"{s['prefill_tps']:.1f} tok/s, decode {s['decode_tps']:.1f} tok/s{spec}]\n[pipeline: {ranks}]", file=sys.stderr)
    if "verify" in extra:
        v = extra["verify"]
        print(f"[verify against one process: {'MATCH' if v['match'] else 'MISMATCH'}; max |logit diff| "
              f"{v['max_abs_logit_diff']:.3g}, greedy {v['tokens_identical']} tokens identical]", file=sys.stderr)
    return status


def verify(engine: PipelineEngine, args: argparse.Namespace, prompt: str, result, options: DecodeOptions) -> dict:
    """Rerun the request in this process on the whole model (loaded here) and compare tokens and logits."""

    single = hetero.load(args.model)
    depth = (result.stats.get("mtp") or {}).get("depth")
    ref = single.generate(prompt, options=options, seed=result.stats["seed"], mtp=depth is not None, draft_depth=depth,
                          chat=args.chat, use_prefix_cache=False)
    ids = engine.encode_prompt(prompt, args.chat) + result.tokens
    ids = ids[: engine.max_context - 1]
    got, want = engine.logits(ids, args.prefill_chunk), single.logits(ids, args.prefill_chunk)  # [S, V] each
    diff = float(np.abs(got - want).max())
    same = ref.tokens == result.tokens
    return {
        "match": same and diff <= VERIFY_RTOL * max(1.0, float(np.abs(want).max())),
        "max_abs_logit_diff": diff,
        "tokens_identical": same,
        "compared_tokens": len(ref.tokens),
        "positions": len(ids),
    }
