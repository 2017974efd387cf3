"""hetero's own few-row product (hetero/host/kernels/few_rows.cpp) and the build both kernels share: built for real against
the installed MLX (CMake, the system's C++ compiler, nanobind), loaded as an MLX op, checked against a float64 numpy
oracle; the property batching rests on (a row's result does not depend on the rows beside it); the products that
take it; and the builds that fail, which must leave MLX's ops running, one line on stderr and nothing half-built in
the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from hetero.host import kernels
from hetero.models.linear import project

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(kernels.unsupported() is not None, reason=f"the kernel: {kernels.unsupported()}")


def graph(*outputs: mx.array) -> str:
    """The primitives behind `outputs`, as MLX's DOT export names them."""
    import io

    buf = io.StringIO()
    mx.export_to_dot(buf, *outputs)
    return buf.getvalue()


@pytest.fixture(scope="module")
def few_rows():
    k = kernels.few_rows()
    assert k is not None, kernels.why_not()
    return k


@pytest.mark.parametrize("out, inner", [(1, 8), (2, 29), (37, 1024), (6144, 1024), (1024, 3072), (513, 77)])
def test_the_kernel_equals_a_float64_product_at_every_row_count(few_rows, out, inner):
    rng = np.random.default_rng(out * inner)
    w = rng.standard_normal((out, inner), dtype=np.float32)
    for rows in range(1, kernels.MAX_ROWS + 1):
        x = rng.standard_normal((rows, inner), dtype=np.float32)
        got = np.array(few_rows(mx.array(x), mx.array(w)))
        want = x.astype(np.float64) @ w.astype(np.float64).T
        scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T  # the sum's magnitude: fp32 error bound
        assert got.shape == (rows, out)
        assert np.all(np.abs(got - want) <= 1e-6 * inner * scale + 1e-30), (rows, np.max(np.abs(got - want)))


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(few_rows):
    """A request's tokens in a batch are bit for bit its tokens alone: each row of an 8-row product equals the same
    row multiplied alone, and in every smaller batch it starts."""
    rng = np.random.default_rng(7)
    w = mx.array(rng.standard_normal((3072, 1024), dtype=np.float32))
    x = mx.array(rng.standard_normal((8, 1024), dtype=np.float32))
    alone = [np.array(few_rows(x[i : i + 1], w)) for i in range(8)]
    for rows in range(2, 9):
        together = np.array(few_rows(x[:rows], w))
        for i in range(rows):
            assert np.array_equal(together[i : i + 1], alone[i]), (rows, i)


def test_the_kernel_runs_inside_compiled_graphs_and_views(few_rows):
    rng = np.random.default_rng(3)
    w_full = mx.array(rng.standard_normal((96, 64), dtype=np.float32))
    w = w_full[32:80]  # a row slice, as a fused projection's part is
    x = mx.array(rng.standard_normal((4, 64), dtype=np.float32))
    step = mx.compile(lambda x, w: mx.tanh(few_rows(x * 2, w)) + 1)
    assert np.array_equal(np.array(step(x, w)), np.array(mx.tanh(few_rows(x * 2, w)) + 1))
    xt = mx.array(rng.standard_normal((64, 4), dtype=np.float32)).T  # not row-contiguous: copied inside the op
    assert np.allclose(np.array(few_rows(xt, w)), np.array(xt) @ np.array(w).T, rtol=1e-5, atol=1e-5)
    assert np.array_equal(np.array(few_rows(x, w)), np.array(few_rows(x, mx.array(np.array(w)))))  # view = own copy
    x3 = x.reshape(2, 2, 64)  # rows in leading dimensions: [2, 2, in] -> [2, 2, out], the same rows
    assert np.array_equal(np.array(few_rows(x3, w)), np.array(few_rows(x, w)).reshape(2, 2, 48))


def test_the_kernel_refuses_what_it_does_not_compute(few_rows):
    w = mx.zeros((16, 8))
    for x, what in [(mx.zeros((9, 8)), "1 to 8 rows"), (mx.zeros((3, 3, 8)), "1 to 8 rows"),
                    (mx.zeros((2, 8), mx.bfloat16), "float32"), (mx.zeros((2, 7)), "expected")]:
        with pytest.raises(ValueError, match=what):
            few_rows(x, w)


