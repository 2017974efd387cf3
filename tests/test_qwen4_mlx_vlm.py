"""Qwen4-Exp checkpoints as the MLX community converts them: mlx-vlm 0.7.10's own converter (`mlx_vlm.convert`),
run here on tiny nested checkpoints that transformers writes, float and 4-bit, and loaded by hetero.

What mlx-vlm writes (read from its real output, not from its code): `language_model.model.*` / `language_model.lm_head`
names, experts stacked as `mlp.switch_mlp.*`, the MLX conv layout, the norms still zero-centred, the PLE hash
buffers kept, PLE shards as `ngram_embedding.shards.{i}.*`, layer_types spelled `qwen_sparse_attention`, no `mtp.*`
tensors (its `convert --mtp` writes the head to a separate drafter folder, `<out>-mtp`), and with `-q` a 4-bit
affine table (groups of 32) for every PLE shard whose rows are a multiple of 32 wide, which hetero
reads where it lies and dequantizes per gathered row. mlx-vlm 0.7.10's config rejects
transformers' `indexed_attention` layer name, so its input is a copy whose config spells it `qwen_sparse_attention`
(the only change). mlx-vlm's greedy decoding on the converted folder is the oracle, with transformers' greedy on the
original for the float conversion.
"""

from __future__ import annotations

import hetero  # before mlx: the fast BLAS
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import qwen4_checkpoint as qc
import torch

from hetero.checkpoint.loader import load_model
from hetero.checkpoint.preflight import preflight
from hetero.errors import HeteroError

pytest.importorskip("mlx_vlm")

PROMPT, NEW = 30, 12
# 4-bit groups of 64 fit the projections; PLE rows 128 / 4 heads = 32 wide, so mlx-vlm quantizes the n-gram tables
WIDE = dict(hidden_size=64, moe_intermediate_size=64, shared_expert_intermediate_size=64, ple_embed_dim=128)


def _convert(tmp_path_factory, name: str, quantize: bool, mtp: bool = False, dtype: str | None = None, **overrides):
    """(transformers model, mlx-vlm's converted folder, the original folder) for a tiny nested checkpoint with an MTP
    head built with `overrides`; with `mtp`, mlx-vlm also writes the head to its drafter folder `<out>-mtp`."""
    from mlx_vlm.convert import convert

    src = tmp_path_factory.mktemp(f"{name}-hf")
    hf = qc.build(src, nested=True, ple_layer_ids=(2, 4), seed=1, mtp=True, **overrides)
    qc.add_tokenizer(src)
    vlm_src = tmp_path_factory.mktemp(f"{name}-vlm-src")
    shutil.copytree(src, vlm_src, dirs_exist_ok=True)
    config = json.loads((vlm_src / "config.json").read_text())
    text = config["text_config"]
    text["layer_types"] = ["qwen_sparse_attention" if t == "indexed_attention" else t for t in text["layer_types"]]
    (vlm_src / "config.json").write_text(json.dumps(config))
    out = tmp_path_factory.mktemp(f"{name}-mlx") / "model"
    convert(str(vlm_src), str(out), quantize=quantize, q_bits=4, mtp=mtp, dtype=dtype)
    return hf, out, src


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return _convert(tmp_path_factory, "q4vlm", quantize=False)


@pytest.fixture(scope="module")
def converted_4bit(tmp_path_factory):
    return _convert(tmp_path_factory, "q4vlm4", quantize=True, mtp=True, **WIDE)


@pytest.fixture(scope="module")
def converted_mtp(tmp_path_factory):
    return _convert(tmp_path_factory, "q4vlmmtp", quantize=False, mtp=True)


def _prompt() -> list[int]:
    return [int(t) for t in np.random.default_rng(3).integers(2, qc.VOCAB, PROMPT)]


def _hetero_greedy(path) -> list[int]:
    model = load_model(path)[0]
    cache, out = model.make_cache(), []
    logits, _ = model(mx.array([_prompt()]), cache)
    for _ in range(NEW):
        out.append(int(mx.argmax(logits[0, -1])))
        logits, _ = model(mx.array([[out[-1]]]), cache)
    return out


def _mlx_vlm_greedy(path) -> list[int]:
    """mlx-vlm's own greedy decoding of the folder (fp32, EOS ignored)."""
    from mlx_vlm import load, stream_generate

    model, processor = load(str(path))
    model.set_dtype(mx.float32)
    getattr(processor, "tokenizer", processor).stopping_criteria = lambda token: False
    stream = stream_generate(model, processor, "", input_ids=mx.array([_prompt()]), max_tokens=NEW, temperature=0.0)
    return [r.token for r in stream if r.finish_reason is None]  # the closing result repeats the last token


