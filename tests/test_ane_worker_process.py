"""The ANE lane's worker process as a Mac will run it: it imports only what it runs (not the engine, not MLX), and
what it writes to stdout (Core ML's compiler does) never reaches the user's stdout, where `--json` is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hetero.pipeline.ane_process import AneProcess
from test_ane_process import _scale_program

TESTS = Path(__file__).resolve().parent
ENGINE_ONLY = ("mlx", "hetero.engine", "hetero.models", "hetero.pipeline", "hetero.decode", "hetero.library",
               "hetero.planner", "torch", "transformers")


def test_the_worker_module_imports_no_engine():
    code = "import sys, json, hetero.coreml.backends.ane_worker; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    modules = json.loads(out.stdout)
    assert "hetero.coreml.backends.ane_worker" in modules
    assert not [m for m in modules if m.startswith(ENGINE_ONLY)]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads a process's mapped libraries from /proc")
def test_a_running_worker_maps_no_engine_library(tmp_path):
    """A real worker that loaded and ran a program: MLX's library is not in its address space."""
    lane = AneProcess()
    try:
        x = np.ones((1, 64, 1, 64), np.float32)
        assert lane.load(_scale_program(tmp_path, (1, 64, 1, 64)))({"x": x})["y"][0, 0, 0, 0] == 3
        maps = Path(f"/proc/{lane.pid}/maps").read_text()
        assert "coremltools" in maps or "numpy" in maps  # what it runs
        assert "libmlx" not in maps and "torch" not in maps
    finally:
        lane.close()


def test_the_workers_stdout_never_reaches_the_users():
    """`hetero run --json` whose worker's Core ML (stood for by `ane_faults:chatty`) writes to file descriptor 1
    and prints while loading and predicting: stdout is the JSON alone; the worker's lines come out on stderr."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
           "HETERO_ANE_LOADER": "ane_faults:chatty"}
    prompt = "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip()\n" * 12
    out = subprocess.run([sys.executable, "-m", "hetero.cli.main", "run", "--prompt", prompt, "--max-tokens", "4",
                          "--no-mtp", "--json", "--ane-fraction", "0.5"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["ane"]["lane_failures"] == 0 and result["pipeline"]["lane"] == "process"
    assert "ANE worker: compiling layer" in out.stderr and "ANE worker: E5RT: predicting" in out.stderr
