"""The ANE lane's programs: the backend (Core ML on macOS, the reference executor elsewhere), the export cache
(exported on first use), and the loaded programs per layer and piece."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hetero.coreml.backends import platform_backend
from hetero.coreml.export import DEFAULT_WEIGHT_FORM, export_plan
from hetero.coreml.manifest import read_manifest
from hetero.errors import AneNonFinite, HeteroError
from hetero.host.progress import ProgressBar
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


def ensure_export(loaded: tuple, key: str, plan: Plan, bucket: int, form: str = DEFAULT_WEIGHT_FORM,
                  check: Callable[[], None] | None = None, reuse: Path | None = None) -> Path:
    """The export directory of `plan` for the loaded model (model, path, config) whose weights `key` names, and a
    context `bucket`: exported on first use with a progress bar, attention programs for every context bucket up to
    `bucket` (each chunk runs the smallest that holds it), quantized weights in the form `form` (`--ane-weights`).
    The directory is named by (key, the plan's sliced fraction, chunk and piece kinds, bucket, weight form).
    `check` runs after every program and may raise to stop the export there (a stopping server); the manifest is
    written last, so a stopped export is never read as finished. `reuse`: an earlier export (a split re-planned
    when its ranges grew) whose packages the new plan leaves unchanged are linked in, not built again."""
    contexts = context_buckets(bucket, plan.chunk)
    tag = "" if set(plan.offload) == set(OFFLOADABLE) else "_" + "+".join(plan.offload)
    if plan.ranges is not None:  # the channels and output scales the ranges chose
        tag += "_r" + plan.ranges.digest()
    if form != DEFAULT_WEIGHT_FORM:  # the two weight forms never share a directory (nor a package: its key)
        tag += f"_w{form}"
    out = model_dir(key) / f"f{plan.sliced_fraction:.4f}_s{plan.chunk}_t{bucket}{tag}"
    try:
        manifest = read_manifest(out)
        files = all((out / p["file"] / "Manifest.json").is_file() for p in manifest["programs"])
        counted = all("weight_forms" in p for p in manifest["programs"])  # else rewritten, its packages reused
        if files and counted and manifest["context_buckets"] == contexts and manifest.get("ane_weights", "lut") == form:
            return out
    except HeteroError:
        pass

    bar = ProgressBar("export Core ML")

    def progress(done: int, total: int) -> None:
        bar(done, total)
        if check is not None:
            check()

    export_plan(plan, loaded, out, contexts, progress=progress, form=form, reuse=reuse)
    return out


@dataclass
class Programs:
    """Loaded programs per layer: attention parts (run, shape, KV heads), MLP parts (run, channels), MoE shared-expert
    parts (run, channels: the same MLP program), z parts."""

    chunk: int
    attention: dict[int, list] = field(default_factory=dict)
    mlp: dict[int, list] = field(default_factory=dict)
    shared_expert: dict[int, list] = field(default_factory=dict)
    gdn_in_proj: dict[int, list] = field(default_factory=dict)
    channels: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)  # (piece, layer) -> the ANE's units
    # when chosen by range (`hetero.planner.ranges`); absent: units [0, share) in their own order
    weights: str = "lut"  # the export's weight form (`--ane-weights`)
    weight_forms: dict[str, int] = field(default_factory=dict)  # matrices per embedding (fp16, lut, blockwise)
    blockwise_capable: int = 0  # matrices `--ane-weights blockwise` embeds (or would embed) as shift-scale

    def ane_units(self, kind: str, layer: int) -> np.ndarray:
        """The units (channels, rows) a layer's piece sends to the ANE."""
        chosen = self.channels.get((kind, layer))
        return chosen if chosen is not None else np.arange(self.share(kind, layer))

    def attention_at(self, layer: int, start: int) -> list:
        """The attention parts of `layer` for a chunk at position `start`: those of the smallest context bucket
        whose cache slots hold every position before it."""
        parts = self.attention[layer]
        slots = min((shape.cache_slots for _, shape, _ in parts if shape.cache_slots >= start), default=None)
        if slots is None:
            raise HeteroError(f"no attention program of layer {layer} holds a chunk at position {start}: the export's "
                              f"largest cache has {max(shape.cache_slots for _, shape, _ in parts)} slots")
        return [p for p in parts if p[1].cache_slots == slots]

    def share(self, kind: str, layer: int) -> int:
        """Units the ANE computes for a layer's piece (its parts cover [0, share))."""
        parts = getattr(self, kind).get(layer, [])
        return max((p[-1].stop for p in parts), default=0)


def _unscaled(run: Callable, factor: float) -> Callable:
    """A program whose outputs carry 2^-shift (folded into its weights), called as one that gives them as they are:
    the product by a power of two is exact."""
    return lambda inputs: {k: v * np.float32(factor) for k, v in run(inputs).items()}


class _Guarded:
    """A loaded program as the split calls it: its outputs unscaled, and non-finite ones raising `AneNonFinite` that
    names its layer and piece (looked for here when `check`: a program run in this process; the worker looks
    itself, `hetero.coreml.backends.ane_worker`, and its error gains them). `lane` and `key` are the worker's program's
    (None in this process): the doctor checks it there."""

    def __init__(self, run: Callable, loaded, name: str, layer: int, piece: str, check: bool):
        self.run, self.name, self.layer, self.piece, self.check = run, name, layer, piece, check
        self.lane, self.key = getattr(loaded, "lane", None), getattr(loaded, "key", None)

    def __call__(self, inputs: dict) -> dict:
        try:
            out = self.run(inputs)
        except AneNonFinite as e:
            raise AneNonFinite(str(e), self.layer, self.piece) from None
        if self.check:
            bad = next((k for k, a in out.items() if not np.isfinite(a).all()), None)
            if bad is not None:
                raise AneNonFinite(f"the ANE lane's program {self.name} returned non-finite values in {bad!r}",
                                   self.layer, self.piece)
        return out


def load_programs(export_dir: Path, loader: Callable[..., Callable], check: bool = False) -> Programs:
    """Every program of an export, loaded by `loader` (path[, function]) -> callable: the platform's backend in
    this process, or `AneProcess.load` into the ANE lane's worker. Each raises `AneNonFinite` (with its layer and
    piece) on NaN or inf: `check` makes it look (a loader in this process; the worker looks itself)."""
    from hetero.coreml.graphs.attention import AttentionShape

    manifest = read_manifest(export_dir)
    progs = Programs(manifest["chunk_size"], weights=manifest.get("ane_weights", "lut"))
    counted = set()  # a package's functions (its context buckets) embed the same matrices
    for p in manifest["programs"]:
        if p["file"] not in counted:
            counted.add(p["file"])
            for kind, n in p.get("weight_forms", {}).items():
                progs.weight_forms[kind] = progs.weight_forms.get(kind, 0) + n
            progs.blockwise_capable += p.get("blockwise_capable", 0)
        path, function = export_dir / p["file"], p.get("function")  # a multifunction package names its function
        loaded, units = (loader(path) if function is None else loader(path, function)), range(*p["part"])
        run = _unscaled(loaded, 2.0 ** p["out_shift"]) if p["out_shift"] else loaded
        run = _Guarded(run, loaded, p["file"], p["layer"], p["piece"], check)
        if "channels" in p:
            key = (p["piece"], p["layer"])
            progs.channels[key] = np.concatenate([progs.channels.get(key, np.zeros(0, np.int64)), p["channels"]])
        if p["piece"] == "attention":
            progs.attention.setdefault(p["layer"], []).append((run, AttentionShape(**p["shape"]), units))
        else:
            getattr(progs, p["piece"]).setdefault(p["layer"], []).append((run, units))
    return progs
