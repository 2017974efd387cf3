"""Running exported packages through Core ML on macOS (CPU + Neural Engine), with a placement report.

Thin on purpose: Core ML itself runs only on macOS. Each package is compiled once to an .mlmodelc next to it
(reused while it is newer than the package) and loaded once per process with CPU_AND_NE. Where the OS offers
MLComputePlan (macOS 14.4+), `placement()` counts the ops Core ML prefers to put on each device; a program
with none on the Neural Engine is reported loudly, because Core ML falls back to the CPU silently.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetero.errors import HeteroError

_LOADED: dict[Path, "CoreMLProgram"] = {}


def available() -> tuple[bool, str]:
    """(whether Core ML can run programs here, why not)."""
    if platform.system() != "Darwin":
        return False, f"Core ML runs only on macOS (this is {platform.system()})"
    try:
        import coremltools  # noqa: F401
    except ImportError:
        return False, "coremltools is not installed"
    return True, ""


@dataclass
class Placement:
    """How many of a program's ops Core ML prefers on each device."""

    program: str
    neural_engine: int
    gpu: int
    cpu: int
    unknown: int

    @property
    def total(self) -> int:
        return self.neural_engine + self.gpu + self.cpu + self.unknown

    def line(self) -> str:
        return (f"{self.program}: {self.neural_engine}/{self.total} ops on the Neural Engine, "
                f"{self.cpu} on the CPU, {self.gpu} on the GPU, {self.unknown} unplaced")


class CoreMLProgram:
    """One compiled package, loaded with compute units CPU_AND_NE."""

    def __init__(self, package: str | os.PathLike):
        ok, why = available()
        if not ok:
            raise HeteroError(why)
        import coremltools as ct

        self.package = Path(package)
        self.compiled = compile_once(self.package)
        self.model = ct.models.CompiledMLModel(str(self.compiled), compute_units=ct.ComputeUnit.CPU_AND_NE)

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one prediction; inputs and outputs are fp16 arrays by name."""
        out = self.model.predict({k: np.asarray(v, dtype=np.float16) for k, v in inputs.items()})
        return {k: np.asarray(v) for k, v in out.items()}

    def placement(self) -> Placement | None:
        """Ops per preferred device from MLComputePlan; None where the OS does not offer it."""
        import coremltools as ct

        try:
            from coremltools.models.compute_plan import MLComputePlan

            plan = MLComputePlan.load_from_path(str(self.compiled), compute_units=ct.ComputeUnit.CPU_AND_NE)
        except Exception:  # older macOS or coremltools without the proxy: no plan to read
            return None
        counts = {"ane": 0, "gpu": 0, "cpu": 0, "unknown": 0}
        for op in plan.model_structure.program.functions["main"].block.operations:
            if op.operator_name == "const":
                continue
            usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
            device = type(usage.preferred_compute_device).__name__ if usage else ""
            key = "ane" if "NeuralEngine" in device else "gpu" if "GPU" in device else "cpu" if "CPU" in device else "unknown"
            counts[key] += 1
        return Placement(self.package.name, counts["ane"], counts["gpu"], counts["cpu"], counts["unknown"])


def compile_once(package: Path) -> Path:
    """The package compiled to `<name>.mlmodelc` beside it; recompiled only when the package is newer."""
    import coremltools as ct

    target = package.with_suffix(".mlmodelc")
    if not target.is_dir() or target.stat().st_mtime < package.stat().st_mtime:
        ct.models.utils.compile_model(str(package), str(target))
    return target


def load(package: str | os.PathLike, report: bool = True) -> CoreMLProgram:
    """A loaded program, cached per process; with `report`, a program placing no op on the ANE is shouted about."""
    key = Path(package).resolve()
    if key not in _LOADED:
        program = CoreMLProgram(key)
        if report:
            check_placement(program)
        _LOADED[key] = program
    return _LOADED[key]


def check_placement(program: CoreMLProgram) -> Placement | None:
    """Print the placement; a loud warning on stderr when zero ops land on the Neural Engine."""
    placed = program.placement()
    if placed is None:
        print(f"{program.package.name}: MLComputePlan unavailable (macOS 14.4+); ANE placement not verified", file=sys.stderr)
    elif placed.neural_engine == 0:
        print(f"WARNING: {placed.line()} -- NOTHING runs on the Neural Engine; Core ML fell back silently", file=sys.stderr)
    return placed
