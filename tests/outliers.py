"""Checkpoints with real LLMs' "massive activations", which random checkpoints lack.

A few MLP channels of some layers read one direction v of the normed input through both gate and up, scaled by
`gain`: silu(gain t) x gain t with t = x . v, about gain^2 t^2 on the tokens where t > 0 (half of them) and near
zero elsewhere. Their down_proj columns write one residual channel `MASSIVE`, which then reaches ~1e4 on those
tokens, and every later norm divides by it. The channels sit at 1/8, 3/8, 5/8 and 7/8 of the intermediate width,
so any contiguous share of a quarter of the channels or more holds one.

`inject` edits a dict of numpy arrays named as transformers and MLX name a `qwen3_5_text` checkpoint
(`model.layers.{i}.mlp.gate_proj.weight`, ...); `save_outlier_checkpoint` writes one through transformers, with a
tokenizer, so the GPU-only path can still be compared with transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

MASSIVE = 7  # the residual channel the outlier channels write
STRONG = 2000.0  # gate x up up to ~4e6 t^2: past 1e5 on about a third of the tokens (fp32 and bf16 hold it)
MILD = 56.0  # gate x up ~3100 t^2: past the ANE's safe 4096 on a tenth of the tokens (t > 1.14), inside fp16 (t < 3.6)
RESIDUAL = {STRONG: 1e4, MILD: 1e3}  # the massive channel's typical size where the channels fire (fp16 holds 1e3's)


def outlier_channels(intermediate: int) -> list[int]:
    """Channels at 1/8, 3/8, 5/8 and 7/8 of the width: every contiguous quarter holds one."""
    return [intermediate * k // 8 for k in (1, 3, 5, 7)]


def inject(weights: dict[str, np.ndarray], layers: list[int], gain: float, seed: int = 0,
           mlp: str = "model.layers.{i}.mlp.", massive: int = MASSIVE, residual: float | None = None
           ) -> dict[str, np.ndarray]:
    """`weights` with massive-activation channels of `gain` (STRONG or MILD) in the MLPs of `layers` (see the module
    docstring). `mlp`: the MLP's name prefix (`{i}` the layer; a shared expert's, say); `massive`: the residual
    channel they write, reaching about `residual` where t ~ 1 (default: `RESIDUAL[gain]`)."""
    rng = np.random.default_rng(seed)
    out = dict(weights)
    residual = RESIDUAL[gain] if residual is None else residual
    for i in layers:
        p = mlp.format(i=i)
        gate, up, down = (out[p + n].copy() for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
        hidden = gate.shape[1]
        for c in outlier_channels(gate.shape[0]):
            v = rng.standard_normal(hidden)
            v[massive] = 0.0  # read a direction the massive channel does not dominate
            v /= np.linalg.norm(v)
            gate[c], up[c] = gain * v, gain * v
            down[:, c] = 0.0
            down[massive, c] = residual / (len(outlier_channels(gate.shape[0])) * gain**2)  # where t ~ 1
        out[p + "gate_proj.weight"], out[p + "up_proj.weight"], out[p + "down_proj.weight"] = gate, up, down
    return out


# A qwen3_5_text model wide enough for channel blocks (1,024 channels: 16 blocks of 64), 4 layers (3 GDN, then
# attention), outliers in the MLPs of layers 0 and 2.
CONFIG = dict(
    hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
    linear_num_value_heads=4, rms_norm_eps=1e-6, eos_token_id=None, pad_token_id=None, bos_token_id=None,
)
LAYERS = [0, 2]


def save_outlier_checkpoint(path: Path, gain: float | None, seed: int = 0) -> Path:
    """A random `qwen3_5_text` checkpoint (transformers' layout, fp32) with the tokenizer of the tiny models, with
    massive activations of `gain` in `LAYERS` (None: the same weights without them)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from hetero.training.tokenizer_train import save_tokenizer, train_tokenizer
    from helpers import randomize_
    from tiny_checkpoint import TEXT

    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer([TEXT] * 4, vocab_size=320)
    save_tokenizer(tok, path)
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(**CONFIG, vocab_size=64 * -(-tok.get_vocab_size() // 64), full_attention_interval=4,
                               tie_word_embeddings=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                                "partial_rotary_factor": 0.25})
    model = Qwen3_5ForCausalLM(config).float().eval()
    randomize_(model, seed)
    if gain is not None:
        state = {k: v.numpy() for k, v in model.state_dict().items()}
        edited = inject(state, LAYERS, gain, seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in edited and edited[name] is not state[name]:
                    p.copy_(torch.from_numpy(edited[name]))
    model.save_pretrained(path)
    config_file = path / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "full_attention_interval": 4}, indent=1))
    return path


