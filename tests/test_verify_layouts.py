"""`--verify` judged by the run's own rounding (`hetero/pipeline/verification.py`) on random checkpoints of every supported
layout, in the Mac's half-precision dtypes: every honest split passes, and each documented defect (an MLP or
shared-expert program losing half its output, a GDN z program returning zeros) fails, in each dtype.

Before, one fixed tolerance per dtype rejected honest bf16 splits of these layouts (0.042-0.067 against 0.036) and
could not see an MLP program losing half its output in bf16 at all."""

from __future__ import annotations

import types

import mlx.core as mx
import numpy as np
import pytest

from hetero.checkpoint.loader import load_model
from hetero.pipeline import configure, verify
import hetero.pipeline.verification as verify_module
from helpers import save_flat, save_nested, save_next
from test_pipeline_moe import write_moe_checkpoint

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
def _four_bit(path):
    """`hetero convert --quantize 4` of a random flat checkpoint (the case whose bf16 GPU-only run itself lay 0.135
    from fp32, which the fixed tolerance could not know)."""
    from hetero.cli.quantize import quantize_checkpoint

    save_flat(path.with_name(path.name + "-float"), tie=False, seed=5)
    return quantize_checkpoint(str(path.with_name(path.name + "-float")), path, bits=4, group_size=32)


WRITERS = {
    "qwen3_5_text": lambda p: save_flat(p, tie=False),
    "qwen3_5_text 4-bit": _four_bit,
    "qwen3_5": lambda p: save_nested(p),
    "qwen3_next": lambda p: save_next(p),
    "qwen3_5_moe": lambda p: write_moe_checkpoint(p),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify-layouts")
    paths = {}
    for name, write in WRITERS.items():
        write(root / name)
        paths[name] = root / name
    return paths


def _engine(path, dtype):
    model, path, config = load_model(path, dtype=dtype)
    # named as an Engine names it (no dtype): a checkpoint's bf16 and fp16 runs share its exported programs
    return types.SimpleNamespace(model=model, config=config, path=path, name=str(path), identity=f"verify-{path.name}")


def _broken(programs: dict, factor: float):
    """The first layer's first program of a piece kind, its outputs scaled by `factor` (0: zeros, 0.5: half)."""
    layer = sorted(programs)[0]
    run, *rest = programs[layer][0]
    programs[layer][0] = (lambda feed, p=run: {k: v * factor for k, v in p(feed).items()}, *rest)
    return lambda: programs[layer].__setitem__(0, (run, *rest))


# MLX's CPU backend runs `gather_mm` (the routed experts) in fp32 only: the MoE layout is checked in fp32 here, the
# dense layouts in the Mac's half-precision dtypes (fp32 splits of each are tested in test_pipeline*.py).
CASES = [(layout, dtype) for layout in WRITERS if layout != "qwen3_5_moe" for dtype in ("bfloat16", "float16")
         if not (layout.endswith("4-bit") and dtype == "float16")]  # 4-bit: the Mac's bf16


@pytest.mark.parametrize("layout, dtype", CASES + [("qwen3_5_moe", "float32")])
def test_honest_splits_pass_and_defects_fail_in_every_dtype(checkpoints, layout, dtype):
    engine = _engine(checkpoints[layout], DTYPES[dtype])
    ids = np.random.default_rng(4).integers(0, engine.model.args.vocab_size, 150).tolist()  # 3 chunks, the last padded
    run = configure(engine, 0.5, 64)
    honest = verify(run, ids, n_tokens=4)
    assert honest["match"] and honest["reference"] == "fp32", honest
    assert honest["distance"] <= honest["tolerance"]
    progs = run.splitter(len(ids)).programs
    mlp = progs.mlp or progs.shared_expert  # an MoE layer's shared expert runs the MLP program
    assert mlp and progs.gdn_in_proj
    for programs, factor in ((mlp, 0.5), (progs.gdn_in_proj, 0.0)):
        restore = _broken(programs, factor)
        check = verify(run, ids, n_tokens=1)  # the arrays decide here, not greedy
        restore()
        assert not check["match"] and check["distance"] > check["tolerance"], (factor, check)


def test_the_reference_is_the_loaded_weights_widened(checkpoints):
    """The fp32 reference holds exactly the bf16 model's values (not the checkpoint's fp32 ones), so only the
    arithmetic's rounding is measured; it is made once per reference, and kept by it (not on the engine)."""
    engine = _engine(checkpoints["qwen3_5_text"], mx.bfloat16)
    fp32 = verify_module.FP32Reference(engine)
    copy = fp32.model()
    assert copy is fp32.model() and copy is not engine.model
    assert set(vars(engine)) == {"model", "config", "path", "name", "identity"}  # nothing stored on the engine
    from mlx.utils import tree_flatten

    ours, theirs = dict(tree_flatten(engine.model.parameters())), dict(tree_flatten(copy.parameters()))
    assert ours.keys() == theirs.keys()
    for name, a in ours.items():
        b = theirs[name]
        assert b.dtype == (mx.float32 if mx.issubdtype(a.dtype, mx.floating) else a.dtype), name
        np.testing.assert_array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)), err_msg=name)


