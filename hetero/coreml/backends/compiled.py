"""Compiling a package for Core ML, keyed by its content (any OS: only the compile call itself needs macOS).

`compile_model(src, dst)` (coremltools.models.utils) compiles into a system temporary folder and ends in
`shutil.move`, which puts a new build *inside* an existing `dst`: the old code loaded the old build after a
re-export. Here a package compiles into a temporary folder beside it, renamed (atomically) to
`<stem>.<content hash>.mlmodelc`: a re-exported package has a new hash, so a stale build is never loaded, and a
crashed compile leaves only a temporary folder nothing loads. `remove_compiled` deletes a package's builds (the
export does it with the package).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from hetero.errors import HeteroError

_DIGESTS: dict[tuple, str] = {}  # package_signature -> content hash, for this process
DIGEST_CHARS = 16  # hex digits of the content hash in a compiled folder's name
_COMPILED = re.compile(rf"^(?P<stem>.+)\.[0-9a-f]{{{DIGEST_CHARS}}}\.mlmodelc$")
_TEMP_PREFIX = ".compiling-"


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
