"""The Qwen4-Exp causal LM: decoder layers (PLE, hyper-connections around a GDN or QSA mixer and the MoE block),
the final hyper-connection mixer, lm_head, the MTP head; `sanitize` (checkpoint -> parameters) and `make_cache`."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from hetero.errors import HeteroError
from hetero.models import activations as act
from hetero.models.cache import GDNCache, ModelCache, last_positions
from hetero.models.compiled import PerThread
from hetero.models.gated_delta import RECURRENT_MAX_TOKENS
from hetero.models.linear import Linear
from hetero.models.lm import CausalLMBase
from hetero.models.moe import SparseMoeBlock
from hetero.models.qwen3_5.layers import MLP, GatedDeltaNet, RMSNorm, rms_norm
from hetero.models.qwen4_exp.args import Qwen4Args
from hetero.models.qwen4_exp.hyper import GatedResidual
from hetero.models.qwen4_exp.ple import PLECache, PLELayer
from hetero.models.qwen4_exp.ple_table import DiskTable, QuantizedDiskTable, StoredRows
from hetero.models.qwen4_exp.qsa import QSAAttention, QSACache
from hetero.models.qwen4_exp.step import LayerSteps
from hetero.models.weights import canonical_name, finish, hf_conv_layout


class GatedDeltaNetQ4(GatedDeltaNet):
    """Qwen3.5's GDN with the output gate of `output_gate_type` (sigmoid in the shipped config, else SiLU)."""

    def __init__(self, args: Qwen4Args):
        super().__init__(args)
        self.gate_act = act.sigmoid if args.output_gate_type == "sigmoid" else act.silu

    def output(self, core: mx.array, z: mx.array, dtype: mx.Dtype) -> mx.array:
        """core [B, S, Hv, Dv] fp32, z [B, S, Hv*Dv] -> out_proj(w * rmsnorm(core) * gate(z)) [B, S, hidden]."""
        B, S = core.shape[:2]
        z = z.reshape(B, S, self.nv, self.dv)
        gate = self.gate_act(z.astype(mx.float32)) if S < act.EAGER_MIN_TOKENS or self.gate_act is not act.sigmoid \
            else act.sigmoid_now(z.astype(mx.float32))  # a prefill chunk's sigmoid: numpy's exp
        out = rms_norm(core, self.norm.weight.astype(mx.float32), self.eps) * gate
        return self.out_proj(out.astype(dtype).reshape(B, S, -1))


class PLEGDNCache(GDNCache):
    """A GDN layer's cache plus, on PLE layers, the PLE state (`ple`); a checkpoint holds both, the GDN's first."""

    def __init__(self, with_ple: bool) -> None:
        super().__init__()
        self.ple = PLECache() if with_ple else None

    def checkpoint_layout(self, args: Qwen4Args, dtype: mx.Dtype) -> list[tuple[str, tuple[int, ...], mx.Dtype]]:
        ple = self.ple.checkpoint_layout(args, dtype) if self.ple is not None else []
        return super().checkpoint_layout(args, dtype) + ple

    def checkpoint(self) -> tuple[mx.array, ...]:
        return super().checkpoint() + (self.ple.checkpoint() if self.ple is not None else ())

    def restore(self, arrays: list[mx.array], n: int) -> None:
        super().restore(arrays[:2], n)
        if self.ple is not None:
            self.ple.restore(*arrays[2:])

    def like(self) -> PLEGDNCache:
        return PLEGDNCache(self.ple is not None)

    @property
    def state(self) -> list[mx.array]:
        return super().state + (self.ple.state if self.ple is not None else [])


