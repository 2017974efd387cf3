"""hetero as an embedded prefill accelerator for mlx-lm: `hetero.prefill` + mlx-lm decoding against mlx-lm alone.

    python bench/embed.py                  # a 16K-token prompt on the bundled model, 2 repeats
    python bench/embed.py --tokens 4096 --repeats 3

One mlx-lm model (`mlx_lm.load` of the bundled checkpoint, in fp32, the CPU's fast dtype) serves every contender:
  - mlx-lm alone: `mlx_lm.stream_generate(model, tokenizer, prompt)`;
  - hetero.prefill: `cache = hetero.prefill(model, prompt[:-1])` on mlx-lm's own weight arrays, then
    `mlx_lm.stream_generate(model, tokenizer, prompt[-1:], prompt_cache=cache)`;
  - hetero.prefill, split: the same with `ane_fraction="auto"` (this machine's measured profile; the ANE lane is
    the reference executor here, one BLAS thread per lane).
TTFT is the time from the call to mlx-lm's first generated token, prefill included. The contenders alternate after
a warm-up; medians. Greedy tokens must be identical across contenders, or the run exits with status 1 after
writing bench/results/embed.json.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # one BLAS thread per lane, as in bench/ttft.py
from hetero.host.blas import reexec_with_fast_blas  # noqa: E402
from hetero.host.environment import environment

TARGET = 0.5  # hetero.prefill + mlx-lm decoding TTFT / mlx-lm alone


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "embed.json"))
    args = ap.parse_args()
    reexec_with_fast_blas()
    os.environ["HETERO_HOME"] = tempfile.mkdtemp(prefix="hetero-embed-")  # the measured profile and exports

    import mlx.core as mx
    import numpy as np
    from mlx_lm import load, stream_generate

    import hetero
    from hetero.checkpoint.source import BUNDLED_MODEL
    from hetero.cli.measure import Sizes, measure
    from hetero.host.settings import save_device_profile

    model, tokenizer = load(str(BUNDLED_MODEL))
    model.set_dtype(mx.float32)
    config = json.loads((Path(BUNDLED_MODEL) / "config.json").read_text())
    save_device_profile(measure(report=lambda line: print(line, flush=True),
                                sizes=Sizes.for_model(config.get("text_config", config), 512)))
    prompt = np.random.default_rng(0).integers(10, config.get("text_config", config)["vocab_size"], args.tokens).tolist()

    def decode(prompt_ids: list[int], cache=None, t0: float | None = None) -> tuple[float, list[int]]:
        t0 = time.perf_counter() if t0 is None else t0
        first, tokens = None, []
        for r in stream_generate(model, tokenizer, prompt_ids, max_tokens=args.decode_tokens, prompt_cache=cache):
            first = first or time.perf_counter() - t0
            tokens.append(int(r.token))
        return first, tokens

    def mlx_lm_alone(ids: list[int]) -> tuple[float, list[int]]:
        return decode(ids)

    def embedded(fraction):
        def run(ids: list[int]) -> tuple[float, list[int]]:
            t0 = time.perf_counter()
            cache = hetero.prefill(model, ids[:-1], ane_fraction=fraction, tokenizer=tokenizer)
            return decode(ids[-1:], cache, t0)
        return run

    contenders = {"mlx-lm alone": mlx_lm_alone, "hetero.prefill": embedded(0.0), "hetero.prefill split": embedded("auto")}
    warm = prompt[:600]
    for run in contenders.values():
        run(warm)  # warm-up: compiles, allocates, exports the split's programs for the short bucket
    embedded("auto")(prompt)  # exports the long prompt's buckets outside the timed runs
    times: dict[str, list[float]] = {name: [] for name in contenders}
    outputs: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        for name, run in contenders.items():  # alternate
            ttft, tokens = run(prompt)
            times[name].append(ttft)
            outputs[name] = tokens
            print(f"{name:22s} TTFT {ttft:7.2f} s", flush=True)
    base = statistics.median(times["mlx-lm alone"])
    rows = {name: {"ttft_s": statistics.median(t), "ttft_runs_s": t, "vs_mlx_lm": statistics.median(t) / base,
                   "same_tokens_as_mlx_lm": outputs[name] == outputs["mlx-lm alone"]} for name, t in times.items()}
    for name, row in rows.items():
        print(f"{name:22s} {row['ttft_s']:7.2f} s  {row['vs_mlx_lm']:.2f}x mlx-lm alone  "
              f"same tokens: {row['same_tokens_as_mlx_lm']}")
    doc = {"environment": environment(), "prompt_tokens": args.tokens, "decode_tokens": args.decode_tokens,
           "rows": rows, "target": {"hetero_prefill_vs_mlx_lm": rows["hetero.prefill"]["vs_mlx_lm"],
                                    "at_or_below": TARGET, "met": rows["hetero.prefill"]["vs_mlx_lm"] <= TARGET}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    if not all(row["same_tokens_as_mlx_lm"] for row in rows.values()):
        sys.exit("FAILED: a contender's greedy tokens differ from mlx-lm alone's")


if __name__ == "__main__":
    main()
