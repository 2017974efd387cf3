"""The ANE lane's programs: the backend (Core ML on macOS, the reference executor elsewhere), the export cache
(exported on first use, for this Mac's target), and the loaded programs per layer and piece.

The attention programs of an export's context buckets load lazily: a chunk loads the smallest bucket that holds it
when it first needs it, and the next bucket is loaded in the background meanwhile (`Programs.attention_at`), so a
short prompt never maps a long one's functions. `Programs.charged_bytes` is what the memory governor counts for the
functions a prompt loads: each function its package's whole weights, as coremltools#2351 reports memory growing per
loaded function even where a multifunction package stores its weights once.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hetero.checkpoint.dtypes import dtype_name
from hetero.coreml.backends import platform_backend
from hetero.coreml.backends.coreml_macos import this_target
from hetero.coreml.export import DEFAULT_WEIGHT_FORM, export_plan
from hetero.coreml.graphs import LAYOUTS
from hetero.coreml.manifest import read_manifest
from hetero.coreml.target import Target, check_target, weight_form_for
from hetero.errors import AneLaneLost, AneNonFinite, HeteroError
from hetero.host.progress import ProgressBar
from hetero.host.settings import machine_id
from hetero.planner import OFFLOADABLE, Plan, context_buckets


def ane_backend() -> tuple[str, Callable[[Path], Callable[[dict], dict]]]:
    """(name, loader): Core ML (CPU_AND_NE) on macOS, the portable reference executor elsewhere."""
    return platform_backend()


def export_root() -> Path:
    """Where exported packages are cached: $HETERO_HOME/coreml, else ~/.cache/hetero/coreml."""
    if os.environ.get("HETERO_HOME"):
        return Path(os.environ["HETERO_HOME"]) / "coreml"
    return Path.home() / ".cache" / "hetero" / "coreml"


def model_dir(key: str) -> Path:
    """Where the exports and activation ranges of the weights `key` names are kept."""
    return export_root() / key.replace("/", "_")


LAYOUT_FILE = "attention_layout.json"  # beside the exports: the layout this machine's doctor measured faster


def attention_layout() -> str:
    """The attention programs' layout on this machine: the one `hetero doctor` measured faster here
    (`save_attention_layout`), else the first of `LAYOUTS` (`heads`)."""
    try:
        found = json.loads((export_root() / LAYOUT_FILE).read_text()).get(machine_id(), {}).get("layout")
    except (OSError, ValueError, AttributeError):
        return LAYOUTS[0]
    return found if found in LAYOUTS else LAYOUTS[0]


def save_attention_layout(layout: str, evidence: dict) -> Path:
    """Remember `layout` (with what measured it) as this machine's attention layout: later exports build it."""
    if layout not in LAYOUTS:
        raise HeteroError(f"attention layout {layout!r}: one of {', '.join(LAYOUTS)}")
    path = export_root() / LAYOUT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data = data if isinstance(data, dict) else {}
    data[machine_id()] = {"layout": layout, **evidence}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    return path


def ensure_export(loaded: tuple, key: str, plan: Plan, bucket: int, form: str = DEFAULT_WEIGHT_FORM,
                  check: Callable[[], None] | None = None, reuse: Path | None = None,
                  target: Target | None = None) -> Path:
    """The export directory of `plan` for the loaded model (model, path, config) whose weights `key` names, and a
    context `bucket`: exported on first use with a progress bar, attention programs for every context bucket up to
    `bucket` (each chunk runs the smallest that holds it), for `target` (default: this Mac's), quantized weights in
    the form `form` (`--ane-weights`) as the target allows it (fp16 below macOS 15), attention in this machine's
    layout (`attention_layout`). The directory is named by (key, the plan's sliced fraction, chunk and piece kinds,
    bucket, the weights' dtype as loaded, target, weight form, layout). `check` runs after every program and may
    raise to stop the export there (a stopping server); the manifest is written last, so a stopped export is never
    read as finished. `reuse`: an earlier export (a split re-planned when its ranges grew) whose packages the new
    plan leaves unchanged are linked in, not built again."""
    contexts = context_buckets(bucket, plan.chunk)
    target = target or this_target()
    form, _ = weight_form_for(form, target)
    layout = attention_layout()
    tag = "" if set(plan.offload) == set(OFFLOADABLE) else "_" + "+".join(plan.offload)
    if plan.ranges is not None:  # the channels and output scales the ranges chose
        tag += "_r" + plan.ranges.digest()
    # the weights as loaded are exported: bf16-rounded ones differ from the files' fp32 values, so an export of the
    # checkpoint loaded in another dtype is not this model's (a bf16 split on fp32's programs failed --verify)
    tag += f"_d{dtype_name(loaded[0].model.norm.weight.dtype)}"
    tag += f"_{target.name}"  # a package built for another OS is never loaded (nor its directory shared)
    if form != DEFAULT_WEIGHT_FORM:  # the weight forms never share a directory (nor a package: its key)
        tag += f"_w{form}"
    if layout != LAYOUTS[0]:
        tag += f"_l{layout}"
    out = model_dir(key) / f"f{plan.sliced_fraction:.4f}_s{plan.chunk}_t{bucket}{tag}"
    try:
        manifest = read_manifest(out)
        files = all((out / p["file"] / "Manifest.json").is_file() for p in manifest["programs"])
        same = (manifest["context_buckets"], manifest.get("target"), manifest.get("ane_weights"),
                manifest.get("attention_layout")) == (contexts, target.name, form, layout)
        if files and same:
            return out
    except HeteroError:
        pass

    bar = ProgressBar("export Core ML")

    def progress(done: int, total: int) -> None:
        bar(done, total)
        if check is not None:
            check()

    export_plan(plan, loaded, out, contexts, progress=progress, target=target, form=form, reuse=reuse, layout=layout)
    return out


