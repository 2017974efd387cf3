"""Which BLAS MLX's CPU backend uses, and switching to the system OpenBLAS on Linux.

The `mlx[cpu]` wheel links a reference BLAS (about 8 GFLOP/s for a 2048^2 fp32 matmul); preloading Debian's
OpenBLAS makes the same matmul about 20x faster. Benchmarks and training re-exec themselves with it so that
every contender in a run shares one environment, which `environment()` records.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)


def openblas_path() -> str | None:
    """The system OpenBLAS library, if installed (Debian: libopenblas0-pthread)."""
    return next((p for p in OPENBLAS_CANDIDATES if Path(p).is_file()), None)


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def reexec_with_openblas(argv: list[str] | None = None) -> None:
    """Restart this Python process with OpenBLAS preloaded, once, on Linux when it is available.

    OpenBLAS misdetects some virtual CPUs as a generic core (about 5x slower kernels), so on AVX2+FMA hardware
    the Haswell kernels are requested unless OPENBLAS_CORETYPE is already set. `argv` defaults to sys.argv
    (pass ["-m", "package.module", ...] for a module run with -m).
    """
    lib = openblas_path()
    if platform.system() != "Linux" or lib is None or lib in os.environ.get("LD_PRELOAD", ""):
        return
    env = dict(os.environ, LD_PRELOAD=":".join(filter(None, [lib, os.environ.get("LD_PRELOAD")])))
    if "OPENBLAS_CORETYPE" not in env and {"avx2", "fma"} <= _cpu_flags():
        env["OPENBLAS_CORETYPE"] = "Haswell"
    os.execve(sys.executable, [sys.executable, *(argv if argv is not None else sys.argv)], env)


def describe() -> str:
    """One line naming the BLAS this process uses."""
    preload = os.environ.get("LD_PRELOAD", "")
    if "openblas" in preload:
        core = os.environ.get("OPENBLAS_CORETYPE", "auto-detected core")
        return f"OpenBLAS (LD_PRELOAD, {core}, {os.environ.get('OPENBLAS_NUM_THREADS', 'all')} threads)"
    if platform.system() == "Darwin":
        return "Accelerate (MLX default)"
    return "mlx[cpu] bundled reference BLAS (slow: apt-get install libopenblas0-pthread)"


def environment() -> dict:
    """What a benchmark's numbers depend on: machine, BLAS, threads, versions."""
    import mlx.core as mx
    import numpy as np

    preload = os.environ.get("LD_PRELOAD", "")
    versions = {"python": platform.python_version(), "mlx": mx.__version__, "numpy": np.__version__}
    try:
        import mlx_lm

        versions["mlx_lm"] = mlx_lm.__version__
    except ImportError:
        pass
    return {
        "machine": platform.machine(),
        "system": platform.system(),
        "cpus": os.cpu_count(),
        "device": str(mx.default_device()),
        "blas": describe(),
        "ld_preload": preload,
        "threads": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE")},
        "versions": versions,
    }
