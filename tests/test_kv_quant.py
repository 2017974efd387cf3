"""Quantized KV (`--kv-bits`, hetero.models.kv_quant): the cache stores exactly what `mx.quantize` gives, attention over it
is attention over the dequantized K/V (prefill chunks, decode, MTP verify, batched rows), rollback still works, the
prefix and session caches keep it apart from full-precision KV, the planner's window grows, and bad values are one
line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import hetero
from hetero.caches.prefix import PrefixCache
from hetero.caches.session import SessionStore
from hetero.cli.main import main
from hetero.decode.prefill import prefill
from hetero.decode.sampling import Sampler, SamplingParams
from hetero.decode.solo import batch_generate, decode_tokens
from hetero.errors import HeteroError
from hetero.models.cache import KVCache
from hetero.models.kv_quant import KVQuant, QuantizedKVCache, kv_quant, use_kv_quant
from hetero.planner import PlanRequest, make_plan
from hetero.profiles import load_profile
from hetero.server.app import ServerSettings
from tiny_checkpoint import write_tiny_model

DATA = Path(__file__).parent / "data"
Q27 = json.loads((DATA / "qwen3.5-27b.json").read_text())
GREEDY = SamplingParams(0.0)


@pytest.fixture(scope="module")
def bundled():
    """The bundled model (head_dim 64: groups of 32 and 64 fit), full-precision KV; tests set `kv_quant` on it."""
    return hetero.load()


@pytest.fixture
def quantized(bundled):
    def use(bits: int | None, group: int = 64):
        use_kv_quant(bundled.model, kv_quant(bits, group if bits else None))
        return bundled

    yield use
    use_kv_quant(bundled.model, None)


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(5, 4000, n).tolist()


class RoundedKV(KVCache):
    """The oracle: a full-precision cache that stores each K/V already rounded by quantize -> dequantize."""

    def __init__(self, quant: KVQuant):
        super().__init__()
        self.quant = quant

    def update_and_fetch(self, keys, values):
        q = lambda x: mx.dequantize(*mx.quantize(x, self.quant.group_size, self.quant.bits),  # noqa: E731
                                    group_size=self.quant.group_size, bits=self.quant.bits)
        return super().update_and_fetch(q(keys), q(values))


# ----------------------------------------------------------------------------------------------------------
# The cache itself


@pytest.mark.parametrize("bits, group", [(8, 64), (4, 32), (8, 128)])
def test_cache_round_trip_equals_mx_dequantize_and_rolls_back(bits, group):
    quant = KVQuant(bits, group)
    rng = np.random.default_rng(bits + group)
    kv = [mx.array(rng.normal(size=(1, 2, 300, 128)).astype(np.float32)) for _ in range(2)]  # [B, Hkv, S, D]
    expect = [mx.dequantize(*mx.quantize(x, group, bits), group_size=group, bits=bits) for x in kv]
    c = QuantizedKVCache(quant)
    c.update_and_fetch(kv[0][:, :, :260], kv[1][:, :, :260])  # a prefill that outgrows one 256-position step
    k, v = c.update_and_fetch(kv[0][:, :, 260:264], kv[1][:, :, 260:264])  # a verify block
    assert c.keys[0].dtype == mx.uint32 and c.keys[0].shape == (1, 2, 512, 128 * bits // 32)
    assert mx.array_equal(k, expect[0][:, :, :264]) and mx.array_equal(v, expect[1][:, :, :264])
    c.trim_to(261)  # 3 of the 4 rejected: later writes land on their slots
    k, v = c.update_and_fetch(kv[0][:, :, 261:300], kv[1][:, :, 261:300])
    assert c.offset == 300
    assert mx.array_equal(k, expect[0]) and mx.array_equal(v, expect[1])
    assert all(mx.array_equal(a, b) for a, b in zip(c.dequantized(), expect))
    full = 2 * 300 * 2 * 128 * 4  # what fp32 K/V of 300 positions hold
    assert sum(a[:, :, :300].nbytes for a in c.state) == full * quant.element_bytes(4) / 4


# ----------------------------------------------------------------------------------------------------------
# Attention over it: the model with the quantized cache equals the model over rounded full-precision K/V


def rounded_cache(model, quant: KVQuant):
    cache = model.make_cache()
    for i, c in enumerate(cache):
        if isinstance(c, KVCache):
            cache[i] = RoundedKV(quant)
    return cache


@pytest.mark.parametrize("bits", [8, 4])
def test_prefill_and_decode_read_the_quantized_cache_exactly(quantized, bits):
    engine = quantized(bits)
    model, quant = engine.model, engine.model.kv_quant
    ids = prompt(200, bits)
    cache = model.make_cache()
    assert {type(c).__name__ for c in cache.backbone} == {"GDNCache", "QuantizedKVCache"}
    assert isinstance(cache.mtp[0], QuantizedKVCache)
    oracle = rounded_cache(model, quant)
    # chunks of 64: each chunk's attention reads the earlier chunks' KV back from the cache (numpy kernel, >= 32 queries)
    got, _ = prefill(model, ids, cache, 64, all_logits=True)
    want, _ = prefill(model, ids, oracle, 64, all_logits=True)
    assert mx.array_equal(got, want)
    for t in (7, 11, 13):  # decode steps: one query over the whole cache
        got, _ = model(mx.array([[t]]), cache)
        want, _ = model(mx.array([[t]]), oracle)
        assert mx.array_equal(got, want)
    full = model.make_cache()
    for i, c in enumerate(full):
        if isinstance(c, QuantizedKVCache):
            full[i] = KVCache()
    full_logits, _ = prefill(model, ids, full, 64, all_logits=True)
    assert not mx.array_equal(want[:, -1], full_logits[:, -1])  # the rounding is real: not the full-precision cache


@pytest.mark.parametrize("bits", [8, 4])
def test_plain_mtp_and_batched_greedy_decoding_agree_with_kv_bits(quantized, bits):
    engine = quantized(bits)
    ids = prompt(150, 10 + bits)
    plain = engine.generate(ids, max_tokens=24, mtp=False, prefill_chunk=64).tokens
    mtp = engine.generate(ids, max_tokens=24, draft_depth=3, prefill_chunk=64)
    assert mtp.tokens == plain  # verify passes write, reject (trim_to) and rewrite quantized slots
    assert 1 < mtp.stats["mtp"]["mean_accepted_length"] < 4  # drafts accepted, and rejected (rolled back), at depth 3
    prompts = [ids, prompt(90, 3), prompt(40, 4)]
    rows = batch_generate(engine.model, prompts, [Sampler(GREEDY) for _ in prompts], [24, 20, 16], set(), [3, 0, 2])
    for p, r in zip(prompts, rows):
        assert r.tokens == list(decode_tokens(engine.model, p, Sampler(GREEDY), len(r.tokens), set()))
    assert rows[0].tokens == plain


def test_greedy_agreement_with_full_kv_at_8_bits(quantized):
    """The bench's figure in small (bench/kv_bits.py measures 2K and 16K): 8-bit KV keeps greedy decoding."""
    ids = prompt(500, 5)
    full = quantized(None).generate(ids, max_tokens=24, mtp=False).tokens
    eight = quantized(8).generate(ids, max_tokens=24, mtp=False).tokens
    assert sum(a == b for a, b in zip(full, eight)) >= 20


