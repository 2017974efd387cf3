"""A float64 numpy oracle of a dense Qwen3.5 prefill, and each path's measured error against it.

The oracle runs the weights a model holds (its own dtype's values, widened exactly to float64), so what it measures
is the arithmetic of a path, not the rounding of its weights: the split and the GPU-only run share those weights,
and `--verify` compares the two. It follows shared/DESIGN.md section 2 with the GDN recurrence token by token.

    python tests/oracle64.py        # the table of docs/planner.md "Verify tolerance per dtype"
"""

from __future__ import annotations

import math

import hetero  # noqa: F401  first: it puts the fast BLAS under MLX before mlx.core loads
import mlx.core as mx
import numpy as np

from hetero.models.cache import KVCache
from hetero.models.gated_delta import CHUNK
from hetero.models.qwen3_5 import RECURRENT_MAX_TOKENS


def f64(a: mx.array) -> np.ndarray:
    """An MLX array widened exactly to float64 numpy (bf16 and fp16 go through fp32, which holds them exactly)."""
    return np.array(a.astype(mx.float32)).astype(np.float64)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _rope(x: np.ndarray, dims: int, theta: float) -> np.ndarray:
    """NeoX rotate_half on the first `dims` of x [H, S, D] at positions 0..S-1."""
    half = dims // 2
    inv = theta ** (-np.arange(half, dtype=np.float64) * 2 / dims)  # [half]
    ang = np.arange(x.shape[1], dtype=np.float64)[:, None] * inv  # [S, half]
    cos, sin = np.cos(ang), np.sin(ang)
    a, b = x[..., :half], x[..., half:dims]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin, x[..., dims:]], -1)


