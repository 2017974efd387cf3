"""Qwen4-Exp (`qwen4_exp`, `qwen4_exp_text`) as the engine asks it (`hetero.models.interface.Architecture`)."""

from __future__ import annotations

from functools import lru_cache

from hetero.models.interface import Shape
from hetero.models.qwen4_exp.args import MODEL_TYPES, Qwen4Args
from hetero.models.qwen4_exp.model import Model, is_hash_buffer, keep_ple_on_disk, sanitize, stored_ple_blocks
from hetero.models.qwen4_exp.ple import head_vocab_sizes


class Qwen4Exp:
    """Hyper-connections around GDN and QSA mixers, routed + shared experts on every layer, per-layer n-gram
    embeddings (PLE) whose tables stay in the checkpoint's files, a one-layer MTP head with its own mixer."""

    name = "qwen4_exp"
    model_types = MODEL_TYPES
    required_fields = ()  # `Qwen4Args.from_config` has transformers' defaults for the sizes it may lack
    quantized_kv = False  # a QSA layer's cache keeps its raw index keys too
    across_hosts = False
    reads_images = False  # its vision tower is not read yet
    drafter_model_type = "qwen4_exp_mtp"  # `mlx_vlm convert --mtp`

    parse = staticmethod(Qwen4Args.from_config)
    sanitize = staticmethod(sanitize)
    derived = staticmethod(is_hash_buffer)  # the PLE hash constants transformers saves (int64)
    build = staticmethod(Model)  # (args, with_mtp)
    keep_on_disk = staticmethod(keep_ple_on_disk)  # a prefill chunk gathers its n-gram rows from the files
    stored_as_is = staticmethod(stored_ple_blocks)  # the PLE n-gram tables stay unquantized, as stored

    @staticmethod
    def shape(args: Qwen4Args) -> Shape:
        h, streams = args.hidden_size, args.hc_count * args.hidden_size
        mixer = 2 * streams * args.hc_lowrank  # a hyper-connection's low-rank input mixer (down, up)
        indexer = h * (args.indexer_n_heads + 1) * args.indexer_head_dim if args.qsa else 0
        E = args.ple_embed_dim
        return Shape(
            residual_width=streams,
            # one layer whatever mtp_num_hidden_layers says: the released head ships `mtp.layers.0` alone (mlx-vlm
            # reads the field as a draft depth)
            mtp_layers=min(1, args.mtp_num_hidden_layers),
            mtp_moe_layers=(0,),
            mtp_input_params=2 * h * h,  # fc_embedding, fc_hidden
            index_key_dim=args.indexer_head_dim,
            indexer_params=indexer,
            # the indexer scores each query against every compressed block (one per indexer_compress_ratio keys)
            indexer_pair_flops=(2.0 * args.indexer_n_heads * args.indexer_head_dim / args.indexer_compress_ratio
                                if indexer else 0.0),
            hyper_params=mixer + streams * args.hc_count,  # and the per-stream injection weights
            final_mixer_params=mixer,
            ple_layers=tuple(i - 1 for i in args.ple_layer_ids),
            ple_params=E * streams + E * h + streams * args.ple_conv_kernel_size,  # key_proj, value_proj, the conv
            ple_table_params=ple_table_params(args),
            ple_state_bytes=len(args.ple_layer_ids) * (args.ple_conv_kernel_size - 1) * args.ngram_size * streams * 4,
            never_split={"mlp": "every qwen4_exp layer is mixture-of-experts: its shared expert is the shared_expert "
                                "piece"},
        )


def ple_table_params(args: Qwen4Args) -> int:
    """Weights of all PLE n-gram tables: each layer's heads' prime vocabularies, padded as the model pads them."""
    if not args.ple_layer_ids:
        return 0
    divisor, width = args.make_ngram_vocab_size_divisible_by, args.ple_embed_dim // args.ngram_heads
    rows = [-(-_vocab_rows(args.ngram_vocab_size_base, i, args.ngram_heads) // divisor) * divisor
            for i in range(len(args.ple_layer_ids))]
    return sum(rows) * width


@lru_cache(maxsize=64)
def _vocab_rows(base: int, ple_index: int, heads: int) -> int:
    """Rows of one PLE layer's heads' prime vocabularies (as the model hashes into them), before padding."""
    return sum(head_vocab_sizes(base, ple_index, heads))


QWEN4_EXP = Qwen4Exp()
