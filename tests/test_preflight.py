"""Pre-flight check: each way a checkpoint can be broken gives its own clear error, before weights are read."""

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from hetero.checkpoint.loader import load_model
from hetero.checkpoint.preflight import preflight
from hetero.errors import HeteroError

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
    linear_value_head_dim=16, full_attention_interval=2, max_position_embeddings=1024, tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> Path:
    """A tiny qwen3_5_text checkpoint written by transformers itself, split over two shards with an index."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt")
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TINY)).save_pretrained(path, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file(), "fixture should be sharded"
    return path


@pytest.fixture
def ckpt(hf_checkpoint, tmp_path) -> Path:
    """A private copy each test may damage."""
    dst = tmp_path / "model"
    shutil.copytree(hf_checkpoint, dst)
    return dst


def index(path: Path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())


def test_clean_checkpoint_passes_and_reports_facts(ckpt):
    report = preflight(ckpt)
    assert report.ok, report.lines()
    assert report.supported and report.shapes_checked
    assert report.n_tensors == len(index(ckpt)["weight_map"])
    assert report.total_bytes == sum(p.stat().st_size for p in ckpt.glob("*.safetensors")) - sum(
        8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in ckpt.glob("*.safetensors")
    )
    assert report.peak_memory_bytes > report.total_bytes
    assert report.has_mtp is False
    assert "result: OK, will load" in report.lines()


def test_renamed_tensors_are_caught_from_the_index_alone(ckpt):
    """A checkpoint in another naming convention: reported without any shard on disk."""
    idx = index(ckpt)
    idx["weight_map"] = {k.replace("model.layers.", "transformer.h."): v for k, v in idx["weight_map"].items()}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(idx))
    for shard in ckpt.glob("*.safetensors"):
        shard.unlink()  # nothing but the index is left to read
    report = preflight(ckpt)
    assert not report.ok
    assert "transformer.h.0.mlp.up_proj.weight" in report.unmapped
    assert "model.layers.0.mlp.up_proj.weight" in report.missing
    assert not report.shapes_checked


def test_renamed_tensor_in_local_shards_is_named(ckpt):
    idx = index(ckpt)
    shard = idx["weight_map"]["model.norm.weight"]
    tensors = load_file(ckpt / shard)
    tensors["model.final_layernorm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, ckpt / shard, metadata={"format": "pt"})
    idx["weight_map"]["model.final_layernorm.weight"] = idx["weight_map"].pop("model.norm.weight")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(idx))
    report = preflight(ckpt)
    assert report.unmapped == ["model.final_layernorm.weight"]
    assert report.missing == ["model.norm.weight"]
    with pytest.raises(HeteroError, match="model.final_layernorm.weight.*naming convention"):
        load_model(ckpt)


def test_missing_shard_names_the_file(ckpt):
    shard = sorted(set(index(ckpt)["weight_map"].values()))[-1]
    (ckpt / shard).unlink()
    with pytest.raises(HeteroError, match=f"shard {shard} .*missing"):
        load_model(ckpt)


def test_truncated_shard_names_the_file(ckpt):
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    report = preflight(ckpt)
    assert not report.ok
    assert shard.name in report.first_problem() and "truncated" in report.first_problem()


def test_corrupt_header_names_the_file(ckpt):
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:20] = b"not json at!"
    shard.write_bytes(bytes(data))
    with pytest.raises(HeteroError, match=f"{shard.name} has a corrupt safetensors header"):
        load_model(ckpt)


def test_wrong_dtype_names_the_tensor(ckpt):
    idx = index(ckpt)
    shard = idx["weight_map"]["model.norm.weight"]
    tensors = load_file(ckpt / shard)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype("float64")
    save_file(tensors, ckpt / shard)
    report = preflight(ckpt)
    assert report.errors == [
        f"tensor model.norm.weight in {shard} has dtype F64; hetero loads F32, F16, BF16 (and U32 quantized) weights"
    ]


def test_shape_mismatch_against_config(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (ckpt / "config.json").write_text(json.dumps(cfg))
    report = preflight(ckpt)
    assert any(m.startswith("model.layers.0.mlp.up_proj.weight: checkpoint [128, 64], config expects [96, 64]") for m in report.shape_mismatches)


def test_moe_config_over_dense_weights_is_refused(ckpt):
    """Experts in config.json, dense MLP tensors in the checkpoint: every expert parameter is reported missing."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    report = preflight(ckpt)
    assert not report.ok and "model.layers.0.mlp.switch_mlp.gate_proj.weight" in report.missing
    assert "model.layers.0.mlp.gate_proj.weight" in report.unmapped


def test_experts_config_with_every_layer_dense_is_accepted(ckpt):
    """HF builds a dense MLP for layers in mlp_only_layers: such a config is not mixture-of-experts."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(num_experts=8, num_experts_per_tok=2, mlp_only_layers=list(range(cfg["num_hidden_layers"])))
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert preflight(ckpt).ok


def test_unknown_model_type_is_refused(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeteroError, match="unsupported model_type 'llama'"):
        load_model(ckpt)


def test_missing_config_and_bad_path(tmp_path):
    with pytest.raises(HeteroError, match="config.json is missing"):
        load_model(tmp_path)
    with pytest.raises(HeteroError, match="no such directory"):
        load_model(tmp_path / "nope")


def test_hub_id_offline_gives_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    report = preflight("Qwen/Qwen3.5-9B")
    assert not report.ok and "HF_HUB_OFFLINE" in report.errors[0] and "\n" not in report.errors[0]


def test_check_command_exit_codes_and_no_traceback(ckpt):
    ok = subprocess.run([sys.executable, "-m", "hetero.cli.main", "check", "--model", str(ckpt)], capture_output=True, text=True)
    assert ok.returncode == 0 and "result: OK" in ok.stdout
    (ckpt / "config.json").write_text("{broken")
    bad = subprocess.run([sys.executable, "-m", "hetero.cli.main", "check", "--model", str(ckpt)], capture_output=True, text=True)
    assert bad.returncode == 1 and "is not valid JSON" in bad.stdout and "Traceback" not in bad.stderr + bad.stdout
