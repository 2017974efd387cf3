"""A checkpoint's safetensors files as the pre-flight check reads them: the index and each shard's header (8 bytes +
JSON), never tensor data; every tensor's name, dtype, shape, file and offset (`TensorInfo`), and the MTP head's
folder mlx-vlm writes beside a checkpoint it converts."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx

from hetero.checkpoint.config_checks import MAX_DIM
from hetero.errors import HeteroError
from hetero.models.architectures import DRAFTER_MODEL_TYPES
from hetero.models.weights import checkpoint_has_mtp

FLOAT_DTYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}
ST_DTYPES = {**FLOAT_DTYPES, "U32": mx.uint32}
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "I64": 8, "F64": 8, "U8": 1, "I8": 1, "BOOL": 1}


@dataclass
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    nbytes: int
    offset: int = -1  # where its data starts in the file, in bytes (-1: unknown, its shard is absent)


def _raw_header(file: Path) -> tuple[int, int, dict]:
    """(file size, header length, the header's JSON object) of one safetensors file; HeteroError if it is none."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HeteroError(f"{file} is truncated (no safetensors header); re-download it")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100_000_000):
                raise HeteroError(f"{file} is not a safetensors file (header length {n} exceeds the file); re-download it")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError):
        raise HeteroError(f"{file} has a corrupt safetensors header; re-download it") from None
    except OSError as e:
        raise HeteroError(f"cannot read {file}: {e.strerror}") from None
    if not isinstance(header, dict):
        raise HeteroError(f"{file} has a corrupt safetensors header (a JSON {type(header).__name__}, not an object); re-download it")
    return size, n, header


def norms_zero_centred(path: Path) -> bool:
    """Whether the checkpoint at `path` stores its norms zero-centred (transformers' layout, scale 1 + w), as the
    files' writer says: transformers records `format: pt` in each safetensors file's metadata, MLX's writers
    (mlx-lm, mlx-vlm, `hetero convert`) `format: mlx` and the norms with their +1. Anything else: transformers'.
    The GDN conv's layout tells the same where a model has one (`hetero.models.weights.hf_conv_layout`); an
    all-attention layout has none."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return True
    metadata = _raw_header(files[0])[2].get("__metadata__")
    return not (isinstance(metadata, dict) and metadata.get("format") == "mlx")


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Tensor metadata of one safetensors file, validated against the file's size (catches truncation)."""
    size, n, header = _raw_header(file)
    tensors: dict[str, TensorInfo] = {}
    end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        info = _tensor_info(file, name, meta)
        info.offset = 8 + n + meta["data_offsets"][0]
        expected = DTYPE_BYTES.get(info.dtype, 0) * _numel(info.shape)
        if info.dtype in DTYPE_BYTES and expected != info.nbytes:
            raise HeteroError(f"{file}: tensor {name} spans {info.nbytes} bytes but {info.dtype}{list(info.shape)} needs {expected}")
        tensors[name] = info
        end = max(end, meta["data_offsets"][1])
    if 8 + n + end > size:
        raise HeteroError(f"{file} is truncated ({size} bytes, its header describes {8 + n + end}); re-download it")
    return tensors


def _tensor_info(file: Path, name: str, meta) -> TensorInfo:
    """One header entry, checked: a dtype string, a shape of sizes >= 0, data offsets 0 <= start <= stop."""
    corrupt = HeteroError(f"{file} has a corrupt safetensors header entry for {name!r}; re-download it")
    if not isinstance(meta, dict):
        raise corrupt
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    is_size = lambda v, top: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= top  # noqa: E731
    if not isinstance(dtype, str) or not isinstance(shape, list) or not all(is_size(d, MAX_DIM) for d in shape):
        raise corrupt
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_size(o, 2**62) for o in offsets) or offsets[0] > offsets[1]:
        raise corrupt
    return TensorInfo(name, dtype, tuple(shape), file.name, offsets[1] - offsets[0])


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def checkpoint_tensors(path: Path) -> tuple[dict[str, TensorInfo], list[str]]:
    """Every tensor the checkpoint declares (name -> info) and the shards that are not on disk.

    Reads the index and the headers of local shards; never tensor data. Tensors of absent shards come from
    the index with unknown dtype and shape.
    """
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = read_index(index_file)
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
        weight_map = {}
        if not shards:
            raise HeteroError(f"{path} holds no model.safetensors and no model.safetensors.index.json")
    absent = [s for s in shards if not (path / s).is_file()]
    tensors = {n: TensorInfo(n, "?", (), f, 0) for n, f in weight_map.items() if f in absent}
    for shard in shards:
        if shard in absent:
            continue
        header = read_header(path / shard)
        for name, f in weight_map.items():
            if f == shard and name not in header:
                raise HeteroError(f"tensor {name} is listed for {shard} in the index but that file does not hold it")
        tensors.update(header)
    drafter = mtp_drafter(path)
    if drafter is not None and not checkpoint_has_mtp(tensors):
        for file in sorted(drafter.glob("*.safetensors")):
            tensors.update({f"mtp.{n}": replace(t, name=f"mtp.{n}", file=os.path.relpath(file, path))
                            for n, t in read_header(file).items()})
    return tensors, absent


def mtp_drafter(path: Path) -> Path | None:
    """The MTP head's folder that mlx-vlm writes beside a checkpoint it converts (`mlx_vlm convert --mtp`: `<dir>-mtp`,
    the head's tensors without their `mtp.` prefix) when an architecture reads it (`Architecture.drafter_model_type`:
    Qwen4-Exp's), or None. A checkpoint without `mtp.*` tensors reads its head from there."""
    folder = drafter_path(path)
    try:
        kind = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return folder if kind in DRAFTER_MODEL_TYPES else None


def drafter_path(path: Path) -> Path:
    """Where mlx-vlm puts the MTP drafter of the checkpoint at `path`: `<path>-mtp`, beside it."""
    return path.with_name(path.name + "-mtp")


def read_index(index_file: Path) -> dict[str, str]:
    """The index's tensor name -> shard file map, checked to be exactly that."""
    try:
        weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError, KeyError, TypeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f for f in weight_map.values()):
        raise HeteroError(f"{index_file} is not a valid safetensors index (no weight_map of tensor -> file); re-download it")
    return weight_map