def test_float_conversion_greedy_equals_mlx_vlm_and_transformers(converted):
    hf, path, _ = converted
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(".ngram_embedding.shards.1.weight" in n for n in names)  # mlx-vlm's PLE naming really is exercised
    assert any(".mlp.switch_mlp." in n for n in names) and not any(n.startswith("mtp.") for n in names)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([_prompt()]), max_new_tokens=NEW, do_sample=False)[0, PROMPT:].tolist()
    ours = _hetero_greedy(path)
    assert ours == ref
    assert ours == _mlx_vlm_greedy(path)


def test_float_conversion_logits_match_transformers(converted):
    """The norms mlx-vlm leaves zero-centred get their +1 once (not twice, not never): logits within 1e-4."""
    hf, path, _ = converted
    tokens = _prompt() + _prompt()  # 60 tokens: QSA drops keys
    ours = np.array(load_model(path)[0](mx.array([tokens]))[0][0])
    ref = qc.hf_logits(hf, tokens)
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


def test_float_conversion_keeps_ple_shards_on_disk(converted):
    """mlx-vlm's `ngram_embedding.shards.{i}` stay in the converted file, memory-mapped, rows equal to the stored."""
    from mlx.utils import tree_flatten
    from safetensors.numpy import load_file

    _, path, _ = converted
    model = load_model(path)[0]
    assert not [k for k, _ in tree_flatten(model.parameters()) if "ngram_embedding" in k]
    stored = load_file(path / "model.safetensors")
    for i, layer in enumerate(model.layers):
        if layer.ple is None:
            continue
        prefix = f"language_model.model.layers.{i}.ple.ple_embedding.ngram_embedding.shards"
        whole = np.concatenate([stored[f"{prefix}.{k}.weight"] for k in range(2)])  # [rows, width]
        rows = np.random.default_rng(i).integers(0, len(whole), (2, 5, 4))
        np.testing.assert_array_equal(np.array(layer.ple.ple_embedding.table(rows)), whole[rows])


def test_check_names_the_layout_and_where_the_mtp_head_would_be(converted):
    """`hetero check` on mlx-vlm's folder: supported, the PLE tables counted, and one line saying the MTP head the
    config declares is not in the folder and where mlx-vlm's `convert --mtp` would put it."""
    _, path, _ = converted
    report = preflight(path)
    text = "\n".join(report.lines())
    assert report.ok, text
    assert "Qwen4ExpForConditionalGeneration (model_type qwen4_exp): supported" in text
    assert "PLE n-gram tables:" in text and "on layers [1, 3]" in text
    assert not report.has_mtp
    assert [w for w in report.warnings if "no mtp.* tensors" in w and f"{path}-mtp" in w]


def test_bf16_conversion_greedy_equals_mlx_vlm(tmp_path_factory):
    """`convert --dtype bfloat16`: every tensor (the PLE shards too, read from the file as BF16) stored in bf16;
    both engines compute in fp32 from those weights and pick the same greedy tokens."""
    from hetero.checkpoint.safetensors import checkpoint_tensors

    _, path, _ = _convert(tmp_path_factory, "q4vlmbf16", quantize=False, dtype="bfloat16")
    tensors = checkpoint_tensors(path)[0]
    assert {t.dtype for n, t in tensors.items() if "ngram_embedding.shards" in n} == {"BF16"}
    assert _hetero_greedy(path) == _mlx_vlm_greedy(path)


def test_4bit_conversion_greedy_equals_mlx_vlm(converted_4bit):
    """mlx-vlm's `-q --q-bits 4` (groups of 64, the PLE tables in groups of 32) loads quantized in hetero, and
    hetero's greedy tokens equal mlx-vlm's own on the same folder."""
    import mlx.nn as nn

    _, path, _ = converted_4bit
    assert json.loads((path / "config.json").read_text())["quantization"]["bits"] == 4
    model = load_model(path, fuse_projections=False)[0]
    assert isinstance(model.layers[0].linear_attn.in_proj_qkv, nn.QuantizedLinear)
    assert _hetero_greedy(path) == _mlx_vlm_greedy(path)


