"""`hetero tune` (the draft-depth tuner) and the settings it saves: the saved choice is the one it measured, a saved
"off" makes `run` decode plainly, a saved depth makes it draft at that depth."""

from __future__ import annotations

import json
import types

import pytest

import hetero
from hetero.cli.main import main
from hetero.cli.tune import PROMPTS, tune
from hetero.decode.depth_calibration import calibrate
import hetero.engine
from hetero.host.settings import PLAIN, save_tuning, settings_path, tuned_depth
from tiny_checkpoint import write_tiny_model


@pytest.fixture(autouse=True)
def private_settings(tmp_path, monkeypatch):
    """Each test reads and writes its own settings file, and first use runs the real calibration (the session's
    is pinned in conftest.py)."""
    monkeypatch.setenv("HETERO_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(hetero.engine, "calibrate", calibrate)


class FakeEngine:
    """Answers `generate` with fixed decode speeds per setting (plain, or MTP at a depth): timing made exact."""

    def __init__(self, plain_tps: float, depth_tps: dict[int, float]):
        self.plain_tps, self.depth_tps = plain_tps, depth_tps
        self.identity, self.name = "fake@0", "fake"
        self.calls = []

    def generate(self, prompt, max_tokens, temperature=0.0, mtp=None, draft_depth=None, **kw):
        self.calls.append((prompt, mtp, draft_depth))
        if not mtp:
            return types.SimpleNamespace(stats={"decode_tps": self.plain_tps})
        stats = {"decode_tps": self.depth_tps[draft_depth], "mtp": {"mean_accepted_length": 1.0 + draft_depth / 2}}
        return types.SimpleNamespace(stats=stats)


def saved(identity: str) -> dict:
    from hetero.host.settings import machine_id

    return json.loads(settings_path().read_text())[machine_id()][identity]


def test_tune_saves_the_depth_it_measured_fastest():
    engine = FakeEngine(100.0, {1: 120.0, 2: 150.0, 3: 140.0, 4: 90.0})
    result = tune(engine, tokens=16, report=lambda line: None)
    assert result["draft_depth"] == 2 and tuned_depth("fake@0") == 2
    assert saved("fake@0")["depths"]["2"]["decode_tps"] == 150.0 and saved("fake@0")["plain_tps"] == 100.0
    measured = [c for c in engine.calls if c[0] in PROMPTS]
    assert {(mtp, d) for _, mtp, d in measured} >= {(False, None), (True, 1), (True, 2), (True, 3), (True, 4)}


def test_tune_saves_off_when_plain_decoding_wins():
    engine = FakeEngine(200.0, {1: 120.0, 2: 150.0, 3: 199.0, 4: 90.0})
    save_tuning("fake@0", {"draft_depth": 3})  # an earlier tune's winner must not survive a new measurement
    result = tune(engine, tokens=16, report=lambda line: None)
    assert result["draft_depth"] == PLAIN and tuned_depth("fake@0") == PLAIN
    assert saved("fake@0")["draft_depth"] == "off"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tune") / "m")


def run_json(model_dir, capsys, *extra: str) -> dict:
    assert main(["run", "--model", str(model_dir), "--prompt", "def add(a, b):", "--max-tokens", "8", "--json",
                 *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("plain_tps, drafted_tps, choice", [(100.0, 130.0, 3), (100.0, 99.0, PLAIN)])
def test_first_use_calibration_saves_the_faster(plain_tps, drafted_tps, choice):
    """The decision alone, with the stepper's decoding replaced by fixed speeds (its real timing is in the next
    test): the faster is saved as a first-use calibration, after one decode of each kind and no other."""
    engine, calls = FakeEngine(plain_tps, {3: drafted_tps}), []

    def decode(depth: int, n: int) -> tuple[float, float | None]:
        calls.append(depth)
        return (drafted_tps, 2.5) if depth else (plain_tps, None)

    assert calibrate(engine, 3, report=lambda line: None, decode=decode) == choice
    assert tuned_depth("fake@0") == choice and saved("fake@0")["calibrated"] == "first use"
    assert sorted(set(calls)) == [0, 3] and engine.calls == []  # never through Engine.generate


def test_an_untuned_run_calibrates_once_then_follows_what_it_measured(model_dir, capsys):
    identity = hetero.load(model_dir).identity
    assert tuned_depth(identity) is None
    assert main(["run", "--model", str(model_dir), "--prompt", "def add(a, b):", "--max-tokens", "8", "--json"]) == 0
    out, err = capsys.readouterr()
    first = json.loads(out)
    assert "measuring MTP against plain decoding" in err  # the user is told why the first run takes longer
    entry = saved(identity)
    assert entry["calibrated"] == "first use"
    measured_mtp_faster = entry["depths"]["3"]["decode_tps"] > entry["plain_tps"]
    assert entry["draft_depth"] == (3 if measured_mtp_faster else PLAIN)
    assert ("mtp" in first) == measured_mtp_faster  # the first run already decodes as measured
    assert main(["run", "--model", str(model_dir), "--prompt", "def add(a, b):", "--max-tokens", "8", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "measuring" not in err and saved(identity) == entry  # measured once
    assert json.loads(out)["tokens"] == first["tokens"]


def test_run_follows_the_saved_choice(model_dir, capsys):
    identity = hetero.load(model_dir).identity
    save_tuning(identity, {"draft_depth": 3})
    assert run_json(model_dir, capsys)["mtp"]["depth"] == 3
    save_tuning(identity, {"draft_depth": 2})
    assert run_json(model_dir, capsys)["mtp"]["depth"] == 2
    save_tuning(identity, {"draft_depth": PLAIN})
    plain = run_json(model_dir, capsys)
    assert "mtp" not in plain  # decoded plainly
    assert run_json(model_dir, capsys, "--draft-depth", "1")["mtp"]["depth"] == 1  # asked for: MTP after all
    assert run_json(model_dir, capsys, "--no-mtp")["tokens"] == plain["tokens"]


def test_tune_on_a_tiny_model_saves_what_it_measured(model_dir):
    engine = hetero.load(model_dir)
    result = tune(engine, depths=(1, 2), tokens=12, report=lambda line: None)
    best = max(result["depths"], key=lambda d: result["depths"][d]["decode_tps"])
    expected = best if result["depths"][best]["decode_tps"] > result["plain_tps"] else PLAIN
    assert result["draft_depth"] == expected and tuned_depth(engine.identity) == expected
    assert all(v["mean_accepted_length"] >= 1.0 for v in result["depths"].values())


# ----------------------------------------------------------------------------------------------------------
# Qwen4-Exp: the same tuner and first-use calibration on a qwen4_exp checkpoint (hyper-connection streams, QSA, PLE,
# and its own MTP head), with the random head (its drafts rejected) and with a head built to agree with the model


@pytest.fixture(scope="module")
def qwen4_dir(tmp_path_factory):
    import qwen4_checkpoint as qc

    path = tmp_path_factory.mktemp("tune-qwen4") / "q4"
    qc.build(path, nested=True, ple_layer_ids=(1, 2), seed=0, mtp=True)
    qc.add_tokenizer(path)
    return path


def test_tune_cli_on_qwen4_saves_plain_when_its_head_is_rejected(qwen4_dir, capsys):
    """`hetero tune` on a qwen4_exp checkpoint whose random head keeps no draft on the tune prompts: every depth is
    measured, none may win (a head that keeps nothing cannot pay), "off" is saved and `hetero run` decodes plainly."""
    assert main(["tune", "--model", str(qwen4_dir), "--tokens", "12"]) == 0
    assert "plain decoding was fastest" in capsys.readouterr().out
    entry = saved(hetero.load(qwen4_dir).identity)
    assert sorted(entry["depths"]) == ["1", "2", "3", "4"]
    assert all(d["mean_accepted_length"] == 1.0 for d in entry["depths"].values())  # the head's drafts: all rejected
    assert entry["draft_depth"] == PLAIN
    assert "mtp" not in run_json(qwen4_dir, capsys)


def test_first_use_calibration_on_qwen4_with_a_rejected_head_decodes_plainly(qwen4_dir, capsys):
    """An untuned qwen4_exp run calibrates through the stepper (plain against depth 3 on the code prompt) and, its
    head's drafts rejected, saves plain decoding and decodes plainly from the first run on."""
    first = run_json(qwen4_dir, capsys)
    entry = saved(hetero.load(qwen4_dir).identity)
    assert entry["calibrated"] == "first use" and entry["depths"]["3"]["mean_accepted_length"] == 1.0
    assert entry["draft_depth"] == PLAIN and "mtp" not in first


def test_tune_on_qwen4_with_an_agreeing_head_measures_what_it_saves(qwen4_dir):
    """The head built to agree with the backbone (tests/test_qwen4_mtp.py `agreeing`): every depth keeps most drafts
    (so each may win), and the saved choice is the fastest measured, or plain where plain was faster."""
    from test_qwen4_mtp import agreeing

    engine = hetero.load(qwen4_dir)
    agreeing(engine.model, alpha=0.02)
    result = tune(engine, depths=(1, 2, 3), tokens=16, report=lambda line: None)
    assert all(result["depths"][d]["mean_accepted_length"] > 1 + 0.6 * d for d in (1, 2, 3))
    best = max(result["depths"], key=lambda d: result["depths"][d]["decode_tps"])
    expected = best if result["depths"][best]["decode_tps"] > result["plain_tps"] else PLAIN
    assert result["draft_depth"] == expected and tuned_depth(engine.identity) == expected
