"""FLOPs per piece and chunk: what each chunk of a prefill computes, on the GPU (causal, over what it sees) and on
the ANE (static programs: a whole padded chunk over its context bucket)."""

from __future__ import annotations

import numpy as np

from hetero.planner.slices import Piece


def chunk_spans(tokens: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of every prefill chunk of a `tokens`-long prompt."""
    starts = np.arange(0, tokens, chunk, dtype=np.float64)
    return starts, np.minimum(chunk, tokens - starts)


def visible_pairs(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Visible (query, key) pairs per chunk: every cached key plus the causal triangle."""
    return sizes * starts + sizes * (sizes + 1) / 2


def context_bucket(tokens: int, chunk: int) -> int:
    """The context of a `tokens`-long prefix's static ANE attention program: its chunks rounded up to a power of
    two (at most 2x waste)."""
    n = -(-tokens // chunk)
    return chunk * (1 << max(0, (n - 1).bit_length()))


def context_buckets(tokens: int, chunk: int) -> list[int]:
    """Every bucket a `tokens`-long prompt's chunks use: chunk x 1, 2, 4, ... up to the prompt's own bucket.

    The ANE's attention programs are exported once per bucket and each chunk runs the smallest one that holds its
    cache and itself, so a chunk attends over at most twice the keys it can see, not over the whole prompt's."""
    top = context_bucket(tokens, chunk)
    return [chunk << k for k in range((top // chunk).bit_length())]


def ane_pairs(starts: np.ndarray, chunk: int) -> np.ndarray:
    """(query, key) pairs a static ANE attention program computes per chunk: a whole (padded) chunk over its whole
    bucket (cache slots + the chunk: `context_bucket` of the chunk's end), whatever part the prompt fills."""
    return chunk * np.array([context_bucket(int(a) + chunk, chunk) for a in starts], dtype=np.float64)


def ane_piece_flops(p: Piece, starts: np.ndarray, sizes: np.ndarray, chunk: int) -> np.ndarray:
    """FLOPs of a piece as a static-shape ANE program computes them (attention: over `ane_pairs`)."""
    if p.kind != "attention":
        return piece_flops(p, starts, sizes)
    return p.token_flops * chunk + p.pair_flops * ane_pairs(starts, chunk)


def piece_flops(p: Piece, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """FLOPs of one layer's piece for each chunk (lm_head: the prompt's last row only)."""
    if p.kind == "lm_head":
        out = np.zeros_like(sizes)
        out[-1] = p.token_flops  # one row: the prompt's last position
        return out
    return p.token_flops * sizes + p.pair_flops * visible_pairs(starts, sizes)


def prefill_flops(ps: list[Piece], tokens: int, chunk: int) -> dict[str, tuple[float, float]]:
    """Per piece kind, (FLOPs, the ANE's share of them) of a `tokens`-long prefill in chunks of `chunk`."""
    starts, sizes = chunk_spans(tokens, chunk)
    flops = {}
    for p in ps:
        total = p.layers * float(piece_flops(p, starts, sizes).sum())
        flops[p.kind] = (total, total * p.ane_share)
    return flops


def ane_share(flops: dict[str, tuple[float, float]]) -> float:
    """The ANE's share of all the FLOPs in `prefill_flops`'s answer."""
    total = sum(t for t, _ in flops.values())
    return sum(a for _, a in flops.values()) / total if total else 0.0
