"""What every causal LM here is made of, under the checkpoint's names: `model` (the backbone), `lm_head` (unless tied
to the embeddings) and `mtp` (the multi-token-prediction head; None without one), and the forward they share. Each
architecture's `Model` extends it with its logits, MTP steps and caches (`hetero.models.interface.CausalLM`)."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from hetero.models.args import Args
from hetero.models.cache import ModelCache
from hetero.models.linear import Linear


class CausalLMBase(nn.Module):
    """The backbone `model`, `lm_head` and `mtp`, built in that order from the architecture's own classes."""

    def __init__(self, args: Args, backbone: Callable[[Args], nn.Module], head: Callable[[Args], nn.Module] | None):
        super().__init__()
        self.args = args
        self.model = backbone(args)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.mtp = head(args) if head is not None else None

    @property
    def has_mtp(self) -> bool:
        return self.mtp is not None

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    def __call__(self, tokens: mx.array, cache: ModelCache | None = None) -> tuple[mx.array, mx.array]:
        """tokens [B, S] -> (logits [B, S, vocab], the hidden the MTP head reads [B, S, hidden_width]); `cache` is
        `make_cache()`."""
        hidden = self.model(tokens, cache.backbone if cache is not None else None)
        return self.logits(hidden), hidden