def _attention(attn, args, x: np.ndarray) -> tuple[np.ndarray, dict]:
    """x [S, hidden] -> (out [S, hidden], {"keys", "values": [Hkv, S, D]})."""
    S, H, Hkv, D = x.shape[0], attn.n_heads, attn.n_kv_heads, attn.head_dim
    eps, rot = args.rms_norm_eps, args.rotary_dims
    qg = (x @ f64(attn.q_proj.weight).T).reshape(S, H, 2 * D)  # [S, H, 2D]: query, then gate
    q, gate = qg[..., :D], qg[..., D:]
    k = (x @ f64(attn.k_proj.weight).T).reshape(S, Hkv, D)
    v = (x @ f64(attn.v_proj.weight).T).reshape(S, Hkv, D).transpose(1, 0, 2)  # [Hkv, S, D]
    q = _rope(_rms(q, f64(attn.q_norm.weight), eps).transpose(1, 0, 2), rot, args.rope_theta)  # [H, S, D]
    k = _rope(_rms(k, f64(attn.k_norm.weight), eps).transpose(1, 0, 2), rot, args.rope_theta)  # [Hkv, S, D]
    kv = np.repeat(np.arange(Hkv), H // Hkv)  # query head h reads KV head h // (H / Hkv)
    scores = q @ k[kv].transpose(0, 2, 1) * D**-0.5  # [H, S, S]
    scores = np.where(np.tril(np.ones((S, S), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    out = (p / p.sum(-1, keepdims=True)) @ v[kv]  # [H, S, D]
    out = out.transpose(1, 0, 2) * _sigmoid(gate)  # [S, H, D]
    return out.reshape(S, H * D) @ f64(attn.o_proj.weight).T, {"keys": k, "values": v}


def _gdn(gdn, args, x: np.ndarray, stats: dict | None = None) -> tuple[np.ndarray, dict]:
    """x [S, hidden] -> (out [S, hidden], {"conv window": [K-1, C], "recurrent state": [Hv, Dk, Dv]}).

    `stats["amplification"]` (multiplied over the layers): how much the gated RMSNorm magnifies the rounding of its
    input o = S^T q, max over tokens and heads of rms(|S|^T |q|) / sqrt(mean(o^2) + eps), at least 1. A dot product's
    rounding scales with its summands' magnitudes |S|^T |q|, the norm divides by o's own size: where the terms
    cancel, or o is small enough for eps to dominate (a sequence's first token, o = (k.q) b v), that ratio is large.
    """
    S, nk, nv, dk, dv, K = x.shape[0], gdn.nk, gdn.nv, gdn.dk, gdn.dv, gdn.kernel
    qkv = x @ f64(gdn.in_proj_qkv.weight).T  # [S, C]
    z = (x @ f64(gdn.in_proj_z.weight).T).reshape(S, nv, dv)
    b, a = x @ f64(gdn.in_proj_b.weight).T, x @ f64(gdn.in_proj_a.weight).T  # [S, Hv]
    conv_in = np.concatenate([np.zeros((K - 1, qkv.shape[1])), qkv])  # [K-1+S, C]
    w = f64(gdn.conv1d.weight)[:, :, 0]  # [C, K]
    conv = _silu(sum(conv_in[j : j + S] * w[:, j] for j in range(K)))  # [S, C]
    q, k = conv[:, : nk * dk].reshape(S, nk, dk), conv[:, nk * dk : 2 * nk * dk].reshape(S, nk, dk)
    v = conv[:, 2 * nk * dk :].reshape(S, nv, dv)
    l2 = lambda t: t / np.sqrt((t * t).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    q, k = np.repeat(l2(q), nv // nk, 1) * dk**-0.5, np.repeat(l2(k), nv // nk, 1)  # [S, Hv, Dk]
    beta = _sigmoid(b)
    g = -np.exp(f64(gdn.A_log)) * np.logaddexp(a + f64(gdn.dt_bias), 0.0)  # [S, Hv]
    state, outs, sizes = np.zeros((nv, dk, dv)), [], []
    for t in range(S):  # S = alpha S; u = beta (v - S^T k); S += k u^T; o = S^T q
        state = state * np.exp(g[t])[:, None, None]
        u = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", state, k[t]))  # [Hv, Dv]
        state = state + k[t][:, :, None] * u[:, None, :]
        outs.append(np.einsum("hkv,hk->hv", state, q[t]))
        sizes.append(np.einsum("hkv,hk->hv", np.abs(state), np.abs(q[t])))  # the summands' magnitudes
    core = np.stack(outs)  # [S, Hv, Dv]
    if stats is not None:
        ratio = np.sqrt((np.stack(sizes) ** 2).mean(-1)) / np.sqrt((core * core).mean(-1) + args.rms_norm_eps)
        stats["amplification"] = stats.get("amplification", 1.0) * max(1.0, float(ratio.max()))
    out = _rms(core, f64(gdn.norm.weight), args.rms_norm_eps) * _silu(z)
    return out.reshape(S, nv * dv) @ f64(gdn.out_proj.weight).T, {"conv window": conv_in[-(K - 1):],
                                                                  "recurrent state": state}


def forward64(model, ids: list[int], stats: dict | None = None) -> tuple[np.ndarray, list[dict]]:
    """The float64 backbone over `ids`: (post-norm hidden of every position [S, hidden], per layer the arrays its
    cache holds, named as `hetero.pipeline.run.cache_difference` names them). `stats`: see `_gdn`."""
    args, inner = model.args, model.model
    eps = args.rms_norm_eps
    h = f64(inner.embed_tokens.weight)[np.array(ids)]  # [S, hidden]
    caches = []
    for layer in model.layers:
        if not hasattr(layer.mlp, "gate_proj"):
            raise NotImplementedError("the oracle covers dense MLPs, not mixtures of experts")
        x = _rms(h, f64(layer.input_layernorm.weight), eps)
        mix, cache = (_gdn(layer.linear_attn, args, x, stats) if layer.is_linear
                      else _attention(layer.self_attn, args, x))
        h = h + mix
        x = _rms(h, f64(layer.post_attention_layernorm.weight), eps)
        m = layer.mlp
        h = h + (_silu(x @ f64(m.gate_proj.weight).T) * (x @ f64(m.up_proj.weight).T)) @ f64(m.down_proj.weight).T
        caches.append(cache)
    return _rms(h, f64(inner.norm.weight), eps), caches


def prefill64(model, ids: list[int]) -> tuple[np.ndarray, list[dict]]:
    """The float64 prefill of `ids` from the weights `model` holds: (last position's logits [V], per layer the
    arrays its cache holds, named as `hetero.pipeline.run.cache_difference` names them)."""
    hidden, caches = forward64(model, ids)
    head = model.model.embed_tokens.weight if model.args.tie_word_embeddings else model.lm_head.weight
    return f64(head) @ hidden[-1], caches


def mtp_kv64(model, next_tokens: list[int], hidden: np.ndarray) -> dict:
    """The MTP layer's K/V [Hkv, m, D] for the pairs (t_{p+1}, h_p) at positions p = 0..m-1 (DESIGN.md section 2):
    z = fc(cat[N(embed t_{p+1}), N(h_p)]), then the layer's input norm and K/V projections. `hidden` [m, hidden] the
    backbone's post-norm h_0..h_{m-1}; one MTP layer (depth 1 fills only its KV)."""
    mtp, args = model.mtp, model.args
    eps = args.rms_norm_eps
    e = f64(model.model.embed_tokens.weight)[np.array(next_tokens, dtype=np.int64)]  # [m, hidden]
    z = np.concatenate([_rms(e, f64(mtp.pre_fc_norm_embedding.weight), eps),
                        _rms(hidden, f64(mtp.pre_fc_norm_hidden.weight), eps)], -1) @ f64(mtp.fc.weight).T  # [m, H]
    (layer,) = mtp.layers
    _, kv = _attention(layer.self_attn, args, _rms(z, f64(layer.input_layernorm.weight), eps))
    return kv


U32 = 2.0**-24  # fp32 unit roundoff
ELEMENTWISE = 32  # per layer: its elementwise ops (norms' rsqrt, silu, sigmoid, softplus, RoPE, the decay's exp)
LAMBDA = 6.55  # 2 exp(-LAMBDA^2 / 2) = 1e-9: the chance that one array's rounding exceeds the bound


def fp32_bound(args, n: int, longest_pass: int = RECURRENT_MAX_TOKENS, mtp: bool = True,
               amplification: float = 1.0) -> float:
    """A bound on max |fp32 - float64| / max |float64| of any array (cache, hidden) of an fp32 run of `n` tokens
    through this architecture (`args` a ModelArgs), when no pass took more than `longest_pass` tokens;
    `amplification` is the input's own, as `forward64(..., stats)` measures it.

    Probabilistic rounding-error analysis (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019): each fp32 operation
    rounds its exact result by a factor (1 + d), |d| <= u = 2^-24, the d independent and of mean zero; to first order
    an output's error is the sum of those d, each weighted by the output's sensitivity to it, so for N roundings of
    sensitivity at most A, Hoeffding's inequality gives |error| <= LAMBDA sqrt(N) A u except with probability
    2 exp(-LAMBDA^2 / 2). N here: the summed reduction lengths along the longest chain an array depends on (the last
    layer's, through every layer below and every earlier token of the recurrences), plus ELEMENTWISE per layer. A:
    every stage but one passes a relative perturbation of its input on at most unchanged (projections read RMS-
    normalised inputs, the residual stream adds, softmax weights average, the GDN update S <- a (I - b k k^T) S +
    b k v^T with a <= 1, 0 < b < 1, |k| = 1 is non-expansive); the exception is each GDN layer's gated RMSNorm of
    o = S^T q, which magnifies o's rounding by rms(|S|^T |q|) / sqrt(mean(o^2) + eps) (large where the terms cancel
    or o is small enough for eps to dominate, as at a sequence's first token): A is the product of those, measured by
    the oracle. Passes of up to RECURRENT_MAX_TOKENS run the token-by-token delta rule; longer ones its chunked form
    (CHUNK-token chunks: the unit-lower inverse's log2(CHUNK) doublings, then the chunk's matmuls), counted alike.
    """
    H, I, D = args.hidden_size, args.intermediate_size, args.head_dim
    dk, dv, nv, K = args.linear_key_head_dim, args.linear_value_head_dim, args.linear_num_value_heads, \
        args.linear_conv_kernel_dim
    recurrence = n * (dk + 4)  # per token: S^T k (dk), then the subtraction, beta, the outer product, the decay
    if longest_pass > RECURRENT_MAX_TOKENS:  # and the chunks in turn, each: k.k (dk), the inverse, t_inv @ v and
        per_chunk = dk + 2 * (CHUNK - 1) + 2 * CHUNK + 2 * dk + 2 * CHUNK  # @ kb, w @ S and q @ S, intra @ v, k^T v
        recurrence += -(-n // CHUNK) * per_chunk
    mlp = H + 2 * H + I  # post-attention norm, gate/up, down
    gdn = H + H + K + dk + recurrence + dk + dv + nv * dv + mlp  # norm, in_proj, conv, l2norm, ..., S^T q, norm, out
    attention = H + H + D + D + 2 * n + args.num_attention_heads * D + mlp  # norm, proj, q/k norm, q.k, softmax, p.v, o
    chain = sum(gdn if t == "linear_attention" else attention for t in args.layer_types) + H  # + the final norm
    chain += ELEMENTWISE * len(args.layer_types)
    if mtp:  # the MTP head's K/V: pre-fc norms, fc over [e; h], the layer's input norm, k/v projections, k norm
        chain += H + 2 * H + H + H + D + ELEMENTWISE
    return LAMBDA * math.sqrt(chain) * max(1.0, amplification) * U32


def greedy64(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after `ids` by the float64 oracle (the whole sequence again for each: small models only)."""
    out = []
    for _ in range(n):
        out.append(int(np.argmax(prefill64(model, ids + out)[0])))
    return out


def cache_arrays(cache: list) -> list[dict]:
    """A filled hetero cache as the oracle names its arrays (K/V [Hkv, n, D]; conv [K-1, C]; state [Hv, Dk, Dv])."""
    out = []
    for c in cache:
        if isinstance(c, KVCache):
            out.append({"keys": f64(c.keys[0, :, : c.offset]), "values": f64(c.values[0, :, : c.offset])})
        else:
            out.append({"conv window": f64(c.conv[0]), "recurrent state": f64(c.recurrent[0])})
    return out


def rel(x: np.ndarray, truth: np.ndarray) -> float:
    """max |x - truth| / max |truth|: the measure `verify` applies to split against GPU-only."""
    return float(np.abs(x - truth).max() / max(np.abs(truth).max(), 1e-300))


def errors(logits: np.ndarray, cache: list[dict], truth: tuple[np.ndarray, list[dict]]) -> dict:
    """A path's error against the oracle: {"logits", "cache" (the worst array), "worst"}."""
    t_logits, t_cache = truth
    worst, where = 0.0, ""
    for i, (ours, theirs) in enumerate(zip(cache, t_cache, strict=True)):
        for name in theirs:
            e = rel(ours[name], theirs[name])
            if e > worst:
                worst, where = e, f"layer {i} {name}"
    return {"logits": rel(logits, t_logits), "cache": worst, "worst": where}


def measure(engine, ids: list[int], fraction: float, chunk: int = 64) -> dict:
    """Errors against the float64 oracle of the GPU-only prefill and of the split at `fraction`, and the two
    paths' difference as `verify` measures it (max of logits and caches)."""
    from hetero.decode.prefill import prefill
    from hetero.pipeline import configure

    model = engine.model
    truth = prefill64(model, ids)
    gpu_cache = model.make_cache()
    ref, _ = prefill(model, ids, gpu_cache, chunk)
    run = configure(engine, fraction, chunk)
    split_cache = model.make_cache()
    res = run.splitter(len(ids)).run(ids, split_cache, mtp=False, logits=True)
    n = len(model.layers)
    gpu = errors(f64(ref[-1]), cache_arrays(gpu_cache[:n]), truth)
    split = errors(f64(res.logits[-1]), cache_arrays(split_cache[:n]), truth)
    g_logits, g_cache = f64(ref[-1]), cache_arrays(gpu_cache[:n])
    between = errors(f64(res.logits[-1]), cache_arrays(split_cache[:n]), (g_logits, g_cache))
    return {"gpu": gpu, "split": split, "split_vs_gpu": between}


# A fixed prompt (code, as the engine's users send), so the measurements do not move with the repository's files.
CODE = "".join(f"def step_{i}(x, y):\n    return x * {i % 13} + y - {i % 7}\n\n" for i in range(400))


def main() -> None:
    """Print the measurements behind `hetero/pipeline/verify_tolerance.py` (docs/planner.md): each checkpoint, prompt
    length and dtype, GPU-only and split (fraction 0.5) against float64, and the split against GPU-only."""
    import tempfile
    from pathlib import Path

    from tiny_checkpoint import write_real_shape_model, write_tiny_model

    root = Path(tempfile.mkdtemp(prefix="oracle64-"))
    models = {"bundled": None, "real-shape seed 0": write_real_shape_model(root / "r0", 0),
              "real-shape seed 1": write_real_shape_model(root / "r1", 1), "tiny": write_tiny_model(root / "t")}
    for label, path in models.items():
        for prompt, n in (("code", 160), ("code", 1024), ("random", 160), ("random", 1024)):
            if n > 160 and label in ("tiny", "real-shape seed 1"):
                continue
            for name, dtype in (("float32", mx.float32), ("bfloat16", mx.bfloat16), ("float16", mx.float16)):
                engine = hetero.load(path, dtype)
                vocab = engine.model.args.vocab_size
                ids = (engine.tokenizer.encode(CODE)[:n] if prompt == "code"
                       else np.random.default_rng(n).integers(3, vocab, n).tolist())  # not the special ids 0-2
                _row(f"{label}, {prompt}", engine, ids, name)
    pipe_rows(root)


def _row(label: str, engine, ids: list[int], name: str) -> None:
    m = measure(engine, ids, 0.5)
    cells = " | ".join(f"{max(m[k]['logits'], m[k]['cache']):.2e} ({m[k]['worst'] or '-'})"
                       for k in ("gpu", "split", "split_vs_gpu"))
    print(f"| {label} | {len(ids)} | {name} | {cells} |", flush=True)


def pipe_rows(root) -> None:
    """The same rows for tests/test_pipeline.py's tiny model (issue 25's failing bf16 case), 150 random tokens."""
    import types

    from hetero.checkpoint.loader import load_model
    from test_coreml_graphs import TINY, save_checkpoint, tiny_model

    pipe = dict(TINY, linear_value_head_dim=32)
    path = save_checkpoint(tiny_model(3, pipe), root / "pipe", pipe)
    ids = np.random.default_rng(0).integers(0, pipe["vocab_size"], 150).tolist()
    for name, dtype in (("float32", mx.float32), ("bfloat16", mx.bfloat16), ("float16", mx.float16)):
        model, where, config = load_model(path, dtype)
        engine = types.SimpleNamespace(model=model, config=config, path=where, name=str(where), identity=f"pipe@{name}")
        _row("test_pipeline tiny", engine, ids, name)


if __name__ == "__main__":
    main()
