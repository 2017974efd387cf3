"""`hetero doctor`'s checks of the real split on a loaded model: each lane's rate, a split prefill with the two lanes'
overlap, every program the split loaded checked in the ANE lane's worker (numbers, placement, CPU fallback), the split
against the GPU-only run, and the memory each lane holds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from hetero.cli.measure import ane_lane, gpu_lane
from hetero.coreml.backends.diagnose import failure_line
from hetero.pipeline import configure, verify

DOCTOR_PROMPT = "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n"
PADDED_ROWS = 37  # rows of the padded last chunk each program is checked on: the rest are zeros, as in a prompt


def check_split(engine, worker, tokens: int, fraction: float, chunk: int, weights: str,
                report: Callable[[str], None]) -> dict:
    """Rates, a split prefill of `tokens` tokens, its programs checked in `worker`, the verification against the
    GPU-only run and the memory: the findings, `run` (the configured split) and `split` (its prefill) included."""
    out: dict = {}
    gpu_flops, gpu_bw = gpu_lane(repeats=3)
    _, ane_flops, call_s = ane_lane(hidden=512, channels=1024, repeats=3, loader=worker.load)
    out["rates"] = r = {"gpu_matmul_gflops": round(gpu_flops / 1e9, 1), "gpu_bandwidth_gbs": round(gpu_bw / 1e9, 1),
                        "ane_mlp_gflops": round(ane_flops / 1e9, 1), "ane_call_ms": round(call_s * 1e3, 3)}
    report(f"rates: GPU lane {r['gpu_matmul_gflops']} GFLOP/s matmul, {r['gpu_bandwidth_gbs']} GB/s; ANE lane "
           f"{r['ane_mlp_gflops']} GFLOP/s on an MLP program, {r['ane_call_ms']} ms per call (through the worker)")

    n = min(tokens, engine.model.args.max_position_embeddings - 64)
    ids = (engine.tokenizer.encode(DOCTOR_PROMPT * (1 + n // 16)))[:n]
    run = configure(engine, fraction, chunk, weights=weights)
    split = run.splitter(n)  # exported on first use (cached for the next doctor or run)
    split.run(ids, engine.model.make_cache(), logits=True)  # warm: programs loaded, compiled functions traced
    mx.reset_peak_memory()
    res = split.run(ids, engine.model.make_cache(), logits=True)
    out["split"] = p = {"tokens": n, "fraction": fraction, "effective_fraction": round(run.effective_fraction, 4),
                        **res.to_dict(), "busy_sum_s": _s(res.gpu_busy_s + res.ane_busy_s),
                        "ipc_share_of_ane_lane": round(res.ipc_s / res.ane_busy_s, 4) if res.ane_busy_s else 0.0,
                        "functions_loaded": split.programs.loaded_functions()}
    report(f"split prefill of {n} tokens at ANE fraction {fraction} ({p['effective_fraction']:.2f} of the FLOPs): "
           f"wall {p['wall_s']:.3f} s against {p['busy_sum_s']:.3f} s of both lanes' busy time (GPU "
           f"{p['gpu_busy_s']:.3f} s, ANE {p['ane_busy_s']:.3f} s): overlap {p['overlap']:.2f}; IPC {p['ipc_s']:.3f} s "
           f"({p['ipc_share_of_ane_lane']:.1%} of the ANE lane)")
    if run.plan.ranges is not None:  # how far the programs' measured values stay inside fp16, per piece kind
        p["fp16_headroom_bits"], p["kept_on_gpu_for_range"] = run.plan.ranges.headroom(), run.plan.ranges.kept_on_gpu()
        report("fp16 headroom (bits below 65504, measured on the GPU lane): "
               + ", ".join(f"{k} {v:.1f}" for k, v in p["fp16_headroom_bits"].items())
               + "; kept on the GPU for range: " + ", ".join(f"{k} {v}" for k, v in p["kept_on_gpu_for_range"].items()))

    out["programs"] = c = check_programs(split, engine.model.args.rotary)
    report(f"programs checked in the worker: {c['checked']} ({c['runs']} runs, a padded last chunk of "
           f"{c['padded_rows']} rows included): {c['failed']} failed; placement {c['placement']}")
    for line in c["failures"]:
        report(f"  FAILED: {line}")

    check = verify(run, ids, n_tokens=8)  # the same prompt: its programs are loaded already
    out["verify"] = check
    report(f"verify ({n} tokens, {engine.model.model.norm.weight.dtype}): "
           f"{'MATCH' if check['match'] else 'MISMATCH'}; distance {check['distance']} at {check['worst'] or '-'} "
           f"(tolerance {check['tolerance']}), greedy "
           f"{check['greedy_match_tokens']}/{check['greedy_compared_tokens']}")
    out["memory"] = split_memory(engine, worker, split, n)
    out["run"], out["_split"] = run, split
    return out


def split_memory(engine, worker, split, tokens: int) -> dict:
    """Each lane's memory: the GPU lane's weights and peak; the ANE worker's footprint now (macOS: proc_pid_rusage,
    never ru_maxrss's peak; Linux: resident) with the Neural Engine's share, and the weights charged for the Core ML
    functions a prompt of `tokens` loads (what the governor counts)."""
    from mlx.utils import tree_flatten

    weights = sum(v.nbytes for _, v in tree_flatten(engine.model.parameters()))
    found = worker.memory()
    return {"gpu_lane_weights_bytes": int(weights), "gpu_lane_peak_bytes": int(mx.get_peak_memory()),
            "ane_worker_resident_bytes": None if found is None else int(found["bytes"]),
            "ane_worker_neural_bytes": None if found is None else found["neural_bytes"],
            "ane_worker_memory_source": None if found is None else found["source"],
            "ane_functions_charged_bytes": split.programs.charged_bytes(tokens),
            "ane_functions_loaded": split.programs.loaded_functions()}


def memory_line(m: dict) -> str:
    held = (f"{m['ane_worker_resident_bytes'] / 2**20:.0f} MiB ({m['ane_worker_memory_source']})"
            if m["ane_worker_resident_bytes"] is not None else "unknown")
    neural = (f", Neural Engine {m['ane_worker_neural_bytes'] / 2**20:.0f} MiB"
              if m["ane_worker_neural_bytes"] is not None else "")
    return (f"memory: GPU lane {m['gpu_lane_weights_bytes'] / 2**20:.0f} MiB of weights, "
            f"{m['gpu_lane_peak_bytes'] / 2**20:.0f} MiB peak in the split; ANE worker {held}{neural}; "
            f"{m['ane_functions_loaded']} attention functions loaded, "
            f"{m['ane_functions_charged_bytes'] / 2**20:.0f} MiB charged to the governor")


def check_programs(split, rotary, seed: int = 0) -> dict:
    """Every program the split loaded, checked in the ANE lane's worker (`AneProcess.diagnose`) on a full chunk
    and on a padded last chunk (`PADDED_ROWS` rows, the rest zero: where a norm's epsilon, subnormal in fp16,
    meets zero rows): finite outputs, agreement with the reference executor, Core ML's placement, and (on the full
    chunk) the Neural Engine's time against the CPU's."""
    from hetero.coreml.fp16 import fp16_values
    from hetero.coreml.graphs.attention import attention_masks, cache_inputs, rope_tables

    progs, rng = split.programs, np.random.default_rng(seed)
    chunk, found = progs.chunk, []
    for kind in ("attention", "mlp", "shared_expert", "gdn_in_proj"):
        for layer, parts in sorted(getattr(progs, kind).items()):
            for part in parts:
                program = part[0]
                for rows in (chunk, PADDED_ROWS):
                    if kind == "attention":
                        shape = part[1]
                        hidden, start = shape.hidden, shape.cache_slots  # the chunk right after a full cache
                        kv = rng.standard_normal((2, 1, shape.kv_heads, start, shape.head_dim)).astype(np.float32)
                        extra = {**rope_tables(start, shape, rotary), **attention_masks(start, shape),
                                 **cache_inputs(kv[0], kv[1], shape)}
                    else:
                        hidden, extra = split.model.args.hidden_size, {}
                    x = np.zeros((1, hidden, 1, chunk), np.float32)  # (1, C, 1, S), rows past `rows` zero
                    x[0, :, 0, :rows] = fp16_values(rng.standard_normal((hidden, rows)).astype(np.float32))
                    result = program.lane.diagnose(program.key, {"x": x, **extra}, timed=rows == chunk)
                    name = Path(program.key[0]).name + (f":{program.key[1]}" if program.key[1] else "")
                    found.append({"program": name, "layer": layer, "piece": kind, "rows": rows, **result})
    failures = [f"{f['program']} ({f['rows']} of {chunk} rows): {failure_line(f)}" for f in found if not f["ok"]]
    statuses = sorted({f["placement"]["status"] for f in found})
    return {"checked": len({f["program"] for f in found}), "runs": len(found), "padded_rows": PADDED_ROWS,
            "failed": len(failures), "failures": failures, "placement": ", ".join(statuses), "each": found}


def _s(x: float) -> float:
    return round(x, 3)
