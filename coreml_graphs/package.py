"""Saving a MIL program as an .mlpackage, and reading a saved package's MIL program back (any OS)."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import coremltools as ct
from coremltools.converters.mil.frontend.milproto.load import load as _load_milproto
from coremltools.converters.mil.mil import Program

from coreml_graphs.ops import DEPLOYMENT_TARGET


def save_program(prog: Program, path: str | os.PathLike) -> Path:
    """Convert `prog` to an fp16 ML Program and write it to `path` (.mlpackage); needs no Core ML runtime."""
    with contextlib.redirect_stderr(io.StringIO()):  # coremltools' per-pass tqdm bars; the export draws its own
        model = ct.convert(
            prog,
            convert_to="mlprogram",
            compute_precision=ct.precision.FLOAT16,
            minimum_deployment_target=DEPLOYMENT_TARGET,
            skip_model_load=True,  # compiling needs macOS; the package is complete without it
        )
    path = Path(path)
    model.save(str(path))
    return path


def load_program(path: str | os.PathLike) -> Program:
    """The MIL program stored in a saved .mlpackage, with its weights read from the package's weight file."""
    path = Path(path)
    if not (path / "Manifest.json").is_file():
        raise FileNotFoundError(f"{path} is not an .mlpackage (no Manifest.json)")
    model = ct.models.MLModel(str(path), skip_model_load=True)
    spec = model.get_spec()
    if spec.WhichOneof("Type") != "mlProgram":
        raise ValueError(f"{path} holds a {spec.WhichOneof('Type')} model, not an ML Program")
    return _load_milproto(spec, spec.specificationVersion, file_weights_dir=model.weights_dir)
