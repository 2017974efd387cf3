"""The order in which pytest-xdist hands modules to its workers: the costliest first.

With `--dist loadscope --no-loadscope-reorder` (pyproject.toml) a worker that runs low on tests takes the next
module in collection order. Handed out in file order, a costly module that comes late (test_quantized_export) was
still running on one worker while the other sat idle; started first, the long modules overlap with everything else
and the run ends on short ones (longest-first scheduling). `HEAVY_FIRST` lists the modules that held a worker
longest (wall time summed per module with `--durations=0`, a full run with two workers), longest first; every other
module keeps its file order after them. A list that has gone stale costs a little wall time, never a test.
"""

from __future__ import annotations

HEAVY_FIRST = [
    "test_agent_clis.py",
    "test_dtypes.py",
    "test_distributed.py",
    "test_ane_worker_death.py",
    "test_ane_process.py",
    "test_distributed_serve.py",
    "test_few_rows_kernel.py",
    "test_quantized_export.py",
    "test_coreml_passes.py",
    "test_pipeline.py",
    "test_qwen4_caches.py",
    "test_bad_input.py",
    "test_pipeline_qwen4.py",
    "test_ane_worker_process.py",
    "test_library.py",
    "test_speculative.py",
    "test_doctor.py",
    "test_verify_layouts.py",
    "test_server.py",
    "test_penalties.py",
    "test_cli.py",
    "test_outliers.py",
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    position = {}  # a module's place in file order
    for item in items:
        position.setdefault(item.path, len(position))
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), position[item.path]))
