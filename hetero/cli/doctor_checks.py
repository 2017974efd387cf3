"""The steps of `hetero doctor` (`hetero.cli.doctor`) and the verdict of each check from what they found.

Each step reads and writes a shared `state` (what later steps need: the config, the worker, the target...) and the
report `out`; the doctor runs each guarded, so a step that raises is that step's failure. `verdicts` turns the whole
report into one verdict per check, each named for what failed.
"""

from __future__ import annotations

import time
from pathlib import Path

from hetero.errors import HeteroError

EXIT_BITS = {"backend": 2, "os": 4, "placement": 8, "fallback": 16, "numbers": 32, "weights": 64, "split": 128}
DEFAULT_THETA = 1e6
LAYOUT_MARGIN = 0.9  # another attention layout replaces the one in use when it takes at most this share of its time


def read_model(state: dict, out: dict, report) -> None:
    """The model's config (a loaded engine's, a checkpoint's or a bare config.json's) and whether weights exist to
    run the split with."""
    from hetero.planner.shape import read_model_config, storage_for

    engine = state["engine"]
    if engine is not None:
        config, name, has_weights = engine.config, engine.name, True
    else:
        config, name = read_model_config(state["model"])
        has_weights = _has_weights(state["model"])
    storage = storage_for(config, None, None)
    state.update(config=config, name=name, has_weights=has_weights,
                 quant=(storage.bits, storage.group_size) if storage.bits <= 4 else None)
    out["model"] = {"name": name, "model_type": config.get("model_type"), "weights": has_weights,
                    "quantization": None if storage.bits >= 16 else [storage.bits, storage.group_size]}
    report(f"model: {name} ({config.get('model_type')}, {storage.label})"
           + ("" if has_weights else ": a bare config, its programs probed with random weights of the planned shapes"))


def _has_weights(model: str | None) -> bool:
    """Whether `model` names weights (the bundled model, a checkpoint directory with safetensors, a hub id) rather than
    a bare config (a .json file, or a directory holding none)."""
    if model is None:
        return True
    path = Path(model)
    if path.is_file():
        return False
    return not path.is_dir() or any(path.glob("*.safetensors"))


def check_backend(state: dict, out: dict, report) -> None:
    """The ANE lane's backend (Core ML here, or why not) and its worker process, up and answering."""
    from hetero.coreml.backends.coreml_macos import available, core_ml
    from hetero.pipeline import ane_backend
    from hetero.pipeline.ane_process import shared_worker

    ml = core_ml()
    on_mac, why = available(ml)
    state.update(ml=ml, on_mac=on_mac)
    name, _ = ane_backend()
    out["backend"] = {"name": name, "core_ml": on_mac, "why_not": why or None, "system": ml.system()}
    t = time.perf_counter()
    worker = shared_worker()
    worker.memory()  # a round trip: the worker is up and answering
    state["worker"] = worker
    out["backend"].update(lane="worker process", pid=worker.pid, ready_s=round(time.perf_counter() - t, 3))
    report(f"ANE lane: {name} in worker process {worker.pid} (ready in {out['backend']['ready_s']} s)"
           + (f"; not Core ML: {why}" if why else ""))


def check_os(state: dict, out: dict, report) -> None:
    """This Mac's export target and the weight form it leaves `--ane-weights`; the compute plan's availability."""
    from hetero.coreml.backends.coreml_macos import macos_version
    from hetero.coreml.backends.placement import COMPUTE_PLAN_MACOS
    from hetero.coreml.target import target_for, weight_form_for

    macos = macos_version(state.get("ml"))
    target = target_for(macos)  # raises below macOS 14: no target loads there
    state["target"] = target
    form, note = weight_form_for(state["weights"], target)
    out["os"] = {"macos": None if macos is None else ".".join(map(str, macos)), "target": target.to_dict(),
                 "weight_form": {"asked": state["weights"], "embedded": form, "note": note},
                 "compute_plan": None if macos is None else tuple(macos) >= COMPUTE_PLAN_MACOS}
    report(f"OS: {'macOS ' + out['os']['macos'] if macos else 'not a Mac'}; programs built for {target.name} "
           f"({'multifunction packages' if target.multifunction else 'one package per context bucket'}), weights "
           f"{form}" + (f" ({note})" if note else ""))


