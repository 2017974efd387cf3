"""The trained models the tests run are shipped files (tests/shipped_models.py): made by this checkout's training
code, small, and refused in one line when they are not; the training recipe stops only at a reply margin."""

from __future__ import annotations

import json
import shutil

import pytest

import shipped_models
from shipped_models import SOURCES, StaleModel, key, shipped


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_each_shipped_model_was_trained_by_this_checkouts_code_and_is_small(name):
    folder = shipped(name)  # raises StaleModel when tests/*_model.py changed without a retrain
    record = json.loads((folder / "trained.json").read_text())
    assert record["key"] == key(name) and record["fit"]["margin"] >= 2.0, record
    files = {p.name: p.stat().st_size for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert sum(files.values()) < 2_000_000, files  # the repository stays light: about 1 MB a model


def test_a_model_trained_by_other_code_or_missing_is_refused_in_one_line(tmp_path):
    shutil.copytree(shipped("tool"), tmp_path / "tool")
    record = tmp_path / "tool" / "trained.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "key": "0123456789abcdef"}))
    with pytest.raises(StaleModel, match=r"^tests/models/tool was trained by other code \(key 0123456789abcdef, "
                                         r"this checkout's \w+\): retrain it with `python tests/shipped_models.py "
                                         r"tool` and commit it$"):
        shipped("tool", root=tmp_path)
    with pytest.raises(StaleModel, match=r"^tests/models/agent-codex is missing: run `python tests/shipped_models.py "
                                         r"agent-codex`$"):
        shipped("agent-codex", root=tmp_path)


def test_the_key_is_the_training_codes_bytes(tmp_path, monkeypatch):
    """Any change to a source of a model changes its key; a file that is not a source does not."""
    here = tmp_path / "tests"
    for source in {s for sources in SOURCES.values() for s in sources}:
        (here / source).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shipped_models.HERE / source, here / source)
    monkeypatch.setattr(shipped_models, "HERE", here)
    before = {name: key(name) for name in SOURCES}
    (here / "agent_model.py").write_text((here / "agent_model.py").read_text() + "\n# a change\n")
    (here / "test_server.py").write_text("# not a source\n")
    after = {name: key(name) for name in SOURCES}
    assert after["tool"] == before["tool"]
    assert all(after[n] != before[n] for n in SOURCES if n.startswith("agent-"))


def test_training_that_does_not_reach_the_margin_raises_rather_than_writes(tmp_path):
    """A fixed step count once shipped models that answered before calling the tool (its decisive token undecided):
    the recipe trains to a margin on every reply token and fails when it cannot reach it."""
    from tool_model import training_pairs, fit_and_save

    shape = dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=1,
                 num_key_value_heads=1, head_dim=32, linear_num_key_heads=1, linear_num_value_heads=1,
                 linear_key_head_dim=16, linear_value_head_dim=16, full_attention_interval=1)
    with pytest.raises(RuntimeError, match=r"training did not reach a reply margin of 2.0 in 25 steps \(margin -"):
        fit_and_save(tmp_path / "model", training_pairs()[:1], shape, lr=1e-4, seed=0, max_steps=25, min_margin=2.0)
    assert not (tmp_path / "model").exists()
