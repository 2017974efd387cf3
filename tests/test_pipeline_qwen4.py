"""The two-lane split on Qwen4-Exp (issue 32, item 5): the ANE takes KV-head groups of every QSA layer (attending to
the keys the GPU's indexer selects), channels of every layer's shared expert and the z rows of every GDN layer
(Core ML programs run by the reference executor); the hyper-connection mixers, PLE, the GDN recurrence, the router
and routed experts and QSA's indexer and index keys stay on the GPU lane.
Split prefill against the GPU-only run (logits, caches, greedy continuation), the exact path's state, `hetero run
--ane-fraction 0.5 --verify`, and `hetero convert --coreml`.

The checkpoints are tiny random `qwen4_exp` layouts written by transformers (tests/qwen4_checkpoint.py): flat with
PLE on layers 0 and 1, and nested with PLE on layers 0 and 3 and an MTP head; QSA drops keys from a few dozen tokens
(budget 8, blocks of 4), and the prompts here are many times that. The shared expert is 128 channels wide (two
64-channel units, so F = 0.5 gives the ANE one). The routers' weights are spread 8x (`spread_routers`): with
4 experts and top-2, the random routers' logits otherwise put some token's 2nd and 3rd experts within the fp16
share's rounding of each other (measured: 1 such token of 600 routing choices flips and moves the logits 1%), a
discrete change of route that no rounding-based tolerance is meant to absorb.
"""

from __future__ import annotations

import json

import hetero  # before mlx: the fast BLAS
import mlx.core as mx
import numpy as np
import pytest
import qwen4_checkpoint as qc

from hetero.cli.main import main
from hetero.decode.prefill import prefill
from hetero.pipeline import configure, verify

SHARED = 128  # shared-expert channels: 2 units of 64
ROUTER_SPREAD = 8.0
LAYOUTS = {"flat": dict(ple_layer_ids=(1, 2)), "nested": dict(nested=True, ple_layer_ids=(1, 4), mtp=True)}
KINDS = ("attention", "gdn_in_proj", "shared_expert")  # every kind a qwen4_exp layer can give the ANE
TOKENS = 150  # 3 chunks of 64 (the last padded): QSA keeps 8 of up to 150 keys per query


def spread_routers(path, factor: float) -> None:
    """Scale every router (`*.mlp.gate.weight`) of the saved checkpoint by `factor`, in place."""
    from safetensors.torch import load_file, save_file

    for file in path.glob("*.safetensors"):
        tensors = load_file(file)
        for name in [n for n in tensors if n.endswith(".mlp.gate.weight")]:
            tensors[name] = tensors[name] * factor
        save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"qwen4-split-{request.param}") / "ckpt"
    qc.build(path, shared_expert_intermediate_size=SHARED, **LAYOUTS[request.param])
    spread_routers(path, ROUTER_SPREAD)
    qc.add_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def engine(checkpoint):
    return hetero.load(str(checkpoint))


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


@pytest.mark.parametrize("fraction, seed", [(0.5, 0), (0.5, 1), (1.0, 2)])
def test_split_prefill_matches_gpu_only(engine, fraction, seed):
    """At 0.5 every layer gives the ANE half of its shared expert, the QSA layer one of its two KV groups (at 1.0 all
    of both: no GPU share to merge), every GDN layer all of its z rows; the split's logits and caches pass verify
    against the fp32 reference and 16 greedy tokens are the GPU-only run's."""
    model = engine.model
    args = model.args
    assert args.model_type.startswith("qwen4_exp") and TOKENS >= 4 * args.indexer_budget  # QSA drops keys
    run = configure(engine, fraction, 64, offload=KINDS, lane="thread")
    split = run.splitter(TOKENS)
    progs = split.programs
    whole = fraction == 1.0
    for i, layer in enumerate(model.layers):
        assert progs.share("shared_expert", i) == SHARED * fraction, i
        assert progs.share("attention", i) == (0 if layer.is_linear else 2 * fraction) and progs.share("mlp", i) == 0
        # the other KV group on the GPU lane
        assert (i in split.pieces.attn_rest) == (not layer.is_linear and not whole)
        assert progs.share("gdn_in_proj", i) == (args.linear_num_value_heads * args.linear_value_head_dim
                                                 if layer.is_linear else 0)
        assert (split.pieces.moe_rest[i].shared is None) == whole  # the other shared channels on the GPU lane
    check = verify(run, _prompt(TOKENS, args.vocab_size, seed), n_tokens=16)
    assert check["match"], check
    assert check["greedy_match_tokens"] == 16 and check["reference"] == "fp32"


def test_exact_path_state_is_the_gpu_only_runs(engine):
    """Layer 0 reads nothing the ANE computed before its recurrence and PLE (the z rows and the shared expert come
    after them): its GDN state and PLE state equal the GPU-only run's; the streams after the ANE's shares do not
    (the share is real), and the last position's hc streams (the carry the MTP head and decoding read) are close."""
    model = engine.model
    ids = _prompt(TOKENS, model.args.vocab_size, 2)
    split_cache, gpu_cache = model.make_cache(), model.make_cache()
    res = configure(engine, 0.5, 64, offload=KINDS, lane="thread").splitter(TOKENS).run(ids, split_cache, logits=True)
    logits, hidden = prefill(model, ids, gpu_cache, 64)
    a, b = split_cache[0], gpu_cache[0]
    for got, want in [(a.recurrent, b.recurrent), (a.conv, b.conv), (a.ple.conv, b.ple.conv)]:
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-6)
    assert np.array_equal(a.ple.context, b.ple.context)
    assert res.hidden.shape == hidden.shape == (1, model.hidden_width)  # the hc streams, not one mixed row
    h, g = np.array(res.hidden), np.array(hidden)
    assert 0 < np.abs(h - g).max() <= 1e-2 * np.abs(g).max()
    assert 0 < np.abs(np.array(res.logits) - np.array(logits)).max()  # the ANE's fp16 share shows