def test_quantized_ple_rows_are_read_exactly_from_disk(converted_4bit):
    """mlx-vlm's 4-bit PLE shards stay in the file (no table among the parameters, the governor counts their
    packed bytes as on disk) and a gather returns exactly the stored rows dequantized."""
    from mlx.utils import tree_flatten

    from hetero.models.qwen4_exp.ple_table import QuantizedDiskTable

    _, path, _ = converted_4bit
    model = load_model(path)[0]
    assert not [k for k, _ in tree_flatten(model.parameters()) if "ngram_embedding" in k]
    stored = mx.load(str(path / "model.safetensors"))
    packed = 0
    for i, layer in enumerate(model.layers):
        if layer.ple is None:
            continue
        table = layer.ple.ple_embedding.table
        assert isinstance(table, QuantizedDiskTable) and (table.bits, table.group_size) == (4, 32)
        prefix = f"language_model.model.layers.{i}.ple.ple_embedding.ngram_embedding.shards"
        whole = mx.concatenate([mx.dequantize(stored[f"{prefix}.{k}.weight"], stored[f"{prefix}.{k}.scales"],
                                              stored[f"{prefix}.{k}.biases"], group_size=32, bits=4)
                                for k in range(2)])  # [rows, 32]
        packed += sum(stored[f"{prefix}.{k}.{kind}"].nbytes for k in range(2) for kind in ("weight", "scales", "biases"))
        rows = np.random.default_rng(i).integers(0, whole.shape[0], (2, 5, 4))
        np.testing.assert_array_equal(np.array(table(rows)), np.array(whole[mx.array(rows)]))
    assert model.ple_disk_bytes == packed


def test_quantized_ple_table_in_another_mode_is_one_line(converted_4bit, tmp_path):
    """A PLE table quantized in a mode hetero does not read (mxfp4 here, declared in config.json) is refused in one
    line at check time."""
    _, path, _ = converted_4bit
    copy = tmp_path / "mxfp4"
    shutil.copytree(path, copy)
    config = json.loads((copy / "config.json").read_text())
    for key, value in config["quantization"].items():
        if ".ngram_embedding.shards." in key:
            value["mode"] = "mxfp4"
    (copy / "config.json").write_text(json.dumps(config))
    problem = preflight(copy).first_problem()
    assert "quantized in mode 'mxfp4'" in problem and "--q-mode affine" in problem and "\n" not in problem


def test_mtp_head_is_read_from_mlx_vlms_drafter_folder(converted_mtp):
    """`mlx_vlm convert --mtp` writes the head to `<out>-mtp` (its tensors without the `mtp.` prefix): hetero finds it
    there, `hetero check` says so, and its draft logits equal those of the head read from the original checkpoint's
    `mtp.*` tensors (which test_qwen4_mtp holds against a float64 oracle)."""
    _, path, src = converted_mtp
    drafter = path.with_name(path.name + "-mtp")
    assert json.loads((drafter / "config.json").read_text())["model_type"] == "qwen4_exp_mtp"
    assert not any(n.startswith("mtp.") for n in mx.load(str(drafter / "model.safetensors")))
    report = preflight(path)
    assert report.ok and report.has_mtp
    assert f"MTP head: present, read from mlx-vlm's drafter folder {drafter}" in "\n".join(report.lines())
    tokens = mx.array([_prompt()])
    draft = []
    for folder in (path, src):
        model = load_model(folder)[0]
        assert model.has_mtp
        _, streams = model(tokens[:, :-1])
        draft.append(np.array(model.draft_logits(model.mtp_hidden(tokens[:, 1:], streams))))
    assert np.abs(draft[0] - draft[1]).max() <= 1e-5 * np.abs(draft[1]).max()


def test_4bit_drafter_folder_loads_quantized_and_greedy_mtp_equals_plain(converted_4bit):
    """`convert -q --mtp` quantizes the drafter too, its routed experts one by one (`experts.{e}.*.scales`): hetero
    stacks them quantized, and greedy speculative decoding with that head equals plain greedy decoding."""
    from hetero.decode.records import MTPStats
    from hetero.decode.sampling import Sampler, SamplingParams
    from hetero.decode.solo import decode_tokens

    _, path, _ = converted_4bit
    drafter = mx.load(str(path.with_name(path.name + "-mtp") / "model.safetensors"))
    assert "layers.0.mlp.experts.0.gate_proj.scales" in drafter
    model = load_model(path)[0]
    assert model.has_mtp and "scales" in model.mtp.layers[0].mlp.switch_mlp.gate_proj  # stacked, still 4-bit
    greedy, stats = Sampler(SamplingParams()), MTPStats(2)
    plain = list(decode_tokens(model, _prompt(), greedy, 16, set()))
    assert list(decode_tokens(model, _prompt(), greedy, 16, set(), depth=2, copy=False, stats=stats)) == plain
    assert stats.mtp_rounds > 0