def test_auto_releases_the_reference(tmp_path, monkeypatch):
    """`--ane-fraction auto` in bf16 verifies its calibration prompt against an fp32 copy of the model, then lets it
    go: a server that chose its fraction holds no second model."""
    import hetero
    from hetero.host.settings import save_device_profile
    from hetero.host.confidence import Estimate
    from hetero.pipeline import auto_fraction
    from tiny_checkpoint import write_tiny_model

    monkeypatch.setenv("HETERO_HOME", str(tmp_path))
    save_device_profile({"name": "this-machine", "chip": "test", "source": "test", "measured": True,
                         "memory_bandwidth_gbs": 10.0, "gpu_fp32_tflops": 0.01, "ane_fp16_tflops": 0.01,
                         "ane_bandwidth_gbs": None, "ram_gb": 8, "gpu_efficiency": 1.0, "ane_efficiency": 1.0,
                         "ane_process_weight_limit_gb": None})
    engine = hetero.load(write_tiny_model(tmp_path / "ckpt"), mx.bfloat16)
    copies = []
    real = verify_module.fp32_copy
    monkeypatch.setattr(verify_module, "fp32_copy", lambda model: copies.append(1) or real(model))
    # the split's TTFT against GPU-only's is scripted a win (its timing decision is tests/test_auto.py's subject)
    run = auto_fraction(engine, 64, report=lambda line: None, time_ttft=lambda run, ids: Estimate.of([0.8, 0.82] * 3))
    assert run.fraction > 0 and copies == [1]  # verified against one copy, made once
    assert not hasattr(engine, "_fp32_reference") and not hasattr(engine, "_fp32_truth")


def test_no_room_for_the_reference_falls_back_to_the_dtype_table(checkpoints, monkeypatch):
    """Where an fp32 copy would not fit in memory, verify says so and applies the dtype's fixed tolerance; an fp32
    model needs no copy (it is its own reference) and `--verify-tol` always means the fixed comparison."""
    from hetero.pipeline.verify_tolerance import verify_tolerance

    monkeypatch.setattr(verify_module, "physical_memory_bytes", lambda: 1 << 20)
    engine = _engine(checkpoints["qwen3_5_text"], mx.bfloat16)
    ids = np.random.default_rng(5).integers(0, engine.model.args.vocab_size, 100).tolist()
    check = verify(configure(engine, 0.5, 64), ids, n_tokens=2)
    assert check["reference"].startswith("dtype table") and check["tolerance"] == verify_tolerance(mx.bfloat16)
    assert check["gpu_distance"] == 0.0  # the GPU-only run is the reference: one distance, the split's from it
    fp32 = _engine(checkpoints["qwen3_5_text"], mx.float32)
    assert verify(configure(fp32, 0.5, 64), ids, n_tokens=2)["reference"] == "fp32"
    fixed = verify(configure(fp32, 0.5, 64), ids, tol=0.5, n_tokens=2)
    assert fixed["reference"] == "--verify-tol" and fixed["tolerance"] == 0.5 and fixed["match"]
