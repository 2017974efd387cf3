"""Running exported packages through Core ML on macOS (CPU + Neural Engine), with a placement report.

Core ML itself runs only on macOS, so the code that calls it is thin (`CoreMLProgram`, `_load_compute_plan`), and
everything around it is plain Python tested on any OS with the real call injected:

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
- **Compilation** (`compile_package`): into a temporary folder beside the package, then renamed (atomically) to
  `<stem>.<content hash>.mlmodelc`, the hash over the package's files; a re-exported package has a new hash, so a
  stale `.mlmodelc` is never loaded, and a crashed compile leaves only a temporary folder nothing loads.
  `remove_compiled` deletes a package's compiled folders (the export does it with the package).
- **Placement** (`placement_report`): from the devices Core ML's `MLComputePlan` (macOS 14.4+) prefers per op, a
  report that flags a program with nothing on the Neural Engine and one with part of its ops off it (partial
  CPU / GPU fallback, which Core ML does silently).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hetero.errors import HeteroError

_LOADED: dict[tuple[Path, str | None], "CoreMLProgram"] = {}
_DIGESTS: dict[tuple, str] = {}  # package_signature -> content hash, for this process
DIGEST_CHARS = 16  # hex digits of the content hash in a compiled folder's name
_COMPILED = re.compile(rf"^(?P<stem>.+)\.[0-9a-f]{{{DIGEST_CHARS}}}\.mlmodelc$")
_TEMP_PREFIX = ".compiling-"


def _native_library() -> None:
    """Import coremltools' native library, which compiling, loading and predicting call into."""
    import coremltools.libcoremlpython  # noqa: F401


def available(system: str | None = None, native: Callable[[], object] = _native_library) -> tuple[bool, str]:
    """(whether Core ML can run programs here, why not). `system` is `platform.system()`'s answer (default: this
    machine's) and `native` imports coremltools' native library (`coremltools.libcoremlpython`): `import
    coremltools` succeeds without it, e.g. where pip fell back to the sdist because no wheel exists for this
    Python, and then every compile and prediction fails."""
    system = system or platform.system()
    if system != "Darwin":
        return False, f"Core ML runs only on macOS (this is {system})"
    try:
        import coremltools
    except ImportError:
        return False, "coremltools is not installed"
    try:
        native()
    except ImportError as e:
        return False, (f"coremltools {coremltools.__version__} has no native library ({e}): install a coremltools "
                       f"wheel built for Python {platform.python_version()} (pip fell back to the source package)")
    return True, ""


MULTIFUNCTION_MACOS = (15,)  # multifunction packages: the iOS 18 / macOS 15 spec (coremltools models/utils.py)


def macos_version(mac_ver: Callable[[], tuple] = platform.mac_ver) -> tuple[int, ...] | None:
    """This Mac's macOS version as numbers ((14, 6, 1)); None off macOS (`mac_ver` is `platform.mac_ver`)."""
    text = mac_ver()[0]
    return tuple(int(x) for x in text.split(".") if x.isdigit()) if text else None


def multifunction_packages(macos: tuple[int, ...] | None) -> bool:
    """Whether an export stores an attention piece's context buckets as the functions of one package (weights
    once): from macOS 15, and off macOS (the reference executor runs them). Before macOS 15 coremltools' binding
    refuses a function name (`CoreMLPython.mm`), so each bucket is a single-function package of its own."""
    return macos is None or tuple(macos) >= MULTIFUNCTION_MACOS


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
# Compilation keyed by the package's content


def package_signature(package: Path) -> tuple:
    """What tells, without reading the weights, that a package is unchanged: each file's inode, size and mtime,
    but Manifest.json by its (tiny) content, as coremltools rewrites it unchanged whenever it opens the package."""
    sig = []
    for f in sorted(p for p in package.rglob("*") if p.is_file()):
        st = f.stat()
        sig.append((str(f.relative_to(package)), f.read_bytes() if f.name == "Manifest.json" else
                    (st.st_ino, st.st_size, st.st_mtime_ns)))
    return package.resolve(), tuple(sig)


