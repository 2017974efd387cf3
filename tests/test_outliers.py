"""The split on a checkpoint with real LLMs' massive activations (`outliers.py`): MLP channels whose gate x up passes
1e5 on a large share of the tokens, and a residual channel of ~1e4 that every later norm divides by.

A contiguous share of channels holds such a channel, fills its program with inf, and the split falls back to
GPU-only on every prompt. With ranges measured on the GPU lane (`hetero/planner/ranges.py`) those channels stay
on the GPU lane, the programs read normed inputs and carry power-of-two output scales, and the split stays engaged
with the outlier-free checkpoint's effective fraction and passes `--verify` in every dtype."""

from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest
import torch

import hetero
from hetero.decode.sampling import Sampler, SamplingParams
from hetero.decode.solo import decode_tokens
from hetero.models import activations as act
from hetero.pipeline import configure, verify
import hetero.pipeline.run as run_module
from hetero.planner.ranges import FP16_MAX, SAFE
from outliers import LAYERS, MASSIVE, MILD, STRONG, outlier_channels, save_outlier_checkpoint

PROMPT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n" * 6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("outliers")
    return {name: save_outlier_checkpoint(root / name, gain) for name, gain in
            (("free", None), ("strong", STRONG), ("mild", MILD))}


@pytest.fixture
def home(tmp_path, monkeypatch):
    """Exports and ranges of this test alone."""
    monkeypatch.setenv("HETERO_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def module_home(tmp_path_factory):
    return tmp_path_factory.mktemp("outliers-home")


@pytest.fixture
def shared_home(module_home, monkeypatch):
    """Exports and ranges shared by this module's tests that do not count them (a checkpoint's runs in every dtype
    reuse one export, as a user's do)."""
    monkeypatch.setenv("HETERO_HOME", str(module_home))
    return module_home


def _ids(engine) -> list[int]:
    return engine.encode_prompt(PROMPT, False)[:-1]  # 3 chunks of 64, the last padded


def _first_mlp(engine, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Layer 0's silu(gate) x up [T, I] and the residual stream after its MLP [T, hidden], in fp32."""
    layer = engine.model.layers[0]
    h = engine.model.model.embed_tokens(mx.array(ids)[None])
    h = h + layer.linear_attn(layer.input_layernorm(h), engine.model.make_cache()[0])
    x = layer.post_attention_layernorm(h)
    a = act.silu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x)  # [1, T, I]
    return np.array(a[0]), np.array((h + layer.mlp(x))[0])


def test_the_checkpoint_carries_massive_activations(checkpoints):
    """Each outlier channel's gate x up passes 1e5 on 20-80% of the tokens (about half: t = x . v > 0.16), and the residual channel they write
    reaches ~1e4; the outlier-free twin has neither."""
    strong, free = hetero.load(checkpoints["strong"], mx.float32), hetero.load(checkpoints["free"], mx.float32)
    ids = _ids(strong)
    a, h = _first_mlp(strong, ids)
    for c in outlier_channels(a.shape[1]):
        share = float((np.abs(a[:, c]) > 1e5).mean())
        assert 0.2 <= share <= 0.8, (c, share)
    assert np.abs(h[:, MASSIVE]).max() > 1e4 and np.median(np.abs(h[:, MASSIVE])) > 1e3
    a, h = _first_mlp(free, ids)
    assert np.abs(a).max() < SAFE and np.abs(h).max() < 100


def test_gpu_only_still_equals_transformers(checkpoints):
    """The GPU-only path on the outlier checkpoint: last logits within 1e-4 of transformers' (relative to their
    largest), and 8 greedy tokens identical."""
    from transformers import Qwen3_5ForCausalLM

    engine = hetero.load(checkpoints["strong"], mx.float32)
    ids = _ids(engine)
    hf = Qwen3_5ForCausalLM.from_pretrained(checkpoints["strong"], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].numpy()
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=0)
    from hetero.decode.prefill import prefill

    ours, _ = prefill(engine.model, ids, engine.model.make_cache(), 64)
    ours = np.array(ours[-1])
    assert np.abs(ours - ref).max() / np.abs(ref).max() <= 1e-4
    greedy = decode_tokens(engine.model, ids, Sampler(SamplingParams()), max_tokens=8, eos_ids=set())
    assert list(greedy) == out[0, len(ids):].tolist()


def test_a_contiguous_share_loses_the_lane(checkpoints, shared_home, monkeypatch, capsys):
    """The control: the same split without measured ranges (a contiguous share of channels, which holds an outlier
    channel) returns inf from its first MLP program, and the prompt falls back to GPU-only."""
    monkeypatch.setattr(run_module, "within_range", lambda plan, ranges: plan)
    engine = hetero.load(checkpoints["strong"], mx.float32)
    run = configure(engine, 0.5, 64)
    cache, n, _ = run.prefill(_ids(engine))
    assert n == 0 and run.lane_failures == 1 and "non-finite" in run.last_failure, run.last_failure
    assert "prefilled GPU-only" in capsys.readouterr().err


