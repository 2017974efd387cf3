"""Loading one rank's share of a checkpoint: only the tensors of its own layers, shard by shard.

The safetensors index (or the single file's header) names the shard of every tensor; a rank opens only the
shards that hold its tensors, and `mx.load` is lazy, so only the tensors it evaluates are read. Rank 0 holds the
embedding; the last rank the final norm, lm_head and the MTP head, and the embedding too when it is needed there
(a tied lm_head is the embedding matrix; the MTP head embeds the next token).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from hetero.checkpoint.preflight import build_lazy_model, sanitize_for
from hetero.checkpoint.safetensors import norms_zero_centred, read_header, read_index
from hetero.errors import HeteroError
from hetero.models.fused import fuse
from hetero.models.interface import Args, CausalLM
from hetero.models.weights import canonical_name, checkpoint_has_mtp


@dataclass(frozen=True)
class Share:
    """What one rank holds: its backbone layers and the parts at either end."""

    layers: range
    first: bool
    last: bool
    tied: bool
    mtp: bool  # the checkpoint has an MTP head (held by the last rank)

    @property
    def embedding(self) -> bool:
        return self.first or (self.last and (self.tied or self.mtp))

    def owns(self, name: str) -> bool:
        """Whether a canonical parameter name belongs to this rank."""
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in self.layers
        if name.startswith("model.embed_tokens."):
            return self.embedding
        return self.last and name.startswith(("model.norm.", "lm_head.", "mtp."))


def weight_map(path: Path) -> dict[str, str]:
    """Checkpoint tensor name -> shard file, from the index or the single file's header."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return read_index(index)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    if not shards:
        raise HeteroError(f"{path} holds no model.safetensors and no model.safetensors.index.json")
    return {name: shard for shard in shards for name in read_header(path / shard)}


def load_share(path: Path, args: Args, layers: range, first: bool, last: bool,
               dtype: mx.Dtype) -> tuple[CausalLM, Share, int]:
    """A lazily built `Model` whose parameters of this rank's share are loaded and evaluated (the rest stay
    unevaluated placeholders that take no memory); also the share and the bytes of weights it holds."""
    files = weight_map(path)
    share = Share(layers, first, last, args.tie_word_embeddings, checkpoint_has_mtp(files))
    mine = {n: f for n, f in files.items() if (c := canonical_name(n)) is not None and share.owns(c)}
    tensors: dict[str, mx.array] = {}
    for shard in sorted(set(mine.values())):  # only the shards that hold this rank's tensors
        try:
            loaded = mx.load(str(path / shard))  # lazy: a tensor is read when evaluated
        except (RuntimeError, ValueError) as e:
            raise HeteroError(f"cannot read {path / shard}: {e}; re-download it") from None
        tensors.update({n: loaded[n] for n, f in mine.items() if f == shard})
        del loaded  # the shard's other tensors (never read)
    probe = _conv_layout_probe(path, files, tensors)
    weights = {k: v for k, v in sanitize_for(args, {**tensors, **probe}, norms_zero_centred(path)).items()
               if share.owns(k)}
    quantized = {k[: -len(".scales")] for k in weights if k.endswith(".scales")}
    net = build_lazy_model(args, share.mtp and last, quantized)
    expected = {k for k, _ in tree_flatten(net.parameters()) if share.owns(k)}
    missing = sorted(expected - set(weights))
    if missing:
        raise HeteroError(f"no tensor for parameter {missing[0]} (rank share {layers.start}..{layers.stop - 1}): "
                          "the checkpoint is incomplete")
    net.load_weights(list(weights.items()), strict=False)
    net.set_dtype(dtype, lambda t: mx.issubdtype(t, mx.floating))
    for i in layers:  # the decay parameters stay fp32, as `load_model` keeps them
        if net.layers[i].is_linear:
            net.layers[i].linear_attn.A_log = weights[f"model.layers.{i}.linear_attn.A_log"].astype(mx.float32)
    params = [v for k, v in tree_flatten(net.parameters()) if share.owns(k)]
    mx.eval(params)
    net.eval()
    nbytes = sum(p.nbytes for p in params)
    del weights, params, tensors, probe  # fusing replaces the loaded tensors with views of the products
    for i in layers:  # only this share's layers: the others are unevaluated placeholders
        fuse(net.layers[i])
    if net.mtp is not None:
        fuse(net.mtp)
    return net, share, nbytes


def _conv_layout_probe(path: Path, files: dict[str, str], tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """`sanitize` tells an HF checkpoint (zero-centred norms) from a converted one by a GDN conv weight's layout.
    A rank whose share has no GDN layer gets an unevaluated placeholder of some conv weight's shape (from its
    shard's header: nothing is read), so its norms are shifted exactly as the single-process load shifts them."""
    if any(n.endswith("conv1d.weight") for n in tensors):
        return {}
    conv = next((n for n in files if n.endswith("conv1d.weight")), None)
    if conv is None:
        return {}
    info = read_header(path / files[conv])[conv]
    return {conv: mx.zeros(info.shape)}