def test_project_takes_the_kernel_for_1_to_8_float32_rows_only(few_rows):
    w = mx.ones((32, 16))
    for shape, dtype, kernel in [((1, 1, 16), mx.float32, True), ((4, 1, 16), mx.float32, True),
                                 ((2, 4, 16), mx.float32, True), ((9, 16), mx.float32, False),
                                 ((3, 16), mx.bfloat16, False)]:
        x = mx.ones(shape, dtype)
        y = project(x, w.astype(dtype))
        assert y.shape == (*shape[:-1], 32)
        assert ("FewRows" in graph(y)) == kernel, (shape, dtype)
        assert np.allclose(np.array(y.astype(mx.float32)), 16.0)


def python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)


STATUS = ("import json, hetero\nfrom hetero.host import kernels\n"
          "print(json.dumps({'loaded': kernels.few_rows() is not None, 'why_not': kernels.why_not()}))")


@pytest.mark.parametrize("env, says", [
    ({"CXX": "/nonexistent/c++"}, "no C++ compiler found"),
    ({"CXXFLAGS": "-fno-such-flag-for-hetero"}, "is not able to compile"),  # the compiler itself fails
    ({"HETERO_FEW_ROW_KERNEL": "0"}, "turned off"),
], ids=["no-compiler", "compiler-fails", "turned-off"])
def test_a_kernel_that_cannot_be_built_leaves_mlx_products_one_line_and_no_library(tmp_path, env, says):
    cache = tmp_path / "kernels"
    run = python(STATUS, {"HETERO_KERNEL_CACHE": str(cache), **env})
    assert run.returncode == 0, run.stderr
    status = json.loads(run.stdout)
    assert status["loaded"] is False and says in status["why_not"], status
    assert "Traceback" not in run.stderr
    if env.get("HETERO_FEW_ROW_KERNEL") != "0":
        assert run.stderr.count("the CPU kernels could not be built") == 1, run.stderr
    # nothing half-built is left where a later process would look (the build's temporary folder is gone too)
    assert not list(cache.rglob("*.so")) and not list(cache.rglob(".build.*"))


def test_a_build_is_kept_whole_and_loaded_by_the_next_process(tmp_path):
    """The first process builds (said on stderr) and clears what a killed build left behind, but not a build that
    may still run in another process; only the finished library has the name a process loads; the next process
    loads it without building."""
    cache = tmp_path / "kernels"
    key_dir = cache / kernels._key()
    abandoned, recent = key_dir / ".build.killed", key_dir / ".build.running"
    for folder in (abandoned, recent):
        (folder / "build").mkdir(parents=True)
        (folder / "build" / "_kernels.partial.so").write_bytes(b"\x7fELF half")  # never loaded: not the final name
    old = os.stat(abandoned).st_mtime - 3 * kernels.BUILD_TIMEOUT_S
    os.utime(abandoned, (old, old))
    first = python(STATUS, {"HETERO_KERNEL_CACHE": str(cache)})
    assert json.loads(first.stdout) == {"loaded": True, "why_not": None}, first.stderr
    assert "building the CPU kernels" in first.stderr
    assert not abandoned.exists() and recent.exists()
    library = key_dir / f"{kernels.NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"
    assert [p for p in key_dir.iterdir() if p.name.endswith(".so")] == [library]
    second = python(STATUS, {"HETERO_KERNEL_CACHE": str(cache)})
    assert json.loads(second.stdout) == {"loaded": True, "why_not": None}, second.stderr
    assert "building" not in second.stderr  # loaded, not rebuilt


def test_a_process_that_finds_a_build_under_way_waits_for_it_and_builds_nothing(tmp_path):
    """pytest-xdist's workers and servers started together ask for the kernels at once: the one that holds the build
    lock builds, the others wait on it and load what it left. Here this process holds the lock while a second one
    starts on an empty cache, then puts a finished library in place (this session's own build) and lets go."""
    import fcntl
    import shutil

    cache = tmp_path / "kernels"
    key_dir = cache / kernels._key()
    key_dir.mkdir(parents=True)
    library = key_dir / f"{kernels.NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"
    with open(key_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiting = subprocess.Popen([sys.executable, "-c", STATUS], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, env={**os.environ, "HETERO_KERNEL_CACHE": str(cache)})
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=5)  # it waits on the lock (the import itself takes about a second)
        shutil.copy(kernels._built(), library)
    out, err = waiting.communicate(timeout=120)
    assert json.loads(out) == {"loaded": True, "why_not": None}, err
    assert "building" not in err  # it loaded the library the holder of the lock left, and built nothing
