"""`python bench/ttft.py --device-model default`: `--ane-fraction auto` against GPU-only on the default user path.

Nothing about threads is set: GPU-only prefills as the two-lane CPU wavefront on both cores, MKL runs its own threads,
and the ANE lane (the reference executor in its worker process) competes for those cores. For every layout of
bench/ttft.py's `LAYOUTS` (the wide dense model, an MoE one with a shared expert, Qwen3-Next's fused projections):
`hetero tune --devices --model` at its shapes (saved as this machine's profile, as a user would), then what
`auto_fraction` decides (the line it says is kept), then GPU-only and auto alternated at every size, auto timed as
`hetero run` runs it (its split where it kept one, else the engine's own GPU-only path). Per round auto's TTFT over
GPU-only's of the same round; the median per layout and size must be at most `AUTO_AT_MOST`. JSON to
bench/results/ttft_default.json, with the machine's load per size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from bench.machine_load import LoadWindow, shared, wait_quiet
from bench.ttft import CHUNK, GPU_ONLY, LAYOUTS, QUIET_CORES, alternate, build_engine, prompt_ids, ratio_summary
from hetero.host.environment import environment

AUTO_AT_MOST = 1.02  # auto's TTFT over GPU-only's, every layout and size (issue 51)
PROFILE_KEYS = ("gpu_fp32_tflops", "ane_fp16_tflops", "prefill_lanes", "lane_threads", "cpu_cores", "lane_contention",
                "ane_on_cpu")


def auto_prefill(engine, run, ids: list[int]):
    """auto's prefill of `ids` as the engine runs it: through its split when it kept one, else GPU-only (the
    engine's own path, the CPU wavefront included)."""
    import mlx.core as mx

    from hetero.decode.prefill import prefill

    if run.plan.slices:
        split = run.splitter(len(ids))  # exported and loaded here, untimed (`hetero run` prepares it the same way)
        return lambda: split.run(ids, engine.model.make_cache(), logits=True)
    return lambda: mx.eval(prefill(engine.model, ids, engine.model.make_cache(), CHUNK)[0])


def one_layout(layout: str, sizes: list[int], repeats: int) -> dict:
    import mlx.core as mx

    from hetero.cli.measure import Sizes, measure
    from hetero.decode.prefill import prefill
    from hetero.host.settings import save_device_profile
    from hetero.pipeline import auto_fraction

    shape = LAYOUTS[layout]
    engine = build_engine(Path(os.environ["HETERO_HOME"]), shape=shape, name=layout)
    wait_quiet(QUIET_CORES)  # as a user measures: on a machine doing nothing else
    profile = measure(report=lambda line: print(f"{layout}: {line}", flush=True), sizes=Sizes.for_model(shape, CHUNK))
    save_device_profile(profile)  # what `--ane-fraction auto` reads
    said: list[str] = []
    run = auto_fraction(engine, CHUNK, report=said.append)
    print(f"{layout}: " + "\n  ".join(said), flush=True)
    row = {"shape": shape, "profile": {k: profile[k] for k in PROFILE_KEYS}, "auto_said": said,
           "auto_fraction": run.requested_fraction, "auto_offload": list(run.offload) if run.plan.slices else [],
           "sizes": {}}
    for n in sizes:
        ids = prompt_ids(n)
        runs = {GPU_ONLY: lambda ids=ids: mx.eval(prefill(engine.model, ids, engine.model.make_cache(), CHUNK)[0]),
                "auto": auto_prefill(engine, run, ids)}
        with LoadWindow() as w:
            got = alternate(runs, repeats)
        gpu, auto = ([t for t, _, _ in got[k]] for k in (GPU_ONLY, "auto"))
        row["sizes"][str(n)] = {"gpu_only_s": statistics.median(gpu), "auto_s": statistics.median(auto),
                                "auto_vs_gpu_only": ratio_summary([x / g for x, g in zip(auto, gpu)]),
                                "others_cores": [o for _, _, o in got["auto"]], "machine": w.result}
        r = row["sizes"][str(n)]
        print(f"{layout} {n:>6}: GPU-only {r['gpu_only_s']:.2f}s, auto {r['auto_s']:.2f}s: "
              f"{r['auto_vs_gpu_only']['median']:.3f}x ({r['auto_vs_gpu_only']['min']:.3f}-"
              f"{r['auto_vs_gpu_only']['max']:.3f}); machine {w.result}", flush=True)
    return row


def default_path(a: argparse.Namespace) -> None:
    sizes = [int(x) for x in a.sizes.split(",")]
    layouts = {name: one_layout(name, sizes, a.repeats) for name in a.layouts.split(",")}
    measured = {name: {n: r["auto_vs_gpu_only"]["median"] for n, r in row["sizes"].items()}
                for name, row in layouts.items()}
    doc = {"environment": environment(), "device_model": "default", "chunk": CHUNK, "repeats": a.repeats,
           "layouts": layouts, "shared_machine": shared([r["machine"] for row in layouts.values()
                                                         for r in row["sizes"].values()]),
           "target": {"auto_vs_gpu_only_at_most": AUTO_AT_MOST, "measured": measured,
                      "met": all(v <= AUTO_AT_MOST for row in measured.values() for v in row.values())}}
    (Path(a.out) / "ttft_default.json").write_text(json.dumps(doc, indent=1))
    print(f"target (auto at most {AUTO_AT_MOST}x GPU-only's TTFT, every layout and size): {doc['target']}")
