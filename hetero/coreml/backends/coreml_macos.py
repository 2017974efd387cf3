"""Running exported packages through Core ML on macOS (CPU + Neural Engine): the lane's thin Mac-only code.

Every call into macOS and Core ML goes through one object, `CoreML`, whose fields are the real calls
(`platform.mac_ver`, `coremltools.models.utils.compile_model`, `CompiledMLModel(...).predict`,
`MLComputePlan.load_from_path`, `proc_pid_rusage`). Everything that decides from their answers is plain Python
tested on any OS, with a stand-in `CoreML` that answers as a given macOS would (tests/fake_mac.py; a process, or
the ANE worker it starts, takes one from $HETERO_COREML="module:attribute").

- **The OS** (`hetero.coreml.target`): which export target this Mac loads (fp16, single-function packages below
  macOS 15), and a package whose specification the OS cannot compile is refused by name, as the OS's refusal
  (`SpecRefused`), before Core ML's compiler fails on it; a function name before macOS 15 likewise (the binding,
  `CoreMLPython.mm`, refuses `functionName` there).
- **Inputs and outputs** (`ProgramRunner`). `CompiledMLModel.predict` is a pybind11 binding that keeps the GIL for
  the whole prediction and takes only int32 / fp32 / fp64 arrays: coremltools replaces an fp16 array by an fp32
  copy, and the binding wraps each array's buffer without copying it in an Objective-C `PybindCompatibleArray`
  that holds a reference to the numpy object. Core ML may release that wrapper after `predict` returns, from its
  own queue (the MLE5 engine unbinds its input ports about a second later), and the wrapper's destructor then
  drops the numpy reference without the GIL; when it was the last one, the array is freed off-thread and the heap
  is corrupted (coremltools PRs #2827, #2829). So each call copies its inputs into fresh C-contiguous fp32 arrays
  that nothing but the program ever references (the copy is also the dtype conversion), and keeps them until a
  later call reads, from the object header, without touching it, that their reference count is back to the
  program's own single reference: Core ML has dropped its wrapper, and the array is freed on the caller's thread.
  Outputs come back from the binding as fp32 (Core ML's fp16 widened, exactly) and are returned as they are.
- **Compilation** (`hetero.coreml.backends.compiled`): keyed by the package's content, replaced atomically.
- **Placement** (`hetero.coreml.backends.placement`): from `MLComputePlan` (macOS 14.4+), judged by cost.
- **Memory** (`memory_now`): the process footprint from `proc_pid_rusage` (`hetero.coreml.backends.footprint`).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np

from hetero.coreml.backends.compiled import compile_package
from hetero.coreml.backends.footprint import Footprint, RusageCall, linux_resident, mac_footprint, proc_pid_rusage
from hetero.coreml.backends.placement import COMPUTE_PLAN_MACOS, PlacementStatus, check_placement, placement_status
from hetero.coreml.target import OS_REFUSED, SpecRefused, Target, check_spec, target_for
from hetero.errors import HeteroError

_LOADED: dict[tuple, "CoreMLProgram"] = {}
FUNCTION_NAME_MACOS = (15, 0)  # the binding sets MLModelConfiguration.functionName only from macOS 15
UNITS = ("CPU_AND_NE", "CPU_ONLY")  # the compute units the lane loads with, and the doctor's CPU baseline


# ----------------------------------------------------------------------------------------------------------
# The calls into macOS and Core ML


def _native_library() -> None:
    """Import coremltools' native library, which compiling, loading and predicting call into."""
    import coremltools.libcoremlpython  # noqa: F401


def _compile_model(src: str, dst: str) -> object:
    import coremltools as ct

    return ct.models.utils.compile_model(src, dst)


def _open_model(compiled: str, units: str, function: str | None) -> Callable[[dict], dict]:
    import coremltools as ct

    return ct.models.CompiledMLModel(compiled, compute_units=ct.ComputeUnit[units], function_name=function).predict


def _compute_plan(compiled: str, units: str) -> object:
    import coremltools as ct
    from coremltools.models.compute_plan import MLComputePlan

    return MLComputePlan.load_from_path(compiled, compute_units=ct.ComputeUnit[units])


