"""Each layer's input projections fused at load (`hetero.models.fused`): GDN qkv|z|b|a, attention q|k|v, SwiGLU
gate|up and the routed experts' gate|up as one product each, quantized ones as quantized products, the checkpoint's
names kept for every reader.

The fused products must give what the separate ones give (per layer, at the row counts that take the CPU's
transposed path and those that do not), the loaded models the same logits and greedy tokens as loaded unfused,
and whatever writes weights by name (HF export, quantization) the checkpoint's tensors.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

import hetero
from hetero.checkpoint.loader import load_model
from hetero.checkpoint.source import read_config
from hetero.cli.quantize import quantizable, quantize_checkpoint
from hetero.distributed.shard import load_share
from hetero.models import moe
from hetero.models.fused import FusedProjection, fuse, project_inputs, unfuse
from hetero.models.qwen3_5 import MLP, Attention, GatedDeltaNet, Model
from hetero.models.qwen3_5.args import ModelArgs
from hetero.training.hf_export import hf_config, save_hf_checkpoint
from tests.tiny_checkpoint import random_weights, write_tiny_model

FUSABLE = (GatedDeltaNet, Attention, MLP)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("fused") / "tiny")


@pytest.fixture(scope="module")
def tiny_q4(tiny, tmp_path_factory):
    """The tiny model at 4 bits, group size 32, as `hetero convert --quantize` writes it (in_proj_b/a stay float)."""
    return quantize_checkpoint(str(tiny), tmp_path_factory.mktemp("fused_q") / "q4", 4, group_size=32)


def fusable(net: nn.Module) -> list[nn.Module]:
    return [m for _, m in net.named_modules() if isinstance(m, FUSABLE)]


def separate(m: nn.Module, x: mx.array) -> list[mx.array]:
    """The parts' own products, one by one (as before fusion)."""
    return [m[n](x) for n in m.PROJECTIONS]


def in_dims(lin: nn.Module) -> int:
    """A projection's input width (a quantized weight packs 32 // bits values per uint32)."""
    packed = isinstance(lin, nn.QuantizedLinear)
    return lin.weight.shape[1] * 32 // lin.bits if packed else lin.weight.shape[1]


def assert_same_outputs(m: nn.Module, rows: int, seed: int = 0) -> None:
    x = mx.random.normal((1, rows, in_dims(m[m.PROJECTIONS[0]])), key=mx.random.key(seed))  # [1, rows, in]
    got, want = project_inputs(m, x), separate(m, x)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-6)


def logits(net: Model, tokens: list[int]) -> np.ndarray:
    out, _ = net(mx.array([tokens]))  # [1, S, vocab]
    return np.array(out.astype(mx.float32))


def test_bundled_model_loads_with_one_product_per_layer_input():
    net, _, _ = load_model(None)
    mods = fusable(net)
    assert len(mods) == 2 * len(net.layers) + 2  # every mixer and MLP, and the MTP layer's
    for m in mods:
        assert isinstance(m.fused, FusedProjection) and len(m.fused.products) == 1, type(m).__name__
        assert m.fused.matches(m)
    gdn = net.layers[0].linear_attn
    rows = [gdn[n].weight.shape[0] for n in gdn.PROJECTIONS]
    assert gdn.fused.products[0][0].weight.shape[0] == sum(rows)  # qkv|z|b|a rows in one weight


def test_fusion_off_keeps_separate_products(tiny):
    net, _, _ = load_model(tiny, fuse_projections=False)
    assert all(m.fused is None for m in fusable(net))


def test_parameters_keep_checkpoint_names_and_values(tiny):
    fused, _, _ = load_model(tiny)
    plain, _, _ = load_model(tiny, fuse_projections=False)
    a, b = dict(tree_flatten(fused.parameters())), dict(tree_flatten(plain.parameters()))
    assert list(a) == list(b)
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in a and "model.layers.1.self_attn.q_proj.weight" in a
    for k in a:
        assert a[k].shape == b[k].shape and np.array_equal(np.array(a[k]), np.array(b[k])), k


@pytest.mark.parametrize("rows", [1, 3, 7, 60])  # 4-48 rows multiply transposed on the CPU (linear.py)
def test_fused_products_equal_separate_products(tiny, rows):
    net, _, _ = load_model(tiny)
    for m in fusable(net):
        assert m.fused is not None
        assert_same_outputs(m, rows)


def test_fused_model_matches_unfused_model(tiny):
    fused, _, _ = load_model(tiny)
    plain, _, _ = load_model(tiny, fuse_projections=False)
    tokens = list(range(5, 45))
    np.testing.assert_allclose(logits(fused, tokens), logits(plain, tokens), rtol=1e-5, atol=1e-5)


def test_bundled_greedy_tokens_identical_fused_and_unfused():
    fused, plain = hetero.load(None), hetero.load(None, fuse_projections=False)
    ids = np.random.default_rng(1).integers(3, fused.model.args.vocab_size, 60).tolist()
    for options in (dict(mtp=False), dict(mtp=True, draft_depth=3)):
        a = fused.generate(ids, max_tokens=24, use_prefix_cache=False, **options).tokens
        b = plain.generate(ids, max_tokens=24, use_prefix_cache=False, **options).tokens
        assert a == b, options


