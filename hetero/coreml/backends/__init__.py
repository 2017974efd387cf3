"""Execution backends for exported prefill pieces.

- `reference_executor`  runs a saved Core ML program with numpy, on any OS (the reference, not the ANE)
- `reference_prefill`   a serial prefill in which exported attention programs replace MLX's attention layers
- `coreml_macos`        runs the same packages through Core ML on macOS (CPU + Neural Engine): the thin Mac code
- `compiled`            compiling a package keyed by its content; `placement` where Core ML runs its ops, judged
                        by cost; `footprint` a process's memory as the OS charges it
- `ane_worker`          the ANE lane's worker process, which runs them (`arena`: its shared-memory buffers)
"""

from hetero.coreml.backends import coreml_macos
from hetero.coreml.backends.reference_executor import ReferenceExecutor


def platform_backend():
    """(name, loader): Core ML (CPU_AND_NE) on macOS, the portable reference executor elsewhere; a loader takes
    (path[, function]) and returns a callable program."""
    if coreml_macos.available()[0]:
        return coreml_macos.core_ml().name, coreml_macos.load
    return "reference executor", ReferenceExecutor
