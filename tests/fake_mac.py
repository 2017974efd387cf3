"""A stand-in for a Mac's Core ML, answering as macOS 14.0, 14.4, 15 or 26 would: a `CoreML` whose every field
stands for one real call (`hetero.coreml.backends.coreml_macos.CoreML`). Nothing else in hetero is replaced: the
lane, the doctor and the export run their own code on these answers. A process takes one from
$HETERO_COREML="fake_mac:<name>" (its ANE worker inherits it; tests/ must be on PYTHONPATH).

What each stand-in call does, and the real call it stands for:

- `system`, `mac_ver`: `platform.system()` = "Darwin", `platform.mac_ver()[0]` = the version;
- `native`: the import of `coremltools.libcoremlpython`, which succeeds on a Mac with coremltools' wheel;
- `compile_model(src, dst)`: `coremltools.models.utils.compile_model` (`MLModel.compileModelAtURL`): refuses a
  package whose specification version the OS does not know, in Core ML's own words ("The model supplied is of
  version 9, intended for a newer version of Xcode. This version of Xcode supports model version 8 or earlier.",
  apple/coremltools#750, #1557), else writes a compiled folder with its `coremldata.bin`;
- `open_model(compiled, units, function)`: `CompiledMLModel(compiled, compute_units, function_name).predict`:
  refuses a function name before macOS 15 in the binding's words (`CoreMLPython.mm`), and predicts with the
  reference executor; each prediction advances the stand-in's `clock` (standing for the wall clock the doctor times
  Core ML with) by the time the device would take: 1 ms plus the package's weights at 2 GB/s on the Neural Engine,
  `speedup` times as long under CPU_ONLY (below 1: the Neural Engine is the slower);
- `compute_plan(compiled, units)`: `MLComputePlan.load_from_path`: raises before macOS 14.4 as the binding does;
  else each op of the package's default function is placed by `place` (op type -> device) with an estimated cost
  proportional to its work, and the ops of its other functions are unplaced (the query names no function);
- `rusage(flavor)`: `proc_pid_rusage(getpid(), flavor)`: a `rusage_info_v6` whose phys footprint is a fixed 64 MiB
  and whose neural footprint is the weights of the packages loaded for the Neural Engine (as stored: a Core ML that
  keeps lookup tables compressed).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hetero.coreml.backends import coreml_macos
from hetero.coreml.backends.coreml_macos import CoreML
from hetero.coreml.backends.footprint import NEURAL_FOOTPRINT_FIELD, PHYS_FOOTPRINT_FIELD, UUID_BYTES
from hetero.coreml.target import max_spec
from hetero.pipeline.ane_process import stop_workers

SOURCE = "source.txt"  # in a stand-in compiled folder: the package it was compiled from


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


@dataclass
class FakeMac:
    """One macOS as Core ML answers it. `place(op)` -> "ane" / "cpu" / "gpu" for the default function's ops;
    `speedup`: the Neural Engine's speed over CPU_ONLY (below 1: slower than the CPU); `max_spec`: the newest
    specification its Core ML compiles (default: the OS's own)."""

    version: str
    place: object = lambda op: "ane"  # noqa: E731
    speedup: float = 4.0
    max_spec: int | None = None
    name: str = ""
    loaded_bytes: list = field(default_factory=list)
    now: list = field(default_factory=lambda: [0.0])  # the stand-in's clock, seconds

    def core_ml(self) -> CoreML:
        return CoreML(name=self.name or f"Core ML stand-in (macOS {self.version})", system=lambda: "Darwin",
                      mac_ver=lambda: self.version, native=lambda: None, compile_model=self.compile_model,
                      open_model=self.open_model, compute_plan=self.compute_plan, rusage=self.rusage,
                      clock=lambda: self.now[0])

    @property
    def macos(self) -> tuple[int, ...]:
        return version_tuple(self.version)

    def compile_model(self, src: str, dst: str) -> str:
        import coremltools as ct

        spec = ct.models.utils.load_spec(src).specificationVersion
        newest = self.max_spec or max_spec(self.macos)
        if spec > newest:
            raise RuntimeError(f'Error compiling model: "Error reading protobuf spec. validator error: The model '
                               f'supplied is of version {spec}, intended for a newer version of Xcode. This version '
                               f'of Xcode supports model version {newest} or earlier.".')
        Path(dst).mkdir(parents=True)
        (Path(dst) / "coremldata.bin").write_bytes(b"stand-in")
        (Path(dst) / SOURCE).write_text(src)
        return dst

    def open_model(self, compiled: str, units: str, function: str | None):
        from hetero.coreml.backends.reference_executor import ReferenceExecutor

        if function is not None and self.macos < (15, 0):
            raise RuntimeError("The 'functionName' property can only be set on macOS >= 15.0")
        package = Path((Path(compiled) / SOURCE).read_text())
        run = ReferenceExecutor(package, function)
        weights = sum(f.stat().st_size for f in package.rglob("weight.bin"))
        if units == "CPU_AND_NE":
            self.loaded_bytes.append(weights)
        seconds = (1e-3 + weights / 2e9) * (self.speedup if units == "CPU_ONLY" else 1.0)

        def predict(feed: dict) -> dict:
            out = {k: np.asarray(v, np.float32) for k, v in run(feed).items()}
            self.now[0] += seconds  # the device's time, on the clock the doctor reads
            return out

        return predict

    def compute_plan(self, compiled: str, units: str):
        if self.macos < (14, 4):
            raise RuntimeError("MLComputePlan is only available on macOS >= 14.4")
        return ComputePlan(Path((Path(compiled) / SOURCE).read_text()), self.place)

    def rusage(self, flavor: int) -> bytes | None:
        if flavor == 6 and self.macos < (14, 0):
            return None
        buf = bytearray(1024)
        struct.pack_into("<Q", buf, UUID_BYTES + 8 * PHYS_FOOTPRINT_FIELD, 64 << 20)
        struct.pack_into("<Q", buf, UUID_BYTES + 8 * NEURAL_FOOTPRINT_FIELD, sum(self.loaded_bytes))
        return bytes(buf)


class ComputePlan:
    """Stands for `MLComputePlan`: `model_structure.program.functions[name].block.operations` (ops with
    `operator_name` and `blocks`), the devices Core ML would use per op and its estimated cost."""

    def __init__(self, package: Path, place):
        from coremltools.models import compute_device as cd

        from hetero.coreml.graphs.package import load_program

        program = load_program(package)
        self.devices = {"ane": cd.MLNeuralEngineComputeDevice, "cpu": cd.MLCPUComputeDevice,
                        "gpu": cd.MLGPUComputeDevice}
        self.place, self.default = place, program.default_function_name
        functions = {}
        for name, func in program.functions.items():
            ops = [SimpleNamespace(operator_name=op.op_type, blocks=[], function=name, work=_work(op))
                   for op in func.operations]
            total = sum(o.work for o in ops) or 1.0
            for o in ops:
                o.work /= total
            functions[name] = SimpleNamespace(block=SimpleNamespace(operations=ops))
        self.model_structure = SimpleNamespace(program=SimpleNamespace(functions=functions))

    def get_compute_device_usage_for_mlprogram_operation(self, op):
        if op.function != self.default or op.operator_name == "const":
            return None  # another function's ops: the query names no function, so they come back unplaced
        kind = self.place(op.operator_name)
        device = object.__new__(self.devices[kind])
        supported = [object.__new__(self.devices[k]) for k in ("ane", "cpu")]
        return SimpleNamespace(preferred_compute_device=device, supported_compute_devices=supported)

    def get_estimated_cost_for_mlprogram_operation(self, op):
        if op.function != self.default:
            return None
        return SimpleNamespace(weight=op.work)


def _work(op) -> float:
    """An op's work, roughly: its output's elements times the length it reduces over for products."""
    out = op.outputs[0]
    n = float(np.prod(out.shape)) if out.shape else 1.0
    if op.op_type in ("conv", "matmul", "einsum"):
        first = op.inputs.get("x", None)
        if first is None:
            first = op.inputs["values"][0]
        inner = first.shape[1] if op.op_type == "conv" else first.shape[-1]
        return n * float(inner)
    return 0.0 if op.op_type == "const" else n


def softmax_on_cpu(op: str) -> str:
    """A Core ML that runs softmax and the reductions on the CPU (the rest on the Neural Engine)."""
    return "cpu" if op in ("softmax", "reduce_max", "reduce_sum", "exp", "real_div") else "ane"


def projections_on_cpu(op: str) -> str:
    """A Core ML that places the products on the CPU: most of any program's cost off the Neural Engine."""
    return "cpu" if op in ("conv", "matmul", "einsum") else "ane"


macos_14_0 = FakeMac("14.0").core_ml()
macos_14_4 = FakeMac("14.4").core_ml()
macos_15 = FakeMac("15.0").core_ml()
macos_26 = FakeMac("26.0").core_ml()
macos_15_products_on_cpu = FakeMac("15.0", place=projections_on_cpu).core_ml()  # a placement failure
macos_15_softmax_on_cpu = FakeMac("15.0", place=softmax_on_cpu).core_ml()
macos_15_slow_ane = FakeMac("15.0", speedup=0.5).core_ml()  # placed on the ANE, slower than the CPU: a fallback
macos_15_old_core_ml = FakeMac("15.0", max_spec=8, name="Core ML stand-in (macOS 15.0 whose Core ML compiles spec 8)"
                               ).core_ml()  # the OS refuses the target's spec in Core ML's own words


TESTS = Path(__file__).resolve().parent


@pytest.fixture
def mac(monkeypatch, tmp_path):
    """Put this process (and the ANE worker it starts) on a stand-in Mac: `mac("macos_14_0")` (a name above), with
    an export cache of its own, as a Mac has; returns the stand-in's `CoreML`. Forgotten when the test ends."""

    def use(name: str) -> CoreML:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
        monkeypatch.setenv("HETERO_COREML", f"fake_mac:{name}")
        monkeypatch.setenv("HETERO_HOME", str(tmp_path / name))
        stop_workers()
        coreml_macos.reset()
        return coreml_macos.core_ml()

    yield use
    stop_workers()
    monkeypatch.delenv("HETERO_COREML", raising=False)
    coreml_macos.reset()
