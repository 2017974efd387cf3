"""`hetero doctor` on the bundled model off a Mac: every check that can run here runs through the real worker process
and the reference executor, each check has its verdict (what needs a Mac is `unavailable`, with why), the findings
come back as JSON, and the exit code is 0. (On the stand-in Macs: tests/test_doctor_macs.py.)"""

from __future__ import annotations

import json
import platform

from hetero.cli.doctor import EXIT_BITS
from hetero.cli.doctor_split import check_programs
from hetero.cli.main import main
from hetero.pipeline import ane_backend, configure
from test_ane_process import fault_env, tiny_engine  # noqa: F401  (fixtures)


def test_doctor_checks_the_split_end_to_end(capsys):
    assert main(["doctor", "--tokens", "512", "--json"]) == 0
    captured = capsys.readouterr()
    found = json.loads(captured.out)
    assert found["ok"] and found["exit_code"] == 0 and found["backend"]["name"] == ane_backend()[0]
    assert found["backend"]["pid"] > 0 and set(found["checks"]) == set(EXIT_BITS)
    assert {c["verdict"] for c in found["checks"].values()} <= {"pass", "unavailable"}
    assert found["checks"]["split"]["verdict"] == "pass" and found["checks"]["numbers"]["verdict"] == "pass"
    assert all(p["lint_errors"] == 0 for p in found["probes"]["each"])  # the plan's programs, built and linted
    split = found["split"]
    assert split["tokens"] == 512 and split["lane"] == "process" and split["worker_s"] > 0 and split["ipc_s"] >= 0
    assert split["gpu_busy_s"] > 0 and split["ane_busy_s"] > 0 and split["busy_sum_s"] > 0
    assert found["verify"]["match"] and found["verify"]["greedy_compared_tokens"] == 8
    assert found["rates"]["gpu_matmul_gflops"] > 0 and found["rates"]["ane_mlp_gflops"] > 0
    memory = found["memory"]
    assert memory["ane_worker_resident_bytes"] > 0 and memory["gpu_lane_weights_bytes"] > 0
    assert memory["ane_functions_charged_bytes"] > 0 and memory["ane_worker_memory_source"] == "resident"
    programs = found["programs"]  # every program the split loaded, checked in the worker, padded chunk included
    names = {e["program"] for e in programs["each"]}
    assert programs["checked"] == len(names) > 0 and programs["failed"] == 0
    assert {(n, r) for n in names for r in (256, programs["padded_rows"])} == {
        (e["program"], e["rows"]) for e in programs["each"]}
    assert {e["piece"] for e in programs["each"]} >= {"attention", "mlp"}
    assert all(e["finite"] and e["ok"] for e in programs["each"])
    forms = found["weights"]  # the three exact weight forms, built and linted at the plan's MLP shape
    assert set(forms["forms"]) == {"fp16", "lut", "blockwise"}
    assert all(f["lint_errors"] == 0 for f in forms["forms"].values())
    assert forms["split"]["form"] == "lut" and forms["split"]["matrices"].get("fp16", 0) > 0  # a float model:
    assert forms["split"]["quantized"] == forms["split"]["blockwise_capable"] == 0  # nothing to take either form
    for line in ("ANE lane:", "overlap", "verify (512 tokens", "memory:", "programs checked in the worker",
                 "weight forms (--ane-weights)", "split weights (--ane-weights lut)", "check split: PASS",
                 "all checks passed"):
        assert line in captured.err
    if platform.system() != "Darwin":  # said, not skipped: what only a Mac can check
        checks = found["checks"]
        assert all(checks[c]["verdict"] == "unavailable" for c in ("backend", "os", "placement", "fallback"))
        assert "only on macOS" in checks["backend"]["reason"] and "Mac" in checks["placement"]["reason"]
        assert programs["placement"] == "unavailable"
        assert forms["recommended"] is None and "need a Mac" in forms["line"]
        assert any("placement" in line for line in found["not_checked"])


def test_the_program_checks_catch_a_padded_chunk_gone_non_finite(tiny_engine, fault_env):
    """Core ML returning NaN on a padded last chunk (as an fp16 epsilon flushed to zero would on zero rows; stood
    for by `ane_faults:garbage` at the worker's 2nd job, the first program's padded run) is a failed check."""
    fault_env.setenv("HETERO_TEST_FAULT_AT", "2")
    run = configure(tiny_engine, 0.5, 64)
    run.ane_loader = "ane_faults:garbage"
    found = check_programs(run.splitter(200), tiny_engine.model.args.rope_theta)
    assert found["failed"] == 1 and "(37 of 64 rows): non-finite" in found["failures"][0]
    bad = [e for e in found["each"] if not e["ok"]]
    assert len(bad) == 1 and bad[0]["rows"] == 37 and not bad[0]["finite"]
    assert found["runs"] == 2 * found["checked"]


def test_doctor_needs_a_split(capsys):
    assert main(["doctor", "--ane-fraction", "0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--ane-fraction" in err


def test_a_doctor_that_cannot_read_its_model_still_prints_its_report(capsys, tmp_path):
    """A config that is not JSON: the model step fails, every check says it could not run and why, the JSON is
    printed whole, and the exit code is 1, a user error as for every command (never a traceback, never an empty
    stdout)."""
    bad = tmp_path / "config.json"
    bad.write_text("{ not json")
    code = main(["doctor", "--model", str(bad), "--json"])
    captured = capsys.readouterr()
    found = json.loads(captured.out)
    assert found["errors"]["model"].startswith("HeteroError") and "not valid JSON" in found["errors"]["model"]
    assert code == found["exit_code"] == 1 and not found["ok"] and set(found["checks"]) == set(EXIT_BITS)
    assert all(c["verdict"] == "unavailable" and "could not be read" in c["reason"] for c in found["checks"].values())
    assert "Traceback" not in captured.err