_LOADS = threading.Lock()  # one program load at a time in this process: reading a package back builds MIL with
# coremltools' builder, whose current-function context is global (two loads at once mix their ops), and the worker
# answers one message at a time anyway


class LazyProgram:
    """A program loaded on its first call, or ahead of it by `load` (from a background thread: one load, however
    many callers ask at once, and one load of any program at a time). `weight_bytes` is what loading it is charged
    (its package's weights)."""

    def __init__(self, load: Callable[[], Callable], weight_bytes: int):
        self._load, self._loaded, self._lock = load, None, threading.Lock()
        self.weight_bytes = weight_bytes

    @property
    def loaded(self) -> bool:
        return self._loaded is not None

    def load(self) -> Callable:
        with self._lock:
            if self._loaded is None:
                with _LOADS:
                    self._loaded = self._load()
            return self._loaded

    def __call__(self, inputs: dict) -> dict:
        return self.load()(inputs)


@dataclass
class Programs:
    """Programs per layer: attention parts (run, shape, KV heads; loaded lazily per context bucket), MLP parts (run,
    channels), MoE shared-expert parts (run, channels: the same MLP program), z parts."""

    chunk: int
    attention: dict[int, list] = field(default_factory=dict)
    mlp: dict[int, list] = field(default_factory=dict)
    shared_expert: dict[int, list] = field(default_factory=dict)
    gdn_in_proj: dict[int, list] = field(default_factory=dict)
    channels: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)  # (piece, layer) -> the ANE's units
    # when chosen by range (`hetero.planner.ranges`); absent: units [0, share) in their own order
    weights: str = "lut"  # the export's weight form (`--ane-weights`, as its target allowed it)
    weight_forms: dict[str, int] = field(default_factory=dict)  # matrices per embedding (fp16, lut, blockwise)
    blockwise_capable: int = 0  # matrices `--ane-weights blockwise` embeds (or would embed) as shift-scale
    eager_bytes: int = 0  # the weights of the programs loaded up front (every piece but attention)
    _warming: set = field(default_factory=set)  # cache slots of the buckets being (or already) warmed

    def ane_units(self, kind: str, layer: int) -> np.ndarray:
        """The units (channels, rows) a layer's piece sends to the ANE."""
        chosen = self.channels.get((kind, layer))
        return chosen if chosen is not None else np.arange(self.share(kind, layer))

    def buckets(self) -> list[int]:
        """The cache slots of the attention programs' context buckets, smallest first."""
        return sorted({shape.cache_slots for parts in self.attention.values() for _, shape, _ in parts})

    def attention_at(self, layer: int, start: int) -> list:
        """The attention parts of `layer` for a chunk at position `start`: those of the smallest context bucket
        whose cache slots hold every position before it (loaded on their first call); the next bucket, every
        layer's, starts loading in the background."""
        parts = self.attention[layer]
        slots = min((shape.cache_slots for _, shape, _ in parts if shape.cache_slots >= start), default=None)
        if slots is None:
            raise HeteroError(f"no attention program of layer {layer} holds a chunk at position {start}: the export's "
                              f"largest cache has {max(shape.cache_slots for _, shape, _ in parts)} slots")
        later = [b for b in self.buckets() if b > slots]
        if later:
            self.warm(later[0])
        return [p for p in parts if p[1].cache_slots == slots]

    def warm(self, slots: int) -> threading.Thread | None:
        """Load every layer's attention parts of the bucket with `slots` cache slots in a background thread (once);
        None when it was already asked for."""
        if slots in self._warming:
            return None
        self._warming.add(slots)
        lazy = [p for p in self._lazy(lambda slots_: slots_ == slots) if not p.loaded]
        if not lazy:
            return None
        thread = threading.Thread(target=_load_quietly, args=(lazy,), daemon=True, name=f"warm bucket {slots}")
        thread.start()
        return thread

    def _lazy(self, which) -> list[LazyProgram]:
        """The lazily loaded attention programs of the buckets whose cache slots `which` accepts."""
        return [run.run for parts in self.attention.values() for run, shape, _ in parts
                if which(shape.cache_slots) and isinstance(getattr(run, "run", None), LazyProgram)]

    def loaded_functions(self) -> int:
        """Attention functions loaded so far (the other pieces' programs load up front)."""
        return sum(p.loaded for p in self._lazy(lambda _: True))

    def charged_bytes(self, tokens: int) -> int:
        """The weight bytes charged for every function a prompt of `tokens` loads: the up-front programs and each
        attention function of the buckets its chunks reach, each at its package's whole weights (coremltools#2351:
        a loaded function's memory does not shrink for weights its package shares)."""
        need = [b for b in self.buckets() if b < tokens]  # a chunk at start < tokens needs slots >= start
        reach = self.buckets()[: len(need) + 1]
        return self.eager_bytes + sum(p.weight_bytes for p in self._lazy(lambda slots: slots in reach))

    def share(self, kind: str, layer: int) -> int:
        """Units the ANE computes for a layer's piece (its parts cover [0, share))."""
        parts = getattr(self, kind).get(layer, [])
        return max((p[-1].stop for p in parts), default=0)