def check_probes(state: dict, out: dict, report) -> None:
    """One program per piece kind at the plan's shapes, each built, linted and run here (Core ML on a Mac, else the
    reference executor): numbers, placement, CPU_AND_NE against CPU_ONLY, the memory its load adds; the faster
    attention layout kept where both were timed."""
    from hetero.cli.doctor_probes import probe_root
    from hetero.cli.doctor_probes import planned_probes
    from hetero.planner.shape import model_shape

    probes = planned_probes(state["config"], state["fraction"], state["chunk"], state["tokens"], state["weights"],
                            state["target"])
    if not probes:
        raise HeteroError("the split has no Core ML programs for this architecture (it stays GPU-only)")
    state["probes"] = probes
    theta = getattr(model_shape(state["config"])[0], "rope_theta", DEFAULT_THETA)
    each = [run_probe(p, probe_root(state["target"]), theta, state["on_mac"], report) for p in probes]
    out["probes"] = {"each": each, "layout": pick_layout(each, report)}


def run_probe(probe, root: Path, theta: float, on_mac: bool, report) -> dict:
    """One probe built (or taken from the cache) and linted; on a Mac also run through Core ML in this process and
    diagnosed against the reference executor (off a Mac the reference executor is the backend: running a probe would
    compare it with itself). An error is the probe's finding."""
    from hetero.cli.doctor_probes import probe_inputs, probe_package
    from hetero.coreml.backends import coreml_macos
    from hetero.coreml.backends.diagnose import diagnose, failure_line
    from hetero.coreml.graphs.lint import lint_package

    entry = {"probe": probe.name, "kind": probe.kind, "layout": getattr(probe.shape, "layout", None)}
    try:
        path = probe_package(probe, root)
        lint = lint_package(path)
        entry.update(program=path.name, lint_errors=len(lint.errors), lint_warnings=len(lint.warnings),
                     lint=lint.lines()[:5], ok=not lint.errors, ran=on_mac)
        bad = f"lint: {lint.lines()[0]}" if lint.errors else None
        if on_mac:
            before = coreml_macos.memory_now()
            program = coreml_macos.load(path, report=False)
            entry.update(diagnose(program, path, None, probe_inputs(probe, theta)))
            after = coreml_macos.memory_now()
            entry["resident_bytes"] = None if before is None or after is None else int(
                after.bytes + (after.neural_bytes or 0) - before.bytes - (before.neural_bytes or 0))
            entry["ok"] = entry["ok"] and not lint.errors
            bad = bad or failure_line(entry)
    except Exception as e:  # noqa: BLE001  (a probe that cannot be built or run is that probe's failure)
        text = str(e).strip().splitlines()
        entry.update(ok=False, error=f"{type(e).__name__}: {text[0] if text else ''}")
        bad = entry["error"]
    report(f"probe {probe.name}: " + (f"FAILED: {bad}" if bad else _probe_line(entry)))
    return entry


def _probe_line(entry: dict) -> str:
    if not entry["ran"]:
        return (f"lint clean ({entry['lint_warnings']} warnings); not run here: the reference executor is this "
                f"machine's backend (Core ML's numbers, placement and timing need a Mac)")
    return (f"lint clean, finite, max rel diff {entry['max_rel_diff']:.3g} from {entry['compared_with']}; "
            f"{entry['placement']['line'].split(': ', 1)[-1]}; {entry['timing']['line']}")


def pick_layout(each: list[dict], report) -> dict:
    """The faster attention layout where both were timed on the Neural Engine (and passed), saved for this
    machine's later exports; else unavailable, with why."""
    from hetero.pipeline.programs import attention_layout, save_attention_layout

    timed = {e["layout"]: e for e in each if e["kind"] == "attention" and e.get("ok")
             and e.get("timing", {}).get("status") == "timed"}
    found = {"current": attention_layout(), "seconds": {k: e["timing"]["cpu_and_ne_s"] for k, e in timed.items()}}
    if len(timed) < 2:
        found.update(status="unavailable", why="both layouts timed on the Neural Engine (a Mac, both passing) decide")
        return found
    default = next(iter(timed)) if found["current"] not in timed else found["current"]
    best = min(timed, key=lambda k: timed[k]["timing"]["cpu_and_ne_s"])
    if timed[best]["timing"]["cpu_and_ne_s"] > LAYOUT_MARGIN * timed[default]["timing"]["cpu_and_ne_s"]:
        best = default  # within the timing's noise: the layout in use stays
    save_attention_layout(best, {"seconds": found["seconds"], "probe": timed[best]["probe"]})
    found.update(status="picked", picked=best, current=best)
    report(f"attention layout: {best} here (" + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in found["seconds"].items())
           + f"; another replaces the one in use below {LAYOUT_MARGIN}x its time); later exports build it")
    return found