class DecoderLayer(nn.Module):
    """h += PLE(h) (PLE layers); h = attn_hc.around(h, mixer); h = mlp_hc.around(h, moe); h is [B, S, hc*d].

    A batch of requests (the stepper's rows, padding after each row's real tokens) passes stacked GDN and PLE
    states and, on the QSA layer, a `RaggedKV` of the rows' own caches (`QSAAttention`)."""

    def __init__(self, args: Qwen4Args, index: int):
        super().__init__()
        self.is_linear = args.layer_types[index] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNetQ4(args)
        else:
            self.self_attn = QSAAttention(args)
        self.mlp = SparseMoeBlock(
            args.hidden_size, args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size,
            args.norm_topk_prob, shared_expert=MLP(args.hidden_size, args.shared_expert_intermediate_size),
        )
        if index + 1 in args.ple_layer_ids:
            self.ple = PLELayer(args, args.ple_layer_ids.index(index + 1))
        else:
            self.ple = None
        hc = dict(hidden=args.hidden_size, hc=args.hc_count, lowrank=args.hc_lowrank, eps=args.rms_norm_eps)
        self.attn_hyper_connection = GatedResidual(**hc)
        self.mlp_hyper_connection = GatedResidual(**hc)
        self._steps = LayerSteps(self)

    def __call__(self, h: mx.array, tokens: np.ndarray, cache, last: bool = False) -> mx.array:
        """h [B, S, hc*d] over `cache` -> h' [B, S, hc*d]. `last` (the MTP head's catch-up and prefill pairs): h'
        [B, 1, hc*d] of each row's last real position; an attention layer writes every position's keys and runs
        the rest (the attention proper, o_proj, the MoE) for that position alone (`LayerSteps`, uncompiled past a
        few tokens)."""
        if self._steps.takes(h, cache) or (last and not self.is_linear and cache is not None):
            return self._steps.run(h, tokens, cache, last)  # decode, verify, draft and catch-up steps (`step.py`)
        h = self.mlp_block(self.mixer_block(h, cache, tokens))
        return last_positions(h, cache) if last else h

    # The layer's pieces, as the split prefill runs them one by one (`hetero.models.interface.DecoderLayer`): each
    # block reads its input from the streams and writes its output back through its hyper-connection; a PLE
    # layer's update comes before the mixer.

    @property
    def mixer_io(self) -> GatedResidual:
        return self.attn_hyper_connection

    @property
    def mlp_io(self) -> GatedResidual:
        return self.mlp_hyper_connection

    @property
    def pre_mixer_state(self) -> bool:
        """A PLE layer's update reads and advances its PLE cache (the last chunk's tokens and conv inputs)."""
        return self.ple is not None

    def before_mixer(self, h: mx.array, tokens: np.ndarray, cache) -> mx.array:
        """h [B, S, hc*d] -> h + PLE(h) on a PLE layer (tokens [B, S] int64 on the host), h elsewhere."""
        if self.ple is None:
            return h
        return h + self.ple(h, tokens, cache.ple if cache is not None else None)

    def mixer(self, x: mx.array, cache, positions: mx.array | None = None) -> mx.array:
        """The mixed input x [B, S, d] -> the mixer's output [B, S, d] (GDN or QSA; text only: no 3-D positions)."""
        if positions is not None:
            raise HeteroError("qwen4_exp checkpoints read text only: no image positions")
        return self.linear_attn(x, cache) if self.is_linear else self.self_attn(x, cache)

    def mixer_block(self, h: mx.array, cache, tokens: np.ndarray | None = None,
                    positions: mx.array | None = None) -> mx.array:
        """The PLE update, then h + inject * mixer(mix(h)): streams [B, S, hc*d] -> [B, S, hc*d]."""
        h = self.before_mixer(h, tokens, cache)
        x, inject = self.mixer_io.read(h)
        return self.mixer_io.write(h, self.mixer(x, cache, positions), inject)

    def mlp_block(self, h: mx.array) -> mx.array:
        """h + inject * moe(mix(h)): streams [B, S, hc*d] -> [B, S, hc*d]."""
        x, inject = self.mlp_io.read(h)
        return self.mlp_io.write(h, self.mlp(x), inject)


