"""hetero's own CPU kernel: the few-row product a decode step runs, built once on this machine and loaded as an MLX op.

A decode step multiplies 1 to 8 rows (one request, a batch of requests, an MTP verify pass) by every weight matrix,
and is bound by reading the weights. MLX's CPU backend hands those products to MKL's sgemm, which reads the
weights about twice over for 4 rows (hetero/models/linear.py has the figures); `few_rows.cpp` reads them once for
all rows (AVX2 + FMA) as an MLX primitive, so it runs inside lazy and compiled graphs like any other op. Every
(channel, row) sums the same chain in the same order whatever the other rows are, so a request's tokens in a
batch are bit for bit the tokens it gets alone.

The extension is compiled against the installed MLX the first time a process needs it (`few_rows()`; about 15 s on
two cores, said on stderr), with CMake, a C++ compiler and nanobind (a Linux x86-64 dependency of hetero), and
kept in `cache_dir()` under a key of the sources and the MLX, nanobind and Python versions: the next process
loads it in milliseconds. A build goes to a temporary folder and only a finished library is moved into place, so
nothing half-built is ever loaded. Where it cannot be built or does not apply (macOS and its GPU, aarch64, a CPU
without AVX2, no compiler), `few_rows()` is None, MLX's own products run, and `why_not()` says why (`hetero
run --json` and every bench's environment record it). HETERO_FEW_ROW_KERNEL=0 turns it off (the baseline the
benches compare against). docs/kernels.md has the design and its figures.
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

from hetero import blas
from hetero.switches import switched_on

MAX_ROWS = 8  # the kernel's row counts: 1 to 8
SOURCES = ("few_rows.cpp", "CMakeLists.txt")
BUILD_TIMEOUT_S = 600

_lock = threading.Lock()
_loaded: list = []  # [module or None] once decided for this process
_reason: list[str] = []  # why the kernel is not in use, once decided


def few_rows():
    """The kernel `few_rows(x [rows, in], w [out, in]) -> [rows, out]` (float32, 1-8 rows, CPU), built and loaded
    on first use; None where it does not apply or could not be built (`why_not`)."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:
            module = _load()
            _loaded.append(module.few_rows if module is not None else None)
    return _loaded[0]


def why_not() -> str | None:
    """Why the kernel is not in use in this process (None when it is); decides it first if nothing did yet."""
    few_rows()
    return _reason[0] if _reason else None


def cache_dir() -> Path:
    """Where built kernels are kept: $HETERO_KERNEL_CACHE, else $HETERO_HOME/kernels, else
    $XDG_CACHE_HOME/hetero/kernels, else ~/.cache/hetero/kernels."""
    if os.environ.get("HETERO_KERNEL_CACHE"):
        return Path(os.environ["HETERO_KERNEL_CACHE"]).expanduser()
    if os.environ.get("HETERO_HOME"):
        return Path(os.environ["HETERO_HOME"]).expanduser() / "kernels"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hetero" / "kernels"


def unsupported() -> str | None:
    """Why this machine or run cannot use the kernel at all (no build is tried), else None."""
    if not switched_on("HETERO_FEW_ROW_KERNEL"):
        return "turned off (HETERO_FEW_ROW_KERNEL=0)"
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"an x86-64 Linux kernel; this is {platform.system()} {platform.machine()} (MLX's own products run)"
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
            library = _built()
            spec = importlib.util.spec_from_file_location("_few_rows", library)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            module.set_threads(blas.threads_in_use())
            _self_check(module.few_rows)
            return module
        except (OSError, ImportError, TypeError, subprocess.SubprocessError, BuildError) as e:
            reason = f"could not be built or loaded ({e})"
            print(f"hetero: the few-row CPU kernel {reason}; MLX's own products run (slower for batches)",
                  file=sys.stderr, flush=True)
    _reason.append(reason)
    return None


def _self_check(few_rows) -> None:
    """The loaded kernel against MLX's product on every row count and an odd shape (a library built for another MLX
    or nanobind fails here: its arrays would not convert)."""
    w = mx.sin(mx.arange(37 * 29, dtype=mx.float32)).reshape(37, 29)  # [out, in], neither a multiple of 8
    for rows in range(1, MAX_ROWS + 1):
        x = mx.cos(mx.arange(rows * 29, dtype=mx.float32)).reshape(rows, 29)
        if not mx.allclose(few_rows(x, w), x @ w.T, rtol=1e-5, atol=1e-5).item():
            raise BuildError(f"its self-check disagrees with MLX's product at {rows} rows")


class BuildError(Exception):
    """The kernel's build failed; the message is its last useful line."""


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
    final = cache_dir() / key / f"_few_rows{sysconfig.get_config_var('EXT_SUFFIX')}"
    if final.is_file():
        return final
    tools = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # the venv's cmake, ninja
    cmake, ninja = shutil.which("cmake", path=tools), shutil.which("ninja", path=tools)
    if cmake is None:
        raise BuildError("no cmake found; install it (pip install cmake, or apt install cmake)")
    if shutil.which(os.environ.get("CXX", "c++"), path=tools) is None:
        raise BuildError("no C++ compiler found; install one (apt install g++) or set CXX")
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(final.parent)
    print("hetero: building the few-row CPU kernel for this MLX (once, about 15 s)...", file=sys.stderr, flush=True)
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
        (library,) = out.glob("_few_rows*.so")
        os.replace(library, final)  # atomic: another process sees the whole library or none
    return final


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
