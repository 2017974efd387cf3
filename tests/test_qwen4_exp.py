"""Qwen4-Exp (qwen4_exp / qwen4_exp_text) against transformers 5.25 on tiny random checkpoints that it writes:
hyper-connections, QSA (prompts several times the indexer budget, so keys are really dropped), PLE on two
placements, routed + shared experts, the GDN's sigmoid output gate; cached decode and chunked prefill; the loader's
check, bad checkpoints and the Engine."""

from __future__ import annotations

import hetero  # before mlx: the fast BLAS
import mlx.core as mx
import numpy as np
import pytest
import qwen4_checkpoint as qc
import torch

from hetero.checkpoint.loader import load_model
from hetero.errors import HeteroError


def load(path):
    """The model alone, through hetero's loader (pre-flight check, sanitize, fused projections)."""
    return load_model(path)[0]


PROMPT = 48  # 12 index blocks of 4 against a budget of 2 blocks


def _tokens(n: int, seed: int) -> list[int]:
    toks = [int(t) for t in np.random.default_rng(seed).integers(2, qc.VOCAB, n)]
    toks[n // 3] = qc.EOS  # an EOS inside the prompt: the n-gram context restarts there
    return toks


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4flat")
    return path, qc.build(path, ple_layer_ids=(1, 2), seed=0)


@pytest.fixture(scope="module")
def nested(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4nested")
    return path, qc.build(path, nested=True, ple_layer_ids=(2, 4), seed=1)


def _run(model, tokens: list[int], chunk: int | None = None) -> np.ndarray:
    """Logits [S, V] from one pass (chunk None) or chunk by chunk over a cache."""
    if chunk is None:
        return np.array(model(mx.array([tokens]))[0][0])
    cache, out = model.make_cache(), []
    for i in range(0, len(tokens), chunk):
        logits, _ = model(mx.array([tokens[i : i + chunk]]), cache)
        out.append(np.array(logits[0]))
    return np.concatenate(out)


def _close(ours: np.ndarray, ref: np.ndarray) -> None:
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("layout", ["flat", "nested"])
def test_logits_match_transformers(layout, request):
    path, hf = request.getfixturevalue(layout)
    model = load(path)
    for seed in (0, 1):
        tokens = _tokens(PROMPT, seed)
        _close(_run(model, tokens), qc.hf_logits(hf, tokens))


def test_prompt_is_long_enough_for_qsa_to_drop_keys(flat):
    """The indexer keeps at most budget + c - 1 keys per query, and the logits depend on which."""
    path, hf = flat
    model = load(path)
    attn = next(l.self_attn for l in model.layers if not l.is_linear)
    x = mx.random.normal((1, PROMPT, qc.TEXT["hidden_size"]), key=mx.random.key(0))
    q, k = attn.indexer.project(x)
    kept = np.array(attn.indexer.select(q, k, 0)[0]).sum(-1)  # [S]
    budget, ratio = qc.TEXT["indexer_budget"], qc.TEXT["indexer_compress_ratio"]
    assert kept.max() <= budget + ratio - 1 and kept[-1] < PROMPT
    tokens = _tokens(PROMPT, 0)
    ref = qc.hf_logits(hf, tokens)
    attn.indexer = None  # plain causal attention over every key
    assert np.abs(_run(model, tokens) - ref).max() > 1e-2 * np.abs(ref).max()


@pytest.mark.parametrize("chunk", [1, 3, 7, 16])
def test_chunked_prefill_and_decode_equal_one_pass(nested, chunk):
    """Over a cache (GDN state, PLE token context and conv window, QSA keys and index keys) every chunk size gives
    the one-pass logits, through positions where the indexer drops keys."""
    path, hf = nested
    model = load(path)
    tokens = _tokens(PROMPT, 2)
    _close(_run(model, tokens, chunk), qc.hf_logits(hf, tokens))


def test_greedy_decode_equals_transformers_generate(flat):
    path, hf = flat
    model = load(path)
    prompt = _tokens(30, 3)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    cache = model.make_cache()
    logits, _ = model(mx.array([prompt]), cache)
    out = []
    for _ in range(12):
        out.append(int(mx.argmax(logits[0, -1])))
        logits, _ = model(mx.array([[out[-1]]]), cache)
    assert out == ref


def test_missing_ple_shard_is_one_line(tmp_path):
    from safetensors.numpy import load_file, save_file

    qc.build(tmp_path, ple_layer_ids=(1,), seed=4)
    for file in tmp_path.glob("*.safetensors"):
        tensors = load_file(file)
        save_file({k: v for k, v in tensors.items() if "shard_1" not in k}, file, metadata={"format": "pt"})
    with pytest.raises(HeteroError, match=r"layer 0's PLE n-gram table has 1 of its 2 shards") as e:
        load(tmp_path)
    assert "\n" not in str(e.value)


def test_wrong_hc_count_is_one_line(tmp_path):
    qc.build(tmp_path, seed=5)
    qc.patch_config(tmp_path, hc_count=3)
    with pytest.raises(HeteroError, match=r"hc_count 3.*2 streams") as e:
        load(tmp_path)
    assert "\n" not in str(e.value)


def test_check_names_architecture_ple_tables_and_experts(flat):
    from hetero.checkpoint.preflight import preflight

    path, _ = flat
    report = preflight(path)
    text = "\n".join(report.lines())
    assert report.ok, text
    assert "Qwen4ExpForCausalLM (model_type qwen4_exp_text): supported" in text
    assert "experts: 4 routed + 1 shared, 2 active per token" in text
    model = load(path)
    table = sum(l.ple.ple_embedding.table.rows * l.ple.ple_embedding.table.width for l in model.layers if l.ple)
    assert f"PLE n-gram tables: {table:,} parameters in all, on layers [0, 1]" in text


def test_ple_tables_stay_on_disk(flat):
    """A loaded model holds no PLE table among its parameters (what the governor counts as weights): each PLE
    layer reads its rows from the checkpoint's shards, memory-mapped, and they equal the stored shards in order."""
    from mlx.utils import tree_flatten
    from safetensors.numpy import load_file

    path, _ = flat
    model = load(path)
    assert not [k for k, _ in tree_flatten(model.parameters()) if "ngram_embedding" in k]
    stored = {}
    for file in path.glob("*.safetensors"):
        stored.update(load_file(file))
    for i, layer in enumerate(model.layers):
        if layer.ple is None:
            continue
        shards = sorted((k for k in stored if f"layers.{i}.ple.ple_embedding.ngram_embedding.shard_" in k),
                        key=lambda k: int(k.split(".shard_")[1].split(".")[0]))
        whole = np.concatenate([stored[k] for k in shards])  # [rows, width]
        table = layer.ple.ple_embedding.table
        rows = np.random.default_rng(i).integers(0, len(whole), (3, 7, 5))
        assert (table.rows, table.width) == whole.shape
        np.testing.assert_array_equal(np.array(table(rows)), whole[rows])


def test_engine_greedy_equals_transformers(tmp_path):
    """`hetero.load` + `Engine.generate` (plain decoding: this checkpoint has no MTP head) give transformers' greedy
    tokens, twice."""
    hf = qc.build(tmp_path, nested=True, ple_layer_ids=(1, 4), seed=6)
    qc.add_tokenizer(tmp_path)
    engine = hetero.load(str(tmp_path))
    ids = engine.tokenizer.encode("def add(a, b):\n    return a + b\n" * 3)
    assert len(ids) >= 4 * qc.TEXT["indexer_budget"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids) :].tolist()
    assert engine.generate(ids, max_tokens=10).tokens == ref
    assert engine.generate(ids + ref[:3], max_tokens=7).tokens == ref[3:]


def test_silu_gate_and_ple_on_last_layer_match_transformers(tmp_path):
    """output_gate_type unset (the GDN gate falls back to hidden_act, SiLU) and PLE on the last layer."""
    hf = qc.build(tmp_path, ple_layer_ids=(4,), seed=7, output_gate_type=None)
    model = load(tmp_path)
    tokens = _tokens(PROMPT, 7)
    _close(_run(model, tokens), qc.hf_logits(hf, tokens))
    _close(_run(model, tokens, 5), qc.hf_logits(hf, tokens))


def test_attention_without_qsa_fields_is_one_line(tmp_path):
    qc.build(tmp_path, seed=8)
    qc.patch_config(tmp_path, indexer_n_heads=None)
    with pytest.raises(HeteroError, match="need the QSA fields") as e:
        load(tmp_path)
    assert "\n" not in str(e.value)


def test_server_batches_concurrent_requests(tmp_path):
    """`hetero serve --max-batch 4` on qwen4_exp: four concurrent chat requests through the real openai SDK decode in
    one batch (the server's /health shows rounds of several requests) and each gets its solo greedy answer. They
    overlap by construction: a long streamed request is decoding in the batch when they are sent (four 16-token
    answers sent at once may otherwise each end before the next one's prefill on a busy machine: a fresh clone's
    run measured a mean batch of 1.0)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from test_server import LiveServer

    qc.build(tmp_path, seed=8)
    qc.add_tokenizer(tmp_path)
    live = LiveServer(hetero.load(str(tmp_path)), max_batch=4, max_concurrent=4)
    try:
        client = live.openai()
        model = client.models.list().data[0].id

        def ask(text: str) -> str:
            out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                                 max_tokens=16, temperature=0)
            return out.choices[0].message.content

        prompts = ["hello there", "write a function", "what is two and two", "explain the code"]
        solo = [ask(p) for p in prompts]
        assert httpx.get(live.url + "/health").json()["batch"]["mean_batch_size"] == 1  # one at a time so far
        holder = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "count to ten"}],
                                                max_tokens=4000, temperature=0, stream=True)
        next(c for c in holder if c.choices and c.choices[0].delta.content)  # decoding in the batch now
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(ask, prompts)) == solo
        holder.close()
        batch = httpx.get(live.url + "/health").json()["batch"]
    finally:
        live.stop()
    # some rounds were shared: the mean over every round (the history holds 512), not only the latest 32, which the
    # longest request may have decoded alone after the others ended
    assert batch["max_batch"] == 4 and batch["rounds"] <= 512 and batch["mean_batch_size"] > 1


def test_the_governor_counts_qsa_kv_and_leaves_ple_on_disk(flat):
    """Per token, each QSA layer keeps K and V and one raw index key; the memory window follows from them (it was
    the model's maximum whatever the RAM, with no attention layer counted). The PLE tables are listed on disk."""
    from hetero.planner.governor import loaded_budget

    path, _ = flat
    model = load(path)
    args = model.args
    per_token = args.layer_types.count("indexed_attention") * (2 * args.num_key_value_heads * args.head_dim
                                                              + args.indexer_head_dim) * 4  # fp32 here
    budget = loaded_budget(model, memory_gb=64)
    assert budget.kv_bytes_per_token == per_token > 0
    assert budget.on_disk == [("PLE n-gram tables", model.ple_disk_bytes)] and model.ple_disk_bytes > 0
    fixed = sum(b for n, b in budget.lines if not n.startswith(("KV cache", "unused")))
    tight = loaded_budget(model, memory_gb=(fixed + per_token * 2048 + 100) / 0.75 / 1e9)
    assert tight.context_window == 2048 < args.max_position_embeddings


@pytest.mark.parametrize("queries,keys", [(48, 48), (40, 300), (8, 300)])
def test_selected_attention_equals_masked_sdpa(queries, keys):
    """QSA's attention over the indexer's keys (on the CPU a prefill chunk's softmax runs in numpy) equals MLX's
    masked scaled-dot-product attention, with the dropped keys weighing nothing, GQA heads and a cache before the
    chunk included."""
    from hetero.models.attention import attend_selected

    rng = np.random.default_rng(queries + keys)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32))
               for s in ((1, 4, queries, 16), (1, 2, keys, 16), (1, 2, keys, 16)))
    pos = np.arange(keys - queries, keys)[:, None]
    allowed = (rng.random((queries, keys)) < 0.3) & (np.arange(keys) <= pos) | (np.arange(keys) == pos)
    mask = mx.array(allowed)[None, None]  # [1, 1, L, T]
    ours = np.array(attend_selected(q, k, v, 0.25, mask))
    ref = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask))
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)
    v_dropped = np.array(v)
    v_dropped[..., ~allowed.any(0), :] = 1e6  # keys no query may see change nothing
    assert np.abs(np.array(attend_selected(q, k, mx.array(v_dropped), 0.25, mask)) - ours).max() < 1e-5


@pytest.mark.parametrize("k", [1, 5, 16, 31])
def test_top_blocks_keeps_what_a_stable_sort_keeps(k):
    """The indexer's block choice by threshold equals the k first of a stable descending sort, ties (repeated
    scores, relu's zeros, -inf of blocks a query cannot see yet) taken lower index first."""
    from hetero.models.qwen4_exp.qsa import top_blocks

    rng = np.random.default_rng(k)
    scores = rng.integers(0, 6, (2, 7, 32)).astype(np.float32)  # many ties
    scores[0, 0] = 0.0  # a row of zeros only
    scores[1, 2, 20:] = -np.inf  # fewer finite scores than k for the larger k
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    want = np.zeros(scores.shape, bool)
    np.put_along_axis(want, order, True, axis=-1)
    got = np.array(top_blocks(mx.array(scores), k))
    assert got.sum(-1).tolist() == [[k] * 7] * 2
    np.testing.assert_array_equal(got, want)