def package_digest(package: Path) -> str:
    """sha256 over the package's files (relative paths and contents, in sorted order). Hashed once per process
    while its `package_signature` holds (a package's functions load one by one): a package saved
    anew (the export removes, then writes it) rehashes; an in-place rewrite of a file to the same size within one
    filesystem clock tick (milliseconds) of the hash would not, in the same process."""
    if not (package / "Manifest.json").is_file():
        raise HeteroError(f"{package} is not an .mlpackage (no Manifest.json); re-run hetero convert --coreml")
    files = sorted(p for p in package.rglob("*") if p.is_file())
    memo = package_signature(package)
    if memo not in _DIGESTS:
        h = hashlib.sha256()
        for f in files:
            h.update(str(f.relative_to(package)).encode() + b"\0")
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 24), b""):
                    h.update(block)
            h.update(b"\0")
        _DIGESTS[memo] = h.hexdigest()
    return _DIGESTS[memo]


def compiled_path(package: Path, digest: str) -> Path:
    """Where the package with content hash `digest` is compiled: `<stem>.<hash>.mlmodelc` beside it."""
    return package.with_name(f"{package.stem}.{digest[:DIGEST_CHARS]}.mlmodelc")


def compiled_owner(name: str) -> str | None:
    """The package stem a folder name in an export directory was compiled from (a compiled folder, an older
    hetero's `<stem>.mlmodelc`, or a compile's temporary folder); None for anything else."""
    if name.startswith(_TEMP_PREFIX):
        return name[len(_TEMP_PREFIX):].rpartition(".")[0] or None
    m = _COMPILED.match(name)
    if m:
        return m["stem"]
    return name[: -len(".mlmodelc")] if name.endswith(".mlmodelc") else None


def remove_compiled(package: Path, keep: Path | None = None) -> None:
    """Delete every folder compiled from `package` (but `keep`), temporary ones included."""
    if not package.parent.is_dir():
        return
    for entry in package.parent.iterdir():
        if compiled_owner(entry.name) == package.stem and entry != keep:
            shutil.rmtree(entry, ignore_errors=True)


def compile_package(package: Path, compile_model: Callable[[str, str], str]) -> Path:
    """The package compiled, keyed by its content: reused when `<stem>.<hash>.mlmodelc` exists, else compiled by
    `compile_model(src, dst)` (coremltools.models.utils.compile_model, whose `shutil.move` would nest a new build
    inside an existing `dst`) into a fresh temporary folder and renamed into place; other builds of it are removed."""
    target = compiled_path(package, package_digest(package))
    if target.is_dir():  # only ever made by the rename below: complete
        return target
    tmp = Path(tempfile.mkdtemp(dir=package.parent, prefix=f"{_TEMP_PREFIX}{package.stem}."))
    try:
        built = tmp / target.name
        compile_model(str(package), str(built))
        if not (built / "coremldata.bin").is_file():
            raise HeteroError(f"compiling {package.name} produced no {built.name}/coremldata.bin")
        try:
            os.rename(built, target)  # atomic: the target is whole or absent
        except OSError:
            if not target.is_dir():  # not a concurrent compile of the same content that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    remove_compiled(package, keep=target)
    return target


# ----------------------------------------------------------------------------------------------------------
# Placement


@dataclass(frozen=True)
class OpDevice:
    """One op of a compute plan: its operator, the device Core ML prefers (`ane`, `gpu`, `cpu`, None when it
    names none), the devices that support it, and its estimated share of the program's cost (None: unknown)."""

    op: str
    preferred: str | None
    supported: tuple[str, ...] = ()
    cost: float | None = None


@dataclass
class Placement:
    """How many of a program's ops Core ML prefers on each device, and which ops run off the Neural Engine."""

    program: str
    neural_engine: int
    gpu: int
    cpu: int
    unknown: int
    off_ane: dict[str, int] = field(default_factory=dict)  # "<op> on <device>" -> count
    off_ane_cost: float | None = None  # estimated share of the cost off the ANE (None: Core ML gave no costs)
    could_be_on_ane: int = 0  # off-ANE ops whose supported devices include the ANE

    @property
    def total(self) -> int:
        return self.neural_engine + self.gpu + self.cpu + self.unknown

    @property
    def verdict(self) -> str:
        """`none` (nothing on the Neural Engine), `partial` (some ops off it), `full`."""
        if self.neural_engine == 0:
            return "none"
        return "partial" if self.neural_engine < self.total else "full"

    def line(self) -> str:
        text = (f"{self.program}: {self.neural_engine}/{self.total} ops on the Neural Engine, "
                f"{self.cpu} on the CPU, {self.gpu} on the GPU, {self.unknown} unplaced")
        if self.verdict == "partial":
            cost = "" if self.off_ane_cost is None else f", {self.off_ane_cost:.1%} of the estimated cost"
            ops = ", ".join(f"{n} {what}" for what, n in sorted(self.off_ane.items(), key=lambda kv: -kv[1]))
            text += f"; off the ANE: {ops}{cost} ({self.could_be_on_ane} of them supported there)"
        return text