def _load_quietly(programs: list[LazyProgram]) -> None:
    """Load `programs` ahead of their first call; a failure is left for that call to raise, where it is handled, and a
    worker lost meanwhile is handed back to it, for the next prompt to report (`AneProcess.lost_in_background`)."""
    for program in programs:
        try:
            program.load()
        except AneLaneLost as e:
            lane = getattr(e, "lane", None)
            if lane is not None:
                lane.lost_in_background()
            return
        except Exception:  # noqa: BLE001  (the chunk that needs it loads it again and reports what went wrong)
            return


class _Guarded:
    """A program as the split calls it: its outputs unscaled (a program whose outputs carry 2^-shift, folded into its
    weights, gives them as they are: the product by a power of two is exact), and non-finite ones raising
    `AneNonFinite` that names its layer and piece (looked for here when `check`: a program run in this process; the worker looks itself,
    `hetero.coreml.backends.ane_worker`, and its error gains them). `lane` and `key` are the worker's program's (None
    in this process): the doctor checks it there (which loads a lazy program)."""

    def __init__(self, run: LazyProgram, shift: int, name: str, layer: int, piece: str, check: bool):
        self.run, self.shift, self.name, self.layer, self.piece, self.check = run, shift, name, layer, piece, check

    @property
    def lane(self):
        return getattr(self.run.load(), "lane", None)

    @property
    def key(self):
        return getattr(self.run.load(), "key", None)

    def __call__(self, inputs: dict) -> dict:
        try:
            out = self.run(inputs)
        except AneNonFinite as e:
            raise AneNonFinite(str(e), self.layer, self.piece) from None
        if self.shift:
            out = {k: v * np.float32(2.0**self.shift) for k, v in out.items()}
        if self.check:
            bad = next((k for k, a in out.items() if not np.isfinite(a).all()), None)
            if bad is not None:
                raise AneNonFinite(f"the ANE lane's program {self.name} returned non-finite values in {bad!r}",
                                   self.layer, self.piece)
        return out


def load_programs(export_dir: Path, loader: Callable[..., Callable], check: bool = False,
                  target: Target | None = None) -> Programs:
    """The programs of an export built for `target` (default: this Mac's; another target's is refused, never
    loaded), loaded by `loader` (path[, function]) -> callable: the platform's backend in this process, or
    `AneProcess.load` into the ANE lane's worker. Every piece but attention loads now; attention loads per context
    bucket when a chunk first needs it (`Programs.attention_at`). Each raises `AneNonFinite` (with its layer and
    piece) on NaN or inf: `check` makes it look (a loader in this process; the worker looks itself)."""
    from hetero.coreml.graphs.attention import AttentionShape

    manifest = read_manifest(export_dir)
    check_target(manifest.get("target"), target or this_target(), str(export_dir))
    progs = Programs(manifest["chunk_size"], weights=manifest.get("ane_weights", "lut"))
    counted = set()  # a package's functions (its context buckets) embed the same matrices
    for p in manifest["programs"]:
        if p["file"] not in counted:
            counted.add(p["file"])
            for kind, n in p.get("weight_forms", {}).items():
                progs.weight_forms[kind] = progs.weight_forms.get(kind, 0) + n
            progs.blockwise_capable += p.get("blockwise_capable", 0)
        path, function = export_dir / p["file"], p.get("function")  # a multifunction package names its function
        lazy = LazyProgram(lambda path=path, function=function: loader(path) if function is None else
                           loader(path, function), p.get("package_weight_bytes", p["weight_bytes"]))
        run, units = _Guarded(lazy, p["out_shift"], p["file"], p["layer"], p["piece"], check), range(*p["part"])
        if "channels" in p:
            key = (p["piece"], p["layer"])
            progs.channels[key] = np.concatenate([progs.channels.get(key, np.zeros(0, np.int64)), p["channels"]])
        if p["piece"] == "attention":
            progs.attention.setdefault(p["layer"], []).append((run, AttentionShape(**p["shape"]), units))
        else:
            lazy.load()  # needed by every chunk: now
            progs.eager_bytes += lazy.weight_bytes
            getattr(progs, p["piece"]).setdefault(p["layer"], []).append((run, units))
    if progs.buckets():
        progs.warm(progs.buckets()[0])  # the first chunk's bucket, loading while the split starts
    return progs