@dataclass(frozen=True)
class CoreML:
    """The calls into macOS and Core ML the lane makes, each the real one by default; a stand-in answers as some
    macOS would (tests name the real call each of its fields stands for)."""

    name: str = "Core ML"
    system: Callable[[], str] = platform.system  # platform.system()
    mac_ver: Callable[[], str] = lambda: platform.mac_ver()[0]  # noqa: E731  "14.6.1"; "" off a Mac
    native: Callable[[], object] = _native_library  # import coremltools.libcoremlpython
    compile_model: Callable[[str, str], object] = _compile_model  # coremltools.models.utils.compile_model(src, dst)
    open_model: Callable[[str, str, str | None], Callable[[dict], dict]] = _open_model  # CompiledMLModel(...).predict
    compute_plan: Callable[[str, str], object] = _compute_plan  # MLComputePlan.load_from_path(compiled, units)
    rusage: RusageCall = proc_pid_rusage  # proc_pid_rusage(getpid(), flavor, &rusage_info)
    clock: Callable[[], float] = time.perf_counter  # the wall clock the doctor times predictions with


@cache
def core_ml() -> CoreML:
    """This process's calls into Core ML: the real ones, or the stand-in $HETERO_COREML names ("module:attribute",
    a `CoreML`; tests, whose ANE worker inherits it)."""
    spec = os.environ.get("HETERO_COREML")
    if not spec:
        return CoreML()
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def available(ml: CoreML | None = None) -> tuple[bool, str]:
    """(whether Core ML can run programs here, why not): macOS, coremltools, and coremltools' native library
    (`coremltools.libcoremlpython`): `import coremltools` succeeds without it, e.g. where pip fell back to the sdist
    because no wheel exists for this Python, and then every compile and prediction fails."""
    ml = ml or core_ml()
    system = ml.system()
    if system != "Darwin":
        return False, f"Core ML runs only on macOS (this is {system})"
    try:
        import coremltools
    except ImportError:
        return False, "coremltools is not installed"
    try:
        ml.native()
    except ImportError as e:
        return False, (f"coremltools {coremltools.__version__} has no native library ({e}): install a coremltools "
                       f"wheel built for Python {platform.python_version()} (pip fell back to the source package)")
    return True, ""


def macos_version(ml: CoreML | None = None) -> tuple[int, ...] | None:
    """This Mac's macOS version as numbers ((14, 6, 1)); None off macOS."""
    ml = ml or core_ml()
    text = ml.mac_ver() if ml.system() == "Darwin" else ""
    return tuple(int(x) for x in text.split(".") if x.isdigit()) if text else None


def this_target(ml: CoreML | None = None) -> Target:
    """The export target of this machine: by its macOS version (`hetero.coreml.target.target_for`); off a Mac the
    newest, which the reference executor runs whole."""
    return target_for(macos_version(ml))


def memory_now(ml: CoreML | None = None) -> Footprint | None:
    """This process's memory now: on macOS its footprint (`proc_pid_rusage`, with the Neural Engine's share from
    macOS 14), on Linux its resident set; None where neither says."""
    ml = ml or core_ml()
    return mac_footprint(ml.rusage) if ml.system() == "Darwin" else linux_resident()


# ----------------------------------------------------------------------------------------------------------
# Inputs held until Core ML lets go of them; fp32 in and out


def _refcount(address: int) -> int:
    """The reference count in the header of the object at `address`, read without taking a reference (which
    could race with Core ML's queue dropping its own). CPython with the GIL: `ob_refcnt` is the header's first word."""
    return ctypes.c_ssize_t.from_address(address).value


@dataclass
class InputHold:
    """Arrays handed to Core ML, each call's kept until Core ML has released every one of them.

    `keep` must get arrays nothing else references (fresh copies) before they are handed over; `sweep` drops the
    calls whose arrays are each back to one reference (the hold's own list), read from the object headers."""

    calls: list[tuple[list[np.ndarray], list[int], int]] = field(default_factory=list)  # arrays, addresses, bytes

    def keep(self, arrays: list[np.ndarray]) -> None:
        """Hold one call's arrays; from here on only their addresses are read (id(): the address in CPython)."""
        self.calls.append((arrays, [id(a) for a in arrays], sum(a.nbytes for a in arrays)))

    def sweep(self) -> int:
        """Drop (and so free, on this thread) every call whose arrays Core ML has released; returns how many."""
        done = [i for i, (_, addresses, _) in enumerate(self.calls) if all(_refcount(a) == 1 for a in addresses)]
        for i in reversed(done):
            del self.calls[i]
        return len(done)

    @property
    def nbytes(self) -> int:
        """Bytes of input arrays still held (counted at `keep`: reading the arrays would take references)."""
        return sum(n for _, _, n in self.calls)


