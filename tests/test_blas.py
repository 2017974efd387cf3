"""The fast BLAS wheel under MLX on Linux (hetero/host/blas.py): applied by `import hetero`, seen in the process's
mappings and in libmlx's own binding of cblas_sgemm, numerically right, and a slow fallback said once."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(platform.system() != "Linux", reason="the BLAS wheel is put under MLX on Linux only")

# a matmul through MLX against numpy's float64, in every shape family a model uses (M = 1, small M, large M;
# weights transposed as in a Linear layer, and not)
NUMERICS = """
import numpy as np
import mlx.core as mx
mx.set_default_device(mx.cpu)
rng = np.random.default_rng(0)
worst = 0.0
for m, k, n, t in ((1, 1024, 768, True), (4, 1024, 768, True), (300, 512, 384, True), (77, 333, 129, False)):
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k) if t else (k, n)).astype(np.float32)
    out = np.array(mx.array(a) @ (mx.array(w).T if t else mx.array(w)))
    ref = a.astype(np.float64) @ (w.T if t else w).astype(np.float64)
    worst = max(worst, float(np.abs(out - ref).max() / (np.sqrt(k) * np.abs(ref).std())))
"""


def _run(*parts: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the code (parts dedented one by one, then joined) in a fresh interpreter, without BLAS variables."""
    full = dict(os.environ)
    for k in ("LD_PRELOAD", "HETERO_BLAS_REEXEC", "MKL_THREADING_LAYER", "MKL_NUM_THREADS", "OMP_NUM_THREADS",
              "OPENBLAS_NUM_THREADS"):
        full.pop(k, None)
    full.update(env or {})
    code = "\n".join(textwrap.dedent(part) for part in parts)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=120)


def _last_json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_hetero_puts_the_wheel_blas_under_mlx():
    proc = _run("""
        import json
        import hetero, hetero.host.blas as b
        """, NUMERICS, """
        kind, paths = b.wheel_library()
        maps = open("/proc/self/maps").read()
        print(json.dumps({"kind": kind, "paths": [str(p) for p in paths], "mapped": [str(p) in maps for p in paths],
                          "provider": b.mlx_blas_library(), "describe": b.describe(), "in_use": b.in_use(),
                          "worst": worst}))
    """)
    r = _last_json(proc)
    assert all(r["mapped"]), r
    assert r["provider"] == r["paths"][-1], r  # libmlx's cblas_sgemm is the wheel's, not the bundled one
    assert r["describe"].startswith({"mkl": "Intel MKL", "nvpl": "NVPL BLAS"}[r["kind"]]), r
    assert r["in_use"]
    assert r["worst"] < 1e-5, r  # fp32 accumulation error, scaled by sqrt(K) and the result's spread
    assert "hetero:" not in proc.stderr  # no fallback message


def test_missing_library_falls_back_once_and_stays_correct():
    # blas.py loaded on its own (not through `import hetero`, which applies the real wheel first), pointed at a
    # library that does not exist
    proc = _run("""
        import importlib.util, json, sys
        spec = importlib.util.spec_from_file_location("blas_alone", "hetero/host/blas.py")
        b = sys.modules["blas_alone"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(b)
        first = b.apply(library="/nonexistent/libmkl_rt.so.3")
        again = b.apply(library="/nonexistent/libmkl_rt.so.3")
        """, NUMERICS, """
        print(json.dumps({"applied": [first, again], "describe": b.describe(), "in_use": b.in_use(),
                          "provider": b.mlx_blas_library(), "worst": worst}))
    """)
    r = _last_json(proc)
    assert r["applied"] == [False, False]
    assert "bundled reference BLAS" in r["describe"] and "slow" in r["describe"], r
    assert not r["in_use"]
    assert "mlx_cpu.libs" in r["provider"], r
    assert r["worst"] < 1e-5, r
    assert proc.stderr.count("hetero: could not load the fast BLAS") == 1, proc.stderr
    assert "/nonexistent/libmkl_rt.so.3" in proc.stderr


def test_mlx_imported_first_is_said_once_with_the_reason():
    proc = _run("""
        import json
        import mlx.core as mx
        import hetero, hetero.host.blas as b
        b.apply()
        print(json.dumps({"describe": b.describe(), "in_use": b.in_use()}))
    """)
    r = _last_json(proc)
    assert "bundled reference BLAS" in r["describe"] and not r["in_use"], r
    assert proc.stderr.count("mlx.core was imported before hetero") == 1, proc.stderr


def test_reexec_puts_the_wheel_blas_under_an_already_imported_mlx(tmp_path):
    # the benchmarks' path: mlx imported first, then reexec_with_fast_blas() restarts once with LD_PRELOAD
    script = tmp_path / "bench_like.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        sys.path.insert(0, sys.argv[1])
        import mlx.core as mx
        from hetero.host.blas import describe, in_use, reexec_with_fast_blas
        reexec_with_fast_blas()
        print(json.dumps({"describe": describe(), "in_use": in_use(), "child": "HETERO_BLAS_REEXEC" in os.environ}))
    """))
    full = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "HETERO_BLAS_REEXEC")}
    proc = subprocess.run([sys.executable, str(script), str(ROOT)], env=full, capture_output=True, text=True,
                          timeout=120)
    r = _last_json(proc)
    assert r["child"] and r["in_use"], r
    assert proc.stdout.count("{") == 1  # the first process never got past the exec
    # and where `import hetero` already did it, nothing restarts
    proc = _run("""
        import json, os
        from hetero.host.blas import in_use, reexec_with_fast_blas
        reexec_with_fast_blas()
        print(json.dumps({"in_use": in_use(), "child": "HETERO_BLAS_REEXEC" in os.environ}))
    """)
    assert _last_json(proc) == {"in_use": True, "child": False}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="MKL's threading layers")
@pytest.mark.parametrize(("env", "want"), [
    ({"OMP_NUM_THREADS": "1"}, "sequential layer, 1 thread"),
    ({"OPENBLAS_NUM_THREADS": "1"}, "sequential layer, 1 thread"),
    ({"MKL_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "1"}, "intel layer, 2 threads"),
])
def test_threads_follow_the_benchmarks_variables(env, want):
    proc = _run("""
        import hetero, hetero.host.blas as b, mlx.core as mx
        mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
        print(b.describe())
    """, env=env)
    assert proc.returncode == 0, proc.stderr
    assert want in proc.stdout, proc.stdout


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="MKL's threading layers")
def test_unasked_threads_are_every_core_on_the_openmp_layer():
    """Unasked, MKL runs on its OpenMP layer over every core (its dynamic mode keeps small products on one thread):
    measured faster than one thread on the 2-core machines too (hetero/host/blas.py). describe() names the layer MKL
    actually loaded, read from the mapped libraries, not the one hetero asked for."""
    proc = _run("""
        import os, hetero, hetero.host.blas as b, mlx.core as mx
        mx.eval(mx.ones((512, 512)) @ mx.ones((512, 512)))
        print(os.cpu_count(), b.mkl_layer_loaded(), b.describe())
    """)
    assert proc.returncode == 0, proc.stderr
    cores, loaded, described = proc.stdout.strip().splitlines()[-1].split(" ", 2)
    assert loaded == "intel", proc.stdout
    assert f"intel layer, {cores} thread" in described, described
