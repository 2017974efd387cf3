"""`hetero doctor`: what the split prefill runs on here and whether it works, checked end to end in about a minute.

It names the ANE lane's backend and starts its worker process, exports a small program and checks it (the ANE lint
everywhere; Core ML's placement on a Mac), compares the two exact weight forms of `--ane-weights` (lint and outputs
everywhere; time and placement on a Mac, which it recommends: `hetero.cli.doctor_weights`), measures each lane's rate,
runs a real split prefill of the model and
measures how much the two lanes overlapped (their busy times against the wall time), verifies that split against
the GPU-only run, reports the memory each lane holds, and lists what it could not check on this machine.
"""

from __future__ import annotations

import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from hetero.cli.doctor_weights import compare_forms, split_forms
from hetero.cli.measure import ane_lane, gpu_lane
from hetero.coreml.backends import coreml_macos
from hetero.coreml.export import DEFAULT_WEIGHT_FORM
from hetero.pipeline import ane_backend, configure, verify
from hetero.pipeline.ane_process import shared_worker

DOCTOR_PROMPT = "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n"


def doctor(engine, tokens: int = 1024, fraction: float = 0.5, chunk: int = 256,
           report: Callable[[str], None] = print, weights: str = DEFAULT_WEIGHT_FORM,
           load_forms: Callable[[Path], Callable] | None = None) -> dict:
    """Run every check on a loaded engine, its split's quantized weights in the form `weights` (`--ane-weights`);
    `report` gets one line per check as it finishes. Returns the findings (`ok`: every check that could run
    passed). `load_forms` loads the weight forms' programs for timing (default: Core ML on a Mac, none elsewhere)."""
    start = time.perf_counter()
    out: dict = {"platform": {"system": platform.platform(), "python": platform.python_version(), "mlx": mx.__version__,
                              "mlx_device": str(mx.default_device())}}
    name, _ = ane_backend()
    on_mac, why_not = coreml_macos.available()
    t = time.perf_counter()
    worker = shared_worker()
    worker.resident_bytes()  # a round trip: the worker is up and answering
    out["backend"] = {"name": name, "lane": "worker process", "pid": worker.pid, "ready_s": _s(time.perf_counter() - t)}
    report(f"ANE lane: {name} in worker process {worker.pid} (ready in {out['backend']['ready_s']} s)")

    out["program"] = _program_check(on_mac)
    report(f"small exported program: {out['program']['line']}")

    if load_forms is None and on_mac:
        load_forms = lambda path: coreml_macos.load(path, report=False)  # noqa: E731
    out["weights"] = compare_forms(load_forms)
    report(f"weight forms (--ane-weights): {out['weights']['line']}")

    gpu_flops, gpu_bw = gpu_lane(repeats=3)
    _, ane_flops, call_s = ane_lane(hidden=512, channels=1024, repeats=3, loader=worker.load)
    out["rates"] = {"gpu_matmul_gflops": round(gpu_flops / 1e9, 1), "gpu_bandwidth_gbs": round(gpu_bw / 1e9, 1),
                    "ane_mlp_gflops": round(ane_flops / 1e9, 1), "ane_call_ms": round(call_s * 1e3, 3)}
    r = out["rates"]
    report(f"rates: GPU lane {r['gpu_matmul_gflops']} GFLOP/s matmul, {r['gpu_bandwidth_gbs']} GB/s; ANE lane "
           f"{r['ane_mlp_gflops']} GFLOP/s on an MLP program, {r['ane_call_ms']} ms per call (through the worker)")

    n = min(tokens, engine.model.args.max_position_embeddings - 64)
    ids = (engine.tokenizer.encode(DOCTOR_PROMPT * (1 + n // 16)))[:n]
    run = configure(engine, fraction, chunk, weights=weights)
    split = run.splitter(n)  # exported on first use (cached for the next doctor or run)
    split.run(ids, engine.model.make_cache(), logits=True)  # warm: programs loaded, compiled functions traced
    mx.reset_peak_memory()
    res = split.run(ids, engine.model.make_cache(), logits=True)
    out["split"] = {"tokens": n, "fraction": fraction, "effective_fraction": round(run.effective_fraction, 4),
                    **res.to_dict(), "busy_sum_s": _s(res.gpu_busy_s + res.ane_busy_s),
                    "ipc_share_of_ane_lane": round(res.ipc_s / res.ane_busy_s, 4) if res.ane_busy_s else 0.0}
    p = out["split"]
    report(f"split prefill of {n} tokens at ANE fraction {fraction} ({p['effective_fraction']:.2f} of the FLOPs): "
           f"wall {p['wall_s']:.3f} s against {p['busy_sum_s']:.3f} s of both lanes' busy time (GPU "
           f"{p['gpu_busy_s']:.3f} s, ANE {p['ane_busy_s']:.3f} s): overlap {p['overlap']:.2f}; IPC {p['ipc_s']:.3f} s "
           f"({p['ipc_share_of_ane_lane']:.1%} of the ANE lane)")
    if run.plan.ranges is not None:  # how far the programs' measured values stay inside fp16, per piece kind
        p["fp16_headroom_bits"], p["kept_on_gpu_for_range"] = run.plan.ranges.headroom(), run.plan.ranges.kept_on_gpu()
        report("fp16 headroom (bits below 65504, measured on the GPU lane): "
               + ", ".join(f"{k} {v:.1f}" for k, v in p["fp16_headroom_bits"].items())
               + "; kept on the GPU for range: " + ", ".join(f"{k} {v}" for k, v in p["kept_on_gpu_for_range"].items()))

    out["programs"] = check_programs(split, engine.model.args.rotary)
    out["weights"]["split"] = split_forms(out["weights"], weights, split.programs)
    c = out["programs"]
    report(f"programs checked in the worker: {c['checked']} ({c['runs']} runs, a padded last chunk of "
           f"{c['padded_rows']} rows included): {c['failed']} failed; placement {c['placement']}")
    for line in c["failures"]:
        report(f"  FAILED: {line}")
    report(f"split weights (--ane-weights {weights}): {out['weights']['split']['line']}")

    check = verify(run, ids, n_tokens=8)  # the same prompt: its programs are loaded already
    out["verify"] = check
    report(f"verify ({n} tokens, {engine.model.model.norm.weight.dtype}): "
           f"{'MATCH' if check['match'] else 'MISMATCH'}; distance {check['distance']} at {check['worst'] or '-'} "
           f"(tolerance {check['tolerance']}), greedy "
           f"{check['greedy_match_tokens']}/{check['greedy_compared_tokens']}")

    weights = sum(v.nbytes for v in _leaves(engine.model.parameters()))
    resident = worker.resident_bytes()
    out["memory"] = {"gpu_lane_weights_bytes": int(weights), "gpu_lane_peak_bytes": int(mx.get_peak_memory()),
                     "ane_worker_resident_bytes": resident}
    m = out["memory"]
    held = (f"{resident / 2**20:.0f} MiB resident now (its interpreter, programs and buffers)" if resident is not None
            else "resident memory unknown (the OS reports only its peak, and Core ML none of its own)")
    report(f"memory: GPU lane {weights / 2**20:.0f} MiB of weights, {m['gpu_lane_peak_bytes'] / 2**20:.0f} MiB peak "
           f"in the split; ANE worker {held}")

    out["not_checked"] = _not_checked(on_mac, why_not)
    for line in out["not_checked"]:
        report(f"not checked: {line}")
    forms = out["weights"]
    forms_ok = not any(f["lint_errors"] for f in forms["forms"].values()) and (
        forms["identical_outputs"] or weights != "blockwise")  # a split in a form this Mac computes otherwise fails
    out["ok"] = bool(check["match"] and out["program"]["ok"] is not False and not c["failed"] and forms_ok)
    out["seconds"] = _s(time.perf_counter() - start)
    report(f"{'all checks passed' if out['ok'] else 'SOME CHECKS FAILED'} ({out['seconds']} s)")
    return out


PADDED_ROWS = 37  # rows of the padded last chunk each program is checked on: the rest are zeros, as in a prompt


def check_programs(split, theta, seed: int = 0) -> dict:
    """Every program the split loaded, checked in the ANE lane's worker (`AneProcess.diagnose`) on a full chunk
    and on a padded last chunk (`PADDED_ROWS` rows, the rest zero: where a norm's epsilon, subnormal in fp16,
    meets zero rows): finite outputs, agreement with the reference executor, Core ML's placement."""
    from hetero.coreml.fp16 import fp16_values
    from hetero.coreml.graphs.attention import attention_masks, cache_inputs, rope_tables

    progs, rng = split.programs, np.random.default_rng(seed)
    chunk, found = progs.chunk, []
    for kind in ("attention", "mlp", "shared_expert", "gdn_in_proj"):
        for layer, parts in sorted(getattr(progs, kind).items()):
            for part in parts:
                program = part[0]
                hidden = None
                for rows in (chunk, PADDED_ROWS):
                    if kind == "attention":
                        shape = part[1]
                        hidden, start = shape.hidden, shape.cache_slots  # the chunk right after a full cache
                        kv = rng.standard_normal((2, 1, shape.kv_heads, start, shape.head_dim)).astype(np.float32)
                        extra = {**rope_tables(start, shape, theta), **attention_masks(start, shape),
                                 **cache_inputs(kv[0], kv[1], shape)}
                    else:
                        hidden, extra = split.model.args.hidden_size, {}
                    x = np.zeros((1, hidden, 1, chunk), np.float32)  # (1, C, 1, S), rows past `rows` zero
                    x[0, :, 0, :rows] = fp16_values(rng.standard_normal((hidden, rows)).astype(np.float32))
                    result = program.lane.diagnose(program.key, {"x": x, **extra})
                    name = Path(program.key[0]).name + (f":{program.key[1]}" if program.key[1] else "")
                    found.append({"program": name, "layer": layer, "piece": kind, "rows": rows, **result})
    failures = [f"{f['program']} ({f['rows']} of {chunk} rows): "
                + (f"non-finite {', '.join(f['nonfinite'])}" if f["nonfinite"] else
                   f"max rel diff {f['max_rel_diff']:.3g} from {f['compared_with']}"
                   if f["max_rel_diff"] > 0 else f["placement"]["line"]) for f in found if not f["ok"]]
    statuses = sorted({f["placement"]["status"] for f in found})
    return {"checked": len({f["program"] for f in found}), "runs": len(found), "padded_rows": PADDED_ROWS,
            "failed": len(failures), "failures": failures, "placement": ", ".join(statuses), "each": found}


def _program_check(on_mac: bool) -> dict:
    """A small MLP program exported and linted; on a Mac also loaded through Core ML for its placement."""
    from hetero.coreml.graphs.lint import lint_package
    from hetero.coreml.graphs.mlp import MLPShape, MLPWeights, build_mlp
    from hetero.coreml.graphs.package import save_program

    rng = np.random.default_rng(0)
    h, c, s = 256, 512, 64
    w = MLPWeights(*(rng.standard_normal(d).astype(np.float32) / np.sqrt(d[1]) for d in ((c, h), (c, h), (h, c))))
    with tempfile.TemporaryDirectory() as tmp:
        path = save_program(build_mlp(MLPShape(h, c, s), w), Path(tmp) / "doctor_mlp.mlpackage")
        lint = lint_package(path)
        placement = coreml_macos.load(path, report=False).placement() if on_mac else None
    found = {"lint_errors": len(lint.errors), "lint_warnings": len(lint.warnings)}
    if placement is not None:
        found.update(placement=placement.verdict, line=placement.line(), ok=lint.errors == [] and
                     placement.verdict == "full")
    else:
        found.update(placement=None, ok=not lint.errors,
                     line=f"ANE lint {len(lint.errors)} errors, {len(lint.warnings)} warnings; placement "
                          f"{'unavailable (MLComputePlan needs macOS 14.4+)' if on_mac else 'needs a Mac'}")
    return found


def _not_checked(on_mac: bool, why_not: str) -> list[str]:
    if on_mac:
        return ["the per-instance ANE weight window (a profile figure, unknown unless measured; not measured by "
                "doctor yet)"]
    return [f"the Neural Engine itself: {why_not}; the ANE lane ran the reference executor (numpy, fp16 at every op "
            "boundary) in the same worker protocol",
            "Core ML placement of the exported programs (MLComputePlan) and partial CPU/GPU fallback",
            "Core ML's compilation, its release of input buffers, and the Mac's rates and memory",
            "the per-instance ANE weight window (a profile figure, unknown unless measured on a Mac)",
            "which weight form (--ane-weights lut or blockwise) this Mac runs faster, whether Core ML keeps each on "
            "the Neural Engine, and whether its shift-scale decompression gives the tables' weights bit for bit",
            "on a Mac, run: hetero doctor --json"]


def _leaves(tree) -> list[mx.array]:
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(tree)]


def _s(x: float) -> float:
    return round(x, 3)


def print_report(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
