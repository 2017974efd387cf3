"""mlx-lm's mixture-of-experts models run by hetero on their own weight arrays (hetero/checkpoint/mlx_lm_model.py).

The tiny `qwen3_5_moe` checkpoints of tests/test_moe_quantized.py (8 experts, top-3, shared expert), loaded with
`mlx_lm.load`: the fp32 HF checkpoint (mlx-lm splits its fused experts into `switch_mlp` at load) and its
`mlx_lm.convert -q` output (4-bit experts, 8-bit routers). hetero's view must hold mlx-lm's very arrays and give
mlx-lm's logits and greedy tokens; a parameter that does not map, and the layouts mlx-lm gets wrong, fail by name.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import hetero
from hetero.checkpoint.mlx_lm_model import wrap
from hetero.decode.options import DecodeOptions
from hetero.decode.solo import decode_tokens
from hetero.models import moe
from test_moe_quantized import (  # noqa: F401  (checkpoints: the module-scoped fixture)
    BITS, CONFIG, GROUP, NEW_TOKENS, assert_close, checkpoints, hetero_logits, mlx_lm_logits, mlx_lm_model,
    prompt,
)

FORMS = {"fp32": "hf", "4bit": "mlx_lm"}  # test id -> checkpoint of the `checkpoints` fixture


def test_no_checkpoint_array_is_copied(checkpoints):
    """Every parameter of hetero's view is the mx.array mlx-lm holds, experts and quantized routers included."""
    for form, key in FORMS.items():
        lm, _ = mlx_lm_model(checkpoints[key])
        theirs = dict(tree_flatten(lm.language_model.parameters()))
        ours = dict(tree_flatten(wrap(lm).model.parameters()))
        assert ours.keys() == theirs.keys() and all(ours[k] is theirs[k] for k in ours), form
        assert any(".switch_mlp.down_proj." in k for k in ours) and not any(k.startswith("mtp.") for k in ours), form
        block = wrap(lm).model.model.layers[0].mlp
        assert isinstance(block, moe.SparseMoeBlock), form
        if form == "4bit":  # quantized as mlx-lm's modules are: 4-bit experts, 8-bit router and shared-expert gate
            proj = block.switch_mlp.gate_proj
            assert isinstance(proj, moe.QuantizedSwitchLinear) and (proj.group_size, proj.bits) == (GROUP, BITS)
            assert isinstance(block.gate, nn.QuantizedLinear) and block.gate.bits == 8
            assert isinstance(block.shared_expert_gate, nn.QuantizedLinear) and block.shared_expert_gate.bits == 8
        else:
            assert isinstance(block.switch_mlp.gate_proj, moe.SwitchLinear)
            assert block.switch_mlp.gate_proj.weight.dtype == mx.float32


@pytest.mark.parametrize("form", FORMS)
def test_logits_and_greedy_tokens_equal_mlx_lms(checkpoints, form):
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    lm, tokenizer = mlx_lm_model(checkpoints[FORMS[form]])
    model = wrap(lm).model
    ids = prompt(160, 5)  # 480 (token, expert) pairs: the grouped form of the routed experts (CPU), decode: pairs
    ours, theirs = hetero_logits(model, ids), mlx_lm_logits(lm, ids)
    assert_close(ours, theirs)  # measured 4e-7 relative (fp32 and 4-bit): accumulation order only
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()

    ids = prompt(40, 6)
    tokens = list(decode_tokens(model, ids, DecodeOptions(NEW_TOKENS), set()))
    alone = [int(r.token) for r in stream_generate(lm, tokenizer, ids, max_tokens=NEW_TOKENS)]
    assert tokens == alone and len(tokens) == NEW_TOKENS
    assert len(set(tokens)) > 3, "a degenerate continuation would not test much"
    # the embedding use: hetero prefills the prompt, mlx-lm decodes on from the cache it hands back
    cache = hetero.prefill(lm, ids[:-1])
    assert len(cache) == len(make_prompt_cache(lm))
    handed = [int(r.token) for r in stream_generate(lm, tokenizer, ids[-1:], max_tokens=NEW_TOKENS, prompt_cache=cache)]
    assert handed == alone


def test_a_tensor_that_does_not_map_fails_by_name(checkpoints):
    lm, _ = mlx_lm_model(checkpoints["hf"])
    mlp = lm.language_model.model.layers[2].mlp.switch_mlp
    mlp["w_gate"] = mlp.pop("gate_proj")  # a renamed expert tensor
    with pytest.raises(hetero.HeteroError, match=r"hetero's \['model.layers.2.mlp.switch_mlp.gate_proj.weight'\] "
                                                 r"\(1\) have no mlx-lm tensor, mlx-lm's "
                                                 r"\['model.layers.2.mlp.switch_mlp.w_gate.weight'\] \(1\)"):
        wrap(lm)

    lm, _ = mlx_lm_model(checkpoints["mlx_lm"])
    proj = lm.language_model.model.layers[1].mlp.switch_mlp.down_proj
    proj.scales = proj.scales[:-1]  # one expert short: the right name, the wrong shape
    with pytest.raises(hetero.HeteroError, match=r"1 tensors have another shape .*layers.1.mlp.switch_mlp.down_proj"
                                                 r".scales \(7, 64, 2\) for \(8, 64, 2\)"):
        wrap(lm)


def _mlx_lm_moe(**changes):
    from mlx_lm.models import qwen3_5_moe

    return qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(dict(CONFIG, full_attention_interval=2, **changes)))


def test_a_flat_config_maps_too():
    """`qwen3_5_moe_text` at the top level (the fixture's config is nested), on mlx-lm's own random init."""
    lm = _mlx_lm_moe()
    assert "text_config" not in CONFIG and lm.args.model_type == "qwen3_5_moe_text"
    ids = prompt(24, 7)
    assert_close(hetero_logits(wrap(lm).model, ids), mlx_lm_logits(lm, ids))


def test_moe_layouts_mlx_lm_gets_wrong_are_refused_by_name():
    from mlx_lm.models import qwen3_next

    with pytest.raises(hetero.HeteroError, match=r"its mixture-of-experts layers are \[0, 1, 2, 3\], config.json "
                                                 r".* makes them \[1, 2, 3\]"):
        wrap(_mlx_lm_moe(mlp_only_layers=[0], intermediate_size=64))  # mlx-lm makes every layer sparse
    lm = _mlx_lm_moe()
    lm.language_model.model.layers[3].mlp.top_k = 2
    with pytest.raises(hetero.HeteroError, match="layer 3 routes to top 2 experts"):
        wrap(lm)

    nxt = qwen3_next.Model(qwen3_next.ModelArgs.from_dict(dict(  # with experts in every layer
        CONFIG, model_type="qwen3_next", intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
        rms_norm_eps=1e-6, linear_conv_kernel_dim=4, max_position_embeddings=256, full_attention_interval=2,
        rope_theta=1e4, partial_rotary_factor=0.5)))
    assert "switch_mlp" in nxt.model.layers[0].mlp
    with pytest.raises(hetero.HeteroError, match=r"qwen3_next layout .* keeps the GDN projections fused"):
        hetero.prefill(nxt, [1, 2, 3])