def test_quantized_parts_fuse_as_quantized_products(tiny_q4):
    net, _, _ = load_model(tiny_q4)
    gdn = net.layers[0].linear_attn
    (qz, qz_split), (ba, ba_split) = gdn.fused.products  # qkv|z quantized, b|a float (kept float by quantize)
    assert isinstance(qz, nn.QuantizedLinear) and qz.weight.dtype == mx.uint32 and qz.bits == 4
    assert qz_split == [gdn.conv_dim] and not isinstance(ba, nn.QuantizedLinear) and ba_split == [gdn.nv]
    attn = net.layers[1].self_attn
    assert len(attn.fused.products) == 1 and isinstance(attn.fused.products[0][0], nn.QuantizedLinear)
    for m in fusable(net):
        for rows in (1, 3):
            assert_same_outputs(m, rows)
    plain, _, _ = load_model(tiny_q4, fuse_projections=False)
    np.testing.assert_allclose(logits(net, list(range(5, 30))), logits(plain, list(range(5, 30))), rtol=1e-5, atol=1e-5)


def test_mixed_bits_fuse_only_neighbours_that_match(tiny):
    net = Model(ModelArgs.from_config(read_config(tiny)), with_mtp=False)
    net.load_weights(list(random_weights(net, 3).items()))
    bits = {"q_proj": 8, "k_proj": 4, "v_proj": 4, "gate_proj": 8, "up_proj": 4}
    nn.quantize(net, group_size=32, class_predicate=lambda p, m: isinstance(m, nn.Linear) and p.endswith(tuple(bits))
                and {"group_size": 32, "bits": bits[p.rsplit(".", 1)[-1]]})
    mx.eval(net.parameters())
    fuse(net)
    attn = net.layers[1].self_attn
    assert [s for _, s in attn.fused.products] == [[], [attn.n_kv_heads * attn.head_dim]]  # q alone, then k|v
    assert all(layer.mlp.fused is None for layer in net.layers)  # gate 8 bits, up 4 bits: nothing to share
    assert_same_outputs(attn, 3)


def test_parameters_replaced_after_fusing_run_the_parts(tiny):
    net, _, _ = load_model(tiny)
    nn.quantize(net, group_size=32, bits=4, class_predicate=quantizable(32))  # new parts: the products are stale
    plain, _, _ = load_model(tiny, fuse_projections=False)
    nn.quantize(plain, group_size=32, bits=4, class_predicate=quantizable(32))
    assert not any(m.fused.matches(m) for m in fusable(net) if isinstance(m[m.PROJECTIONS[0]], nn.QuantizedLinear))
    np.testing.assert_array_equal(logits(net, list(range(5, 25))), logits(plain, list(range(5, 25))))
    unfuse(net)
    assert all(m.fused is None for m in fusable(net))


def test_hf_export_of_a_fused_model_writes_checkpoint_names(tiny, tmp_path):
    net, _, _ = load_model(tiny, dtype=mx.float32)
    file = save_hf_checkpoint(net, hf_config(net.args, [2]), tmp_path / "hf", dtype=mx.float32)
    written = mx.load(str(file))
    layer = "model.language_model.layers"
    for mixer, parts in (("linear_attn", GatedDeltaNet.PROJECTIONS), ("mlp", MLP.PROJECTIONS)):
        for p in parts:
            np.testing.assert_array_equal(np.array(written[f"{layer}.0.{mixer}.{p}.weight"]),
                                          np.array(net.layers[0][mixer][p].weight))
    assert {f"{layer}.1.self_attn.{p}.weight" for p in Attention.PROJECTIONS} <= set(written)
    again, _, _ = load_model(tmp_path / "hf", dtype=mx.float32)  # norms stored w - 1 and read back + 1: rounding
    np.testing.assert_allclose(logits(again, list(range(5, 25))), logits(net, list(range(5, 25))), atol=1e-5)


def test_quantized_checkpoint_keeps_checkpoint_names(tiny_q4):
    written = mx.load(str(tiny_q4 / "model.safetensors"))
    for p in ("in_proj_qkv", "in_proj_z"):
        assert {f"model.layers.0.linear_attn.{p}.{k}" for k in ("weight", "scales", "biases")} <= set(written)
    assert "model.layers.0.linear_attn.in_proj_b.weight" in written and "model.layers.0.mlp.gate_proj.scales" in written


def test_distributed_share_fuses_only_its_own_layers(tiny):
    args = ModelArgs.from_config(read_config(tiny))
    net, _, _ = load_share(tiny, args, range(0, 2), first=True, last=False, dtype=mx.float32)
    assert net.layers[0].linear_attn.fused is not None and net.layers[1].self_attn.fused is not None
    assert net.layers[1].mlp.fused is not None
    assert net.layers[2].linear_attn.fused is None and net.layers[2].mlp.fused is None  # another rank's placeholders