def check_weights(state: dict, out: dict, report) -> None:
    """The three weight forms at the plan's MLP shape (`hetero.cli.doctor_weights.compare_forms`)."""
    from hetero.cli.doctor_probes import probe_root
    from hetero.cli.doctor_weights import compare_forms
    from hetero.coreml.backends import coreml_macos

    mlp = next((p for p in state.get("probes", []) if p.kind in ("mlp", "shared_expert")), None)
    if mlp is None:
        out["weights"] = {"status": "unavailable", "why": "the plan has no MLP program to compare the forms on"}
        return
    from hetero.cli.measure import median_seconds

    load = (lambda path: coreml_macos.load(path, report=False)) if state["on_mac"] else None
    clock = coreml_macos.core_ml().clock
    out["weights"] = compare_forms(mlp, probe_root(state["target"]), state["target"], load, quant=state["quant"],
                                   memory=coreml_macos.memory_now,
                                   timer=lambda what, fn, n: median_seconds(fn, n, clock=clock))
    report(f"weight forms (--ane-weights): {out['weights']['line']}")


def check_split_lane(state: dict, out: dict, report) -> None:
    """The real split of the model (`hetero.cli.doctor_split.check_split`); unavailable for a bare config."""
    from hetero.cli.doctor_split import check_split, memory_line
    from hetero.cli.doctor_weights import split_forms

    if not state.get("has_weights"):
        out["split"] = {"status": "unavailable", "why": "a bare config: no weights to run the split with (its "
                                                       "programs were probed at the planned shapes)"}
        return
    engine = state["engine"]
    if engine is None:
        import hetero

        engine = hetero.load(state["model"], state["dtype"])
    found = check_split(engine, state["worker"], state["tokens"], state["fraction"], state["chunk"],
                        state["weights"], report)
    run, split = found.pop("run"), found.pop("_split")
    out.update(found)
    if "forms" in out.get("weights", {}):
        out["weights"]["split"] = split_forms(out["weights"], state["weights"], split.programs)
        report(f"split weights (--ane-weights {state['weights']}): {out['weights']['split']['line']}")
    out["split"]["weight_form"] = run.weights
    report(memory_line(out["memory"]))


# ----------------------------------------------------------------------------------------------------------
# Verdicts


_NOT_RUN = "no program ran through Core ML (a Mac's): the probes were built and linted here"


def _v(verdict: str, reason: str = "", **extra) -> dict:
    return {"verdict": verdict, "reason": reason, **extra}


def verdicts(out: dict) -> dict[str, dict]:
    """One verdict per check (`EXIT_BITS`' names: the exit code's bits, `hetero.cli.doctor`) from the report; a step that did not run leaves its checks
    unavailable, saying which step it waited for."""
    errors, skipped = out.get("errors", {}), out.get("skipped", {})
    runs = out.get("probes", {}).get("each", []) + out.get("programs", {}).get("each", [])
    found = {"backend": _backend(out, errors), "os": _os(out, errors), "placement": _placement(runs, errors),
             "fallback": _fallback(runs, errors), "numbers": _numbers(runs, errors),
             "weights": _weights(out, errors), "split": _split(out, errors)}
    steps = {"backend": "backend", "os": "os", "placement": "probes", "fallback": "probes", "numbers": "probes",
             "weights": "weights", "split": "split"}
    for check, step in steps.items():  # the program checks still judge the split's runs when the probes skipped
        if step in skipped and found[check]["verdict"] != "fail" and (step != "probes" or not runs):
            found[check] = _v("unavailable", skipped[step])
    return found


def _backend(out: dict, errors: dict) -> dict:
    if "backend" in errors:
        return _v("fail", errors["backend"])
    b = out.get("backend")
    if b is None:
        return _v("fail", errors.get("model", "not reached"))
    if b["core_ml"]:
        return _v("pass", f"{b['name']} in worker process {b['pid']}")
    if b["system"] == "Darwin":  # a Mac whose Core ML cannot run: the lane runs the reference executor
        return _v("fail", b["why_not"])
    return _v("unavailable", f"{b['why_not']}: the lane ran the reference executor in the same worker protocol")


def _os(out: dict, errors: dict) -> dict:
    if "os" in errors:
        return _v("fail", errors["os"])
    o = out.get("os")
    if o is None:
        return _v("unavailable", "not reached")
    if o["macos"] is None:
        return _v("unavailable", "not a Mac: which packages the OS compiles is checked on one (the reference executor "
                                 "runs every target)")
    return _v("pass", f"macOS {o['macos']} compiles {o['target']['name']} programs, weights "
                      f"{o['weight_form']['embedded']}")


