"""`hetero doctor` as a first Mac run meets it: with Core ML's answers injected as macOS 14.0, 14.4, 15 and 26 would
give them (tests/fake_mac.py, each call naming the real one), it prints its whole JSON report every time, each check
with its own verdict, and names each failure for what it is: a placement failure as `placement`, a CPU fallback as
`fallback`, a refused specification as `os`; the exit code carries exactly the failed checks' bits. With a bare
27B config it checks programs of the plan's shapes, not the bundled model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetero.checkpoint.source import BUNDLED_MODEL
from hetero.cli.doctor import EXIT_BITS
from hetero.cli.main import main
from fake_mac import mac  # noqa: F401  (fixture)

BARE = str(Path(BUNDLED_MODEL) / "config.json")  # the bundled model's config alone: no weights, no split
CONFIGS = Path(__file__).resolve().parent / "data"  # real configs (shared/reference/configs)
VERDICTS = {"pass", "fail", "unavailable"}


def doctor_json(capsys, *argv: str) -> tuple[int, dict, str]:
    code = main(["doctor", *argv, "--json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err  # stdout is the JSON alone, whole


@pytest.mark.parametrize("version, target, placement, forms", [
    ("macos_14_0", "macos14-spec8", "unavailable", ["fp16"]),  # no compute plan before 14.4
    ("macos_14_4", "macos14-spec8", "pass", ["fp16"]),
    ("macos_15", "macos15-spec9", "pass", ["fp16", "lut", "blockwise"]),
    ("macos_26", "macos15-spec9", "pass", ["fp16", "lut", "blockwise"]),
])
def test_the_doctor_prints_its_whole_report_on_every_macos(mac, capsys, version, target, placement, forms):
    mac(version)
    code, found, err = doctor_json(capsys, "--model", BARE, "--tokens", "256")
    assert set(found["checks"]) == set(EXIT_BITS) and all(c["verdict"] in VERDICTS for c in found["checks"].values())
    assert code == found["exit_code"] == 0 and found["ok"] and found["failed"] == []
    assert found["backend"]["core_ml"] and found["os"]["target"]["name"] == target
    assert found["checks"]["os"]["verdict"] == "pass" and found["checks"]["placement"]["verdict"] == placement
    assert found["checks"]["fallback"]["verdict"] == "pass" and found["checks"]["numbers"]["verdict"] == "pass"
    assert found["checks"]["split"]["verdict"] == "unavailable" and "bare config" in found["checks"]["split"]["reason"]
    probes = found["probes"]["each"]
    assert {(p["kind"], p["layout"]) for p in probes} >= {("attention", "heads"), ("attention", "keys_on_channels"),
                                                          ("mlp", None), ("gdn_in_proj", None)}
    assert all(p["ran"] and p["ok"] and p["timing"]["status"] == "timed" for p in probes)
    weights = found["weights"]
    assert [f for f, e in weights["forms"].items() if e["available"]] == forms and weights["recommended"] in forms
    for line in ("ANE lane: Core ML stand-in", f"programs built for {target}", "check placement:", "exit code 0"):
        assert line in err


@pytest.mark.parametrize("stand_in, failed, says", [
    ("macos_15_products_on_cpu", "placement", "of the estimated cost"),
    ("macos_15_slow_ane", "fallback", "not clearly faster"),
    ("macos_15_old_core_ml", "os", "the OS refuses it"),
])
def test_the_doctor_names_each_failure_for_what_it_is(mac, capsys, stand_in, failed, says):
    """One failure each, and only that check fails: a Core ML that runs the products on the CPU (most of the cost
    off the ANE), one whose Neural Engine is slower than the CPU alone, one whose compiler refuses the macOS 15 spec
    (the tables' programs: the doctor then recommends fp16, which it compiles)."""
    mac(stand_in)
    code, found, _ = doctor_json(capsys, "--model", BARE, "--tokens", "256")
    assert found["failed"] == [failed] and code == found["exit_code"] == EXIT_BITS[failed]
    assert says in found["checks"][failed]["reason"]
    assert set(found["checks"]) == set(EXIT_BITS)
    if failed == "os":
        assert found["weights"]["recommended"] == "fp16" and not found["weights"]["forms"]["lut"]["available"]


def test_the_doctor_checks_the_split_on_a_mac_end_to_end(mac, capsys):
    """With weights, on macOS 15: every program the split loaded is checked in the worker under the stand-in's Core
    ML (placed, timed against CPU_ONLY, compared with the reference executor), and the worker's memory is its
    footprint from proc_pid_rusage, with the Neural Engine's share."""
    mac("macos_15")
    code, found, _ = doctor_json(capsys, "--tokens", "256")
    assert code == 0 and found["ok"], found["checks"]
    programs = found["programs"]["each"]
    assert programs and all(p["placement"]["status"] == "placed" and p["placement"]["ok"] for p in programs)
    full = [p for p in programs if p["rows"] == 256]
    assert all(p["timing"]["status"] == "timed" and not p["timing"]["flagged"] for p in full)
    memory = found["memory"]
    assert memory["ane_worker_memory_source"] == "phys_footprint" and memory["ane_worker_neural_bytes"] > 0
    assert memory["ane_functions_charged_bytes"] > 0 and found["verify"]["match"]


def test_the_doctor_probes_a_27b_configs_planned_shapes(capsys):
    """A bare Qwen3.5-27B config, off a Mac: one program per kind of the plan at a quarter (the first KV group of 4
    at the run's largest bucket, the planned MLP share, the z rows, a vision block at the capped bucket), built and
    linted clean; nothing 256 wide (the bundled model's) among them, and the split unavailable without weights."""
    from hetero.planner import context_bucket
    from hetero.planner.plan import PlanRequest
    from hetero.planner.recommend import split_plan
    from hetero.planner.slices import split_for_budget
    from hetero.planner.vision import MAX_VISION_PATCHES
    from hetero.profiles import default_profile_name, load_profile

    config = json.loads((CONFIGS / "qwen3.5-27b.json").read_text())
    code, found, _ = doctor_json(capsys, "--model", str(CONFIGS / "qwen3.5-27b.json"), "--ane-fraction", "0.25",
                                 "--tokens", "1024")
    assert code == 0 and found["model"]["weights"] is False
    plan = split_plan(PlanRequest(config, load_profile(default_profile_name()), 0.25, context_bucket(1024, 256), 256),
                      ("attention", "mlp", "gdn_in_proj"))
    first = {k: split_for_budget(plan.args, next(s for s in plan.slices if s.piece == k), plan.program_budget)[0]
             for k in ("attention", "mlp", "gdn_in_proj")}
    names = {p["probe"] for p in found["probes"]["each"]}
    units = {k: s.stop - s.start for k, s in first.items()}
    assert f"layer {first['attention'].layer} attention ({6 * units['attention']} heads of 256, " \
           f"{units['attention']} KV, hidden 5120, bucket 1024, heads layout, fp16)" in names
    assert f"layer {first['mlp'].layer} mlp ({units['mlp']} channels, hidden 5120, fp16)" in names
    assert f"layer {first['gdn_in_proj'].layer} gdn_in_proj ({units['gdn_in_proj']} z rows, hidden 5120, fp16)" in names
    assert f"vision_block (hidden 1152, 16 heads, {MAX_VISION_PATCHES} patches, fp16)" in names
    assert not any("hidden 256," in n for n in names)
    assert all(p["lint_errors"] == 0 and not p["ran"] for p in found["probes"]["each"])
    assert found["checks"]["split"]["verdict"] == "unavailable"
