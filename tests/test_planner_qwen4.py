"""`hetero plan` on Qwen4-Exp (issue 32): the Flash-Next config we plan against (docs/qwen4_flash_next/config.json)
on 128 GB and 96 GB Macs at 4 bits. The PLE n-gram tables count on disk, never among the weights; the weights fit;
the context window follows from the governor's per-token KV bytes (QSA layers' K, V and index key, the MTP layer).
Expected values are worked out here from the config fields and the model's own hasher, not from the planner."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hetero.checkpoint.preflight import build_lazy_model
from hetero.cli.main import main
from hetero.models.architectures import parse_args
from hetero.models.qwen4_exp.ple import NGramHasher
from hetero.planner import model_shape, parameter_counts
from hetero.planner.governor import RUNTIME_RESERVE

ROOT = Path(__file__).resolve().parents[1]
FLASH_NEXT = ROOT / "docs" / "qwen4_flash_next" / "config.json"
CONFIG = json.loads(FLASH_NEXT.read_text())
TEXT = CONFIG["text_config"]


def plan_json(capsys, memory_gb: int) -> dict:
    assert main(["plan", "--model", str(FLASH_NEXT), "--bits", "4", "--memory-gb", str(memory_gb),
                 "--ane-fraction", "0", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def table_bytes() -> int:
    """The PLE tables as the checkpoint stores them: bf16 rows of the model's own hasher's table, per PLE layer."""
    args = parse_args(CONFIG)
    width = args.ple_embed_dim // args.ngram_heads
    return sum(2 * NGramHasher(args, i).table_rows * width for i in range(len(args.ple_layer_ids)))


def kv_bytes_per_token() -> int:
    """bf16 K, V and the raw index key per token, in every QSA layer and the MTP head's one layer."""
    qsa = sum(t != "linear_attention" for t in TEXT["layer_types"]) + 1
    return qsa * (2 * TEXT["num_key_value_heads"] * TEXT["head_dim"] + TEXT["indexer_head_dim"]) * 2


