"""Logit warping (temperature, top-k, top-p, min-p) and sampling.

`warp` turns logits into the log-probabilities that plain decoding samples from; speculative decoding uses
the very same function for its target distribution, so both decode paths see identical distributions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx

from hetero.validate import MIN_P, TEMPERATURE, TOP_K, TOP_P, check_seed


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token; temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        TEMPERATURE.check(self.temperature, "temperature")
        TOP_K.check(self.top_k, "top-k (0 disables it)")
        TOP_P.check(self.top_p, "top-p")
        MIN_P.check(self.min_p, "min-p")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: mx.array, params: SamplingParams) -> mx.array:
    """logits [..., V] -> log-probabilities [..., V] (fp32) after temperature, top-k, top-p and min-p.

    Removed tokens get -inf. Greedy params give a one-hot distribution on the argmax.
    """
    logits = logits.astype(mx.float32)
    if params.greedy:
        best = mx.argmax(logits, axis=-1, keepdims=True)
        onehot = mx.arange(logits.shape[-1]) == best
        return mx.where(onehot, 0.0, -mx.inf)
    logprobs = logits / params.temperature
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if 0 < params.top_k < logits.shape[-1]:
        kth = mx.sort(logprobs, axis=-1)[..., -params.top_k][..., None]  # [..., 1]
        logprobs = mx.where(logprobs >= kth, logprobs, -mx.inf)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)  # top-p sees the renormalised mass
    if params.top_p < 1.0:
        order = mx.argsort(-logprobs, axis=-1)  # [..., V] most likely first
        sorted_lp = mx.take_along_axis(logprobs, order, axis=-1)
        before = mx.cumsum(mx.exp(sorted_lp), axis=-1) - mx.exp(sorted_lp)  # mass strictly before each token
        keep_sorted = before < params.top_p  # always keeps the most likely token
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        logprobs = mx.where(keep, logprobs, -mx.inf)
    if params.min_p > 0:
        threshold = mx.max(logprobs, axis=-1, keepdims=True) + mx.log(mx.array(params.min_p))
        logprobs = mx.where(logprobs >= threshold, logprobs, -mx.inf)
    return logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)


def sample(logprobs: mx.array, key: mx.array | None = None) -> mx.array:
    """Draw one token id per row from warped log-probabilities [..., V]."""
    return mx.random.categorical(logprobs, axis=-1, key=key)


class Sampler:
    """Warps and samples with its own seeded key stream, so seeded runs repeat exactly."""

    def __init__(self, params: SamplingParams, seed: int | None = None):
        self.params = params
        check_seed(seed)
        self.key = mx.random.key(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))

    def next_key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    def __call__(self, logits: mx.array) -> mx.array:
        """logits [..., V] -> token ids [...]."""
        if self.params.greedy:
            return mx.argmax(logits, axis=-1)
        return sample(warp(logits, self.params), self.next_key())


def accept_drafts(
    target_logprobs: mx.array,
    drafts: mx.array,
    draft_logprobs: mx.array | None,
    key: mx.array,
) -> tuple[mx.array, mx.array]:
    """Exact speculative acceptance (Leviathan et al.): the output is distributed as the target alone.

    target_logprobs [k+1, V]: warped target distributions p_0..p_k; drafts [k]: proposed ids d_0..d_{k-1};
    draft_logprobs [k, V]: the proposal q_i they were drawn from, or None for point-mass proposals (argmax or
    copied drafts). Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample from
    normalize(max(0, p_i - q_i)) over the whole vocabulary; if all k are accepted, draw a bonus token from p_k.
    Returns (number accepted, next token), both lazy scalars.
    """
    k = drafts.shape[0]
    p = mx.exp(target_logprobs)  # [k+1, V]
    if draft_logprobs is None:
        q = (mx.arange(p.shape[-1])[None, :] == drafts[:, None]).astype(p.dtype)  # [k, V] one-hot
    else:
        q = mx.exp(draft_logprobs)  # [k, V]
    u_key, s_key = mx.random.split(key)
    rows = mx.arange(k)
    p_d, q_d = p[rows, drafts], q[rows, drafts]  # [k]
    accepted = mx.random.uniform(shape=(k,), key=u_key) * q_d < p_d  # u < p/q without dividing by q
    n = mx.sum(mx.cumprod(accepted.astype(mx.int32)))  # leading accepted drafts
    residual = mx.concatenate([mx.maximum(p[:k] - q, 0.0), p[k:]], axis=0)[n]  # [V]
    residual = mx.where(mx.sum(residual) > 0, residual, p[n])  # p == q exactly: rejection had probability 0
    token = mx.random.categorical(mx.log(residual), key=s_key)
    return n, token


def accept_greedy(target_logits: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy acceptance: drafts match the target's argmax; the next token is the argmax after them."""
    best = mx.argmax(target_logits, axis=-1)  # [k+1]
    n = mx.sum(mx.cumprod((best[:-1] == drafts).astype(mx.int32)))
    return n, best[n]