class TextModel(nn.Module):
    """Embeddings copied into hc streams, the decoder stack, the final hyper-connection mixer -> [B, S, d]."""

    def __init__(self, args: Qwen4Args):
        super().__init__()
        self.hc = args.hc_count
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.hyper_connection_mixer = GatedResidual(args.hidden_size, args.hc_count, args.hc_lowrank,
                                                    args.rms_norm_eps, final=True)

    @property
    def norm(self) -> nn.Module:
        """The final mixer's norm: engine code reads the compute dtype as `model.model.norm.weight.dtype`."""
        return self.hyper_connection_mixer.hc_norm

    def __call__(self, tokens: mx.array, cache: list | None) -> mx.array:
        """tokens [B, S] -> the last layer's streams [B, S, hc*d], before the final mixer (`Model.logits` mixes
        them): the MTP head reads the streams themselves."""
        h, host_tokens = self.begin(tokens)
        for i in range(len(self.layers)):
            h = self.run_layer(i, h, host_tokens, cache[i] if cache is not None else None)
        return self.end(h)

    # `__call__` in three steps, which the CPU prefill wavefront (`hetero.decode.wavefront`) runs layer by layer,
    # two chunks at once: the same ops in the same order per chunk.

    def begin(self, tokens: mx.array) -> tuple[mx.array, np.ndarray]:
        """tokens [B, S] -> (the streams entering layer 0 [B, S, hc*d], the host token ids the PLE layers hash)."""
        host_tokens = np.array(tokens, dtype=np.int64)  # the PLE hashes run on the host
        return mx.tile(self.embed_tokens(tokens), (1, 1, self.hc)), host_tokens  # every stream starts as e_t

    def run_layer(self, i: int, h: mx.array, host_tokens: np.ndarray, cache) -> mx.array:
        """Layer i: streams [B, S, hc*d] -> [B, S, hc*d]; writes `cache` (layer i's own)."""
        return self.layers[i](h, host_tokens, cache)

    def end(self, h: mx.array) -> mx.array:
        """After the last layer: the streams as `__call__` returns them (the final mixer runs in `Model.logits`)."""
        return h


class MTPHead(nn.Module):
    """`mtp.*`: the multi-token-prediction head, fed the backbone's streams h_p [hc*d] and the token t_{p+1}.

        e = fc_embedding(N(embed t_{p+1}; pre_fc_norm_embedding))     [d]
        z = fc_hidden(N(h_p; pre_fc_norm_hidden) per stream) + e      [hc, d]: one RMS over all hc*d, one fc per stream
        z = layer(z)                                                  a QSA + MoE decoder layer with hyper-connections
        draft logits = lm_head(hyper_connection_mixer(z))             the head's own mixer, the shared lm_head

    The streams z (before the mixer) feed the head again at the next depth, with the draft token.
    """

    def __init__(self, args: Qwen4Args):
        super().__init__()
        d, hc = args.hidden_size, args.hc_count
        self.hidden, self.hc = d, hc
        self.pre_fc_norm_embedding = RMSNorm(d, args.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(hc * d, args.rms_norm_eps)
        self.fc_embedding = Linear(d, d, bias=False)
        self.fc_hidden = Linear(d, d, bias=False)
        layer_args = replace(args, num_hidden_layers=1, layer_types=["indexed_attention"], ple_layer_ids=[])
        # One layer whatever mtp_num_hidden_layers says: the released head ships `mtp.layers.0` alone, and mlx-vlm
        # 0.7.10 (which reads it) builds one layer and takes that field as the draft depth instead.
        self.layers = [DecoderLayer(layer_args, 0)]
        self.hyper_connection_mixer = GatedResidual(d, hc, args.hc_lowrank, args.rms_norm_eps, final=True)
        # a draft step and a catch-up over a round's accepted pairs: compiled as the backbone's steps are (`step.py`;
        # the layer's own step is its `LayerSteps`)
        self._step_inputs = PerThread(self._inputs)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: list | None, last: bool = False) -> mx.array:
        """embeds [B, S, d] (of t_{p+1}), hidden [B, S, hc*d] (h_p) at positions cache.offset.. -> streams [B, S, hc*d]
        (`last`: [B, 1, hc*d], each row's last real position; `Model.mtp_hidden`)."""
        z = (self._step_inputs if hidden.shape[1] <= RECURRENT_MAX_TOKENS else self._inputs)(embeds, hidden)
        for i, layer in enumerate(self.layers):  # only the last layer's outputs are the head's: it may stop early
            z = layer(z, None, cache[i] if cache is not None else None, last and i == len(self.layers) - 1)
        return z

    def _inputs(self, embeds: mx.array, hidden: mx.array) -> mx.array:
        """embeds [B, S, d], hidden [B, S, hc*d] -> the layer's input streams [B, S, hc*d]."""
        B, S, _ = hidden.shape
        e = self.fc_embedding(self.pre_fc_norm_embedding(embeds))  # [B, S, d]
        h = self.pre_fc_norm_hidden(hidden).reshape(B, S, self.hc, self.hidden)  # [B, S, hc, d]
        return (self.fc_hidden(h) + e[:, :, None, :]).reshape(B, S, -1)  # [B, S, hc*d]


