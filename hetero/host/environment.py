"""What a benchmark's numbers depend on, in one dict: the machine, the BLAS under MLX and its threads, hetero's own
CPU kernels, the versions. Every bench/ script records it in its JSON."""

from __future__ import annotations

import os
import platform

import mlx.core as mx
import numpy as np

from hetero.host import blas, kernels


def environment() -> dict:
    """What a benchmark's numbers depend on: machine, BLAS, threads, versions."""
    versions = {"python": platform.python_version(), "mlx": mx.__version__, "numpy": np.__version__}
    try:  # the peer engine, where installed (bench extra)
        import mlx_lm

        versions["mlx_lm"] = mlx_lm.__version__
    except ImportError:
        pass
    mx.eval(mx.ones((2, 2)) @ mx.ones((2, 2)))  # MKL loads its threading layer on the first call
    return {
        "machine": platform.machine(),
        "system": platform.system(),
        "cpus": os.cpu_count(),
        "device": str(mx.default_device()),
        "blas": blas.describe(),
        "blas_library": blas.mlx_blas_library(),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "threads": {k: os.environ.get(k) for k in
                    ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "MKL_THREADING_LAYER")},
        "versions": versions,
        **kernels.status(),  # hetero's own 1-8 row products and delta step (hetero.host.kernels)
    }
