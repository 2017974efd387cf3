"""The vision tower's Core ML programs (patch embedding, each block, merger), exported from tiny random `qwen3_5`
checkpoints of both tower layouts and run by the reference executor, against the MLX tower's same pieces and the
whole MLX tower (cosine >= 0.9999, PSNR >= 60 dB, as the text programs): a square and a non-square image padded
to one bucket, two images packed in one bucket, padding that never reaches real patches, lint and reuse."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from hetero.coreml.backends.accuracy import compare
from hetero.coreml.backends.reference_executor import ReferenceExecutor, gelu
from hetero.coreml.backends.reference_vision import VisionPrograms, grid_inputs, pack_patches
from hetero.coreml.export_vision import export_vision
from hetero.coreml.graphs.lint import lint_package
from hetero.coreml.manifest import read_vision_manifest
from hetero.errors import HeteroError
from hetero.models.qwen3_5_vision.args import VisionArgs
from hetero.models.qwen3_5_vision.model import load_vision
from hetero.models.qwen3_5_vision.positions import interpolation, rotary_angles
from hetero.models.qwen3_5_vision.preprocess import ImageProcessor
from tests.vision_checkpoint import LAYOUTS, draw_image, save_vl

COSINE, PSNR = 0.9999, 60.0
BUCKET = 256  # both layouts' images fit (at most 256 patches); the merger's S / 4 = 64
SIZES = [(64, 64), (80, 48)]  # (width, height): square, non-square (other grids, padded in the bucket)


def assert_close(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    m = compare(ours, ref)
    assert m["cosine"] >= COSINE and m["psnr_db"] >= PSNR, f"{what}: {m}"


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def exported(request, tmp_path_factory):
    """(tower, processor, export directory, manifest) of one layout, exported once for the module."""
    path = tmp_path_factory.mktemp(f"vl-{request.param}")
    save_vl(path, request.param)
    args = VisionArgs.from_config(json.loads((path / "config.json").read_text())["vision_config"])
    tower = load_vision(args, mx.load(str(path / "model.safetensors")))
    out = path / "coreml_vision"
    return tower, ImageProcessor.from_checkpoint(path), out, export_vision(tower, out, [BUCKET])


def programs(exported) -> VisionPrograms:
    tower, _, out, _ = exported
    return VisionPrograms(out, BUCKET, tower.args, np.array(tower.pos_embed.weight))


def executor(exported, piece: str) -> ReferenceExecutor:
    out, manifest = exported[2], exported[3]
    return ReferenceExecutor(out / next(p["file"] for p in manifest["programs"] if p["piece"] == piece))


def mlx_embedded(tower, pixels: np.ndarray, grid) -> mx.array:
    """The tower's input to block 0, as `VisionModel.encode` computes it: patch embedding + resampled positions."""
    _, h, w = grid
    idx, weights = interpolation(h, w, tower.args.spatial_merge_size, tower.args.num_position_embeddings)
    pos = (tower.pos_embed.weight[idx] * weights[:, :, None]).sum(axis=1)
    return tower.patch_embed(mx.array(pixels)) + pos  # [n, D]