# ----------------------------------------------------------------------------------------------------------
# Prefix and session caches


def test_prefix_and_session_caches_store_it_quantized_and_keyed_by_kv_bits(quantized, tmp_path):
    ids, more = prompt(150, 7), [11, 12, 13]
    engine = quantized(8)
    cold8 = engine.generate(ids + more, max_tokens=10, draft_depth=3, prefill_chunk=64)
    key8 = engine.cache_key
    engine.prefix_cache = PrefixCache(store=SessionStore(tmp_path))
    try:
        engine.generate(ids, max_tokens=10, draft_depth=3, prefill_chunk=64)
        node = engine.prefix_cache.lookup(key8, ids)
        assert node is not None and node.kv[0][0].dtype == mx.uint32 and len(node.kv[0]) == 6  # stored packed
        manifest = next(tmp_path.glob("*/*.json"))
        names = mx.load(str(manifest.with_suffix(".safetensors"))).keys()
        assert {"kv.0.k", "kv.0.k.scales", "kv.0.k.biases", "kv.0.v.biases"} <= set(names)

        engine.prefix_cache = PrefixCache(store=SessionStore(tmp_path))  # a restart: nothing in RAM
        warm8 = engine.generate(ids + more, max_tokens=10, draft_depth=3, prefill_chunk=64)
        assert warm8.stats["cached_tokens"] == 150 and warm8.tokens == cold8.tokens  # restored bit for bit

        full = quantized(None)
        assert full.cache_key != key8
        shared = engine.prefix_cache  # the same RAM trie and disk store, full-precision KV now
        cold = full.generate(ids + more, max_tokens=10, draft_depth=3, prefill_chunk=64, use_prefix_cache=False)
        warm = full.generate(ids + more, max_tokens=10, draft_depth=3, prefill_chunk=64)
        assert full.prefix_cache is shared and warm.stats["cached_tokens"] == 0  # the 8-bit entry is not served
        assert warm.tokens == cold.tokens
        assert quantized(4).generate(ids + more, max_tokens=4, prefill_chunk=64).stats["cached_tokens"] == 0
    finally:
        engine.prefix_cache = None


