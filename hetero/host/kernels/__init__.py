"""hetero's own CPU kernels, built once on this machine and loaded as MLX ops: the few-row product and the gated
delta rule's decode step.

A decode step multiplies 1 to 8 rows (one request, a batch of requests, an MTP verify pass) by every weight matrix,
and is bound by reading the weights. MLX's CPU backend hands those products to MKL's sgemm, which reads the
weights about twice over for 4 rows (hetero/models/linear.py has the figures); `few_rows.cpp` reads them once for
all rows (AVX2 + FMA). Each GDN layer's step then updates its recurrent state [rows, Hv, Dk, Dv], which MLX does in
five passes over memory; `delta_step.cpp` reads and writes it once. Both are MLX primitives, so they run inside lazy
and compiled graphs like any other op, and both compute every row the same way whatever rows sit beside it, so a
request's tokens in a batch are bit for bit the tokens it gets alone.

The extension is compiled against the installed MLX the first time a process needs it (`library()`; about 30 s on
two cores, said on stderr), with CMake, a C++ compiler and nanobind (a Linux x86-64 dependency of hetero), and
kept in `cache_dir()` under a key of the sources and the MLX, nanobind and Python versions: the next process
loads it in milliseconds. A build goes to a temporary folder and only a finished library is moved into place, so
nothing half-built is ever loaded. Where it cannot be built or does not apply (macOS and its GPU, aarch64, a CPU
without AVX2, no compiler), `few_rows()` and `delta_step()` are None, MLX's own ops run, and `why_not()` says why
(`hetero run --json` and every bench's environment record it). HETERO_FEW_ROW_KERNEL=0 and HETERO_DELTA_KERNEL=0
turn each off (the baselines the benches compare against). docs/kernels.md has the design and its figures.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

import mlx.core as mx

from hetero.host import blas
from hetero.host.switches import switched_on

MAX_ROWS = 8  # the few-row kernel's row counts: 1 to 8
MAX_VALUE_DIM = 512  # the delta step's largest value head
SOURCES = ("kernels.h", "few_rows.cpp", "delta_step.cpp", "module.cpp", "CMakeLists.txt")
NAME = "_kernels"  # the extension module
BUILD_TIMEOUT_S = 600

_lock = threading.Lock()
_loaded: list = []  # [module or None] once decided for this process
_reason: list[str] = []  # why the library is not in use, once decided
_ops: dict[str, object] = {}  # op name -> the op or None, once decided


def few_rows():
    """The kernel `few_rows(x [..., in], w [out, in]) -> [..., out]` (float32, 1-8 rows: x's leading positions, CPU),
    built and loaded on first use; None where it does not apply, could not be built or is turned off (`why_not`)."""
    return _op("few_rows", "HETERO_FEW_ROW_KERNEL")


def delta_step():
    """The kernel `delta_step(q, k [..., Dk], v [..., Dv], g, beta [...], state [..., Dk, Dv]) -> [out [..., Dv],
    state]` (one token of the gated delta rule with log decay g, float32, Dv up to MAX_VALUE_DIM, CPU); None like
    `few_rows`."""
    return _op("delta_step", "HETERO_DELTA_KERNEL")


def why_not(switch: str = "HETERO_FEW_ROW_KERNEL") -> str | None:
    """Why the kernel that `switch` turns off is not in use in this process (None when it is); builds or loads the
    library first if nothing did yet."""
    if not switched_on(switch):
        return f"turned off ({switch}=0)"
    return None if library() is not None else _reason[0]


def status() -> dict[str, str]:
    """{"few_row_kernel": ..., "delta_kernel": ...}: "in use", or why not (what `hetero run --json` and the benches'
    environments record)."""
    return {"few_row_kernel": why_not("HETERO_FEW_ROW_KERNEL") or "in use",
            "delta_kernel": why_not("HETERO_DELTA_KERNEL") or "in use"}


def library() -> ModuleType | None:
    """The extension module, built and loaded on first use (once per process); None where it does not apply or
    could not be built (`why_not`)."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:
            _loaded.append(_load())
    return _loaded[0]


def _op(name: str, switch: str):
    """The op `name` of the library, or None; decided once per process (`project` asks for every product)."""
    if name not in _ops:
        module = library() if switched_on(switch) else None
        _ops[name] = getattr(module, name) if module is not None else None
    return _ops[name]


def cache_dir() -> Path:
    """Where built kernels are kept: $HETERO_KERNEL_CACHE, else $HETERO_HOME/kernels, else
    $XDG_CACHE_HOME/hetero/kernels, else ~/.cache/hetero/kernels."""
    if os.environ.get("HETERO_KERNEL_CACHE"):
        return Path(os.environ["HETERO_KERNEL_CACHE"]).expanduser()
    if os.environ.get("HETERO_HOME"):
        return Path(os.environ["HETERO_HOME"]).expanduser() / "kernels"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hetero" / "kernels"


def unsupported() -> str | None:
    """Why this machine cannot use the kernels at all (no build is tried), else None."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"an x86-64 Linux kernel; this is {platform.system()} {platform.machine()} (MLX's own ops run)"
    flags = _cpu_flags()
    if not {"avx2", "fma"} <= flags:
        return "this CPU lacks AVX2 or FMA"
    if not blas.openmp_runtime():
        return "the Intel OpenMP runtime (the intel-openmp wheel, an mkl dependency) is not installed"
    return None


def _load() -> ModuleType | None:
    reason = unsupported()
    if reason is None:
        try:
            spec = importlib.util.spec_from_file_location(NAME, _built())
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            module.set_threads(blas.threads_in_use())
            _self_check(module)
            return module
        except (OSError, ImportError, TypeError, subprocess.SubprocessError, BuildError) as e:
            reason = f"could not be built or loaded ({e})"
            print(f"hetero: the CPU kernels {reason}; MLX's own ops run (slower decode steps)",
                  file=sys.stderr, flush=True)
    _reason.append(reason)
    return None


def _self_check(module: ModuleType) -> None:
    """The loaded kernels against MLX's own ops on odd shapes and every row count (a library built for another MLX
    or nanobind fails here: its arrays would not convert)."""
    w = mx.sin(mx.arange(37 * 29, dtype=mx.float32)).reshape(37, 29)  # [out, in], neither a multiple of 8
    for rows in range(1, MAX_ROWS + 1):
        x = mx.cos(mx.arange(rows * 29, dtype=mx.float32)).reshape(rows, 29)
        if not mx.allclose(module.few_rows(x, w), x @ w.T, rtol=1e-5, atol=1e-5).item():
            raise BuildError(f"its self-check disagrees with MLX's product at {rows} rows")
    n, dk, dv = 3, 5, 11
    q, k = (mx.sin(mx.arange(n * dk, dtype=mx.float32) * f).reshape(n, dk) for f in (0.7, 1.3))
    v = mx.cos(mx.arange(n * dv, dtype=mx.float32)).reshape(n, dv)
    g, beta = mx.array([-0.1, -0.7, 0.0]), mx.array([0.3, 1.0, 0.7])
    state = mx.sin(mx.arange(n * dk * dv, dtype=mx.float32)).reshape(n, dk, dv)
    decayed = state * mx.exp(g)[:, None, None]  # the rule as gated_delta._recurrent_step writes it
    u = beta[:, None] * (v - (k[:, None, :] @ decayed)[:, 0])  # [n, dv]
    expected = decayed + k[:, :, None] * u[:, None, :]
    out, new = module.delta_step(q, k, v, g, beta, state)
    if not (mx.allclose(new, expected, rtol=1e-5, atol=1e-5).item()
            and mx.allclose(out, (q[:, None, :] @ expected)[:, 0], rtol=1e-5, atol=1e-5).item()):
        raise BuildError("its self-check disagrees with MLX's gated delta step")


class BuildError(Exception):
    """The kernels' build failed; the message is its last useful line."""