def _placement(runs: list[dict], errors: dict) -> dict:
    placed = [r for r in runs if "placement" in r]
    bad = [r for r in placed if r["placement"].get("ok") is False]
    unplaced = sum(r["placement"].get("verdict") == "unplaced" for r in placed)
    judged = sum(r["placement"].get("ok") is True for r in placed)
    if bad:
        return _v("fail", f"{len(bad)} of {len(placed)} runs: {bad[0]['placement']['line']}", failed=len(bad),
                  judged=judged, unplaced=unplaced)
    if judged:
        return _v("pass", f"{judged} runs within the cost budget; {unplaced} unplaced functions counted apart",
                  judged=judged, unplaced=unplaced)
    why = placed[0]["placement"]["line"].split(": ", 1)[-1] if placed else errors.get("probes", _NOT_RUN)
    return _v("unavailable", why, unplaced=unplaced)


def _fallback(runs: list[dict], errors: dict) -> dict:
    timed = [r for r in runs if r.get("timing", {}).get("status") == "timed"]
    flagged = [r for r in timed if r["timing"]["flagged"]]
    if flagged:
        name = flagged[0].get("probe") or flagged[0].get("program")
        return _v("fail", f"{len(flagged)} of {len(timed)} programs: {name}: {flagged[0]['timing']['line']}",
                  flagged=len(flagged), timed=len(timed))
    if timed:
        return _v("pass", f"the Neural Engine ran all {len(timed)} timed programs clearly faster than the CPU",
                  timed=len(timed))
    why = next((r["timing"]["line"] for r in runs if "timing" in r), errors.get("probes", _NOT_RUN))
    return _v("unavailable", why)


def _numbers(runs: list[dict], errors: dict) -> dict:
    from hetero.coreml.target import OS_REFUSED

    runs = [r for r in runs if OS_REFUSED not in r.get("error", "")]  # the OS's refusal: the os check's failure
    bad = [r for r in runs if r.get("error") or (("numbers_ok" in r) and not r["numbers_ok"])
           or r.get("lint_errors")]
    ran = [r for r in runs if r.get("ran", True)]
    if bad:
        r = bad[0]
        what = r.get("error") or (f"lint: {r['lint'][0]}" if r.get("lint_errors") else
                                  f"non-finite {r['nonfinite']}" if r["nonfinite"] else
                                  f"max rel diff {r['max_rel_diff']:.3g} from {r['compared_with']}")
        return _v("fail", f"{len(bad)} of {len(runs)} runs: {r.get('probe') or r.get('program')}: {what}",
                  failed=len(bad))
    if "probes" in errors:
        return _v("fail", errors["probes"])
    if not ran:
        return _v("unavailable", "no program ran through a backend other than the reference executor (the probes "
                                 "were built and linted: ANE rules clean)" if runs else "no program ran")
    return _v("pass", f"{len(ran)} runs finite and within the reference executor's outputs"
                      + (f"; {len(runs) - len(ran)} probes linted clean, not run here" if len(ran) < len(runs) else ""),
              runs=len(ran))


def _weights(out: dict, errors: dict) -> dict:
    if "weights" in errors:
        return _v("fail", errors["weights"])
    w = out.get("weights")
    if w is None or "forms" not in w:
        return _v("unavailable", (w or {}).get("why", "not reached"))
    linted = [f for f, e in w["forms"].items() if e.get("available") and e["lint_errors"]]
    if linted:
        return _v("fail", f"the {', '.join(linted)} program fails the ANE lint")
    if out.get("split", {}).get("weight_form") == "blockwise" and w["identical_outputs"] is False:
        return _v("fail", "the split runs blockwise weights, which this Mac computes differently from the tables")
    if w["recommended"] is None:
        return _v("pass", f"the forms lint clean; {w['why']}")
    return _v("pass", f"recommended --ane-weights {w['recommended']}: {w['why']}")


def _split(out: dict, errors: dict) -> dict:
    from hetero.coreml.target import OS_REFUSED

    if "split" in errors and OS_REFUSED in errors["split"]:
        return _v("unavailable", "the OS refused the split's programs (the os check says which)")
    if "split" in errors:
        return _v("fail", errors["split"])
    s = out.get("split")
    if s is None:
        return _v("unavailable", "not reached")
    if s.get("status") == "unavailable":
        return _v("unavailable", s["why"])
    v = out["verify"]
    if not v["match"]:
        return _v("fail", f"the split does not match the GPU-only run (distance {v['distance']} at "
                          f"{v['worst'] or '-'}, tolerance {v['tolerance']})")
    return _v("pass", f"{s['tokens']} tokens split at {s['fraction']}, overlap {s['overlap']:.2f}, verify MATCH")
