"""Where Core ML places a program's ops, from its compute plan (`MLComputePlan`, macOS 14.4+), judged by cost.

Core ML falls back to the CPU or GPU silently, op by op. The compute plan says, per op of a function, the device it
prefers, the devices that support it and the op's estimated share of the function's cost. A program passes when at
most `OFF_ANE_BUDGET` (2%) of its estimated cost runs off the Neural Engine: a reshape on the CPU costs nothing worth
a failure, a projection there costs most of the program. Ops Core ML names no device for are *unplaced*, counted
apart (`MLComputePlan.load_from_path` takes no function name, so the ops of a multifunction package's other
functions may come back unplaced: a whole function unplaced is `unplaced`, neither a pass nor a fallback). A query
that raises is `failed`, never `unavailable`, which means this OS has no compute plan (before macOS 14.4).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from hetero.errors import HeteroError

OFF_ANE_BUDGET = 0.02  # share of a program's estimated cost that may run off the Neural Engine and still pass
COMPUTE_PLAN_MACOS = (14, 4)  # MLComputePlan's first macOS


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
    """How many of a program's ops Core ML prefers on each device, which run off the Neural Engine, and what share
    of the estimated cost of the placed ops that is."""

    program: str
    neural_engine: int
    gpu: int
    cpu: int
    unknown: int  # unplaced: ops Core ML names no device for
    off_ane: dict[str, int] = field(default_factory=dict)  # "<op> on <device>" -> count
    off_ane_cost: float | None = None  # estimated share of the placed ops' cost off the ANE (None: Core ML gave none)
    could_be_on_ane: int = 0  # off-ANE ops whose supported devices include the ANE

    @property
    def total(self) -> int:
        return self.neural_engine + self.gpu + self.cpu + self.unknown

    @property
    def placed(self) -> int:
        return self.total - self.unknown

    @property
    def verdict(self) -> str:
        """`unplaced` (Core ML names a device for none of its ops), `none` (nothing on the Neural Engine), `partial`
        (some placed ops off it), `full`."""
        if self.placed == 0:
            return "unplaced"
        if self.neural_engine == 0:
            return "none"
        return "partial" if self.neural_engine < self.placed else "full"

    @property
    def ok(self) -> bool | None:
        """Whether the program passes: at most `OFF_ANE_BUDGET` of its estimated cost off the ANE (without costs:
        no op off it); None for an unplaced one, which says nothing either way."""
        if self.verdict == "unplaced":
            return None
        if self.verdict == "none":
            return False
        if self.off_ane_cost is None:
            return self.verdict == "full"
        return self.off_ane_cost <= OFF_ANE_BUDGET

    def line(self) -> str:
        text = (f"{self.program}: {self.neural_engine}/{self.total} ops on the Neural Engine, "
                f"{self.cpu} on the CPU, {self.gpu} on the GPU, {self.unknown} unplaced")
        if self.verdict == "unplaced":
            return text + " (the compute plan names no device for this function: not judged)"
        if self.verdict == "partial":
            cost = "" if self.off_ane_cost is None else f", {self.off_ane_cost:.1%} of the estimated cost"
            ops = ", ".join(f"{n} {what}" for what, n in sorted(self.off_ane.items(), key=lambda kv: -kv[1]))
            text += f"; off the ANE: {ops}{cost} ({self.could_be_on_ane} of them supported there)"
            text += " -- within" if self.ok else " -- above"
            text += f" the {OFF_ANE_BUDGET:.0%} budget"
        return text


_LABELS = {"gpu": "the GPU", "cpu": "the CPU", None: "no device"}


def device_kind(device: object) -> str | None:
    """`ane`, `gpu` or `cpu` for a coremltools compute device (MLNeuralEngineComputeDevice, ...); None for none."""
    name = type(device).__name__ if device is not None else ""
    return "ane" if "NeuralEngine" in name else "gpu" if "GPU" in name else "cpu" if "CPU" in name else None


def placement_report(program: str, ops: Iterable[OpDevice]) -> Placement:
    """The placement of a program from its per-op devices (what `MLComputePlan.
    get_compute_device_usage_for_mlprogram_operation` and `get_estimated_cost_for_mlprogram_operation` give for
    each op; `const` and `constexpr_*` ops are weights, never placed, and are skipped; unplaced ops' costs count
    neither way)."""
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
        if op.preferred is None:
            continue
        costed = costed and op.cost is not None
        cost_all += op.cost or 0.0
        if op.preferred != "ane":
            what = f"{op.op} on {_LABELS[op.preferred]}"
            off[what] = off.get(what, 0) + 1
            cost_off += op.cost or 0.0
            could += "ane" in op.supported
    share = (cost_off / cost_all if cost_all > 0 else 0.0) if costed else None
    return Placement(program, counts["ane"], counts["gpu"], counts["cpu"], counts[None], off, share, could)


@dataclass
class PlacementStatus:
    """What a compute-plan query gave: `placed` (with its `report`), `unavailable` (this macOS has no
    MLComputePlan, or this is not a Mac) or `failed` (the query itself raised: `error`)."""

    program: str
    status: str
    report: Placement | None = None
    error: str | None = None

    @property
    def ok(self) -> bool | None:
        """True: within the budget; False: a fallback above it, or a failed query; None: not judged (unavailable,
        or a function the query leaves unplaced)."""
        if self.status == "failed":
            return False
        return self.report.ok if self.report is not None else None

    def to_dict(self) -> dict:
        found = {"status": self.status, "line": self.line(), "ok": self.ok}
        if self.report is not None:
            r = self.report
            found.update(verdict=r.verdict, off_ane_cost=r.off_ane_cost, ops=r.total, unplaced_ops=r.unknown)
        if self.error is not None:
            found.update(error=self.error)
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


def check_placement(found: PlacementStatus) -> PlacementStatus:
    """Print a warning on stderr when a program's placement fails its budget or its query failed (an OS without a
    compute plan is said once, by `hetero doctor`, not once per program)."""
    r = found.report
    if found.status == "failed":
        print(f"WARNING: {found.line()}", file=sys.stderr)
    elif found.status == "unavailable":
        pass
    elif r.verdict == "none":
        print(f"WARNING: {r.line()} -- NOTHING runs on the Neural Engine; Core ML fell back silently", file=sys.stderr)
    elif r.verdict == "partial" and not r.ok:
        print(f"WARNING: partial CPU/GPU fallback: {r.line()}", file=sys.stderr)
    return found


def plan_ops(plan, function: str | None) -> list[OpDevice]:
    """Every op of a compute plan's function (`function` None: a single-function package's main), nested blocks
    included, with Core ML's preferred and supported devices and estimated cost (`plan` answers as
    coremltools' `MLComputePlan` does). A function the plan's structure lacks has no placed ops: none."""
    functions = plan.model_structure.program.functions
    if (function or "main") not in functions:
        return []
    out, stack = [], list(functions[function or "main"].block.operations)
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
