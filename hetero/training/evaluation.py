"""How good the tiny model is, and whether its written checkpoint is the model: validation loss and top-1 of the
backbone and the MTP head, greedy samples, whether chat replies end, and the written checkpoint reloaded by hetero
and by mlx-lm against the in-memory model (`check_checkpoint`)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from hetero.checkpoint.loader import load_model
from hetero.models.qwen3_5 import Model
from hetero.models.qwen3_5.weights import is_zero_centred_norm


def evaluate(model: Model, tokens: np.ndarray, seq: int = 256, batch: int = 16, max_tokens: int | None = None) -> dict:
    """Next-token loss and top-1 of backbone and MTP head over non-overlapping windows of the validation tokens."""
    n = (len(tokens) - 2) // seq
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // seq))
    windows = np.stack([tokens[i * seq : i * seq + seq + 2] for i in range(n)])
    ce_sum = ce_mtp_sum = hit = hit_mtp = 0.0
    for b in range(0, n, batch):
        w = mx.array(windows[b : b + batch])
        logits, hidden = model(w[:, :-2])
        draft, _ = model.mtp_forward(w[:, 1:-1], hidden)
        ce = nn.losses.cross_entropy(logits, w[:, 1:-1], reduction="sum")
        ce_mtp = nn.losses.cross_entropy(draft, w[:, 2:], reduction="sum")
        acc = (logits.argmax(-1) == w[:, 1:-1]).sum()
        acc_mtp = (draft.argmax(-1) == w[:, 2:]).sum()
        mx.eval(ce, ce_mtp, acc, acc_mtp)
        ce_sum += ce.item()
        ce_mtp_sum += ce_mtp.item()
        hit += acc.item()
        hit_mtp += acc_mtp.item()
    count = n * seq
    return dict(valid_tokens=count, valid_loss=ce_sum / count, valid_mtp_loss=ce_mtp_sum / count,
                backbone_top1=hit / count, mtp_top1=hit_mtp / count)


def greedy(model: Model, prompt: list[int], n: int, eos: set[int] = frozenset()) -> list[int]:
    """Greedy continuation with the model's caches (prefill, then one token at a time)."""
    cache = model.make_cache()
    logits, _ = model(mx.array([prompt]), cache)
    out = []
    for _ in range(n):
        tok = logits[0, -1].argmax().item()
        if tok in eos:
            break
        out.append(tok)
        logits, _ = model(mx.array([[tok]]), cache)
    return out


def chat_endings(model: Model, tok, conversations: list[str], end: int, limit: int = 300) -> dict:
    """Greedy replies to each conversation's last user turn: how many close with `end` within `limit` tokens."""
    lengths = []
    for text in conversations:
        prompt = text[: text.rindex("<|im_start|>assistant\n")] + "<|im_start|>assistant\n"
        reply = greedy(model, tok.encode(prompt).ids, limit + 1, eos={end})
        lengths.append(len(reply))
    ended = [n for n in lengths if n <= limit]
    return dict(chat_prompts=len(lengths), chat_ended=len(ended), chat_limit=limit,
                chat_median_reply_tokens=float(np.median(ended)) if ended else None)




def check_checkpoint(model: Model, out_dir: Path, probe: np.ndarray, log=print) -> dict:
    """Load the checkpoint with hetero (strict) and with mlx-lm; compare logits with the in-memory model."""
    x = mx.array(probe[None])
    ref, ref_hidden = model(x)
    ref_draft, _ = model.mtp_forward(x, ref_hidden)
    loaded, _, _ = load_model(out_dir, dtype=mx.float32)
    got, got_hidden = loaded(x)
    got_draft, _ = loaded.mtp_forward(x, got_hidden)
    scale = mx.abs(ref).max().item()
    result = dict(
        hetero_max_abs_diff=mx.abs(got - ref).max().item(),
        hetero_mtp_max_abs_diff=mx.abs(got_draft - ref_draft).max().item(),
        logit_scale=scale,
        hetero_top1_agreement=(got.argmax(-1) == ref.argmax(-1)).mean().item(),
    )
    log(f"hetero reload: max |logit diff| {result['hetero_max_abs_diff']:.4f} (MTP {result['hetero_mtp_max_abs_diff']:.4f}) "
        f"of max |logit| {scale:.1f}, top-1 agreement {result['hetero_top1_agreement']:.4f}")
    try:
        from mlx_lm.utils import load_model as mlx_lm_load_model

        other, _ = mlx_lm_load_model(Path(out_dir))
        other.set_dtype(mx.float32, lambda t: mx.issubdtype(t, mx.floating))
        theirs = other(x)
        result["mlx_lm_max_abs_diff"] = mx.abs(theirs - got).max().item()
        # mlx-lm adds the norm shift in bf16 (bf16 + 1.0 stays bf16); with our shifted norms rounded alike the two agree
        rounded = [(k, v.astype(mx.bfloat16).astype(mx.float32) if is_zero_centred_norm(k) else v)
                   for k, v in tree_flatten(loaded.parameters())]
        loaded.load_weights(rounded)
        result["mlx_lm_max_abs_diff_bf16_norms"] = mx.abs(theirs - loaded(x)[0]).max().item()
        log(f"mlx-lm reload: max |logit diff| vs hetero {result['mlx_lm_max_abs_diff']:.5f}, "
            f"{result['mlx_lm_max_abs_diff_bf16_norms']:.2e} with hetero's norms rounded as mlx-lm rounds them")
    except ImportError:
        log("mlx-lm is not installed: skipped its check")
    return result