PROCESS_HOLD = InputHold()  # every Core ML program of this process: a job's sweep frees any program's released inputs


class ProgramRunner:
    """One program's calls: `predict` (the binding, `CompiledMLModel.predict` on a Mac) fed fresh fp32 copies of
    the inputs, held by `hold` until Core ML has released them; fp32 outputs by name."""

    def __init__(self, name: str, predict: Callable[[dict], dict], input_shapes: dict[str, tuple[int, ...]],
                 hold: InputHold | None = None):
        if getattr(sys, "_is_gil_enabled", lambda: True)() is False:  # free-threaded: another object header
            raise HeteroError("the Core ML lane needs CPython with the GIL (its input hold reads object headers)")
        self.name, self.predict, self.input_shapes = name, predict, input_shapes
        self.hold = InputHold() if hold is None else hold  # programs may share one: any job frees any released

    def _fresh(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The inputs as fresh C-contiguous fp32 arrays, checked against the declared shapes."""
        missing = sorted(set(self.input_shapes) - set(inputs))
        if missing:
            raise HeteroError(f"{self.name}: missing inputs {missing}")
        feed = {}
        for name, shape in self.input_shapes.items():
            a = np.array(inputs[name], dtype=np.float32, order="C", copy=True)  # owned by the hold alone
            if a.shape != shape:
                raise HeteroError(f"{self.name}: input {name} has shape {a.shape}, the program takes {shape}")
            feed[name] = a
        return feed

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one prediction. `inputs`: name -> array of the declared shape, any float dtype (fp16 values in any
        dtype are exact in fp32); returns name -> fp32 array (Core ML's fp16 outputs widened exactly)."""
        self.hold.sweep()
        feed = self._fresh(inputs)
        self.hold.keep(list(feed.values()))  # before predict: nothing touches them afterwards but the hold
        out = self.predict(feed)
        del feed  # the job has returned: its inputs go now if Core ML let go of them, else at a later job's sweep
        self.hold.sweep()
        return {k: np.asarray(v, dtype=np.float32) for k, v in out.items()}


# ----------------------------------------------------------------------------------------------------------
# The package's declared facts (any OS), and the thin Core ML program (macOS)


@dataclass(frozen=True)
class PackageFacts:
    """What a package's spec declares: its specification version, its functions (None: a single-function package)
    with the default one, and each function's input shapes."""

    spec: int
    default: str | None
    inputs: dict[str | None, dict[str, tuple[int, ...]]] = field(default_factory=dict)


def package_facts(package: Path) -> PackageFacts:
    """The spec facts of a saved package (read once from its model.mlmodel)."""
    import coremltools as ct

    desc = (spec := ct.models.utils.load_spec(str(package))).description
    shapes = lambda inputs: {i.name: tuple(int(d) for d in i.type.multiArrayType.shape) for i in inputs}  # noqa: E731
    if desc.functions:
        return PackageFacts(spec.specificationVersion, desc.defaultFunctionName,
                            {f.name: shapes(f.input) for f in desc.functions})
    return PackageFacts(spec.specificationVersion, None, {None: shapes(desc.input)})


def default_function(package: Path) -> str | None:
    """The default function of a multifunction package; None for a single-function one."""
    return package_facts(package).default


def declared_inputs(package: Path, function: str | None = None, facts: PackageFacts | None = None
                    ) -> dict[str, tuple[int, ...]]:
    """Input name -> shape of a package's function (`function` None: its default one), read from its spec."""
    facts = facts or package_facts(package)
    if facts.default is not None:
        name = function or facts.default
        if name not in facts.inputs:
            raise HeteroError(f"{package.name} has no function {name!r} (it has {', '.join(sorted(facts.inputs))})")
        return facts.inputs[name]
    if function not in (None, "main"):
        raise HeteroError(f"{package.name} has one function, main, not {function!r}")
    return facts.inputs[None]


class CoreMLProgram:
    """One package's function, compiled once (by content) and loaded with compute units `units` through the calls
    of `ml` (this process's `core_ml()` by default). The OS's refusals are named before Core ML is asked: a
    specification it cannot compile (`SpecRefused`) and a function name before macOS 15."""

    def __init__(self, package: str | os.PathLike, function: str | None = None, ml: CoreML | None = None,
                 units: str = "CPU_AND_NE"):
        self.ml = ml or core_ml()
        ok, why = available(self.ml)
        if not ok:
            raise HeteroError(why)
        self.package, self.units = Path(package), units
        facts = package_facts(self.package)
        self.function = function or facts.default  # None: a single-function package
        name = self.package.name + (f":{self.function}" if self.function else "")
        self.macos = macos_version(self.ml)
        check_spec(facts.spec, self.macos, name)
        if self.function is not None and self.macos is not None and self.macos < FUNCTION_NAME_MACOS:
            raise HeteroError(f"{name}: macOS {'.'.join(map(str, self.macos))} cannot load a function by name (the "
                              f"binding sets functionName only from macOS 15): export one package per bucket here")
        self.compiled = _compiled(self.package, self.ml.compile_model, name)
        predict = self.ml.open_model(str(self.compiled), units, self.function)
        self.run = ProgramRunner(name, predict, declared_inputs(self.package, self.function, facts), PROCESS_HOLD)
        self._cpu: CoreMLProgram | None = None

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One prediction: inputs by name (any float dtype, copied to fp32), fp32 outputs by name."""
        return self.run(inputs)

    @property
    def clock(self) -> Callable[[], float]:
        """The clock its predictions are timed with (`CoreML.clock`)."""
        return self.ml.clock

    def cpu_only(self) -> "CoreMLProgram":
        """The same function loaded with CPU_ONLY (the doctor's baseline: a Neural Engine that is not clearly
        faster than this is a silent fallback)."""
        if self._cpu is None:
            self._cpu = CoreMLProgram(self.package, self.function, self.ml, "CPU_ONLY")
        return self._cpu

    def placement_status(self) -> PlacementStatus:
        """This program's placement from MLComputePlan: placed, unavailable (before macOS 14.4) or failed."""
        return placement_status(self.run.name, self._compute_plan, self.function)

    def _compute_plan(self):
        if self.macos is None or self.macos < COMPUTE_PLAN_MACOS:
            return None
        return self.ml.compute_plan(str(self.compiled), "CPU_AND_NE")


NEWER_SPEC = "intended for a newer version"  # Core ML's compiler refusing a specification version: "The model
# supplied is of version 9, intended for a newer version of Xcode. This version of Xcode supports model version 8 or
# earlier." (apple/coremltools#750, #1557)


def _compiled(package: Path, compile_model: Callable, name: str) -> Path:
    """`compile_package`, with Core ML's refusal of the package's specification named as the OS's (`SpecRefused`)."""
    try:
        return compile_package(package, compile_model)
    except Exception as e:  # noqa: BLE001  (Core ML's compile errors come as RuntimeError with its words)
        if NEWER_SPEC not in str(e):
            raise
        words = str(e).strip().splitlines()[0]
        raise SpecRefused(f"{name}: Core ML says {words!r}: {OS_REFUSED} (its Core ML is older than this "
                          f"package's specification)") from None


def reset() -> None:
    """Forget this process's loaded programs and its Core ML calls (a process whose $HETERO_COREML changed: tests)."""
    _LOADED.clear()
    core_ml.cache_clear()


def load(package: str | os.PathLike, function: str | None = None, report: bool = True) -> CoreMLProgram:
    """A loaded program (a package's `function`, None: its default), cached per process; with `report`, a program
    whose placement fails its cost budget (or whose query failed) is reported on stderr."""
    key = (Path(package).resolve(), function)
    if key not in _LOADED:
        program = CoreMLProgram(key[0], function)
        if report:
            check_placement(program.placement_status())
        _LOADED[key] = program
    return _LOADED[key]


def multifunction_packages(macos: tuple[int, ...] | None) -> bool:
    """Whether an export for a Mac running `macos` stores an attention piece's context buckets as the functions of
    one package (weights once): from macOS 15, and off macOS (the reference executor runs them)."""
    return target_for(macos).multifunction

