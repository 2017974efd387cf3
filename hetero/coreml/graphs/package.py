"""Saving MIL programs as .mlpackage files (one function, or several sharing their weights), and reading a saved
package's MIL program back (any OS)."""

from __future__ import annotations

import contextlib
import gc
import io
import os
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

import coremltools as ct
from coremltools.converters.mil.frontend.milproto.load import load as _load_milproto
from coremltools.converters.mil.mil import Program

from hetero.coreml.graphs.ops import DEPLOYMENT_TARGET

# The passes of coremltools' default pipeline (95 of them, each followed by a full program validation) that change
# a program these builders write; the others find nothing to do in them and took half of every export's time. The
# package is the default pipeline's byte for byte: tests/test_coreml_passes.py checks it for every builder and
# weight form, so a builder that starts to need another pass fails there.
PASSES = ("common::noop_elimination", "common::fuse_transpose_matmul", "common::reduce_transposes",
          "common::add_fp16_cast", "common::dead_code_elimination", "common::remove_redundant_ops",
          "common::topological_reorder", "common::dead_code_elimination")


def pass_pipeline() -> ct.PassPipeline:
    """The main pass pipeline `save_program` converts with (`PASSES`, in the default pipeline's order)."""
    return ct.PassPipeline(pass_names=list(PASSES), pipeline_name="hetero")


_converting = threading.local()  # `.on` while this thread converts inside `lean_conversion`
_validate_each_time = Program.validate
_describe = Program.__str__


def _validate_unless_converting(prog: Program, *args, **kwargs) -> None:
    if not getattr(_converting, "on", False):
        _validate_each_time(prog, *args, **kwargs)


def _describe_unless_converting(prog: Program) -> str:
    if getattr(_converting, "on", False):
        return f"<MIL program: functions {', '.join(prog.functions)}>"
    return _describe(prog)


@contextlib.contextmanager
def lean_conversion():
    """Within it, this thread's coremltools conversions skip the work that does not shape the package.

    Around each of its passes, a conversion validates the whole program (a walk over every op's inputs and users)
    and prints it whole into a debug log message, built even when nothing logs it; after it, a full `gc.collect()`.
    Together, about three quarters of an export's time (bench/export_passes.py). Here the program is described by
    its function names, objects made before the conversion are out of the collector's reach, and validation is
    left to the caller, once, on the converted program (`save_program` does: a pass that breaks the program still
    fails the export). Validating and printing only read a program, so the package is the same byte for byte
    (tests/test_coreml_passes.py). Other threads keep coremltools' own behaviour."""
    Program.validate = _validate_unless_converting  # idempotent: both delegate whenever the flag is off
    Program.__str__ = _describe_unless_converting
    _converting.on = True
    gc.freeze()  # each collect walks only what the conversion made, not the whole process's heap
    try:
        yield
    finally:
        _converting.on = False
        gc.unfreeze()


def save_program(prog: Program, path: str | os.PathLike, pipeline: ct.PassPipeline | None = None) -> Path:
    """Convert `prog` to an fp16 ML Program and write it to `path` (.mlpackage); needs no Core ML runtime. The
    package's minimum OS is the newest opset among its functions (macOS 15 for lookup-table weights).
    `pipeline`: the main pass pipeline (default `pass_pipeline()`; coremltools' own is `ct.PassPipeline()`)."""
    target = max((f.opset_version or DEPLOYMENT_TARGET for f in prog.functions.values()), default=DEPLOYMENT_TARGET)
    with contextlib.redirect_stderr(io.StringIO()), lean_conversion():  # stderr: coremltools' per-pass tqdm bars
        model = ct.convert(
            prog,
            convert_to="mlprogram",
            compute_precision=ct.precision.FLOAT16,
            minimum_deployment_target=target,
            skip_model_load=True,  # compiling needs macOS; the package is complete without it
            pass_pipeline=pipeline or pass_pipeline(),
        )
    _validate_each_time(model._mil_program)  # once, on what the passes made (they ran unchecked)
    path = Path(path)
    model.save(str(path))
    return path


def save_functions(progs: Iterable[tuple[str, Program]], path: str | os.PathLike) -> Path:
    """Write the single-function programs `progs` ((function name, program) pairs, each saved and let go before
    the next is taken) as one multifunction .mlpackage at `path` whose equal constants are stored once
    (`coremltools.utils.save_multifunction` deduplicates them across functions); the first name is the default
    function. A multifunction package needs macOS 15 / iOS 18."""
    path = Path(path)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.stem}.") as tmp:  # same disk: no copy across
        desc, names = ct.utils.MultiFunctionDescriptor(), []
        for name, prog in progs:
            desc.add_function(str(save_program(prog, Path(tmp) / f"{name}.mlpackage")), "main", name)
            names.append(name)
        if not names:
            raise ValueError("save_functions needs at least one program")
        desc.default_function_name = names[0]
        with contextlib.redirect_stderr(io.StringIO()), lean_conversion():  # it reads back functions validated here
            ct.utils.save_multifunction(desc, str(path))
    return path


def load_program(path: str | os.PathLike) -> Program:
    """The MIL program stored in a saved .mlpackage (every function; `default_function_name` as the package
    declares it), with its weights read from the package's weight file."""
    path = Path(path)
    if not (path / "Manifest.json").is_file():
        raise FileNotFoundError(f"{path} is not an .mlpackage (no Manifest.json)")
    model = ct.models.MLModel(str(path), skip_model_load=True)
    spec = model.get_spec()
    if spec.WhichOneof("Type") != "mlProgram":
        raise ValueError(f"{path} holds a {spec.WhichOneof('Type')} model, not an ML Program")
    prog = _load_milproto(spec, spec.specificationVersion, file_weights_dir=model.weights_dir)
    if spec.description.defaultFunctionName:  # the loader leaves "main", which a multifunction package may not have
        prog.default_function_name = spec.description.defaultFunctionName
    return prog