class Model(CausalLMBase):
    """The causal LM: `model` (backbone), `lm_head` (unless tied) and, when the checkpoint has one, `mtp`."""

    def __init__(self, args: Qwen4Args, with_mtp: bool = False):
        super().__init__(args, TextModel, MTPHead if with_mtp else None)
        self._step_logits = PerThread(self._logits)  # a few positions (decode, verify): compiled, see `step.py`
        self._step_draft_logits = PerThread(self._draft_logits)  # the same for the MTP head's drafts

    @property
    def hidden_width(self) -> int:
        """Width of the hidden `__call__` returns, which the MTP head reads and prefix checkpoints carry: hc*d."""
        return self.args.hc_count * self.args.hidden_size

    @property
    def ple_disk_bytes(self) -> int:
        """Bytes of the PLE n-gram tables read from the checkpoint's files (`keep_ple_on_disk`), not held."""
        return sum(l.ple.ple_embedding.table.nbytes for l in self.layers
                   if l.ple is not None and l.ple.ple_embedding.table is not None)

    @property
    def on_disk(self) -> list[tuple[str, int]]:
        """What the model reads from the checkpoint's files as needed instead of holding: (what, bytes)."""
        return [("PLE n-gram tables", self.ple_disk_bytes)] if self.ple_disk_bytes else []

    def head(self, x: mx.array) -> mx.array:
        """lm_head (or the tied embeddings): x [B, S, d] -> [B, S, vocab]."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(x)
        return self.lm_head(x)

    def logits(self, hidden: mx.array) -> mx.array:
        """The backbone's streams [B, S, hc*d] -> logits [B, S, vocab], through the final mixer."""
        return (self._step_logits if hidden.shape[1] <= RECURRENT_MAX_TOKENS else self._logits)(hidden)

    def _logits(self, hidden: mx.array) -> mx.array:
        return self.head(self.model.hyper_connection_mixer(hidden))

    def mtp_hidden(self, next_tokens: mx.array, hidden: mx.array, cache: list | None = None,
                   last: bool = False) -> mx.array:
        """MTP step: next_tokens [B, S] (t_{p+1}) with streams [B, S, hc*d] (h_p: the backbone's, or the head's own
        output at the previous depth) -> the head's streams [B, S, hc*d]; `cache` is `make_cache().mtp`.

        `last` (a catch-up before drafting, a prefill chunk's pairs): only [B, 1, hc*d], each row's last real position
        (a `RaggedKV` row's own length). The head has one layer, so the earlier positions leave only their keys in
        its cache: the attention, o_proj and the MoE run for the last position alone, not for every pair."""
        if self.mtp is None:
            raise HeteroError("this checkpoint has no MTP head (no mtp.* tensors): speculative decoding is unavailable")
        return self.mtp(self.model.embed_tokens(next_tokens), hidden, cache, last)

    def draft_logits(self, z: mx.array) -> mx.array:
        """The MTP head's streams [B, S, hc*d] -> draft logits [B, S, vocab], through the head's own mixer."""
        return (self._step_draft_logits if z.shape[1] <= RECURRENT_MAX_TOKENS else self._draft_logits)(z)

    def _draft_logits(self, z: mx.array) -> mx.array:
        return self.head(self.mtp.hyper_connection_mixer(z))

    def make_cache(self) -> ModelCache:
        """One cache per layer: `PLEGDNCache` (GDN state, conv window, PLE state) or `QSACache`; then one `QSACache`
        per MTP layer."""
        return ModelCache([PLEGDNCache(l.ple is not None) if l.is_linear else QSACache() for l in self.model.layers],
                          [QSACache() for _ in self.mtp.layers] if self.mtp is not None else [])


