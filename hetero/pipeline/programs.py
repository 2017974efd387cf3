"""The ANE lane's programs: the backend (Core ML on macOS, the reference executor elsewhere), the export cache
(exported on first use), and the loaded programs per layer and piece."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hetero.errors import HeteroError
from hetero.export import export_coreml, read_manifest
from hetero.planner import OFFLOADABLE, context_buckets


def ane_backend() -> tuple[str, Callable[[Path], Callable[[dict], dict]]]:
    """(name, loader): Core ML (CPU_AND_NE) on macOS, the portable reference executor elsewhere."""
    from hetero.backends import coreml_macos

    ok, _ = coreml_macos.available()
    if ok:
        return "Core ML", coreml_macos.load
    from hetero.backends.reference_executor import ReferenceExecutor

    return "reference executor", ReferenceExecutor


def export_root() -> Path:
    """Where exported packages are cached: $HETERO_HOME/coreml, else ~/.cache/hetero/coreml."""
    if os.environ.get("HETERO_HOME"):
        return Path(os.environ["HETERO_HOME"]) / "coreml"
    return Path.home() / ".cache" / "hetero" / "coreml"


def ensure_export(
    model_ref: str | None, key: str, fraction: float, chunk: int, bucket: int, offload: tuple[str, ...] = OFFLOADABLE,
    loaded: tuple | None = None,
) -> Path:
    """The export directory for (model key, fraction, chunk, bucket, piece kinds), exported on first use with a
    progress bar: attention programs for every context bucket up to `bucket` (each chunk runs the smallest that
    holds it). `loaded` = (model, path, config): export the weights in memory instead of reading the files."""
    contexts = context_buckets(bucket, chunk)
    tag = "" if set(offload) == set(OFFLOADABLE) else "_" + "+".join(offload)
    out = export_root() / key.replace("/", "_") / f"f{fraction:.4f}_s{chunk}_t{bucket}{tag}"
    try:
        manifest = read_manifest(out)
        files = all((out / p["file"] / "Manifest.json").is_file() for p in manifest["programs"])
        if files and manifest["context_buckets"] == contexts:
            return out
    except HeteroError:
        pass
    from hetero.progress import ProgressBar

    export_coreml(model_ref, out, fraction, chunk, contexts, progress=ProgressBar("export Core ML"), kinds=offload,
                  loaded=loaded)
    return out


@dataclass
class Programs:
    """Loaded programs per layer: attention parts (run, shape, KV heads), MLP parts (run, channels), z parts."""

    chunk: int
    attention: dict[int, list] = field(default_factory=dict)
    mlp: dict[int, list] = field(default_factory=dict)
    gdn_in_proj: dict[int, list] = field(default_factory=dict)

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


def load_programs(export_dir: Path, loader: Callable[[Path], Callable]) -> Programs:
    from coreml_graphs.attention import AttentionShape

    manifest = read_manifest(export_dir)
    progs = Programs(manifest["chunk_size"])
    for p in manifest["programs"]:
        run, units = loader(export_dir / p["file"]), range(*p["part"])
        if p["piece"] == "attention":
            progs.attention.setdefault(p["layer"], []).append((run, AttentionShape(**p["shape"]), units))
        else:
            getattr(progs, p["piece"]).setdefault(p["layer"], []).append((run, units))
    return progs
