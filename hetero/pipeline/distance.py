"""`--verify`'s one distance between two runs of the same prompt: the largest relative RMS difference of any block.

Every compared array (the last logits, each layer's keys and values, GDN conv window and recurrent state) is cut
into blocks: one head's keys or values over `TOKENS` consecutive tokens; a GDN layer's recurrent state and its conv
window whole (they sum up every token, and only error from upstream reaches them: their qkv, b and a projections
run on the exact path; per head, a long-memory head's fp16 rounding varied 3.7x between two honest runs); the
logits vector. A block's distance is ||a - b|| / ||b||, b the reference's block, and the distance
of two runs is the largest over every block of every array (`where` names it: "layer 3 keys, head 0, tokens
3520-3547").

Why blocks of a few dozen tokens: the two measures before were each blind to one kind of defect. The largest
element over an array's largest (max |a - b| / max |b|) let one extreme element of a bf16 run's rounding hide a
program that lost half its output; the RMS over a whole array diluted a defect on a few tokens by the square root of
their share of the prompt (keys 25% off at some tokens of a 3,548-token prompt read 0.0128 there, against 0.248 for
the largest element: the RMS was the wrong one). A single token's row is no better: a chaotic random checkpoint's
bf16 run moves some rows by more than 100% from fp32 by rounding alone (a 4-bit one: 155% of a typical row), which
hides a program losing half its output (166%), while over 64-token blocks the same runs read 0.20 and 0.60. A block
dilutes a one-token defect by at most sqrt(TOKENS) = 8, and no more however long the prompt.

A block far smaller than its array's typical block (their RMS) is judged against `FLOOR` times the typical one: a
decayed GDN head or a near-zero stretch of values carries the array's absolute rounding, not a relative one.
"""

from __future__ import annotations

import numpy as np

FLOOR = 0.1
TOKENS = 64  # tokens per block of keys and values: the split's smallest chunk


def rows(name: str, a: np.ndarray) -> np.ndarray:
    """An array as blocks [R, W]: keys / values [..., H, T, D] per head and `TOKENS` tokens (the last block padded
    with zeros, which both runs share), a recurrent state [B, Hv, Dk, Dv] or conv window [B, K-1, C] whole per
    sequence, logits [V] one block."""
    if name.endswith(("keys", "values")):
        t = a.shape[-2]
        n = -(-t // TOKENS)
        pad = [(0, 0)] * (a.ndim - 2) + [(0, n * TOKENS - t), (0, 0)]
        return np.pad(a, pad).reshape(-1, TOKENS * a.shape[-1])  # [..., H, n, TOKENS * D] per (head, block)
    if name.endswith(("recurrent state", "conv window")):
        return a.reshape(a.shape[0], -1)
    return a.reshape(-1, a.shape[-1])


def _where(name: str, shape: tuple[int, ...], row: int) -> str:
    if name.endswith(("keys", "values")):
        n = -(-shape[-2] // TOKENS)
        head, block = divmod(row, n)
        first = block * TOKENS
        return f"{name}, head {head % shape[-3]}, tokens {first}-{min(first + TOKENS, shape[-2]) - 1}"
    return name


def row_distances(name: str, ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Each block's relative RMS difference [R] (inf where `ours` is not finite)."""
    a, b = rows(name, ours.astype(np.float64)), rows(name, ref.astype(np.float64))
    norms = np.linalg.norm(b, axis=1)  # [R]
    typical = float(np.sqrt(np.mean(norms**2))) if norms.size else 0.0
    d = np.linalg.norm(a - b, axis=1) / np.maximum(np.maximum(norms, FLOOR * typical), 1e-30)
    return np.where(np.isfinite(d), d, np.inf)


def distance(ours: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> tuple[float, str]:
    """The distance of two runs' arrays (by name, `ref` the reference) and where it lies (module docstring)."""
    worst, where = 0.0, ""
    for name, b in ref.items():
        d = row_distances(name, ours[name], b)
        if d.size and d.max() > worst:
            worst, where = float(d.max()), _where(name, b.shape, int(d.argmax()))
    return worst, where
