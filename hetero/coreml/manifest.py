"""The manifests of an export directory, read and written in one place: `manifest.json` (the text model's
programs, `hetero.coreml.export`) and `vision.json` (the vision tower's, `hetero.coreml.export_vision`). Each is
checked for its format on read, and written whole or not at all. Light on purpose: the backends and the runtime read
manifests without importing the exporters (or coremltools)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from hetero.errors import HeteroError


@dataclass(frozen=True)
class Manifest:
    """One kind of manifest: its file name, the format this hetero reads, and what a missing or damaged one asks."""

    file: str
    format: int
    missing: str  # what it means that there is none
    redo: str  # what to do when it is damaged


TEXT = Manifest("manifest.json", 4, "not a Core ML export directory (run hetero convert --coreml)",
                "re-run hetero convert --coreml")  # 4: normed inputs, channels by range, output shifts
VISION = Manifest("vision.json", 1, "the vision tower was not exported there", "export the vision tower again")
MANIFEST, MANIFEST_FORMAT = TEXT.file, TEXT.format
VISION_MANIFEST, VISION_FORMAT = VISION.file, VISION.format


def read(out: str | os.PathLike, kind: Manifest = TEXT) -> dict:
    """The manifest of kind `kind` in export directory `out`; HeteroError when there is none, it is damaged or it
    is of another format."""
    file = Path(out) / kind.file
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise HeteroError(f"{file} is missing: {kind.missing}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HeteroError(f"{file} is damaged ({e}); {kind.redo}") from None
    if manifest.get("format") != kind.format:
        raise HeteroError(f"{file} has format {manifest.get('format')!r}; this hetero reads format {kind.format}")
    return manifest


def read_manifest(out: str | os.PathLike) -> dict:
    """The text model's manifest of an export directory (`read`)."""
    return read(out, TEXT)


def read_vision_manifest(out: str | os.PathLike) -> dict:
    """The vision tower's manifest of an export directory (`read`)."""
    return read(out, VISION)


def listed_files(out: Path, kind: Manifest = TEXT) -> list[str]:
    """The package files any readable manifest of kind `kind` in `out` lists, whatever its format."""
    try:
        return [p["file"] for p in json.loads((out / kind.file).read_text())["programs"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def write(out: Path, manifest: dict, kind: Manifest = TEXT) -> None:
    """Write `manifest` into `out` whole: a reader sees the previous one or this one, never half of it."""
    tmp = out / (kind.file + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(out / kind.file)
