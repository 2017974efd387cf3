"""A float64 numpy oracle of the Qwen4-Exp MTP head, read straight from a checkpoint's files.

transformers has no MTP forward for qwen4_exp (it drops `mtp.*` at load), so this is written from its layer code
(`transformers/models/qwen4_exp/modular_qwen4_exp.py`: Qwen4ExpTextRMSNorm, Qwen4ExpTextGatedResidual,
Qwen4ExpTextQSAIndexer, Qwen4ExpTextAttention over Qwen3_5Attention, Qwen3NextSparseMoeBlock, Qwen4ExpTextDecoderLayer)
and the head's wiring as the released tensors imply it (mlx-vlm 0.7.10 `speculative/drafters/qwen4_exp_mtp`):

    e = fc_embedding(N(embed t_{p+1}; pre_fc_norm_embedding))
    z = fc_hidden(N(h_p; pre_fc_norm_hidden) viewed as hc streams of d) + e        one RMS over all hc*d features
    z = decoder_layer(z)  at MTP positions 0, 1, ...                                 QSA + MoE, hyper-connections
    draft logits = lm_head(hyper_connection_mixer(z))

Everything runs on the checkpoint's own tensors (HF names, zero-centred norms stored as w and applied as 1 + w,
per-expert or fused experts), widened to float64: nothing is shared with hetero's loader or modules.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np


def load_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every floating tensor of the checkpoint as float64, under its own name."""
    from safetensors.numpy import load_file

    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        for name, value in load_file(file).items():
            if np.issubdtype(value.dtype, np.floating):
                out[name] = value.astype(np.float64)
    return out


def text_config(path: Path) -> dict:
    config = json.loads((Path(path) / "config.json").read_text())
    text = dict(config.get("text_config") or config)
    rope = text.get("rope_parameters") or {}
    text.setdefault("rope_theta", rope.get("rope_theta", 10_000_000.0))
    text.setdefault("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
    return text


def _rms(x: np.ndarray, w: np.ndarray, eps: float, group: int | None = None) -> np.ndarray:
    """Qwen4ExpTextRMSNorm: x / rms(x) * (1 + w), the RMS over each `group`-wide slice (None: the whole axis)."""
    shape = x.shape
    g = x.reshape(*shape[:-1], -1, group) if group else x
    g = g / np.sqrt((g * g).mean(-1, keepdims=True) + eps)
    return g.reshape(shape) * (1.0 + w)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _rope(x: np.ndarray, positions: np.ndarray, dims: int, theta: float) -> np.ndarray:
    """NeoX rotate_half on the first `dims` features of x [N, ..., D] at positions [N]."""
    half = dims // 2
    inv = 1.0 / theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)  # [half]
    ang = positions.astype(np.float64)[:, None] * inv  # [N, half]
    cos = np.concatenate([np.cos(ang)] * 2, -1)  # [N, dims]
    sin = np.concatenate([np.sin(ang)] * 2, -1)
    cos, sin = cos.reshape(cos.shape[0], *([1] * (x.ndim - 2)), dims), sin.reshape(sin.shape[0], *([1] * (x.ndim - 2)), dims)
    r = x[..., :dims]
    rotated = np.concatenate([-r[..., half:], r[..., :half]], -1)
    return np.concatenate([r * cos + rotated * sin, x[..., dims:]], -1)