_LABELS = {"gpu": "the GPU", "cpu": "the CPU", None: "no device"}


def device_kind(device: object) -> str | None:
    """`ane`, `gpu` or `cpu` for a coremltools compute device (MLNeuralEngineComputeDevice, ...); None for none."""
    name = type(device).__name__ if device is not None else ""
    return "ane" if "NeuralEngine" in name else "gpu" if "GPU" in name else "cpu" if "CPU" in name else None


def placement_report(program: str, ops: Iterable[OpDevice]) -> Placement:
    """The placement of a program from its per-op devices (what `MLComputePlan.
    get_compute_device_usage_for_mlprogram_operation` and `get_estimated_cost_for_mlprogram_operation` give for
    each op; `const` and `constexpr_*` ops are weights, never placed, and are skipped)."""
    counts = {"ane": 0, "gpu": 0, "cpu": 0, None: 0}
    off: dict[str, int] = {}
    cost_all = cost_off = 0.0
    costed, could = True, 0
    for op in ops:
        if op.op == "const" or op.op.startswith("constexpr_"):  # weights (a LUT expands at load), never placed
            continue
        if op.preferred not in counts:
            raise HeteroError(f"{program}: op {op.op} on unknown device {op.preferred!r}")
        counts[op.preferred] += 1
        costed = costed and op.cost is not None
        cost_all += op.cost or 0.0
        if op.preferred != "ane":
            what = f"{op.op} on {_LABELS[op.preferred]}"
            off[what] = off.get(what, 0) + 1
            cost_off += op.cost or 0.0
            could += "ane" in op.supported
    share = (cost_off / cost_all if cost_all > 0 else 0.0) if costed else None
    return Placement(program, counts["ane"], counts["gpu"], counts["cpu"], counts[None], off, share, could)


COMPUTE_PLAN_MACOS = (14, 4)  # MLComputePlan's first macOS


@dataclass
class PlacementStatus:
    """What a compute-plan query gave: `placed` (with its `report`), `unavailable` (this macOS has no
    MLComputePlan, or this is not a Mac) or `failed` (the query itself raised: `error`)."""

    program: str
    status: str
    report: Placement | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        found = {"status": self.status, "line": self.line()}
        if self.report is not None:
            found.update(verdict=self.report.verdict, ok=self.report.verdict == "full")
        if self.error is not None:
            found.update(error=self.error, ok=False)
        return found

    def line(self) -> str:
        if self.status == "placed":
            return self.report.line()
        if self.status == "failed":
            return f"{self.program}: the compute-plan query failed ({self.error}); ANE placement not verified"
        return f"{self.program}: MLComputePlan unavailable (macOS 14.4+); ANE placement not verified"


def placement_status(program: str, load_plan: Callable[[], object | None], function: str | None) -> PlacementStatus:
    """Query a compiled program's placement: `load_plan()` is the compute plan (`MLComputePlan.load_from_path` on
    a Mac), None where the OS has none; a query that raises, loading or reading the plan, is `failed`, never
    `unavailable`."""
    try:
        plan = load_plan()
        if plan is None:
            return PlacementStatus(program, "unavailable")
        return PlacementStatus(program, "placed", placement_report(program, plan_ops(plan, function)))
    except Exception as e:  # noqa: BLE001  (any failure of Core ML's query is reported, with its first line)
        text = str(e).strip().splitlines()
        return PlacementStatus(program, "failed", error=f"{type(e).__name__}: {text[0] if text else ''}")


def check_placement(placed: Placement | None, name: str, error: str | None = None) -> Placement | None:
    """Print a warning on stderr when a program places nothing, or only part of its ops, on the Neural Engine, or
    when its compute-plan query failed (`error`)."""
    if error is not None:
        print(f"WARNING: {name}: the compute-plan query failed ({error}); ANE placement not verified",
              file=sys.stderr)
    elif placed is None:
        print(f"{name}: MLComputePlan unavailable (macOS 14.4+); ANE placement not verified", file=sys.stderr)
    elif placed.verdict == "none":
        print(f"WARNING: {placed.line()} -- NOTHING runs on the Neural Engine; Core ML fell back silently",
              file=sys.stderr)
    elif placed.verdict == "partial":
        print(f"WARNING: partial CPU/GPU fallback: {placed.line()}", file=sys.stderr)
    return placed


