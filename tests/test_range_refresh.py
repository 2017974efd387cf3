"""Activation ranges that follow the prompts: the GPU lane tracks the largest values of every split piece on the
chunks it runs and merges growth into ranges.json; a prompt that still drives a program past fp16 (a token the
calibration text never held, `outliers.inject_trigger`) falls back to GPU-only once, is measured on the GPU lane,
and the split is re-planned so the next such prompt stays on the lane (hetero/planner/ranges.py)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import hetero
from hetero.errors import AneNonFinite
from hetero.pipeline import configure, load_programs
import hetero.pipeline.calibrate as calibrate_module
from hetero.pipeline.calibrate import RANGES_FILE, calibrate, plan_shares
from hetero.pipeline.run import calibration_ids
from hetero.planner.ranges import REFRESH_GROWTH, SAFE, PieceRange, Ranges
from outliers import TRIGGER, TRIGGER_CHANNEL, save_trigger_checkpoint

PROMPT = "def add(a, b):\n    return a @ b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n" * 2
AGAIN = "class Matrix:\n    def __matmul__(self, other):\n        return self.rows @ other\n" * 2  # the trigger again
PLAIN = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n" * 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_trigger_checkpoint(tmp_path_factory.mktemp("trigger") / "ckpt")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """Exports and ranges of this test alone."""
    monkeypatch.setenv("HETERO_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _saved(home) -> Ranges:
    (file,) = home.rglob(RANGES_FILE)
    return Ranges.from_dict(json.loads(file.read_text())["ranges"])


def _generate(engine, prompt: str, split=None) -> list[int]:
    return engine.generate(prompt, max_tokens=8, mtp=False, split=split, use_prefix_cache=False).tokens


def test_a_prompt_past_the_calibration_falls_back_once_and_the_split_is_replanned(checkpoint, home, capsys):
    """The calibration text never holds the trigger token, so the channel it drives past 1e6 goes to the ANE. The
    first prompt holding it: its program returns inf, the prompt gives exactly the GPU-only tokens, one warning line
    says the split was re-planned, and ranges.json now keeps that channel's block on the GPU lane. The next prompt
    holding it (another text) stays on the lane with no failure and gives the GPU-only tokens; only the re-planned
    layer's MLP program was exported again, and a new split of the checkpoint (a later `hetero run`) plans with
    the grown ranges."""
    engine = hetero.load(checkpoint, mx.float32)
    token = engine.tokenizer.encode(TRIGGER)[0]
    assert token not in calibration_ids(engine) and token in engine.encode_prompt(PROMPT, False)
    run = configure(engine, 0.5, 64)
    share = next(s for s in run.plan.slices if s.layer == 0 and s.piece == "mlp")
    assert TRIGGER_CHANNEL in run.plan.ranges.get(0, "mlp").channels(0, share.stop)  # the calibration missed it
    before = _saved(home).get(0, "mlp")
    assert max(before.block_max) < SAFE
    capsys.readouterr()

    assert _generate(engine, PROMPT, run) == _generate(engine, PROMPT)
    assert run.lane_failures == 1 and "non-finite" in run.last_failure and run.replans == 1
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "prefilled GPU-only" in warnings[0] and "re-planned" in warnings[0], warnings
    grown = _saved(home).get(0, "mlp")
    block = TRIGGER_CHANNEL // grown.block
    assert grown.block_max[block] > 1e6 and grown.order[-1] == block and grown.safe_units == before.safe_units - 64
    assert all(g >= b for g, b in zip(grown.block_max, before.block_max))
    assert TRIGGER_CHANNEL not in run.plan.ranges.get(0, "mlp").channels(0, share.stop)

    assert _generate(engine, AGAIN, run) == _generate(engine, AGAIN)
    assert run.lane_failures == 1 and run.last is not None  # the split prefilled it, on the lane
    (export,) = [d for d in run._exports.values()]
    rebuilt = [p["file"] for p in json.loads((export / "manifest.json").read_text())["programs"] if not p["reused"]]
    assert rebuilt == ["layer00_mlp_part0.mlpackage"], rebuilt
    assert configure(engine, 0.5, 64).plan.ranges.digest() == run.plan.ranges.digest()


def test_the_gpu_lane_tracks_each_piece_and_merges_growth(checkpoint, home):
    """On a prompt without the trigger, the largest normed input the GPU lane tracks per piece equals the
    calibration's measurement of the same prompt (within fp16's rounding past the first piece, whose merged shares
    the split's stream holds), and the largest ANE output the calibration's fp32 one within fp16's rounding;
    saved ranges smaller than them by more than the refresh margin grow to hold them."""
    engine = hetero.load(checkpoint, mx.float32)
    run = configure(engine, 0.5, 64, lane="thread")
    file = next(home.rglob(RANGES_FILE))
    saved = json.loads(file.read_text())
    for p in saved["ranges"]["pieces"]:  # as if calibrated on tamer text: a quarter of every value
        p["input_max"] /= 4
        p["out_max"] /= 4
    file.write_text(json.dumps(saved))
    run = configure(engine, 0.5, 64, lane="thread")
    ids = engine.encode_prompt(PLAIN, False)
    run.prefill(ids)
    assert run.lane_failures == 0 and run.last is not None
    seen = run._splits[next(iter(run._splits))].observed()
    measured = calibrate(engine.model, ids[:-1], plan_shares(run.unranged), prior=run.plan.ranges)
    assert set(seen) == set(measured.pieces)
    for key, (x, out) in seen.items():
        r = measured.get(*key)
        # the first piece reads the model's own values; later ones a stream the ANE's fp16 shares were merged into
        assert x == pytest.approx(r.input_max, rel=1e-6 if key == min(seen) else 1e-3), key
        if key[1] != "attention":
            assert out == pytest.approx(r.out_max, rel=1e-2), key
    after = _saved(home)
    for key, (x, out) in seen.items():
        assert after.get(*key).input_max >= x and after.get(*key).out_max >= out, key


def test_an_in_thread_program_that_returns_nan_names_its_piece(checkpoint, home, monkeypatch):
    """The in-thread lane checks its programs' outputs as the worker does: a NaN (`ane_faults.garbage`, the reference
    executor's outputs replaced at its first job) raises `AneNonFinite` naming the program's layer and piece, which
    the split re-measures."""
    import ane_faults

    engine = hetero.load(checkpoint, mx.float32)
    run = configure(engine, 0.5, 64, lane="thread")
    run.splitter(100)
    monkeypatch.setenv("HETERO_TEST_FAULT_AT", "1")
    monkeypatch.setattr(ane_faults, "_JOBS", [0])
    programs = load_programs(next(iter(run._exports.values())), ane_faults.garbage, check=True)
    (program, _), *_ = programs.mlp[2]
    with pytest.raises(AneNonFinite, match="non-finite") as e:
        program({"x": np.ones((1, engine.model.args.hidden_size, 1, 64), np.float32)})
    assert (e.value.layer, e.value.piece) == (2, "mlp")


def test_ranges_merge_monotonically():
    """Merging two measurements holds both: every largest value at least either's, the safe channels at most
    either's, the output shift at least either's; the blocks past SAFE in either go last. Growth under the refresh
    margin is not merged."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        a, b = (PieceRange.by_blocks(512, 64, float(rng.uniform(1, 20)), (10 ** rng.uniform(0, 5, 8)).tolist())
                for _ in range(2))
        a.out_max, b.out_max = float(10 ** rng.uniform(0, 5)), float(10 ** rng.uniform(0, 5))
        m = Ranges({(0, "mlp"): a}, 512).merge(Ranges({(0, "mlp"): b}, 64)).get(0, "mlp")
        for r in (a, b):
            assert m.input_max >= r.input_max and m.out_max >= r.out_max and m.out_shift >= r.out_shift
            assert m.safe_units <= r.safe_units and all(x >= y for x, y in zip(m.block_max, r.block_max))
        unsafe = {i for i, v in enumerate(np.maximum(a.block_max, b.block_max)) if v >= SAFE}
        assert set(m.order[len(m.order) - len(unsafe):] if unsafe else []) == unsafe
        assert m.out_max * 2.0**-m.out_shift <= SAFE
    r = Ranges({(0, "mlp"): PieceRange(512, 512, 10.0, 5.0, 100.0)}, 512)
    assert r.grown({(0, "mlp"): (10.0 * REFRESH_GROWTH, 100.0)}) is None
    assert r.grown({(0, "mlp"): (10.0, 100.0 * REFRESH_GROWTH * 1.01)}).get(0, "mlp").out_max > 100.0