class Oracle:
    """The MTP head of one checkpoint in float64 (`draft`)."""

    def __init__(self, path: Path):
        self.t, self.c = load_tensors(path), text_config(path)
        c = self.c
        self.d, self.hc, self.eps = c["hidden_size"], c["hc_count"], c.get("rms_norm_eps", 1e-6)
        self.rot = int(c["head_dim"] * c["partial_rotary_factor"])
        self.theta = float(c["rope_theta"])
        prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in self.t else "model."
        self.embed = self.t[prefix + "embed_tokens.weight"]
        self.lm_head = self.embed if c.get("tie_word_embeddings") else self.t["lm_head.weight"]

    def w(self, name: str) -> np.ndarray:
        return self.t["mtp." + name]

    def lin(self, x: np.ndarray, name: str) -> np.ndarray:
        return x @ self.w(name + ".weight").T

    # -- the pieces of transformers' decoder layer ---------------------------------------------------------------

    def gated_residual(self, h: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray | None]:
        """Qwen4ExpTextGatedResidual: streams h [N, hc*d] -> (mixed input [N, d], injection weights [N, hc] or
        None for the final mixer)."""
        n = _rms(h, self.w(f"{name}.hc_norm.weight"), self.eps, group=self.d)
        mix = _sigmoid(self.lin(_silu(self.lin(n, f"{name}.input_mix_weight_down") / self.hc),
                                f"{name}.input_mix_weight_up"))
        mixed = (mix.reshape(-1, self.hc, self.d) * n.reshape(-1, self.hc, self.d)).mean(1)
        if "mtp." + name + ".block_inject_weight.weight" not in self.t:
            return mixed, None
        return mixed, 2 * _sigmoid(self.lin(n, f"{name}.block_inject_weight") / self.hc)

    def selected(self, x: np.ndarray, name: str) -> np.ndarray:
        """Qwen4ExpTextQSAIndexer._select_tokens: x [N, d] at positions 0..N-1 -> mask [N, N] of the tokens each
        query attends to (the causal ones it selects)."""
        c = self.c
        Hi, Di, ratio = c["indexer_n_heads"], c["indexer_head_dim"], c["indexer_compress_ratio"]
        top = c["indexer_budget"] // ratio
        N = x.shape[0]
        qk = self.lin(x, f"{name}.index_qk_proj")  # [N, (Hi+1)*Di]
        q = _rms(qk[:, : Hi * Di].reshape(N, Hi, Di), self.w(f"{name}.q_layernorm.weight"), self.eps)
        q = _rope(q, np.arange(N), self.rot, self.theta)  # [N, Hi, Di]
        raw = qk[:, Hi * Di :]  # [N, Di]
        mask = np.zeros((N, N), bool)
        for p in range(N):
            visible = np.arange(p + 1)
            blocks = len(visible) // ratio
            chosen = []
            if blocks:
                tokens = visible[: blocks * ratio].reshape(blocks, ratio)
                pooled = _rms(raw[tokens].mean(1), self.w(f"{name}.k_layernorm.weight"), self.eps)  # [NB, Di]
                keys = _rope(pooled, tokens[:, 0], self.rot, self.theta)
                scores = np.maximum(q[p] @ keys.T, 0.0).sum(0) / math.sqrt(Di)  # [NB]
                best = np.argsort(-scores, kind="stable")[: min(top, blocks)]
                chosen = tokens[best].ravel().tolist()
            mask[p, chosen + visible[blocks * ratio :].tolist()] = True
        return mask

    def attention(self, x: np.ndarray, name: str) -> np.ndarray:
        """Qwen4ExpTextAttention: gated GQA (q|gate, q/k norms, partial RoPE) under the indexer's mask: x [N, d]."""
        c = self.c
        H, Hkv, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        N = x.shape[0]
        qg = self.lin(x, f"{name}.q_proj").reshape(N, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
        k = self.lin(x, f"{name}.k_proj").reshape(N, Hkv, D)
        v = self.lin(x, f"{name}.v_proj").reshape(N, Hkv, D)
        pos = np.arange(N)
        q = _rope(_rms(q, self.w(f"{name}.q_norm.weight"), self.eps), pos, self.rot, self.theta)  # [N, H, D]
        k = _rope(_rms(k, self.w(f"{name}.k_norm.weight"), self.eps), pos, self.rot, self.theta)
        mask = self.selected(x, f"{name}.indexer")  # [N, N]
        kv = np.arange(H) // (H // Hkv)
        scores = np.einsum("nhd,mhd->hnm", q, k[:, kv]) * D**-0.5  # [H, N, N]
        scores = np.where(mask[None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out = np.einsum("hnm,mhd->nhd", p / p.sum(-1, keepdims=True), v[:, kv])  # [N, H, D]
        return self.lin((out * _sigmoid(gate)).reshape(N, H * D), f"{name}.o_proj")

    def expert(self, x: np.ndarray, name: str, e: int) -> np.ndarray:
        if f"mtp.{name}.experts.gate_up_proj" in self.t:
            gate_up, down = self.w(f"{name}.experts.gate_up_proj")[e], self.w(f"{name}.experts.down_proj")[e]
            gate, up = np.split(gate_up, 2, axis=0)
        else:
            gate, up, down = (self.w(f"{name}.experts.{e}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj"))
        return (_silu(x @ gate.T) * (x @ up.T)) @ down.T

    def moe(self, x: np.ndarray, name: str) -> np.ndarray:
        """Qwen3NextSparseMoeBlock: softmax router, top-k (renormalised), SwiGLU experts, gated shared expert."""
        c = self.c
        logits = self.lin(x, f"{name}.gate")  # [N, E]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.zeros_like(x)
        for n in range(x.shape[0]):
            top = np.argsort(-probs[n], kind="stable")[: c["num_experts_per_tok"]]
            weights = probs[n, top] / (probs[n, top].sum() if c.get("norm_topk_prob", True) else 1.0)
            out[n] = sum(wt * self.expert(x[n], name, int(e)) for e, wt in zip(top, weights))
        s = f"{name}.shared_expert"
        shared = self.lin(_silu(self.lin(x, f"{s}.gate_proj")) * self.lin(x, f"{s}.up_proj"), f"{s}.down_proj")
        return out + _sigmoid(self.lin(x, f"{name}.shared_expert_gate")) * shared

    def layer(self, h: np.ndarray, name: str) -> np.ndarray:
        """Qwen4ExpTextDecoderLayer (no PLE): streams [N, hc*d] -> [N, hc*d]."""
        for block, run in (("attn_hyper_connection", lambda x: self.attention(x, f"{name}.self_attn")),
                           ("mlp_hyper_connection", lambda x: self.moe(x, f"{name}.mlp"))):
            x, inject = self.gated_residual(h, f"{name}.{block}")
            h = h + (inject[:, :, None] * run(x)[:, None, :]).reshape(h.shape)
        return h

    # -- the head ---------------------------------------------------------------------------------------------

    def draft(self, next_tokens: list[int], streams: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Inputs at MTP positions 0..N-1: tokens t_{p+1} [N] and streams h_p [N, hc*d] -> (draft logits [N, V],
        the head's streams [N, hc*d], which feed it again at the next depth)."""
        N = streams.shape[0]
        e = self.lin(_rms(self.embed[np.asarray(next_tokens)], self.w("pre_fc_norm_embedding.weight"), self.eps),
                     "fc_embedding")  # [N, d]
        h = _rms(streams, self.w("pre_fc_norm_hidden.weight"), self.eps).reshape(N, self.hc, self.d)
        z = (self.lin(h, "fc_hidden") + e[:, None, :]).reshape(N, -1)  # [N, hc*d]
        layer = 0
        while f"mtp.layers.{layer}.mlp.gate.weight" in self.t:
            z = self.layer(z, f"layers.{layer}")
            layer += 1
        mixed, _ = self.gated_residual(z, "hyper_connection_mixer")
        return mixed @ self.lm_head.T, z
