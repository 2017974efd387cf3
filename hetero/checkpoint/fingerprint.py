"""Fingerprint of the weights a checkpoint directory holds: what every cached state is keyed by.

Cached states (prefix-cache checkpoints in RAM, session-cache entries on disk, exported Core ML programs) are only
valid for the exact weights they were computed from. The model argument and config.json do not pin those: a new
hub revision with the same config, a re-download or another directory of the same name all change the weights
and keep the config. Hashing every weight byte would cost seconds to minutes on a large checkpoint, so the
fingerprint covers, per safetensors file: its resolved path (a hub cache names its blobs by content hash), size,
mtime in nanoseconds and the whole safetensors header (names, dtypes, shapes, offsets, metadata). Rewriting any
tensor changes the mtime; a re-quantized or re-shaped one changes the header.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own cap on its JSON header


def _header_bytes(file: Path) -> bytes:
    """The raw JSON header of a safetensors file (b"" if unreadable: the loader reports that file by itself)."""
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return b""
            (n,) = struct.unpack("<Q", head)
            return f.read(min(n, MAX_HEADER_BYTES))
    except OSError:
        return b""


def weights_fingerprint(path: str | os.PathLike) -> str:
    """A short hex digest that changes whenever the weight files under `path` (*.safetensors) may have changed.

    Reads only the files' metadata and headers (milliseconds, even for a sharded checkpoint of many GB).
    """
    h = hashlib.sha256()
    for file in sorted(Path(path).glob("*.safetensors")):
        real = file.resolve()
        st = real.stat()
        h.update(json.dumps([file.name, str(real), st.st_size, st.st_mtime_ns]).encode())
        header = _header_bytes(real)
        h.update(struct.pack("<Q", len(header)) + header)
    return h.hexdigest()[:16]


def checkpoint_identity(name: str, config: dict) -> str:
    """Names a checkpoint in per-machine settings and caches: its name plus a hash of its config."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    return f"{name}@{digest}"