# ----------------------------------------------------------------------------------------------------------
# The package's declared inputs (any OS), and the thin Core ML calls (macOS)


def default_function(package: Path) -> str | None:
    """The default function of a multifunction package; None for a single-function one."""
    import coremltools as ct

    desc = ct.models.utils.load_spec(str(package)).description
    return desc.defaultFunctionName if desc.functions else None


def declared_inputs(package: Path, function: str | None = None) -> dict[str, tuple[int, ...]]:
    """Input name -> shape of a package's function (`function` None: its default one), read from its spec."""
    import coremltools as ct

    desc = ct.models.utils.load_spec(str(package)).description
    if desc.functions:
        name = function or desc.defaultFunctionName
        found = [f for f in desc.functions if f.name == name]
        if not found:
            raise HeteroError(f"{package.name} has no function {name!r} (it has "
                              f"{', '.join(sorted(f.name for f in desc.functions))})")
        inputs = found[0].input
    elif function not in (None, "main"):
        raise HeteroError(f"{package.name} has one function, main, not {function!r}")
    else:
        inputs = desc.input
    return {i.name: tuple(int(d) for d in i.type.multiArrayType.shape) for i in inputs}


class CoreMLProgram:
    """One package's function, compiled once (by content) and loaded with compute units CPU_AND_NE."""

    def __init__(self, package: str | os.PathLike, function: str | None = None):
        ok, why = available()
        if not ok:
            raise HeteroError(why)
        import coremltools as ct

        self.package = Path(package)
        self.function = function or default_function(self.package)  # None: a single-function package
        name = self.package.name + (f":{self.function}" if self.function else "")
        self.compiled = compile_package(self.package, ct.models.utils.compile_model)
        model = ct.models.CompiledMLModel(str(self.compiled), compute_units=ct.ComputeUnit.CPU_AND_NE,
                                          function_name=self.function)
        self.run = ProgramRunner(name, model.predict, declared_inputs(self.package, self.function), PROCESS_HOLD)

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One prediction: inputs by name (any float dtype, copied to fp32), fp32 outputs by name."""
        return self.run(inputs)

    def placement_status(self) -> PlacementStatus:
        """This program's placement from MLComputePlan: placed, unavailable (before macOS 14.4) or failed."""
        return placement_status(self.run.name, lambda: _load_compute_plan(self.compiled), self.function)

    def placement(self) -> Placement | None:
        """Ops per preferred device from MLComputePlan; None where it is unavailable or failed."""
        return self.placement_status().report


def _load_compute_plan(compiled: Path):
    """Core ML's compute plan of a compiled program (macOS 14.4+), None before it. Only a Mac runs this."""
    import coremltools as ct

    version = macos_version()
    if version is None or version < COMPUTE_PLAN_MACOS:
        return None
    from coremltools.models.compute_plan import MLComputePlan

    return MLComputePlan.load_from_path(str(compiled), compute_units=ct.ComputeUnit.CPU_AND_NE)


def plan_ops(plan, function: str | None) -> list[OpDevice]:
    """Every op of a compute plan's function (`function` None: a single-function package's main), nested blocks
    included, with Core ML's preferred and supported devices and estimated cost (`plan` answers as
    coremltools' `MLComputePlan` does)."""
    block = plan.model_structure.program.functions[function or "main"].block
    out, stack = [], list(block.operations)
    while stack:
        op = stack.pop(0)
        stack.extend(o for b in op.blocks for o in b.operations)
        usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
        cost = plan.get_estimated_cost_for_mlprogram_operation(op)
        out.append(OpDevice(
            op.operator_name,
            device_kind(usage.preferred_compute_device) if usage else None,
            tuple(k for k in (device_kind(d) for d in (usage.supported_compute_devices if usage else [])) if k),
            cost.weight if cost else None,
        ))
    return out


def load(package: str | os.PathLike, function: str | None = None, report: bool = True) -> CoreMLProgram:
    """A loaded program (a package's `function`, None: its default), cached per process; with `report`, a program
    placing none or only part of its ops on the ANE is reported on stderr."""
    key = (Path(package).resolve(), function)
    if key not in _LOADED:
        program = CoreMLProgram(key[0], function)
        if report:
            found = program.placement_status()
            check_placement(found.report, program.run.name, found.error)
        _LOADED[key] = program
    return _LOADED[key]