def fp16_exact(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def bc1s(x: np.ndarray, bucket: int) -> np.ndarray:
    return np.pad(x.T, ((0, 0), (0, bucket - x.shape[0])))[None, :, None, :].astype(np.float16)


@pytest.mark.parametrize("size", SIZES)
def test_patch_embed_program_matches_mlx(exported, size):
    tower, proc, _, _ = exported
    pixels, grid = proc(draw_image(*size))
    pixels = fp16_exact(pixels)
    ref = np.array(mlx_embedded(tower, pixels, grid))
    inputs = grid_inputs(tower.args, np.array(tower.pos_embed.weight), [grid], BUCKET)
    out = executor(exported, "patch_embed")({"patches": pack_patches(pixels, BUCKET), "pos": inputs["pos"]})["x"]
    assert_close(out[0, :, 0, : len(pixels)].T, ref, "patch embedding")


@pytest.mark.parametrize("size", SIZES)
def test_each_block_program_matches_mlx(exported, size):
    """Each block on the MLX tower's own input to it (rounded to fp16), padded to the bucket."""
    tower, proc, _, _ = exported
    a = tower.args
    pixels, grid = proc(draw_image(*size))
    x = mlx_embedded(tower, pixels, grid)
    _, h, w = grid
    angles = rotary_angles(h, w, a.spatial_merge_size, a.head_dim, a.rope_theta)
    angles = mx.concatenate([angles, angles], axis=-1)[:, None, :]
    inputs = grid_inputs(a, np.array(tower.pos_embed.weight), [grid], BUCKET)
    for i, block in enumerate(tower.blocks):
        x = mx.array(fp16_exact(x))
        ref = np.array(block(x, mx.cos(angles), mx.sin(angles), frames=1))
        feed = {"x": bc1s(np.array(x), BUCKET), **{k: inputs[k] for k in ("cos", "sin", "mask")}}
        out = executor(exported, f"block{i:02d}")(feed)
        assert_close(out["x_out"][0, :, 0, : len(pixels)].T, ref, f"block {i}")
        x = mx.array(ref)


def test_merger_program_matches_mlx(exported):
    tower, proc, _, _ = exported
    pixels, grid = proc(draw_image(*SIZES[1]))
    rng = np.random.default_rng(0)
    x = fp16_exact(rng.standard_normal((len(pixels), tower.args.hidden_size)) * 2)
    ref = np.array(tower.merger(mx.array(x)))
    out = executor(exported, "merger")({"x": bc1s(x, BUCKET)})["out"]
    assert_close(out[0, :, 0, : len(pixels) // tower.args.merge_unit].T, ref, "merger")


@pytest.mark.parametrize("size", SIZES)
def test_whole_tower_through_the_programs_matches_mlx(exported, size):
    tower, proc, _, _ = exported
    pixels, grid = proc(draw_image(*size))
    ref = np.array(tower(mx.array(pixels), [grid]))
    ours = programs(exported).run(pixels, [grid])
    assert ours.shape == ref.shape
    assert_close(ours, ref, "tower")


def test_two_images_packed_in_one_bucket_never_see_each_other(exported):
    """Two images in one bucket (the mask keeps each to itself) give the MLX tower's embeddings of both."""
    tower, proc, _, _ = exported
    (a, ga), (b, gb) = proc(draw_image(32, 32, seed=1)), proc(draw_image(48, 32, seed=2))
    pixels = np.concatenate([a, b])
    ref = np.array(tower(mx.array(pixels), [ga, gb]))
    assert_close(programs(exported).run(pixels, [ga, gb]), ref, "two images")


def test_padding_never_changes_real_patches(exported):
    """Whatever the padding patches hold, the real patches' outputs are bit for bit the same."""
    tower, proc, _, _ = exported
    pixels, grid = proc(draw_image(*SIZES[1]))
    n = len(pixels)
    assert n < BUCKET
    inputs = grid_inputs(tower.args, np.array(tower.pos_embed.weight), [grid], BUCKET)
    block = executor(exported, "block00")
    rng = np.random.default_rng(1)
    x = bc1s(rng.standard_normal((n, tower.args.hidden_size)), BUCKET)
    noisy = x.copy()
    noisy[..., n:] = (rng.standard_normal(noisy[..., n:].shape) * 100).astype(np.float16)
    feed = {k: inputs[k] for k in ("cos", "sin", "mask")}
    clean, dirty = block({"x": x, **feed})["x_out"], block({"x": noisy, **feed})["x_out"]
    np.testing.assert_array_equal(dirty[..., :n], clean[..., :n])
    assert np.isfinite(dirty).all()


def test_programs_pass_the_ane_lint(exported):
    out, manifest = exported[2], exported[3]
    assert len(manifest["programs"]) == len(exported[0].blocks) + 2
    for p in manifest["programs"]:
        report = lint_package(out / p["file"])
        assert not report.errors, report.lines()


def test_reexport_reuses_every_unchanged_package_and_rebuilds_a_changed_one(exported, tmp_path):
    tower, _, out, first = exported
    again = export_vision(tower, out, [BUCKET])
    assert all(p["reused"] for p in again["programs"])
    assert [p["key"] for p in again["programs"]] == [p["key"] for p in first["programs"]]
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    bias = tower.blocks[0].norm1.bias
    try:
        tower.blocks[0].norm1.bias = bias + 0.5
        changed = export_vision(tower, copy, [BUCKET])
    finally:
        tower.blocks[0].norm1.bias = bias
    assert [p["piece"] for p in changed["programs"] if not p["reused"]] == ["block00"]
    assert read_vision_manifest(copy)["programs"][1]["key"] != first["programs"][1]["key"]


def test_bad_buckets_and_too_many_patches_are_one_line(exported):
    tower, proc, _, _ = exported
    with pytest.raises(HeteroError, match="multiple of 256 patches"):
        export_vision(tower, exported[2] / "bad", [320])
    pixels, grid = proc(draw_image(*SIZES[0]))
    copies = BUCKET // len(pixels) + 1
    with pytest.raises(HeteroError, match="do not fit the vision bucket of 256"):
        programs(exported).run(np.concatenate([pixels] * copies), [grid] * copies)


@pytest.mark.parametrize("mode", ["EXACT", "TANH_APPROXIMATION", "SIGMOID_APPROXIMATION"])
def test_gelu_equals_coremltools_value_inference(mode):
    """The executor's gelu (its own erf for EXACT) against coremltools' numpy semantics, both rounded to fp16."""
    from coremltools.converters.mil.mil.ops.defs.iOS15.activation import gelu as mil_gelu

    x = np.concatenate([np.linspace(-8, 8, 4001), np.random.default_rng(0).standard_normal(4000) * 3])
    x = x.astype(np.float16).astype(np.float32)
    shim = type("Shim", (), {"_input_types": {}, "x": type("V", (), {"val": x.astype(np.float64)})(),
                             "mode": type("V", (), {"val": mode})()})()
    want = np.asarray(mil_gelu.value_inference(shim)).astype(np.float16)
    ours = gelu(x, mode).astype(np.float16)
    assert (np.abs(ours.astype(np.float32) - want) <= np.spacing(np.abs(want))).all()
    assert (ours == want).mean() >= 0.99


RESIDUAL_WRITERS = ("patch_embed.proj", "pos_embed", "attn.proj", "mlp.linear_fc2")  # what adds into the residual


def residual_max(tower, pixels: np.ndarray, grid) -> float:
    """The largest |value| the MLX tower's residual stream holds (block inputs and the merger's input)."""
    a = tower.args
    _, h, w = grid
    x = mlx_embedded(tower, pixels, grid)
    angles = rotary_angles(h, w, a.spatial_merge_size, a.head_dim, a.rope_theta)
    angles = mx.concatenate([angles, angles], axis=-1)[:, None, :]
    largest = float(mx.abs(x).max())
    for block in tower.blocks:
        x = block(x, mx.cos(angles), mx.sin(angles), frames=1)
        largest = max(largest, float(mx.abs(x).max()))
    return largest


def with_residual_scaled(tower, k: float):
    """The tower with every weight that writes into the residual stream times k: its residual is k times the
    original's everywhere, and (LayerNorm being scale-invariant up to its epsilon) its embeddings nearly the same."""
    from mlx.utils import tree_flatten

    from hetero.models.qwen3_5_vision.model import VisionModel

    params = [(n, p * k if any(w in n for w in RESIDUAL_WRITERS) else p) for n, p in tree_flatten(tower.parameters())]
    out = VisionModel(tower.args)
    out.load_weights(params, strict=True)
    return out


@pytest.mark.parametrize("target", [6000.0, 40000.0])  # past the old LayerNorm's 4096 bound, and near fp16's end
def test_programs_hold_a_residual_up_to_fp16s_range(exported, target, tmp_path):
    """Real ViTs carry residual outliers in the thousands: a tower whose residual reaches `target` (its residual
    writers scaled) runs through its programs without overflow and matches the MLX tower within the verify
    tolerance (`vision_lane.COSINE` / `PSNR`)."""
    from hetero.pipeline.vision_lane import COSINE as VERIFY_COSINE, PSNR as VERIFY_PSNR

    tower, proc, _, _ = exported
    pixels, grid = proc(draw_image(*SIZES[1]))
    k = target / residual_max(tower, pixels, grid)
    big = with_residual_scaled(tower, k)
    assert target * 0.99 < residual_max(big, pixels, grid) < 65504
    export_vision(big, tmp_path, [BUCKET])
    ours = VisionPrograms(tmp_path, BUCKET, big.args, np.array(big.pos_embed.weight)).run(pixels, [grid])
    ref = np.array(big(mx.array(pixels), [grid]))
    assert np.isfinite(ours).all(), f"{int((~np.isfinite(ours)).sum())} non-finite embedding values"
    m = compare(ours, ref)
    assert m["cosine"] >= VERIFY_COSINE and m["psnr_db"] >= VERIFY_PSNR, m


def test_layer_norm_is_exact_for_any_row_in_fp16s_range(tmp_path):
    """The programs' LayerNorm on rows from zero (padding) through tiny ones (where the 1e-6 epsilon counts) to an
    outlier of 60000, against float64 LayerNorm with the same epsilon: each row within a few fp16 roundings of its
    largest output, a zero row exactly beta, and the epsilon counted where it matters."""
    from coremltools.converters.mil import Builder as mb

    from hetero.coreml.graphs.ops import build_program
    from hetero.coreml.graphs.package import save_program
    from hetero.coreml.graphs.vision import VISION_EPS, layer_norm

    C, S = 48, 64
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((S, C))
    rows *= np.geomspace(3e-4, 3e3, S)[:, None]  # spread from below the epsilon's scale to past 4096
    rows[0] = 0.0  # a padding row
    rows[1] = 2e-3 * rows[1] / np.abs(rows[1]).max()  # variance near the epsilon
    rows[2, 5] = 60000.0  # one outlier near fp16's end
    rows[3] = 8.0 + rng.standard_normal(C)  # a common offset (LayerNorm centres it)
    x = fp16_exact(rows)
    gamma, beta = 1 + 0.1 * rng.standard_normal(C), 0.1 * rng.standard_normal(C)
    prog = build_program({"x": (1, C, 1, S)}, lambda inp: {
        "y": mb.identity(x=layer_norm(inp["x"], gamma, beta, VISION_EPS, "ln"), name="y_out")})
    save_program(prog, tmp_path / "ln.mlpackage")
    ours = ReferenceExecutor(tmp_path / "ln.mlpackage")({"x": x.T[None, :, None, :].astype(np.float16)})["y"]
    ours = ours[0, :, 0, :].T  # [S, C]
    xd = x.astype(np.float64)
    centred = xd - xd.mean(axis=1, keepdims=True)
    want = centred / np.sqrt((centred**2).mean(axis=1, keepdims=True) + VISION_EPS) * gamma + beta
    assert np.isfinite(ours).all()
    err = np.abs(ours - want).max(axis=1) / np.abs(want).max(axis=1)  # per row, relative to its largest output
    assert err.max() < 2**-9, (err.argmax(), err.max())  # a few fp16 roundings
    np.testing.assert_array_equal(ours[0], fp16_exact(beta))  # a zero row gives beta
    no_eps = centred[1] / np.sqrt((centred[1] ** 2).mean()) * gamma + beta
    assert np.abs(no_eps - want[1]).max() > 50 * err[1] * np.abs(want[1]).max()  # where the epsilon counts


def test_programs_of_an_older_builder_are_exported_again(exported, tmp_path):
    """`ensure_vision_export` (the lane's first use) reuses a current export as it is, and exports again the
    programs of an older builder version (version 1's LayerNorm overflowed past 4096), never running them."""
    from hetero.coreml.export_vision import VISION_BUILDER_VERSION
    from hetero.pipeline.vision_lane import ensure_vision_export

    tower, _, out, _ = exported
    copy = tmp_path / "vision"
    shutil.copytree(out, copy)
    stamp = (copy / "vision.json").stat().st_mtime_ns
    assert ensure_vision_export(tower, copy, BUCKET) == copy and (copy / "vision.json").stat().st_mtime_ns == stamp
    old = json.loads((copy / "vision.json").read_text())
    old["builder_version"] = 1
    for p in old["programs"]:
        p["key"] = "written by builder version 1"
    (copy / "vision.json").write_text(json.dumps(old))
    ensure_vision_export(tower, copy, BUCKET)
    again = read_vision_manifest(copy)
    assert again["builder_version"] == VISION_BUILDER_VERSION and not any(p["reused"] for p in again["programs"])
