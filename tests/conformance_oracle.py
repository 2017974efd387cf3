"""transformers as the conformance oracle, its discrete choices pinned to hetero's where the two tie.

A top-k choice is discontinuous: where two candidates' scores lie within rounding of each other (an MoE router's
k-th and (k+1)-th experts, two QSA blocks a query might keep) two fp32 implementations, or transformers in fp32
and in float64, may each take either, and the logits then differ by the choice, not by any error: a QSA query of
the issue's layout at budget 512 over 1,536 tokens kept block 191 (score 3.9773726) where transformers kept block 161
(3.9773805), and its logits moved 1e-3. So hetero's choices over the prompt are recorded (`Choices.recording`) and
transformers runs with them wherever its own differ at a near-tie, its scores of the two within `NEAR` of each other
relative to the row's largest (`pinned`); a choice that differs by more stays transformers' own, and the logits then
show the difference. `Choices.ties` counts the pinned choices.

Exact ties are another matter, pinned for the whole oracle in `conformance_checks.stable_topk` (the lower index).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

NEAR = 1e-4


class Choices:
    """hetero's discrete choices over one pass of a prompt, in layer order: each MoE layer's experts [N, k] and each
    QSA layer's kept keys [L, T] bool. `ties`: how many rows the oracle took from them."""

    def __init__(self):
        self.routes: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.ties = 0

    @contextlib.contextmanager
    def recording(self, model):
        """Record `model`'s choices while it runs one pass inside the block (no wavefront: one call per layer)."""
        from hetero.models.moe import Routes
        from hetero.models.qwen4_exp import qsa

        routes = Routes(model)
        real = qsa.Indexer.select

        def select(indexer, q, keys, offset):
            mask = real(indexer, q, keys, offset)  # [B, L, T]
            self.masks.append(np.array(mask[0]))
            return mask

        qsa.Indexer.select = select
        try:
            with routes.using():
                yield self
        finally:
            qsa.Indexer.select = real
        layer = lambda name: int(name.split("layers.")[1].split(".")[0])  # noqa: E731
        self.routes = [routes.calls[name][0][1] for name in sorted(routes.calls, key=layer)]


def _router(choices: Choices, order: list[int], real):
    """A TopKRouter forward whose rows take hetero's experts where its own top-k differs from them at a near-tie."""

    def forward(router, hidden):
        logits, scores, indices = real(router, hidden)
        i = order[0]
        order[0] += 1
        if i >= len(choices.routes):
            return logits, scores, indices
        ours = torch.from_numpy(choices.routes[i].astype(np.int64))  # [n, k]
        probs = torch.softmax(logits.float(), dim=-1)  # [N, E]
        for row in range(min(len(ours), len(indices))):
            theirs, mine = set(indices[row].tolist()), set(ours[row].tolist())
            if theirs == mine:
                continue
            gap = float(probs[row, list(theirs - mine)].min() - probs[row, list(mine - theirs)].max())
            if gap > NEAR * float(probs[row].max()):
                continue  # not a tie: transformers keeps its own, and the logits will say so
            picked = probs[row, ours[row]]
            if getattr(router, "norm_topk_prob", True):
                picked = picked / picked.sum()
            indices[row], scores[row] = ours[row], picked.to(scores.dtype)
            choices.ties += 1
        return logits, scores, indices

    return forward


def _block_scores(indexer, q: torch.Tensor, raw_keys: torch.Tensor, cos, sin, query: int) -> torch.Tensor:
    """transformers' indexer scores of every complete block for one query (its `_select_tokens`, row by row)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb

    c = indexer.compress_ratio
    n = (query + 1) // c
    pooled = indexer.k_layernorm(raw_keys[0, : n * c].view(n, c, -1).float().mean(1).to(raw_keys.dtype))
    starts = torch.arange(n) * c
    keys = apply_rotary_pos_emb(pooled.unsqueeze(1), cos=cos[0].index_select(0, starts),
                                sin=sin[0].index_select(0, starts)).squeeze(1)  # [n, Di]
    return torch.relu(q[0, query].float() @ keys.float().T).sum(0) / math.sqrt(indexer.index_head_dim)  # [n]


def _selector(choices: Choices, order: list[int], real):
    """An indexer's `_select_tokens` whose rows take hetero's blocks where its own differ from them at a near-tie."""

    def select(indexer, hidden, q, raw_keys, cos, sin, attention_mask, **kwargs):
        mask = real(indexer, hidden, q, raw_keys, cos, sin, attention_mask, **kwargs)  # [B, 1, S, T]
        i = order[0]
        order[0] += 1
        if i >= len(choices.masks):
            return mask
        ours = torch.from_numpy(choices.masks[i])  # [n, n]
        c, n = indexer.compress_ratio, min(ours.shape[0], mask.shape[2])
        for row in torch.nonzero((mask[0, 0, :n, :n] != ours[:n, :n]).any(-1)).flatten().tolist():
            blocks = (row + 1) // c
            theirs = set(torch.nonzero(mask[0, 0, row, : blocks * c].view(blocks, c).any(-1)).flatten().tolist())
            mine = set(torch.nonzero(ours[row, : blocks * c].view(blocks, c).any(-1)).flatten().tolist())
            scores = _block_scores(indexer, q, raw_keys, cos, sin, row)
            gap = float(scores[list(theirs - mine)].min() - scores[list(mine - theirs)].max()) if theirs != mine else 0
            if gap > NEAR * float(scores.abs().max()):
                continue
            mask[0, 0, row, :n] = ours[row, :n]
            choices.ties += 1
        return mask

    return select


@contextlib.contextmanager
def pinned(hf, choices: Choices):
    """transformers' model `hf` with its routers' and QSA indexers' choices pinned to `choices` at near-ties, for
    one forward pass inside the block (calls are matched in order, layer by layer)."""
    routers = {type(m) for m in hf.modules() if type(m).__name__.endswith("TopKRouter")}
    indexers = {type(m) for m in hf.modules() if type(m).__name__.endswith("QSAIndexer")}
    saved = [(cls, "forward", cls.forward) for cls in routers] + [(cls, "_select_tokens", cls._select_tokens)
                                                                 for cls in indexers]
    route_order, mask_order = [0], [0]
    for cls in routers:
        cls.forward = _router(choices, route_order, cls.forward)
    for cls in indexers:
        cls._select_tokens = _selector(choices, mask_order, cls._select_tokens)
    try:
        yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)
