"""The ANE lint: each rule is caught on a program built to break it; the builders' own programs are clean;
`hetero convert --lint DIR` exits 1 on errors and 0 otherwise."""

from __future__ import annotations

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol, types

from hetero.cli.main import main
from hetero.coreml.graphs.attention import AttentionShape, AttentionWeights, build_attention
from hetero.coreml.graphs.gdn import GDNInProjShape, GDNInProjWeights, build_gdn_in_proj
from hetero.coreml.graphs.lint import lint_package, lint_program
from hetero.coreml.graphs.mlp import MLPShape, MLPWeights, build_mlp
from hetero.coreml.graphs.ops import DEPLOYMENT_TARGET
from hetero.coreml.graphs.package import save_program

BC1S = (1, 64, 1, 64)


def spec(shape=BC1S, dtype=types.fp16):
    return [mb.TensorSpec(shape=shape, dtype=dtype)]


def one_op_program(shape=BC1S, dtype=types.fp16):
    @mb.program(input_specs=spec(shape, dtype), opset_version=DEPLOYMENT_TARGET)
    def prog(x):
        return mb.relu(x=x)

    return prog


def rules(prog, **kw) -> set[str]:
    return lint_program(prog, **kw).rules("error")


def test_fp32_compute_is_an_error():
    assert "fp16" in rules(one_op_program(dtype=types.fp32))


def test_axis_above_16384_is_an_error():
    assert "axis" in rules(one_op_program(shape=(1, 16448, 1, 64)))


def test_rank_above_4_is_an_error():
    assert "rank" in rules(one_op_program(shape=(1, 2, 2, 1, 64)))


def test_dynamic_shape_is_an_error():
    assert "dynamic" in rules(one_op_program(shape=(1, 64, 1, get_new_symbol())))


def test_pow_is_an_error():
    @mb.program(input_specs=spec(), opset_version=DEPLOYMENT_TARGET)
    def prog(x):
        return mb.pow(x=x, y=np.float16(2.0))

    assert "pow" in rules(prog)


def test_reduce_then_rsqrt_norm_is_an_error():
    @mb.program(input_specs=spec(), opset_version=DEPLOYMENT_TARGET)
    def prog(x):
        ms = mb.reduce_mean(x=mb.mul(x=x, y=x), axes=[1], keep_dims=True)  # (1, 1, 1, S)
        return mb.mul(x=x, y=mb.rsqrt(x=mb.add(x=ms, y=np.float16(1e-6))))

    assert "rsqrt-norm" in rules(prog)


def test_minus_inf_constant_is_an_error():
    mask = np.zeros((1, 1, 1, 64), np.float16)
    mask[..., 32:] = -np.inf

    @mb.program(input_specs=spec(), opset_version=DEPLOYMENT_TARGET)
    def prog(x):
        return mb.add(x=x, y=mask)

    report = lint_program(prog)
    assert "inf" in report.rules("error") and any("-inf" in f.message for f in report.errors)


def test_program_above_the_weight_budget_is_an_error():
    @mb.program(input_specs=spec(), opset_version=DEPLOYMENT_TARGET)
    def prog(x):
        return mb.conv(x=x, weight=np.ones((64, 64, 1, 1), np.float16))  # 8 KiB of weights

    assert "weights" in rules(prog, weight_budget=4096)
    assert "weights" not in rules(prog, weight_budget=16384)


def test_sequence_not_a_multiple_of_64_is_an_error():
    assert "seq" in rules(one_op_program(shape=(1, 64, 1, 48)))


def test_unaligned_last_axis_is_only_a_warning():
    report = lint_program(one_op_program(shape=(1, 1, 64, 20)))
    assert report.rules("warning") == {"align"} and not report.errors


def test_an_op_outside_the_documented_ane_ops_is_an_error():
    """gather is not among the ops the Neural Engine is documented to run (Core ML places it on the CPU or GPU)."""
    @mb.program(input_specs=spec(), opset_version=DEPLOYMENT_TARGET)
    def prog(x):
        return mb.gather(x=x, indices=np.arange(32, dtype=np.int32), axis=1)

    report = lint_program(prog)
    assert report.rules("error") == {"ane-op"} and "gather" in report.errors[0].message


def test_documented_ops_in_forms_the_ane_does_not_run_are_errors():
    """einsum only in its BC1S attention form, and a softmax or reduction within a sample, never over the batch."""
    @mb.program(input_specs=spec(shape=(1, 64, 1, 64)), opset_version=DEPLOYMENT_TARGET)
    def batch_softmax(x):
        return mb.softmax(x=x, axis=0)

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 128, 1, 64), dtype=types.fp16),
                             mb.TensorSpec(shape=(1, 64, 1, 64), dtype=types.fp16)], opset_version=DEPLOYMENT_TARGET)
    def scores(k, q):  # keys (1, T, 1, D) . q (1, D, 1, S): the reference layout's form, under other letters
        return mb.einsum(values=(k, q), equation="bkhc,bchq->bkhq")

    assert "ane-op" in lint_program(batch_softmax).rules("error")
    assert lint_program(scores).rules("error") == set()


