"""One rank's share of the model as a pipeline stage.

`Stage.model(tokens, cache)` is the rank's part of the backbone pass: rank 0 embeds the tokens, every other rank
receives the previous rank's hidden states [B, S, H]; the rank's own layers run over its own caches; the result
goes to the next rank, or, on the last rank, through the final norm. On the last rank a `Stage` stands in for
`Model` where the engine's own code takes one (`decode.prefill.prefill`, `decode.solo.decode_tokens`): it has
`layers`, `model`, `logits`, `mtp_hidden`, `make_cache` and `args`, so prefill, drafting, acceptance and rollback
are the single-process code, run over the last rank's layers.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from hetero.decode.depth import MAX_DEPTH
from hetero.distributed.group import Link
from hetero.distributed.shard import Share
from hetero.errors import HeteroError
from hetero.models.cache import GDNCache, KVCache, LayerCache, ModelCache, last_positions
from hetero.models.interface import Args, CausalLM, DecoderLayer

# control messages from the last rank: [kind, n, token_0 .. token_{n-1}]; a request that asked for logprobs has
# every COMMIT followed by their rows, from the last rank to rank 0 (`outputs.send_logprobs`), and a stoppable one
# by rank 0's answer to the last rank (`rounds.GO_ON` / `rounds.STOP`)
VERIFY, STEP, COMMIT, DONE = 1, 2, 3, 4


class Stage:
    """This rank's layers (and embedding / head) with the link to its neighbours."""

    def __init__(self, net: CausalLM, share: Share, link: Link, dtype: mx.Dtype, weight_bytes: int, path: Path):
        self.args: Args = net.args
        self.share, self.link, self.dtype, self.weight_bytes = share, link, dtype, weight_bytes
        self.path = path  # the checkpoint directory on this host
        self.layers: list[DecoderLayer] = [net.model.layers[i] for i in share.layers]
        self.embed_tokens = net.model.embed_tokens if share.embedding else None
        self.norm = net.model.norm if share.last else None
        self.lm_head = net.lm_head if share.last and not self.args.tie_word_embeddings else None
        self.mtp = net.mtp if share.last else None
        self.announce: int | None = None  # last rank: the message kind that tells the others to run a pass
        self.prefix = None  # this rank's PrefixCache, made by the first request that asks for one
        self.grammar_tokenizer = None  # last rank: llguidance's vocabulary, built by the first constrained request

    @property
    def has_mtp(self) -> bool:
        return self.share.mtp

    def model(self, tokens: mx.array, cache: list[LayerCache]) -> mx.array:
        """tokens [B, S] (ids on rank 0; elsewhere only the shape counts) through this rank's layers.

        Returns the post-norm hidden [B, S, H] on the last rank, elsewhere the (lazy) send to the next rank."""
        if self.announce is not None:  # a decode pass: the other ranks learn its tokens (rank 0 embeds them)
            self.link.from_last([self.announce, tokens.size, *tokens.reshape(-1).tolist()], message_length())
        B, S = tokens.shape
        h = self.embed_tokens(tokens) if self.link.first else self.link.recv_prev((B, S, self.args.hidden_size),
                                                                                     self.dtype)
        for layer, c in zip(self.layers, cache):
            h = layer(h, c)  # [B, S, H]
        return self.norm(h) if self.link.last else self.link.send_next(h)

    def logits(self, hidden: mx.array) -> mx.array:
        """As `Model.logits` (last rank)."""
        if self.args.tie_word_embeddings:
            return self.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def draft_logits(self, z: mx.array) -> mx.array:
        """As `Model.draft_logits` (last rank)."""
        return self.logits(z)

    def mtp_hidden(self, next_tokens: mx.array, hidden: mx.array, cache: list[KVCache] | None = None,
                   last: bool = False) -> mx.array:
        """As `Model.mtp_hidden` (last rank): `cache` is the MTP layers' caches."""
        if self.mtp is None:
            raise HeteroError("this checkpoint has no MTP head (no mtp.* tensors): speculative decoding is unavailable")
        z = self.mtp(self.embed_tokens(next_tokens), hidden, cache)
        return last_positions(z, cache[-1] if cache else None) if last else z

    def make_cache(self) -> ModelCache:
        """One cache per own layer, then (last rank) one per MTP layer."""
        return ModelCache([GDNCache() if l.is_linear else KVCache() for l in self.layers],
                          [KVCache() for _ in self.mtp.layers] if self.mtp is not None else [])


def message_length() -> int:
    """Ints in a control message: kind, count, and up to a verify pass's tokens (x and MAX_DEPTH drafts)."""

    return 2 + MAX_DEPTH + 1
