"""The export converts with a trimmed main pass pipeline (`hetero.coreml.graphs.package.PASSES`) instead of coremltools'
default one, and that must not change a single byte of any package: every builder (attention with and without a
cache, in both layouts, the MLP with its output shift, the GDN z rows) in every weight form (fp16, per-group lookup
tables, blockwise shift-scale) is converted both ways and compared, its program description and its weight blob.

A builder that starts to write something one of the skipped passes would rewrite fails here, and its pass then
belongs in `PASSES`."""

from __future__ import annotations

import contextlib
from pathlib import Path

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
from coremltools.converters.mil.mil.passes.pass_registry import register_pass

from hetero.checkpoint.loader import load_model
from hetero.cli.quantize import quantize_checkpoint
from hetero.coreml.pieces import PieceSlice, build_piece, in_form, mlp_weights
from hetero.coreml.graphs import package
from hetero.coreml.graphs.package import PASSES, save_program
from tests.test_coreml_graphs import save_checkpoint, tiny_model

CHUNK = 64


def package_bytes(path: Path) -> dict[str, bytes]:
    """Every file of a saved .mlpackage but its Manifest.json (which names files by random identifiers)."""
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*"))
            if f.is_file() and f.name != "Manifest.json"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny model in fp32 and as a 4-bit `hetero convert --quantize` checkpoint (group 32)."""
    root = tmp_path_factory.mktemp("passes")
    float_dir = save_checkpoint(tiny_model(3), root / "float")
    return {"float": str(float_dir), "q4": str(quantize_checkpoint(str(float_dir), root / "q4", bits=4, group_size=32))}


def programs(checkpoint: str, form: str):
    """(name, a function building a fresh MIL program) for one slice of each piece kind in the first layer of each
    mixer: attention with and without cache slots, the MLP on picked channels with an output shift, the GDN z rows.
    Fresh, because a conversion rewrites the program it is given."""
    from hetero.coreml.graphs.mlp import MLPShape, build_mlp

    net, _, _ = load_model(checkpoint)
    args = net.args
    attn, gdn = args.layer_types.index("full_attention"), args.layer_types.index("linear_attention")
    heads = args.num_key_value_heads  # several: their programs share constants a pass may merge
    attention = PieceSlice(attn, "attention", 0, heads)
    for s, context, layout in [(attention, CHUNK, "heads"), (attention, 4 * CHUNK, "heads"),
                               (attention, CHUNK, "keys_on_channels"), (attention, 4 * CHUNK, "keys_on_channels"),
                               (PieceSlice(gdn, "mlp", 0, 32), CHUNK, "heads"),
                               (PieceSlice(gdn, "gdn_in_proj", 0, 32), CHUNK, "heads")]:
        yield f"{s.piece}@{context}:{layout}", lambda s=s, context=context, layout=layout: build(
            *build_piece(args, net, s, CHUNK, context, form=form, layout=layout))
    channels = np.array([5, 1, 30, 31, 64, 2] + list(range(70, 96)))  # out of order, across groups
    weights = in_form(mlp_weights(net.layers[gdn].mlp, channels, out_shift=3), form)
    yield "mlp-shifted", lambda: build_mlp(MLPShape(args.hidden_size, len(channels), CHUNK), weights)


def build(shape, weights, builder):
    return builder(shape, weights)


def stock(program, path: Path) -> Path:
    """Saved the way coremltools converts by itself: its default pipeline, the program validated around every
    pass, a gc after the convert (not within `package.lean_conversion`)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(package, "lean_conversion", contextlib.nullcontext)
        return save_program(program, path, ct.PassPipeline())


# (the fp16 form of a quantized checkpoint writes the float checkpoint's ops: plain fp16 constants)
@pytest.mark.parametrize("checkpoint,form", [("float", "lut"), ("q4", "lut"), ("q4", "blockwise")])
def test_the_trimmed_pipeline_writes_the_default_pipelines_packages(checkpoints, form, checkpoint, tmp_path):
    default_pipeline = ct.PassPipeline()
    rest = iter(default_pipeline.passes)
    assert all(p in rest for p in PASSES)  # a subsequence of the default pipeline: its passes in its order
    compared = 0
    for name, program in programs(checkpoints[checkpoint], form):
        trimmed = package_bytes(save_program(program(), tmp_path / f"{name}-trimmed.mlpackage"))
        default = package_bytes(stock(program(), tmp_path / f"{name}-default.mlpackage"))
        assert trimmed.keys() == default.keys(), name
        for file in default:
            assert trimmed[file] == default[file], f"{name}: {file} differs from the default pipeline's"
        compared += 1
    assert compared == 7


def test_vision_programs_are_the_default_pipelines_too(tmp_path):
    """The vision tower's programs (patch embedding, a block with tanh GELU, the merger with exact GELU) convert with
    the trimmed pipeline to the default pipeline's packages byte for byte."""
    from hetero.coreml.export_vision import vision_pieces
    from hetero.models.qwen3_5_vision.args import VisionArgs
    from hetero.models.qwen3_5_vision.model import VisionModel

    tower = VisionModel(VisionArgs(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                                   out_hidden_size=48, num_position_embeddings=16, hidden_act="gelu_pytorch_tanh"))
    compared = 0
    for piece, shape, weights, builder in vision_pieces(tower, 256):
        trimmed = package_bytes(save_program(builder(shape, weights), tmp_path / f"{piece}-t.mlpackage"))
        default = package_bytes(stock(builder(shape, weights), tmp_path / f"{piece}-d.mlpackage"))
        assert trimmed == default, f"{piece}: differs from the default pipeline's package"
        compared += 1
    assert compared == 3


@register_pass(namespace="hetero_test")
class use_before_definition(AbstractGraphPass):
    """A broken pass: it moves the main function's last op first, so it reads values not yet computed."""

    def apply(self, prog):
        ops = prog.functions["main"].operations
        last = ops[-1]
        ops.remove(last)
        ops.insert_op_before(last, before_op=ops[0])


def test_a_pass_that_breaks_the_program_still_fails_the_export(checkpoints, tmp_path):
    """The export validates each converted program once, after its passes, instead of around every pass: a pass
    that leaves the program invalid is still caught, and nothing is written."""
    _, make = next(programs(checkpoints["float"], "lut"))
    broken = ct.PassPipeline(pass_names=[*PASSES, "hetero_test::use_before_definition"], pipeline_name="broken")
    with pytest.raises(ValueError, match="not visible"):
        save_program(make(), tmp_path / "broken.mlpackage", broken)
    assert not (tmp_path / "broken.mlpackage").exists()