def random_experts(dims: int, hidden: int, experts: int, bits: int | None, seed: int = 0) -> moe.SwitchGLU:
    """Routed experts with N(0, 1/dims) weights, 4-bit quantized (group 32) when `bits`, evaluated."""
    glu = moe.SwitchGLU(dims, hidden, experts)
    rng = np.random.default_rng(seed)
    glu.update(tree_unflatten([(n, mx.array((rng.standard_normal(p.shape) / np.sqrt(dims)).astype(np.float32)))
                               for n, p in tree_flatten(glu.parameters())]))
    if bits:
        nn.quantize(glu, group_size=32, bits=bits)
    mx.eval(glu.parameters())
    return glu


def assert_experts_identical(fused: moe.SwitchGLU, plain: moe.SwitchGLU, experts: int, k: int, dims: int,
                             token_counts=(1, 5, 40)) -> None:
    """Every form (decode's pairs, sorted, the CPU prefill's grouped) gives the unfused experts' very numbers."""
    rng = np.random.default_rng(1)
    for tokens in token_counts:
        x = mx.array(rng.standard_normal((1, tokens, dims)).astype(np.float32))  # [1, S, dims]
        idx = mx.array(np.argsort(rng.random((1, tokens, experts)), axis=-1)[..., :k].astype(np.uint32))  # [1, S, k]
        for form in ("pairs", "sorted", "grouped"):
            got, want = np.array(fused(x, idx, form)), np.array(plain(x, idx, form))
            assert np.array_equal(got, want), (tokens, form, np.abs(got - want).max())


def test_moe_routed_and_shared_experts_fuse_gate_up(tmp_path):
    from tests.test_pipeline_moe import write_moe_checkpoint

    path = write_moe_checkpoint(tmp_path / "moe") or tmp_path / "moe"
    net, _, _ = load_model(path, dtype=mx.float32)
    plain, _, _ = load_model(path, dtype=mx.float32, fuse_projections=False)
    block, plain_block = net.layers[0].mlp, plain.layers[0].mlp
    assert block.shared_expert.fused is not None and len(block.shared_expert.fused.products) == 1
    assert_same_outputs(block.shared_expert, 3)
    glu, plain_glu = block.switch_mlp, plain_block.switch_mlp
    assert plain_glu.fused is None
    experts, width, dims = plain_glu.gate_proj.weight.shape
    for m in (glu, net.mtp.layers[0].mlp.switch_mlp):  # the MTP head's experts too
        (product, offsets), = m.fused.products
        assert isinstance(product, moe.SwitchLinear) and product.weight.shape == (experts, 2 * width, dims)
        assert offsets == [width] and m.fused.matches(m)
    for name in ("gate_proj", "up_proj"):  # the parts: views of the product's rows, the checkpoint's values
        assert np.array_equal(np.array(glu[name].weight), np.array(plain_glu[name].weight)), name
    assert_experts_identical(glu, plain_glu, experts, block.top_k, dims)
    tokens = list(range(5, 30))
    np.testing.assert_allclose(logits(net, tokens), logits(plain, tokens), rtol=1e-5, atol=1e-5)


def test_fused_experts_prefill_chunk_takes_numpys_swiglu_with_the_same_numbers(monkeypatch):
    """A prefill chunk large enough for the grouped form's numpy SwiGLU: the fused product's halves, read in place
    (`activations.silu_mul_halves_now`), give the separate products' very numbers."""
    from hetero.models import activations as act

    fused, plain = random_experts(64, 128, 8, bits=None), random_experts(64, 128, 8, bits=None)
    fuse(fused)
    halves, halves_now = [], act.silu_mul_halves_now
    monkeypatch.setattr(act, "silu_mul_halves_now", lambda y: halves.append(y.size) or halves_now(y))
    assert_experts_identical(fused, plain, 8, 2, 64, token_counts=(700,))
    assert halves and max(halves) // 2 >= act.EAGER_MIN  # the fused form ran, in numpy


def test_quantized_experts_fuse_as_one_quantized_stack():
    fused, plain = random_experts(64, 32, 6, bits=4), random_experts(64, 32, 6, bits=4)
    assert fuse(fused) == 1
    (product, offsets), = fused.fused.products
    assert isinstance(product, moe.QuantizedSwitchLinear) and (product.bits, product.group_size) == (4, 32)
    assert product.weight.dtype == mx.uint32 and product.weight.shape == (6, 64, 64 * 4 // 32) and offsets == [32]
    assert product.scales.shape == product.biases.shape == (6, 64, 2)  # packed rows, scales, biases: one stack
    assert_experts_identical(fused, plain, 6, 2, 64)


def test_experts_replaced_after_fusing_run_their_parts():
    fused, plain = random_experts(64, 32, 6, bits=None), random_experts(64, 32, 6, bits=None)
    fuse(fused)
    for glu in (fused, plain):
        nn.quantize(glu, group_size=32, bits=4)
    assert not fused.fused.matches(fused)  # new parts: the float product is stale and never runs
    assert_experts_identical(fused, plain, 6, 2, 64)