def _key() -> str:
    import nanobind

    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((here / name).read_bytes())
    versions = (mx.__version__, nanobind.__version__, sys.version_info[:2], sysconfig.get_config_var("EXT_SUFFIX"))
    h.update(repr(versions).encode())
    return h.hexdigest()[:16]


def _built() -> Path:
    """The compiled extension for this MLX, built now if the cache does not hold it."""
    try:
        key = _key()
    except ImportError as e:
        raise BuildError(f"nanobind is not installed: {e}") from None
    final = cache_dir() / key / f"{NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if final.is_file():
        return final
    tools = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # the venv's cmake, ninja
    cmake, ninja = shutil.which("cmake", path=tools), shutil.which("ninja", path=tools)
    if cmake is None:
        raise BuildError("no cmake found; install it (pip install cmake, or apt install cmake)")
    if shutil.which(os.environ.get("CXX", "c++"), path=tools) is None:
        raise BuildError("no C++ compiler found; install one (apt install g++) or set CXX")
    final.parent.mkdir(parents=True, exist_ok=True)
    import fcntl  # POSIX; the kernels build on Linux only

    with open(final.parent / "build.lock", "w") as lock:  # processes starting at once (test workers, servers)
        fcntl.flock(lock, fcntl.LOCK_EX)  # wait for the one that builds instead of building it again
        if not final.is_file():
            _build(final, cmake, ninja)
    return final


def _build(final: Path, cmake: str, ninja: str | None) -> None:
    """Compile the extension into `final` by way of a temporary folder (an atomic move at the end)."""
    _remove_abandoned_builds(final.parent)
    print("hetero: building the CPU kernels for this MLX (once, about 30 s)...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".build.") as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "build"
        src.mkdir()
        for name in SOURCES:
            shutil.copy(Path(__file__).parent / name, src / name)
        mlx_cmake = Path(mx.__file__).parent / "share" / "cmake" / "MLX"  # mlx/core*.so -> mlx/share/...
        configure = [cmake, "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
                     f"-DPython_EXECUTABLE={sys.executable}", f"-DMLX_DIR={mlx_cmake}"]
        if ninja is not None:
            configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        for command in (configure, [cmake, "--build", str(out), "--parallel"]):
            run = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if run.returncode != 0:
                raise BuildError(_last_error(run.stdout + run.stderr))
        (library,) = out.glob(f"{NAME}*.so")
        os.replace(library, final)  # atomic: another process sees the whole library or none


def _remove_abandoned_builds(folder: Path) -> None:
    """Delete the temporary folders of builds whose process was killed (older than a build may take)."""
    for stale in folder.glob(".build.*"):
        try:
            if time.time() - stale.stat().st_mtime > 2 * BUILD_TIMEOUT_S:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def _last_error(log: str) -> str:
    """The first line of a failed build's log that says what failed (a compiler's `error:`, CMake's message)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if "error:" in line.lower():
            return line[:300]
        if line.startswith("CMake Error"):  # its message follows on a few indented lines, up to a full stop
            message = []
            for part in lines[i + 1 : i + 6]:
                message.append(part)
                if part.endswith("."):
                    break
            return "CMake: " + " ".join(message)[:300]
    return (lines or ["no output"])[-1][:300]


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