# a PLE table's row blocks: transformers' `shard_{i}.weight`, and (mlx-vlm `convert -q`) `.scales` / `.biases` too
_PLE_SHARD = re.compile(r"(.*\.ple\.ple_embedding\.ngram_embedding)\.shard_(\d+)\.(weight|scales|biases)$")
_PLE_BUFFERS = ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes")


def is_hash_buffer(name: str) -> bool:
    """PLE hash constants that transformers saves (int64) and `sanitize` drops: they follow from the config."""
    return name.rsplit(".", 1)[-1] in _PLE_BUFFERS


def is_zero_centred_norm(name: str) -> bool:
    """Every RMSNorm of this family is stored as w with scale 1 + w, except the GDN output norm."""
    module = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
    return name.endswith(".weight") and "norm" in module and not name.endswith("linear_attn.norm.weight")


def sanitize(args: Qwen4Args, weights: dict[str, mx.array], zero_centred: bool = True) -> dict[str, mx.array]:
    """Checkpoint tensors -> parameters: canonical names (vision skipped), PLE shards concatenated (their hash
    buffers dropped: recomputed from the config), experts stacked, conv layout, the norms' +1 once."""
    out, hash_buffers = {}, False
    for key, value in weights.items():
        name = canonical_name(key)
        if name is not None and is_hash_buffer(name):
            hash_buffers = True
        elif name is not None:
            out[name] = value
    _check_hc(args, out)
    _join_ple_shards(args, out)
    hf_conv = hf_conv_layout(out, zero_centred)
    if args.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    # The norms are stored zero-centred (+1 to apply) by transformers (its conv layout) and by mlx-vlm (MLX conv
    # layout, hash buffers kept); only hetero's own converted copies drop the buffers and store 1 + w.
    return finish(out, args.num_experts, hf_conv or hash_buffers, is_zero_centred_norm)


def _check_hc(args: Qwen4Args, out: dict[str, mx.array]) -> None:
    w = out.get("model.hyper_connection_mixer.hc_norm.weight")
    if w is not None and w.shape[0] != args.hc_count * args.hidden_size:
        raise HeteroError(f"config.json says hc_count {args.hc_count}, but the checkpoint's hyper-connections hold "
                          f"{w.shape[0] // args.hidden_size} streams (hc_norm is {w.shape[0]} wide): fix hc_count")


def _join_ple_shards(args: Qwen4Args, out: dict[str, mx.array]) -> None:
    """`...ngram_embedding.shard_{i}.weight` (split along rows) -> `...ngram_embedding.weight`, dequantized (lazily:
    `keep_ple_on_disk` drops it unread) when the shards are quantized; one line if any PLE layer's table is absent
    or incomplete."""
    shards: dict[str, dict[str, dict[int, mx.array]]] = {}  # table -> weight / scales / biases -> shard -> rows
    for name in [n for n in out if _PLE_SHARD.match(n)]:
        m = _PLE_SHARD.match(name)
        shards.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = out.pop(name)
    for layer in args.ple_layer_ids:
        base = f"model.layers.{layer - 1}.ple.ple_embedding.ngram_embedding"
        if f"{base}.weight" in out:
            continue
        kinds = shards.pop(base, {})
        weight = _joined_rows(args, base, kinds, "weight")
        if "scales" in kinds or "biases" in kinds:
            scales, biases = _joined_rows(args, base, kinds, "scales"), _joined_rows(args, base, kinds, "biases")
            bits, group = ple_quantization(args, base)
            if weight.shape[1] * 32 // bits != scales.shape[1] * group or scales.shape != biases.shape:
                raise HeteroError(f"layer {layer - 1}'s quantized PLE table does not fit config.json's quantization "
                                  f"({bits}-bit, groups of {group}): packed {list(weight.shape)}, scales "
                                  f"{list(scales.shape)}, biases {list(biases.shape)}; re-convert the checkpoint")
            weight = mx.dequantize(weight, scales, biases, group_size=group, bits=bits)
        out[f"{base}.weight"] = weight


