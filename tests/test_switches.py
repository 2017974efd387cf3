"""The environment's on/off switches (hetero/host/switches.py): what turns them off, and a value that is neither on nor
off said once on stderr with what to set, the switch left on."""

from __future__ import annotations

import pytest

from hetero.decode import wavefront
from hetero.host import switches


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(switches, "_said", set())


@pytest.mark.parametrize("value, on", [("0", False), ("OFF", False), (" no ", False), ("false", False),
                                       ("1", True), ("on", True), ("Yes", True), ("", True)])
def test_the_values_that_turn_a_switch_off_and_on(monkeypatch, capsys, value, on):
    monkeypatch.setenv("HETERO_FEW_ROW_KERNEL", value)
    assert switches.switched_on("HETERO_FEW_ROW_KERNEL") is on
    assert capsys.readouterr().err == ""


def test_an_unset_switch_is_on(monkeypatch, capsys):
    monkeypatch.delenv("HETERO_PREFILL_WAVEFRONT", raising=False)
    assert switches.switched_on("HETERO_PREFILL_WAVEFRONT")
    assert capsys.readouterr().err == ""


def test_a_typo_is_said_once_and_leaves_the_switch_on(monkeypatch, capsys):
    monkeypatch.setenv(wavefront.ENV, "of")  # meant "off"
    assert switches.switched_on(wavefront.ENV) and switches.switched_on(wavefront.ENV)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{wavefront.ENV}='of' is neither on nor off" in err and "set it to 0" in err
    monkeypatch.setenv(wavefront.ENV, "0")
    assert not wavefront.enabled()  # the wavefront reads the switch
