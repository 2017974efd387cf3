"""The Mac's dtypes in CI: the split prefill and `--verify` in bf16 and fp16 as well as fp32, on a random checkpoint
with Qwen3.5's real layer shapes, checked against a float64 oracle (`oracle64.py`); `--dtype` end to end."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import hetero
from hetero.checkpoint.dtypes import default_dtype, platform_dtype
from hetero.cli.main import main
from hetero.pipeline import verification
from hetero.pipeline import configure, verify
from hetero.pipeline.verify_tolerance import ANE_DTYPE, ANE_SHARE_ERROR, K, MEASURED_ERROR, reference_error, verify_tolerance
from oracle64 import cache_arrays, f64, measure, prefill64, rel
from tiny_checkpoint import write_real_shape_model

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
PROMPT = "def add(a, b):\n    return a + b\n" * 12  # 167 tokens: three 64-token chunks, the last padded


@pytest.fixture(scope="module")
def real_shapes(tmp_path_factory):
    return write_real_shape_model(tmp_path_factory.mktemp("real") / "ckpt")


@pytest.fixture(scope="module")
def engines(real_shapes):
    return {name: hetero.load(real_shapes, d) for name, d in DTYPES.items()}


def _ids(engine) -> list[int]:
    return engine.encode_prompt(PROMPT, False)[:-1]


def test_the_oracle_is_the_fp32_path_within_fp32_rounding(engines):
    """The oracle is right where nothing may differ but rounding: the fp32 GPU-only prefill within 1e-5 of it (head
    dim 256, 128-wide GDN heads, three chunks through the chunked delta rule, one attention layer over the cache)."""
    from hetero.decode.prefill import prefill

    engine = engines["float32"]
    ids = _ids(engine)
    logits, caches = prefill64(engine.model, ids)
    cache = engine.model.make_cache()
    ref, _ = prefill(engine.model, ids, cache, 64)
    ours = cache_arrays(cache.backbone)
    assert rel(f64(ref[-1]), logits) <= 1e-5
    for i, arrays in enumerate(caches):  # every layer's K/V [Hkv, n, D], conv window and state [Hv, Dk, Dv]
        for name, truth in arrays.items():
            assert rel(ours[i][name], truth) <= 1e-5, (i, name)


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32"])
def test_split_verifies_and_is_as_close_to_float64_as_gpu_only(engines, name):
    """In each dtype both paths stay within the dtype's reference error of the float64 oracle, the premise of the
    fixed tolerance (hetero/pipeline/verify_tolerance.py), and the split passes `verify`, judged against the same prompt in
    fp32 (hetero/pipeline/verification.py). The split computes in the model's dtype on the GPU lane and in fp16 on
    the ANE's."""
    engine = engines[name]
    ids = _ids(engine)
    assert engine.model.model.norm.weight.dtype == DTYPES[name]
    m = measure(engine, ids, 0.5)
    for path in ("gpu", "split"):
        assert max(m[path]["logits"], m[path]["cache"]) <= reference_error(DTYPES[name]), m
    run = configure(engine, 0.5, 64)
    check = verify(run, ids, n_tokens=8)
    assert check["reference"] == "fp32" and check["match"], check
    assert check["tolerance"] == pytest.approx(verification.K * check["gpu_distance"] + verification.ANE_FLOOR, abs=2e-6)
    if check["greedy_match_tokens"] < 8:  # parted only where the GPU-only run's own choice was a near-tie
        assert check["greedy_tie_at"] == check["greedy_match_tokens"] and check["greedy_gap"] <= 2 * check["tolerance"]


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32"])
def test_verify_catches_each_defective_program_in_every_dtype(engines, name):
    """A GDN z program whose rows come back zero (it moves this checkpoint's arrays 7%) and an MLP program losing
    half its output (2.8%) fail in every dtype. Under the fixed bf16 tolerance (0.036 of the largest element) the
    MLP defect passed: the split now answers to its distance from fp32, 2.9% against the honest split's 0.8%."""
    engine = engines[name]
    ids = _ids(engine)
    run = configure(engine, 0.5, 64)
    progs = run.splitter(len(ids)).programs
    for programs, factor in ((progs.gdn_in_proj, 0.0), (progs.mlp, 0.5)):
        layer = sorted(programs)[0]
        program, units = programs[layer][0]
        programs[layer][0] = (lambda feed, p=program, f=factor: {k: v * f for k, v in p(feed).items()}, units)
        check = verify(run, ids, n_tokens=1)  # the arrays decide here, not greedy
        programs[layer][0] = (program, units)
        assert not check["match"] and check["distance"] > check["tolerance"], check