def _joined_rows(args: Qwen4Args, base: str, kinds: dict[str, dict[int, mx.array]], kind: str) -> mx.array:
    """Table `base`'s `kind` (weight, scales, biases) shards concatenated along rows; one line when some are missing."""
    parts, layer = kinds.get(kind, {}), base.split(".")[2]
    if len(parts) != args.split_ngram_parts or set(parts) != set(range(args.split_ngram_parts)):
        raise HeteroError(f"layer {layer}'s PLE n-gram table has {len(parts)} of its {args.split_ngram_parts} "
                          f"shards ({base}.shard_*.{kind}): the checkpoint is incomplete, download the missing "
                          "PLE shards")
    return mx.concatenate([parts[i] for i in range(args.split_ngram_parts)], axis=0)


def ple_quantization(args: Qwen4Args, base: str) -> tuple[int, int]:
    """(bits, group_size) of a quantized PLE table: config.json's entry for its first shard (mlx-vlm writes one per
    shard, groups of 32) or the global one; one line for a mode other than affine."""
    q = args.quantization or {}
    own = [v for k, v in q.items() if isinstance(v, dict) and canonical_name(k) == f"{base}.shard_0"]
    params = own[0] if own else q
    if params.get("mode", "affine") != "affine":
        raise HeteroError(f"{base} is quantized in mode {params['mode']!r}; hetero reads affine-quantized PLE tables "
                          "only: convert with `--q-mode affine` or without -q")
    return int(params.get("bits", 4)), int(params.get("group_size", 64))


def keep_ple_on_disk(model: Model, weights: dict[str, mx.array], path: Path, tensors: dict) -> None:
    """Point each PLE layer at its n-gram table where the checkpoint stores it (memory-mapped row blocks,
    `ple_table.DiskTable`, or `QuantizedDiskTable` for quantized shards) and drop the table from the loaded
    `weights` unread. `tensors`: the checkpoint's tensor name -> `loader.TensorInfo` (file, dtype, shape, offset)."""
    blocks: dict[str, dict[str, dict[int, StoredRows]]] = {}  # table -> weight / scales / biases -> shard -> rows
    for raw, info in tensors.items():
        name = canonical_name(raw)
        if name is None or "ngram_embedding" not in name:
            continue
        stored = StoredRows(path / info.file, info.dtype, tuple(info.shape), info.offset)
        shard = _PLE_SHARD.match(name)
        if shard is not None:
            blocks.setdefault(shard.group(1), {}).setdefault(shard.group(3), {})[int(shard.group(2))] = stored
        elif name.endswith(".ngram_embedding.weight"):  # stored whole (a converted checkpoint)
            blocks.setdefault(name[: -len(".weight")], {}).setdefault("weight", {})[0] = stored
    for i, layer in enumerate(model.layers):
        if layer.ple is None:
            continue
        base = f"model.layers.{i}.ple.ple_embedding.ngram_embedding"
        tables = {kind: DiskTable([parts[k] for k in sorted(parts)]) for kind, parts in blocks.get(base, {}).items()}
        weights.pop(f"{base}.weight", None)
        if "scales" in tables:
            bits, group = ple_quantization(model.args, base)
            table = QuantizedDiskTable(tables["weight"], tables["scales"], tables["biases"], bits, group)
        else:
            table = tables["weight"]
        layer.ple.ple_embedding.use_table(table)


def stored_ple_blocks(path: Path, tensors: dict) -> dict[str, mx.array]:
    """The PLE tables' row blocks as the checkpoint at `path` stores them, under canonical names, read lazily
    (each only when written): what a converted copy of the checkpoint carries over unchanged. `tensors` as for
    `keep_ple_on_disk`."""
    out, files = {}, {}
    for raw, info in tensors.items():
        name = canonical_name(raw)
        if name is not None and ".ple.ple_embedding.ngram_embedding." in name:
            if info.file not in files:
                files[info.file] = mx.load(str(path / info.file))  # lazy: nothing is read here
            out[name] = files[info.file][raw]
    return out
