"""`hetero tune` (the draft-depth tuner), the first-use calibration and the settings they save: the saved verdict is
the one measured beyond the noise (with its interval and samples), a verdict inside the noise or measured with other
code is measured again, a saved "off" makes `run` decode plainly, a saved depth makes it draft at that depth."""

from __future__ import annotations

import json
import types

import pytest

import hetero
from hetero.cli.main import main
from hetero.cli.tune import tune
from hetero.decode.depth_calibration import calibrate
from hetero.decode.depth_contest import can_pay
import hetero.engine
from hetero.host.settings import (PLAIN, measured_with, pin_tuning, remeasure_reason, save_tuning, settings_path,
                                  tuned_depth)
from tiny_checkpoint import write_tiny_model


@pytest.fixture(autouse=True)
def private_settings(tmp_path, monkeypatch):
    """Each test reads and writes its own settings file, and first use runs the real calibration (the session's
    is pinned in conftest.py)."""
    monkeypatch.setenv("HETERO_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(hetero.engine, "calibrate", calibrate)


class Scripted:
    """A decoder with fixed speeds per setting (plain, or MTP at a depth) and fixed accepted lengths, on a clock it
    advances by each decode's time: the real contest and verdict run on exact timing (tests/test_confidence.py
    draws the noise)."""

    def __init__(self, plain_tps: float, depth_tps: dict[int, float], accepted: float = 2.5):
        self.plain_tps, self.depth_tps, self.accepted = plain_tps, depth_tps, accepted
        self.now, self.calls = 0.0, []

    def __call__(self, depth: int, prompt: int, tokens: int):
        tps = self.depth_tps[depth] if depth else self.plain_tps
        self.now += tokens / tps
        self.calls.append((depth, prompt))
        return tps, (self.accepted if depth else None)


FAKE = types.SimpleNamespace(identity="fake@0", name="fake")  # what the contest needs of an engine: its names


def saved(identity: str) -> dict:
    from hetero.host.settings import machine_id

    return json.loads(settings_path().read_text())[machine_id()][identity]


def test_tune_saves_the_depth_it_measured_fastest_with_its_interval():
    d = Scripted(100.0, {1: 120.0, 2: 150.0, 3: 140.0, 4: 90.0})
    result = tune(FAKE, tokens=16, report=lambda line: None, decode=d, clock=lambda: d.now)
    assert result["draft_depth"] == 2 and tuned_depth("fake@0") == 2
    entry = saved("fake@0")
    assert entry["depths"]["2"]["decode_tps"] == 150.0 and entry["plain_tps"] == 100.0
    assert entry["depths"]["2"]["ratio"]["low"] == pytest.approx(1.5) and entry["depths"]["2"]["ratio"]["samples"] == 6
    assert entry["verdict"]["settled"] and "95% interval" in entry["verdict"]["why"]
    assert {depth for depth, _ in d.calls} == {0, 1, 2, 3, 4} and {p for _, p in d.calls} == {0, 1, 2}
    assert remeasure_reason("fake@0") is None  # settled, measured with this code: it stands


def test_tune_saves_off_when_plain_decoding_wins():
    d = Scripted(200.0, {1: 120.0, 2: 150.0, 3: 199.0, 4: 90.0})
    save_tuning("fake@0", {"draft_depth": 3})  # an earlier tune's winner must not survive a new measurement
    result = tune(FAKE, tokens=16, report=lambda line: None, decode=d, clock=lambda: d.now)
    assert result["draft_depth"] == PLAIN and tuned_depth("fake@0") == PLAIN
    assert saved("fake@0")["draft_depth"] == "off"


@pytest.mark.parametrize("plain_tps, drafted_tps, choice", [(100.0, 130.0, 3), (100.0, 90.0, PLAIN)])
def test_first_use_calibration_saves_the_faster_beyond_the_noise(plain_tps, drafted_tps, choice):
    """The decision alone, with the stepper's decoding replaced by fixed speeds (its real timing is in the tests
    below): pairs alternate on three prompts until the interval excludes 1, after a warm-up of each side."""
    d = Scripted(plain_tps, {3: drafted_tps})
    assert calibrate(FAKE, 3, report=lambda line: None, decode=d, clock=lambda: d.now) == choice
    entry = saved("fake@0")
    assert tuned_depth("fake@0") == choice and entry["calibrated"] == "first use"
    assert entry["verdict"]["settled"] and entry["verdict"]["pairs"] == 6
    assert d.calls[:2] == [(0, 0), (3, 0)]  # the warm-up: each side once


def test_a_verdict_inside_the_noise_is_measured_again_and_adds_to_its_samples():
    """Two speeds too close to tell within the cap: the acceptance model keeps MTP, the verdict is unsettled, and
    the next chance measures again, adding its pairs to the saved ones."""
    class Noisy(Scripted):
        def __call__(self, depth, prompt, tokens):
            self.depth_tps = {3: 100.0 * (1.3 if len(self.calls) % 4 in (1, 2) else 0.8)}
            return super().__call__(depth, prompt, tokens)

    d = Noisy(100.0, {3: 100.0})
    calibrate(FAKE, 3, report=lambda line: None, decode=d, cap_s=2.0, expected=lambda *_: 1.2, clock=lambda: d.now)
    first = saved("fake@0")
    assert not first["verdict"]["settled"] and first["draft_depth"] == 3
    assert remeasure_reason("fake@0") == "its last verdict was inside the noise"
    lines = []
    calibrate(FAKE, 3, report=lines.append, decode=d, cap_s=2.0, expected=lambda *_: 1.2, clock=lambda: d.now,
              why=remeasure_reason("fake@0"))
    again = saved("fake@0")
    assert again["verdict"]["pairs"] > first["verdict"]["pairs"]
    assert again["samples"]["ratios"]["3"][: first["verdict"]["pairs"]] == first["samples"]["ratios"]["3"]
    assert "adding to" in lines[0] and again["calibrated"].startswith("again: its last verdict was inside the noise")


def test_what_is_measured_again():
    assert remeasure_reason("fake@0") == "never measured on this machine"
    save_tuning("fake@0", {"draft_depth": 3, "calibrated": "first use"})  # an earlier hetero's one-sample decision
    assert "earlier hetero" in remeasure_reason("fake@0")
    save_tuning("fake@0", {"draft_depth": 2})  # written by hand, or by an earlier `hetero tune`: it stands
    assert remeasure_reason("fake@0") is None
    pin_tuning("fake@0", 3, "pinned")
    assert remeasure_reason("fake@0") is None
    stale = {**saved("fake@0"), "measured_with": {**measured_with(), "mlx": "0.0.1"}}
    save_tuning("fake@0", stale)
    assert remeasure_reason("fake@0").startswith("measured with other code (mlx 0.0.1 -> ")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tune") / "m")


def run_json(model_dir, capsys, *extra: str) -> dict:
    assert main(["run", "--model", str(model_dir), "--prompt", "def add(a, b):", "--max-tokens", "8", "--json",
                 *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_an_untuned_run_calibrates_once_then_follows_what_it_measured(model_dir, capsys):
    identity = hetero.load(model_dir).identity
    assert tuned_depth(identity) is None
    assert main(["run", "--model", str(model_dir), "--prompt", "def add(a, b):", "--max-tokens", "8", "--json"]) == 0
    out, err = capsys.readouterr()
    first = json.loads(out)
    assert "measuring MTP against plain decoding" in err  # the user is told why the first run takes longer
    entry = saved(identity)
    assert entry["calibrated"] == "first use" and entry["measured_with"] == measured_with()
    assert_consistent(entry)
    assert ("mtp" in first) == (entry["draft_depth"] != PLAIN)  # the first run already decodes as measured
    assert main(["run", "--model", str(model_dir), "--prompt", "def add(a, b):", "--max-tokens", "8", "--json"]) == 0
    out, err = capsys.readouterr()
    if entry["verdict"]["settled"]:
        assert "measuring" not in err and saved(identity) == entry  # measured once
    else:  # inside the noise on this machine today: the next run measured again, adding to the pairs
        assert "its last verdict was inside the noise" in err
        assert saved(identity)["verdict"]["pairs"] > entry["verdict"]["pairs"]
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


def assert_consistent(entry: dict) -> None:
    """A saved verdict agrees with the samples it saved: a depth that kept no draft never wins; a settled depth's
    interval lies above 1, a settled "off"'s below it for every depth that kept drafts (or the verdict says tie)."""
    depths = {int(d): v for d, v in entry["depths"].items()}
    paying = {d: v for d, v in depths.items() if can_pay(v["mean_accepted_length"])}
    verdict, choice = entry["verdict"], entry["draft_depth"]
    assert set(entry["samples"]["ratios"]) == {str(d) for d in depths}
    if not paying:
        assert choice == PLAIN and "almost no draft was accepted" in verdict["why"]
    elif verdict["settled"] and "tie" not in verdict["why"] and "as far as" not in verdict["why"]:
        if choice == PLAIN:
            assert all(v["ratio"]["high"] < 1 for v in paying.values())
        else:
            assert paying[choice]["ratio"]["low"] > 1
    else:
        assert choice == PLAIN or choice in paying


def test_tune_on_a_tiny_model_saves_what_it_measured(model_dir):
    engine = hetero.load(model_dir)
    result = tune(engine, depths=(1, 2), tokens=12, report=lambda line: None, cap_s=10.0)
    assert_consistent(result)
    assert tuned_depth(engine.identity) == result["draft_depth"]
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
    """`hetero tune` on a qwen4_exp checkpoint whose random head keeps (almost) no draft on the tune prompts (the
    copy lane's n-gram drafts now and then): every depth is measured, none wins, "off" is saved and `hetero run`
    decodes plainly."""
    assert main(["tune", "--model", str(qwen4_dir), "--tokens", "12", "--seconds", "20"]) == 0
    out = capsys.readouterr().out
    assert "saved 'off'" in out
    entry = saved(hetero.load(qwen4_dir).identity)
    assert sorted(entry["depths"]) == ["1", "2", "3", "4"]
    assert all(d["mean_accepted_length"] < 1.2 for d in entry["depths"].values())  # the head's drafts: rejected
    assert entry["draft_depth"] == PLAIN
    assert_consistent(entry)
    assert "mtp" not in run_json(qwen4_dir, capsys)


def test_first_use_calibration_on_qwen4_with_a_rejected_head_decodes_plainly(qwen4_dir, capsys):
    """An untuned qwen4_exp run calibrates through the stepper (plain against depth 3 on the code prompts) and, its
    head's drafts rejected, saves plain decoding and decodes plainly from the first run on."""
    first = run_json(qwen4_dir, capsys)
    entry = saved(hetero.load(qwen4_dir).identity)
    assert entry["calibrated"] == "first use" and entry["depths"]["3"]["mean_accepted_length"] < 1.2
    assert entry["draft_depth"] == PLAIN and "mtp" not in first
    assert_consistent(entry)


def test_tune_on_qwen4_with_an_agreeing_head_measures_what_it_saves(qwen4_dir):
    """The head built to agree with the backbone (tests/test_qwen4_mtp.py `agreeing`): every depth keeps most drafts
    (so each may win), and the saved choice is the fastest measured, or plain where plain was faster."""
    from test_qwen4_mtp import agreeing

    engine = hetero.load(qwen4_dir)
    agreeing(engine.model, alpha=0.02)
    result = tune(engine, depths=(1, 2, 3), tokens=16, report=lambda line: None, cap_s=15.0)
    assert all(result["depths"][d]["mean_accepted_length"] > 1 + 0.6 * d for d in (1, 2, 3))
    assert_consistent(result)
    assert tuned_depth(engine.identity) == result["draft_depth"]


def test_tune_show_prints_each_verdict_why_and_what_is_measured_again(capsys):
    from hetero.host.settings import save_device_profile

    d = Scripted(100.0, {1: 120.0, 2: 150.0})
    tune(FAKE, depths=(1, 2), tokens=16, report=lambda line: None, decode=d, clock=lambda: d.now)
    save_tuning("other@1", {**saved("fake@0"), "measured_with": {**measured_with(), "hetero": "0.0.0+old"}})
    save_device_profile({"name": "this-machine", "measured_with": measured_with(),
                         "confidence": {"gpu matmul": {"median": 0.002, "low": 0.0019, "high": 0.0021, "samples": 9,
                                                       "spread": 0.05}}})
    assert main(["tune", "--show"]) == 0
    out = capsys.readouterr().out
    assert "fake@0: MTP at depth 2 (hetero tune)" in out and "why: MTP at depth 2 decodes 1.50x" in out
    assert out.count("stands") == 2  # the verdict and the device profile
    assert "other@1" in out and "measured again at the next run: measured with other code (hetero 0.0.0+old" in out
    assert "gpu matmul: 2.000 ms per call (+-5.0%, 9 samples)" in out