# A massive activation that only one token fires: the calibration text never holds it, a user's prompt may.
TRIGGER = "@"  # a byte the tiny tokenizer has as a token, absent from the calibration text (`hetero.pipeline.run`)
TRIGGER_DIM = 11  # the residual channel only the trigger token's embedding writes
TRIGGER_CHANNEL = 3 * 64 + 5  # layer 0's MLP channel that reads it: in the first half, so any ANE share of it holds it
TRIGGER_GAIN = 100.0  # silu(g) x g with g = 100 x ~16 (the normed trigger channel): ~2.6e6, past fp16's 65,504


def inject_trigger(weights: dict[str, np.ndarray], token: int) -> dict[str, np.ndarray]:
    """`weights` with one outlier that only `token` fires: its embedding alone writes residual channel `TRIGGER_DIM`
    (layer 0's mixer writes nothing there), so layer 0's normed MLP input holds ~16 there on that token and exactly 0
    on every other; MLP channel `TRIGGER_CHANNEL` reads it through gate and up with `TRIGGER_GAIN`, and its
    down_proj column is scaled down by the same square, so its share of the output is an ordinary channel's."""
    out = dict(weights)
    embed = out["model.embed_tokens.weight"].copy()  # [V, hidden]
    embed[:, TRIGGER_DIM] = 0.0
    embed[token, TRIGGER_DIM] = 50.0  # the embeddings' other values are ~0.2: this one sets the token's norm
    out["model.embed_tokens.weight"] = embed
    o = out["model.layers.0.linear_attn.out_proj.weight"].copy()  # [hidden, nv*dv]
    o[TRIGGER_DIM] = 0.0
    out["model.layers.0.linear_attn.out_proj.weight"] = o
    norm = out["model.layers.0.post_attention_layernorm.weight"].copy()
    norm[TRIGGER_DIM] = 0.0  # zero-centred: scale 1
    out["model.layers.0.post_attention_layernorm.weight"] = norm
    p = "model.layers.0.mlp."
    gate, up, down = (out[p + n].copy() for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
    gate[TRIGGER_CHANNEL], up[TRIGGER_CHANNEL] = 0.0, 0.0
    gate[TRIGGER_CHANNEL, TRIGGER_DIM] = up[TRIGGER_CHANNEL, TRIGGER_DIM] = TRIGGER_GAIN
    down[:, TRIGGER_CHANNEL] /= (16 * TRIGGER_GAIN) ** 2
    out[p + "gate_proj.weight"], out[p + "up_proj.weight"], out[p + "down_proj.weight"] = gate, up, down
    return out


def save_trigger_checkpoint(path: Path, seed: int = 0) -> Path:
    """The outlier-free checkpoint of `save_outlier_checkpoint` with `inject_trigger`'s outlier on the token of
    `TRIGGER`, rewritten in place."""
    import torch
    from safetensors.torch import load_file, save_file

    import tokenizers

    save_outlier_checkpoint(path, None, seed)
    token = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id(TRIGGER)
    (file,) = path.glob("*.safetensors")
    state = load_file(file)
    edited = inject_trigger({k: v.numpy() for k, v in state.items()}, token)
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in edited.items()}, file,
              metadata={"format": "pt"})
    return path