def test_a_damaged_ranges_file_is_never_trusted(checkpoint, home, monkeypatch, capsys):
    """ranges.json cut in half (a copy or a crash that wrote it in place) is said in one warning line and measured
    again; a write that fails before its rename leaves the saved file as it was and no temporary behind."""
    engine = hetero.load(checkpoint, mx.float32)
    first = configure(engine, 0.5, 64)
    file = next(home.rglob(RANGES_FILE))
    good = file.read_text()
    file.write_text(good[: len(good) // 2])
    real, calls = calibrate_module.calibrate, []
    monkeypatch.setattr(calibrate_module, "calibrate", lambda *a, **k: calls.append(a) or real(*a, **k))
    capsys.readouterr()
    again = configure(engine, 0.5, 64)
    assert len(calls) == 1 and again.plan.ranges.to_dict() == first.plan.ranges.to_dict()
    err = [line for line in capsys.readouterr().err.splitlines() if "damaged" in line]
    assert len(err) == 1 and err[0].startswith("warning:") and "measured again" in err[0]
    assert json.loads(file.read_text())["ranges"] == first.plan.ranges.to_dict()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(calibrate_module.os, "replace", crash)
    grown = Ranges({k: PieceRange(**{**vars(r), "input_max": r.input_max * 8}) for k, r in
                    again.plan.ranges.pieces.items()}, again.plan.ranges.tokens)
    with pytest.raises(OSError):
        calibrate_module.merge_ranges(file.parent, again.unranged, again.range_tokens, grown)
    assert json.loads(file.read_text())["ranges"] == first.plan.ranges.to_dict()
    assert not list(file.parent.glob("*.tmp"))