@pytest.mark.parametrize("name, dtype", [("strong", mx.float32), ("strong", mx.bfloat16), ("mild", mx.float16)])
def test_the_split_stays_engaged_and_verifies(checkpoints, shared_home, name, dtype):
    """In the worker process lane: no lane failure, the outlier-free twin's effective fraction (within 0.1), the
    outlier channels' blocks and no others kept on the GPU lane (all 4 of 64 channels in each of 2 layers where they
    are strong), every program's measured
    values at least 3 bits inside fp16, and `--verify` passes. fp16 takes the mild outliers (gate x up past the
    ANE's safe 4096, inside fp16): the strong ones overflow fp16 on the GPU-only path itself."""
    engine = hetero.load(checkpoints[name], dtype)
    twin = configure(hetero.load(checkpoints["free"], dtype), 0.5, 64)
    ids = _ids(engine)
    run = configure(engine, 0.5, 64)
    blocks = {c // 64 for c in outlier_channels(engine.model.args.intermediate_size)}
    for layer in range(engine.model.args.num_hidden_layers):
        r = run.plan.ranges.get(layer, "mlp")
        kept = set(r.order[r.safe_units // r.block:])
        assert kept <= blocks and (layer != LAYERS[0] or kept == blocks), (layer, kept)  # only outlier blocks stay
    if name == "strong":
        assert run.plan.ranges.kept_on_gpu()["mlp"] == len(LAYERS) * 4 * 64
    assert all(bits >= 3 for bits in run.plan.ranges.headroom().values()), run.plan.ranges.headroom()
    assert abs(run.effective_fraction - twin.effective_fraction) <= 0.1
    cache, n, _ = run.prefill(ids)
    assert run.lane_failures == 0 and n == len(ids) - 1
    check = verify(run, ids, n_tokens=8)
    assert check["match"], check
    assert "fp16_headroom_bits" in run.plan.to_dict()


def test_ranges_are_measured_once_per_plan(checkpoints, home, monkeypatch):
    """The ranges are cached next to the split's programs: a second split of the same plan reads them; another
    fraction measures again. A damaged file is measured again, never trusted."""
    import hetero.pipeline.calibrate as calibrate_module

    engine = hetero.load(checkpoints["strong"], mx.float32)
    first = configure(engine, 0.5, 64)
    real, calls = calibrate_module.calibrate, []
    monkeypatch.setattr(calibrate_module, "calibrate", lambda *a: calls.append(a) or real(*a))
    again = configure(engine, 0.5, 64)
    assert not calls and again.plan.ranges.to_dict() == first.plan.ranges.to_dict()
    configure(engine, 0.25, 64)
    assert len(calls) == 1
    (file,) = home.rglob("ranges.json")
    file.write_text("{not json")
    configure(engine, 0.5, 64)
    assert len(calls) == 2


def test_output_shifts_keep_every_program_output_inside_fp16(checkpoints, shared_home):
    """Every offloaded piece's largest measured output, after its 2^-shift, is at most the safe 4096."""
    engine = hetero.load(checkpoints["strong"], mx.float32)
    ranges = configure(engine, 0.5, 64).plan.ranges
    for (layer, piece), r in ranges.pieces.items():
        assert r.out_max * 2.0**-r.out_shift <= SAFE, (layer, piece, r)
        assert r.act_max < SAFE and r.input_max < FP16_MAX / 8, (layer, piece, r)




def test_hetero_plan_reports_the_headroom_a_split_run_measured(checkpoints, home, capsys):
    """`hetero plan` never loads the weights: before a split run of the checkpoint it says the headroom is not
    measured; after one, it plans with that run's ranges (the outlier channels counted on the GPU lane, the same
    effective fraction at the run's planning context) and reports their headroom per piece kind."""
    from hetero.cli.main import main

    path = str(checkpoints["strong"])
    plan = ["plan", "--model", path, "--ane-fraction", "0.5", "--chunk", "64", "--context", "4096"]
    assert main(plan) == 0
    assert "fp16 headroom: not measured yet" in capsys.readouterr().out
    run = configure(hetero.load(path, mx.float32), 0.5, 64)
    assert main(plan + ["--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["fp16_headroom_bits"] == run.plan.ranges.headroom()
    assert out["kept_on_gpu_for_range"] == run.plan.ranges.kept_on_gpu() and out["kept_on_gpu_for_range"]["mlp"] > 0
    assert out["effective_fraction"] == round(run.plan.effective_fraction, 6)
    assert main(plan) == 0
    assert "fp16 headroom (bits, measured): " in capsys.readouterr().out


def test_the_governor_counts_the_gpu_shares_gathered_beside_the_weights(checkpoints, shared_home):
    """Channels chosen by range are not a slice: the GPU lane's rest of an outlier layer's MLP is gathered into new
    arrays (gate and up rows, down columns), which the split reports and the memory governor budgets. Contiguous
    rests are views of the loaded weights and cost nothing."""
    from hetero.planner import loaded_budget

    engine = hetero.load(checkpoints["strong"], mx.float32)
    run = configure(engine, 0.5, 64)
    split = run.splitter(len(_ids(engine)) - 1)
    args = engine.model.args
    expected = 0
    for layer, rest in split.pieces.mlp_rest.items():
        r = run.plan.ranges.get(layer, "mlp")
        gpu = args.intermediate_size - len(split.programs.ane_units("mlp", layer))
        assert rest.copied == (3 * gpu * args.hidden_size * 4 if r.order else 0), layer
        expected += rest.copied
    assert expected > 0 and split.copied_bytes() == expected
    plain = loaded_budget(engine.model, 24, in_flight=4)
    budget = loaded_budget(engine.model, 24, in_flight=4, split_copy_bytes=split.copied_bytes())
    assert ("GPU lane's split shares gathered beside the weights", expected) in budget.lines
    assert not any("gathered" in name for name, _ in plain.lines)