@pytest.mark.parametrize("pick", [-2, 0])
def test_greedy_continuations_may_part_only_at_a_near_tie(engines, monkeypatch, pick):
    """A split whose first greedy token is the GPU-only run's runner-up (pick -2) or its least likely token (pick 0):
    verify accepts the parting exactly when the GPU-only logits lead by at most 2 tol x max |logit| there."""
    engine = engines["bfloat16"]
    ids = _ids(engine)
    real, calls = verification.greedy_continuation, []

    def continuation(model, cache, logits, n):
        tokens = real(model, cache, logits, n)
        calls.append(tokens)
        if len(calls) == 1:  # verify asks for the split's continuation first
            order = np.argsort(np.array(logits[-1].astype(mx.float32)))
            tokens = [int(order[pick])] + tokens[1:]
        return tokens

    monkeypatch.setattr(verification, "greedy_continuation", continuation)
    check = verify(configure(engine, 0.5, 64), ids, n_tokens=4)
    assert check["greedy_match_tokens"] == 0 and check["greedy_gap"] > 0, check
    tie = check["greedy_gap"] <= 2 * check["tolerance"]
    assert check["match"] == tie and check["greedy_tie_at"] == (0 if tie else None), check
    if pick == 0:
        assert not check["match"]


def test_tolerance_table_follows_its_derivation():
    """K = 2 (the triangle inequality) x the larger of the dtype's and the ANE share's measured error (the ANE lane
    computes fp16 always)."""
    assert K == 2
    for name, d in DTYPES.items():
        assert verify_tolerance(d) == pytest.approx(K * max(MEASURED_ERROR[name], ANE_SHARE_ERROR))
    assert ANE_SHARE_ERROR == max(MEASURED_ERROR[ANE_DTYPE], MEASURED_ERROR["float32"])  # fp32's worst is a split
    assert verify_tolerance(mx.float32) == verify_tolerance(mx.float16) < verify_tolerance(mx.bfloat16)
    with pytest.raises(ValueError):
        verify_tolerance(mx.int32)


# ----------------------------------------------------------------------------------------------------------
# --dtype on the command line


def test_run_split_verify_in_bf16_on_the_bundled_model(capsys):
    """`hetero run --dtype bfloat16 --ane-fraction 0.5 --verify`: the model loads in bf16 and the split passes,
    judged against the same prompt in fp32."""
    argv = ["run", "--dtype", "bfloat16", "--ane-fraction", "0.5", "--verify", "--prompt", PROMPT, "--max-tokens", "4",
            "--verify-tokens", "16", "--prefill-chunk", "64", "--no-mtp", "--json"]
    assert main(argv) == 0
    v = json.loads(capsys.readouterr().out)["verify"]
    assert v["match"] and v["reference"] == "fp32" and v["distance"] <= v["tolerance"], v


@pytest.mark.parametrize("command", ["run", "serve", "prefill", "tune"])
def test_dtype_flag_help_default_and_bad_value(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    name = {mx.float32: "float32", mx.bfloat16: "bfloat16"}[platform_dtype()]
    assert "--dtype {float32,bfloat16,float16}" in text and f"(default: {name})" in text
    try:
        code = main([command, "--dtype", "fp8"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1 and "float32, bfloat16, float16" in err, err


def test_prefill_writes_the_cache_in_the_dtype(tmp_path, capsys):
    from hetero.library import load_prompt_cache

    prompt = tmp_path / "p.txt"
    prompt.write_text(PROMPT)
    out = tmp_path / "c.safetensors"
    assert main(["prefill", "--dtype", "float16", "--prompt-file", str(prompt), "--out", str(out)]) == 0
    cache = load_prompt_cache(str(out))
    assert cache[3].keys.dtype == mx.float16  # the bundled model's first attention layer


def test_serve_and_tune_load_in_the_dtype(monkeypatch):
    """The server and the tuner load the model themselves: `--dtype` reaches them as the load default."""
    import hetero.cli.main

    seen = {}  # the names the commands call, in the CLI's module
    monkeypatch.setattr(hetero.cli.main, "serve", lambda *a, **k: seen.setdefault("serve", hetero.load().model))
    monkeypatch.setattr(hetero.cli.main, "tune", lambda engine, **k: seen.setdefault("tune", engine.model))
    assert main(["serve", "--dtype", "bfloat16", "--no-session-cache"]) == 0
    assert main(["tune", "--dtype", "float16", "--tokens", "1"]) == 0
    assert seen["serve"].model.norm.weight.dtype == mx.bfloat16
    assert seen["tune"].model.norm.weight.dtype == mx.float16
    assert default_dtype() == platform_dtype()  # the command's dtype ends with it


def test_library_generate_loads_a_path_in_the_dtype():
    """hetero.generate(path, dtype=...) loads the checkpoint in that dtype; an engine loaded in another is refused."""
    from hetero.checkpoint.source import BUNDLED_MODEL
    from hetero.errors import HeteroError
    from hetero.library import _engine

    text = hetero.generate(str(BUNDLED_MODEL), prompt="def f():", max_tokens=2, dtype=mx.float16, mtp=False)
    assert isinstance(text, str)
    engine = _engine(str(BUNDLED_MODEL), mx.float16)
    assert engine.model.model.norm.weight.dtype == mx.float16
    with pytest.raises(HeteroError, match="already loaded"):
        _engine(engine, mx.bfloat16)