PROMPT = "def add(a, b):\n    return a + b\n" * 6


def test_run_split_verify_cli(engine, checkpoint, capsys):
    """`hetero run --ane-fraction 0.5 --verify` (the ANE lane's worker process) exits 0 with the ANE lane busy, passes
    verify, and generates what the GPU-only run does."""
    assert len(engine.tokenizer.encode(PROMPT)) >= 4 * engine.model.args.indexer_budget
    argv = ["run", "--model", str(checkpoint), "--prompt", PROMPT, "--max-tokens", "8", "--prefill-chunk", "64",
            "--json"]
    assert main(argv + ["--ane-fraction", "0.5", "--verify", "--verify-tokens", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ane"]["requested_fraction"] == 0.5 and out["pipeline"]["ane_busy_s"] > 0
    assert out["verify"]["match"] and out["verify"]["greedy_compared_tokens"] == 8
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == out["tokens"]


def test_convert_coreml_writes_the_split_programs(checkpoint, tmp_path, capsys):
    """`hetero convert --coreml --ane-fraction 0.5` writes one shared-expert program per layer, one z program per GDN
    layer and one attention program per QSA layer."""
    from hetero.coreml.manifest import read_manifest

    out = tmp_path / "coreml"
    assert main(["convert", "--model", str(checkpoint), "--coreml", "--ane-fraction", "0.5", "--chunk-size", "64",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    programs = read_manifest(out)["programs"]
    config = json.loads((checkpoint / "config.json").read_text())
    types = (config.get("text_config") or config)["layer_types"]
    want = {(i, "shared_expert") for i in range(len(types))}
    want |= {(i, "gdn_in_proj" if t == "linear_attention" else "attention") for i, t in enumerate(types)}
    assert {(p["layer"], p["piece"]) for p in programs} == want


def test_chunk_edges_see_the_state_at_each_edge(engine):
    """`on_chunk` (the prefix cache's hook) sees at every chunk edge n the cache as it stood at n, while layers
    below already hold later chunks: each GDN layer's state and PLE state as its chunk left them, each QSA layer's
    K, V and index keys up to n. Layer 0's (exact path) equal a GPU-only prefill of the first n tokens; the QSA
    layer's are within the fp16 share's rounding of it."""
    model = engine.model
    ids = _prompt(TOKENS, model.args.vocab_size, 3)
    views = {}
    split = configure(engine, 0.5, 64, offload=KINDS, lane="thread").splitter(TOKENS)
    split.run(ids, model.make_cache(), logits=False, on_chunk=lambda n, cache, hidden: views.setdefault(n, cache))
    assert sorted(views) == [64, 128, TOKENS]
    qsa = model.args.layer_types.index("indexed_attention")
    for n in (64, 128):
        gpu = model.make_cache()
        prefill(model, ids[:n], gpu, 64)
        at = views[n].backbone
        assert all(c.offset == n for c in at)
        exact = [(at[0].recurrent, gpu[0].recurrent), (at[0].conv, gpu[0].conv), (at[0].ple.conv, gpu[0].ple.conv)]
        for got, want in exact:
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-6)
        assert np.array_equal(at[0].ple.context, gpu[0].ple.context)
        got, want = at[qsa].rows(0, n), gpu[qsa].rows(0, n)
        assert len(got) == 3  # K, V and the index keys
        for x, y in zip(got, want):
            x, y = np.array(x), np.array(y)
            assert x.shape == y.shape and np.abs(x - y).max() <= 1e-2 * np.abs(y).max()


def test_quantized_split_matches_gpu_only(checkpoint):
    """4-bit weights (group 32, so the shared expert's down_proj and o_proj split at column 64 and 32; the routed
    experts, 16 channels wide, stay float): the exporter writes the ANE's rows and columns as exact lookup tables and
    the GPU rest slices the packed weights; verify passes and 16 greedy tokens are the GPU-only run's."""
    import types

    import mlx.nn as nn

    engine = hetero.load(str(checkpoint))
    grouped = lambda path, m: isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.shape[-1] % 32 == 0  # noqa: E731
    nn.quantize(engine.model, group_size=32, bits=4, class_predicate=grouped)
    mx.eval(engine.model.parameters())  # on this thread: the lanes evaluate on their own
    layer = engine.model.layers[2]
    assert isinstance(layer.self_attn.o_proj, nn.QuantizedLinear)
    assert isinstance(layer.mlp.shared_expert.down_proj, nn.QuantizedLinear)
    engine = types.SimpleNamespace(model=engine.model, config=engine.config, path=engine.path,
                                   identity=f"{engine.identity}-q4", weights_fingerprint="q4g32")
    run = configure(engine, 0.5, 64, offload=KINDS, lane="thread")
    assert run.splitter(TOKENS).programs.weight_forms.get("lut", 0) > 0  # the quantized matrices as lookup tables
    check = verify(run, _prompt(TOKENS, engine.model.args.vocab_size, 1), n_tokens=16)
    assert check["match"] and check["greedy_match_tokens"] == 16, check
