"""`hetero doctor` on the bundled model: every check runs through the real worker process and the reference
executor here, the findings come back as JSON, and what a Linux machine cannot check is said."""

from __future__ import annotations

import json
import platform

from hetero.cli import main
from hetero.pipeline import ane_backend


def test_doctor_checks_the_split_end_to_end(capsys):
    assert main(["doctor", "--tokens", "512", "--json"]) == 0
    captured = capsys.readouterr()
    found = json.loads(captured.out)
    assert found["ok"] and found["backend"]["name"] == ane_backend()[0] and found["backend"]["pid"] > 0
    assert found["program"]["lint_errors"] == 0
    split = found["split"]
    assert split["tokens"] == 512 and split["lane"] == "process" and split["worker_s"] > 0 and split["ipc_s"] >= 0
    assert split["gpu_busy_s"] > 0 and split["ane_busy_s"] > 0 and split["busy_sum_s"] > 0
    assert found["verify"]["match"] and found["verify"]["greedy_compared_tokens"] == 8
    assert found["rates"]["gpu_matmul_gflops"] > 0 and found["rates"]["ane_mlp_gflops"] > 0
    assert found["memory"]["ane_worker_resident_bytes"] > 0 and found["memory"]["gpu_lane_weights_bytes"] > 0
    for line in ("ANE lane:", "overlap", "verify (512 tokens", "memory:", "all checks passed"):
        assert line in captured.err
    if platform.system() != "Darwin":  # said, not skipped: what only a Mac can check
        assert any("Neural Engine" in line for line in found["not_checked"])
        assert found["program"]["placement"] is None and "needs a Mac" in found["program"]["line"]


def test_doctor_needs_a_split(capsys):
    assert main(["doctor", "--ane-fraction", "0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--ane-fraction" in err