# ----------------------------------------------------------------------------------------------------------
# The governor and `hetero plan`


def test_plan_window_grows_with_kv_bits():
    """Qwen3.5-27B, 4-bit weights, GPU-only, 32 GB: KV memory sets the window (102,912 tokens at bf16 KV)."""
    windows = {b: make_plan(PlanRequest(Q27, load_profile("m4-pro"), 0.0, context=262144, bits=4, memory_gb=32,
                                        kv_bits=b)).memory.context_window for b in (None, 8, 4)}
    assert windows[None] == 102912
    assert windows[8] >= 1.8 * windows[None]
    assert windows[4] > windows[8]
    per_token = make_plan(PlanRequest(Q27, load_profile("m4-pro"), 0.0, context=4096, bits=4, memory_gb=32, kv_bits=8))
    assert per_token.memory.kv_bytes_per_token == 17 * 2 * 4 * (256 + 2 * 2 * 256 // 64)  # packed + scales + biases


def test_plan_command_prints_the_quantized_kv_budget(capsys):
    argv = ["plan", "--model", str(DATA / "qwen3.5-27b.json"), "--bits", "4", "--ane-fraction", "0", "--profile",
            "m4-pro", "--memory-gb", "32", "--context", "262144", "--kv-bits", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "KV cache (8-bit KV, groups of 64): 194048 tokens" in out and "context window: 194048 tokens" in out


def test_loaded_budget_counts_the_quantized_kv(quantized):
    from hetero.planner.governor import loaded_budget

    full = loaded_budget(quantized(None).model, memory_gb=8).kv_bytes_per_token
    eight = loaded_budget(quantized(8).model, memory_gb=8).kv_bytes_per_token
    assert full == 3 * 2 * 2 * 64 * 4  # 2 attention layers + MTP, fp32 on the CPU
    assert eight == 3 * 2 * 2 * (64 + 2 * 4 * 64 // 64)


# ----------------------------------------------------------------------------------------------------------
# Bad values: one line


def one_line(capsys, argv) -> str:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv, needle", [
    (["run", "--prompt", "x", "--kv-bits", "3"], "--kv-bits: invalid choice: 3"),
    (["serve", "--kv-bits", "16"], "--kv-bits: invalid choice: 16"),
    (["plan", "--kv-bits", "8", "--kv-group-size", "48"], "--kv-group-size: invalid choice: 48"),
    (["run", "--prompt", "x", "--kv-group-size", "32"], "--kv-group-size 32 needs --kv-bits 8 or 4"),
    (["run", "--prompt", "x", "--kv-bits", "8", "--ane-fraction", "0.5"], "--kv-bits with --ane-fraction"),
])
def test_bad_kv_flags_are_one_line(capsys, argv, needle):
    assert needle in one_line(capsys, argv)


def test_group_size_that_does_not_divide_head_dim_is_one_line(capsys, tmp_path):
    tiny = write_tiny_model(tmp_path / "tiny")  # head_dim 16: no group size divides it
    err = one_line(capsys, ["run", "--model", str(tiny), "--prompt", "x", "--kv-bits", "8", "--kv-group-size", "32"])
    assert "--kv-group-size 32 does not divide the model's head_dim 16" in err
    plan = ["plan", "--model", str(DATA / "qwen3.5-27b.json"), "--kv-bits", "4", "--kv-group-size", "128"]
    assert main(plan) == 0  # 256 / 128: fine
    capsys.readouterr()


def test_library_and_server_settings_check_kv_bits_too():
    with pytest.raises(HeteroError, match="choose 8 or 4"):
        hetero.load(kv_bits=2)
    with pytest.raises(HeteroError, match="--kv-bits with --ane-fraction"):
        ServerSettings(kv_bits=8, ane=0.5)
    assert ServerSettings(kv_bits=4, kv_group_size=32).kv_group_size == 32


def test_library_prefill_and_split_refuse_quantized_kv(quantized):
    engine = quantized(8)
    with pytest.raises(HeteroError, match="full-precision prompt cache"):
        hetero.prefill(engine, [5, 6, 7])
    with pytest.raises(HeteroError, match="an mlx-lm prompt cache holds full-precision KV only"):
        engine.generate([5, 6], max_tokens=2, prompt_cache=[object()])


# ----------------------------------------------------------------------------------------------------------
# The commands end to end


def test_run_command_decodes_with_quantized_kv(quantized, capsys):
    text = "def add(a, b):\n    return a + b\n"
    assert main(["run", "--prompt", text, "--max-tokens", "12", "--no-mtp", "--kv-bits", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == quantized(4).generate(text, max_tokens=12, mtp=False).tokens


def test_server_over_quantized_kv_serves_from_its_prefix_cache(quantized, tmp_path):
    from test_server import LiveServer

    engine = quantized(8)
    engine.prefix_cache = PrefixCache(store=SessionStore(tmp_path))
    server = LiveServer(engine)
    try:
        client = server.openai()
        prompt = "class Point:\n    def __init__(self, x, y):\n" * 12
        first = client.completions.create(model="bundled", prompt=prompt, max_tokens=10, temperature=0)
        second = client.completions.create(model="bundled", prompt=prompt, max_tokens=10, temperature=0)
    finally:
        server.stop()
        engine.prefix_cache = None
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].text == first.choices[0].text
    assert first.choices[0].text == engine.tokenizer.decode(
        engine.generate(prompt, max_tokens=10, mtp=False, use_prefix_cache=False).tokens)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bits, group", [(8, 32), (8, 64), (4, 64), (4, 128)])
def test_cpu_unpacking_equals_mx_dequantize(dtype, bits, group):
    from hetero.models.kv_quant import dequantize

    x = mx.array(np.random.default_rng(bits * group).normal(0, 3, (1, 3, 70, 256)).astype(np.float32)).astype(dtype)
    packed = mx.quantize(x, group_size=group, bits=bits)
    got = dequantize(*(a[:, :, 5:60] for a in packed), KVQuant(bits, group))  # a strided slice, as the cache reads
    want = mx.dequantize(*packed, group_size=group, bits=bits)[:, :, 5:60]
    assert got.dtype == want.dtype == dtype and mx.array_equal(got, want)


def test_an_architecture_without_quantized_kv_says_so():
    from hetero.models.qwen4_exp.args import Qwen4Args
    from hetero.models.qwen4_exp.model import Model as Qwen4Model
    from qwen4_checkpoint import TEXT  # (imports torch: already loaded in a whole-suite run)

    model = Qwen4Model(Qwen4Args.from_config(dict(TEXT, model_type="qwen4_exp_text")))
    with pytest.raises(HeteroError, match="qwen4_exp models keep full-precision KV only; leave --kv-bits out") as e:
        use_kv_quant(model, KVQuant(8))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("argv, line", [
    (["run", "--prompt", "x", "--kv-bits", "8"],
     "hetero: error: --kv-bits under mlx.launch: the ranks keep full-precision KV only; leave --kv-bits out"),
    (["serve", "--kv-bits", "8"], "hetero: error: --kv-bits: not available when serving across ranks (mlx.launch); "
                                  "leave it out (each rank keeps its prefix cache in RAM)"),
])
def test_kv_bits_under_mlx_launch_is_one_line(argv, line):
    env = {**os.environ, "MLX_RANK": "0", "MLX_HOSTFILE": os.devnull}
    proc = subprocess.run([sys.executable, "-m", "hetero", *argv], cwd=Path(__file__).parents[1], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [line], proc.stderr