@pytest.mark.parametrize("memory_gb", [128, 96])
def test_plan_counts_ple_on_disk_and_the_window_from_kv_bytes(capsys, memory_gb):
    d = plan_json(capsys, memory_gb)
    m = d["memory"]
    lines = {line["name"]: line["bytes"] for line in m["lines"]}
    assert [x["bytes"] for x in m["on_disk"]] == [table_bytes()] and table_bytes() > 100e9  # ~51B bf16 parameters
    assert not any("PLE" in name for name in lines)  # neither as RAM ...
    weights = lines["weights (4-bit, group size 64)"]
    params = d["parameters"]["total"]
    assert weights == int(params * (4 / 8 + 4 / 64))  # ... nor inside the weights: 4 bits + fp16 scale, bias per 64
    assert params + d["parameters"]["on_disk"] == pytest.approx(124.3e9, rel=1e-3)

    wirable = int(memory_gb * 1e9 * 0.75)
    assert m["wirable_bytes"] == wirable and weights < wirable  # the 4-bit weights fit
    per_token = kv_bytes_per_token()
    assert m["kv_bytes_per_token"] == per_token
    fixed = sum(b for n, b in lines.items() if not n.startswith(("KV cache", "unused")))
    assert lines["runtime reserve (MLX, allocator, decode)"] == RUNTIME_RESERVE
    room = wirable - fixed
    assert m["memory_tokens"] == room // per_token > 0
    window = m["context_window"]
    assert 0 < window == min(TEXT["max_position_embeddings"], room // per_token // 512 * 512)
    kv = next(b for n, b in lines.items() if n.startswith("KV cache"))
    assert kv == window * per_token and sum(lines.values()) == wirable


def test_96_gb_leaves_less_room_than_128(capsys):
    small, large = plan_json(capsys, 96)["memory"], plan_json(capsys, 128)["memory"]
    assert 0 < small["memory_tokens"] < large["memory_tokens"]
    assert large["memory_tokens"] - small["memory_tokens"] == pytest.approx(32e9 * 0.75 / kv_bytes_per_token(), abs=2)


def test_plan_text_says_the_tables_are_on_disk_and_the_window(capsys):
    assert main(["plan", "--model", str(FLASH_NEXT), "--bits", "4", "--memory-gb", "128"]) == 0
    out = capsys.readouterr().out
    assert "51.20B PLE n-gram tables on disk" in out
    assert "PLE n-gram tables, 51.20B parameters in bf16 (on disk, memory-mapped: not counted)" in out
    assert "context window: 262144 tokens (the model's maximum; the memory would hold" in out
    assert "only the z rows may leave" in out  # default fraction 0.5: the split's caps, with their reasons
    assert "vision tower" not in out  # its config has one, but hetero reads no qwen4_exp tower: nothing to predict


def test_flash_next_config_matches_the_published_totals():
    """The inferred hidden size and layer count (docs/qwen4_flash_next.md) reproduce the published totals:
    125B parameters with ~51B of PLE tables and a ~4B MTP head, ~6B active per token."""
    n = parameter_counts(*model_shape(CONFIG))
    assert n.on_disk == table_bytes() // 2 == pytest.approx(51e9, rel=0.01)
    assert n.total + n.on_disk == pytest.approx(125e9, rel=0.01)
    assert n.mtp_total == pytest.approx(4e9, rel=0.06)
    assert n.active - n.mtp_active == pytest.approx(6e9, rel=0.05)


def test_transformers_reads_the_docs_config():
    from transformers import Qwen4ExpConfig

    config = Qwen4ExpConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")})
    t = config.text_config
    assert (t.hidden_size, t.num_hidden_layers, t.ple_embed_dim, t.layer_types.count("indexed_attention")) == (5120, 16, 2560, 4)


def test_planner_counts_equal_the_model_parameters():
    """The planner's Qwen4-Exp pieces (hyper-connections, PLE projections, the indexer, the MTP head) count exactly
    the matrices of the model hetero builds, on a tiny config; the n-gram tables apart, as on disk."""
    from mlx.utils import tree_flatten

    sys.path.insert(0, str(Path(__file__).parent))
    from qwen4_checkpoint import TEXT as TINY

    config = dict(TINY, model_type="qwen4_exp_text", ple_layer_ids=[1, 2], mtp_num_hidden_layers=1)
    args = parse_args(config)
    sizes = {k: v.size for k, v in tree_flatten(build_lazy_model(args, True).parameters()) if v.ndim >= 2}
    n = parameter_counts(*model_shape(config))
    assert n.on_disk == sum(v for k, v in sizes.items() if "ngram_embedding" in k) > 0
    assert n.total == sum(v for k, v in sizes.items() if "ngram_embedding" not in k)
    assert n.mtp_total == sum(v for k, v in sizes.items() if k.startswith("mtp."))


@pytest.mark.parametrize("flags,message", [
    (["--hosts", "2"], "--hosts: the pipeline across hosts does not run qwen4_exp checkpoints yet; plan one host"),
    (["--kv-bits", "8"], "--kv-bits: qwen4_exp models keep full-precision KV only; leave --kv-bits out"),
])
def test_what_qwen4_cannot_run_is_one_line(capsys, flags, message):
    """The planner refuses what the runtime refuses for this architecture, instead of planning it."""
    assert main(["plan", "--model", str(FLASH_NEXT), *flags]) != 0
    assert capsys.readouterr().err.strip().splitlines() == [f"hetero: error: {message}"]


def split_json(capsys, *flags: str) -> dict:
    assert main(["plan", "--model", str(FLASH_NEXT), "--bits", "4", "--memory-gb", "128", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_splits_attention_heads_shared_experts_and_z_rows(capsys):
    """At F = 0.5 the ANE takes one of the two KV groups of every QSA layer, half of every layer's shared expert (256
    of 512 channels, 16 layers) and the z rows of every GDN layer, capped at z / (qkv + z + b + a); the routed
    experts, the QSA indexer, the hyper-connection mixers, PLE and the GDN recurrence keep everything, each with its
    reason."""
    plan = split_json(capsys, "--ane-fraction", "0.5")
    by = plan["pieces"]
    nk, nv, dk, dv = (TEXT[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                        "linear_value_head_dim"))
    z, rows = nv * dv, 2 * nk * dk + 2 * nv * dv + 2 * nv
    shared = TEXT["shared_expert_intermediate_size"]
    assert (by["shared_expert"]["layers"], by["shared_expert"]["ane_units"]) == (16, shared // 2)
    assert (by["gdn_in_proj"]["layers"], by["gdn_in_proj"]["ane_units"], by["gdn_in_proj"]["units"]) == (12, z, rows)
    assert (by["attention"]["layers"], by["attention"]["ane_units"], by["attention"]["units"]) == (4, 1, 2)
    for kind in ("qsa_indexer", "moe", "hyper_connections", "ple", "gdn_recurrence", "gdn_out_proj", "mtp"):
        assert by[kind]["ane_units"] == 0 and by[kind]["cap_reason"], kind
    assert "hyper-connection" in by["hyper_connections"]["cap_reason"] and "PLE" in by["ple"]["cap_reason"]
    slices = {(s["layer"], s["piece"]) for s in plan["layers"]}
    gdn = [i for i, t in enumerate(TEXT["layer_types"]) if t == "linear_attention"]
    qsa = [i for i, t in enumerate(TEXT["layer_types"]) if t != "linear_attention"]
    assert slices == ({(i, "shared_expert") for i in range(16)} | {(i, "gdn_in_proj") for i in gdn}
                      | {(i, "attention") for i in qsa})


def test_plan_ane_fraction_auto_predicts_the_split(capsys):
    """`hetero plan --ane-fraction auto` gives the fraction `--ane-fraction auto` starts from (as --recommend): a
    split that offloads something and is predicted faster than GPU-only on the default profile, and exactly the
    plan --recommend prints."""
    auto = split_json(capsys, "--ane-fraction", "auto")
    assert auto == split_json(capsys, "--recommend")
    assert 0 < auto["recommended_fraction"] <= 1 and auto["layers"]
    predicted = auto["predicted"]
    assert predicted["split_prefill_s"] < predicted["gpu_only_prefill_s"]
    assert {s["piece"] for s in auto["layers"]} <= {"attention", "shared_expert", "gdn_in_proj"}


def test_plan_pieces_qwen4_cannot_split_is_one_line(capsys):
    """Asking for the dense MLP alone (a share this layout cannot take: every layer is MoE): one line saying why and
    what can leave, not a plan of nothing."""
    assert main(["plan", "--model", str(FLASH_NEXT), "--ane-fraction", "0.5", "--pieces", "mlp"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hetero: error: --pieces mlp: a qwen4_exp checkpoint gives")
    assert "mixture-of-experts" in err[0] and err[0].endswith("offload attention, gdn_in_proj, shared_expert (or all)")