def test_every_program_kind_is_clean_and_within_the_documented_ane_ops():
    """Every program kind as its builder emits it (attention in both layouts, over one key axis and over key blocks;
    the MLP, the z rows, the vision tower's three programs) breaks no rule at all: every op among `ANE_OPS`, every
    tensor of rank <= 4, no warnings."""
    from hetero.coreml.graphs.lint import ANE_OPS
    from hetero.cli.doctor_probes import Probe, probe_weights
    from hetero.coreml.graphs.vision import (MergerShape, MergerWeights, PatchEmbedShape, PatchEmbedWeights,
                                             VisionBlockShape, build_merger, build_patch_embed, build_vision_block)

    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    progs = {}
    for layout in ("heads", "keys_on_channels"):
        for block in (64, 16384):
            progs[f"attention {layout} {block}"] = build_attention(
                AttentionShape(hidden=64, heads=4, kv_heads=2, head_dim=32, rotary_dims=8, chunk=64, cache_slots=128,
                               eps=1e-6, key_block=block, layout=layout),
                AttentionWeights(r(128, 64), r(128, 64), r(64, 64), r(64, 64), r(32), r(32), r(64, 128)))
    progs["mlp"] = build_mlp(MLPShape(64, 128, 64, channel_block=64), MLPWeights(r(128, 64), r(128, 64), r(64, 128)))
    progs["z"] = build_gdn_in_proj(GDNInProjShape(64, 64, 64), GDNInProjWeights(r(64, 64)))
    block = VisionBlockShape(64, 4, 128, 256)
    progs["vision block"] = build_vision_block(block, probe_weights(Probe("vision_block", None, block, None), rng))
    progs["patch embed"] = build_patch_embed(PatchEmbedShape(96, 64, 256), PatchEmbedWeights(r(64, 96), r(64)))
    progs["merger"] = build_merger(MergerShape(64, 128, 4, 256), MergerWeights(r(64), r(64), r(256, 256), r(256),
                                                                             r(128, 256), r(128)))
    for name, prog in progs.items():
        report = lint_program(prog, name)
        assert report.findings == [], report.lines()
        ops = {op.op_type for f in prog.functions.values() for op in f.operations}
        assert {o for o in ops if o != "const" and not o.startswith("constexpr_")} <= ANE_OPS, name


def test_a_subnormal_epsilon_is_an_error():
    """Qwen's RMSNorm epsilon, 1e-6, is subnormal in fp16: a norm that carries it as it is gets the error (hardware
    that flushes it to zero divides a zero row by zero); the attention builder's norms carry it times 4^4."""
    from hetero.coreml.graphs.ops import FP16_TINY, norm_shift, rms_norm

    @mb.program(input_specs=spec(), opset_version=DEPLOYMENT_TARGET)
    def prog(x):
        return rms_norm(x, None, 1e-6, axis=1, name="norm")

    assert "subnormal" in lint_program(prog).rules("error")
    assert norm_shift(1e-6) == 4 and 1e-6 * 4.0**4 >= 2 * FP16_TINY and norm_shift(1e-3) == 0


def save_fp32(prog, path):
    """Save without the fp16 conversion, so the saved package keeps its fp32 compute."""
    ct.convert(prog, convert_to="mlprogram", compute_precision=ct.precision.FLOAT32,
               minimum_deployment_target=DEPLOYMENT_TARGET, skip_model_load=True).save(str(path))
    return path


def test_lint_reads_saved_packages_and_the_cli_exits_nonzero_on_errors(tmp_path, capsys):
    bad, good = tmp_path / "bad", tmp_path / "good"
    bad.mkdir()
    good.mkdir()
    save_fp32(one_op_program(dtype=types.fp32), bad / "fp32.mlpackage")
    save_program(one_op_program(), good / "relu.mlpackage")
    assert "fp16" in lint_package(bad / "fp32.mlpackage").rules("error")
    assert main(["convert", "--lint", str(bad)]) == 1
    assert "error [fp16]" in capsys.readouterr().out
    assert main(["convert", "--lint", str(good)]) == 0
    assert "0 errors" in capsys.readouterr().out


def test_cli_lint_of_an_empty_directory_is_a_one_line_error(tmp_path, capsys):
    assert main(["convert", "--lint", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("hetero: error:") and "no .mlpackage" in err and "\n" not in err


@pytest.mark.parametrize("argv", [["convert", "--coreml", "--quantize", "4", "--out", "x"]])
def test_convert_modes_are_exclusive(argv):
    with pytest.raises(SystemExit):
        main(argv)
