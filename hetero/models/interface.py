"""What the rest of the engine knows of an architecture: the interface each folder under models/ implements
(`Architecture`, keyed by config.json's model_type in `hetero.models.architectures`), the model it builds
(`CausalLM`, whose layers are `DecoderLayer`s the split prefill may take apart), the arguments every architecture's
config parses into (`Args`, in `hetero.models.args`), and what the planner prices (`Shape`). Nothing outside models/ asks which architecture it holds: it asks these.

    arch = architecture(config["model_type"])      # hetero.models.architectures
    args = arch.parse(config)                      # the config as typed arguments (`Args`)
    params = arch.sanitize(args, tensors)          # checkpoint names -> parameters
    model = arch.build(args, with_mtp=True)        # a `CausalLM`; `model.make_cache()` its per-layer caches
    arch.shape(args)                               # what the planner prices beyond the fields every `Args` has

Adding an architecture: a folder that implements `Architecture` (and the model's pieces below), and its line in
`hetero.models.architectures`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from hetero.models.args import Args
from hetero.models.cache import ModelCache


@dataclass(frozen=True)
class Shape:
    """What the planner prices beyond the fields every `Args` has: each architecture's own parts, as counts. An
    architecture without a part leaves it at zero (empty)."""

    residual_width: int  # the residual stream a layer reads and writes: hidden_size, or several streams of it
    mtp_layers: int  # decoder layers of the MTP head as built (0: no head declared)
    mtp_moe_layers: tuple[int, ...] = ()  # which of them have a mixture-of-experts MLP
    mtp_input_params: int = 0  # the head's input projections (fc) ahead of its layers
    index_key_dim: int = 0  # values per token an attention layer keeps beside its K/V (a QSA indexer's raw keys)
    indexer_params: int = 0  # weights of one attention layer's key selection (a QSA indexer)
    indexer_pair_flops: float = 0.0  # its FLOPs per (query, visible key) pair
    hyper_params: int = 0  # weights of one hyper-connection (two per decoder layer: mixer and MLP)
    final_mixer_params: int = 0  # weights of the hyper-connection mixer in place of the final norm
    ple_layers: tuple[int, ...] = ()  # 0-based layers with per-layer n-gram embeddings
    ple_params: int = 0  # weights of one PLE block held in memory (projections, conv)
    ple_table_params: int = 0  # weights of every PLE n-gram table: read from the checkpoint's files, never held
    ple_state_bytes: int = 0  # per sequence: every PLE layer's carried state (its conv window, in fp32)
    never_split: dict[str, str] = field(default_factory=dict)  # offloadable piece kinds it has none of, and why


class Residual(Protocol):
    """Where a block (a layer's mixer or MLP) meets the residual stream: `read` gives the block's input and what
    `write` needs besides; `write` puts the block's output back. The model runs its blocks through the same two."""

    def read(self, h: mx.array) -> tuple[mx.array, Any]: ...

    def write(self, h: mx.array, out: mx.array, ctx: Any) -> mx.array: ...


class DecoderLayer(Protocol):
    """One decoder layer as the split prefill (`hetero.pipeline.split`) takes it apart: a mixer block (GDN when
    `is_linear`, else attention) then an MLP block, each reading and writing the residual stream through its
    `Residual`. `mixer_block` and `mlp_block` run a block whole, exactly as the layer runs it."""

    is_linear: bool
    mlp: Any  # dense SwiGLU (`MLP`) or mixture of experts (`SparseMoeBlock`, its shared expert a SwiGLU)

    @property
    def mixer_io(self) -> Residual: ...

    @property
    def mlp_io(self) -> Residual: ...

    @property
    def pre_mixer_state(self) -> bool: ...  # whether `before_mixer` reads and advances state in the layer's cache

    def before_mixer(self, h: mx.array, tokens: np.ndarray | None, cache: Any) -> mx.array: ...

    def mixer(self, x: mx.array, cache: Any, positions: mx.array | None = None) -> mx.array: ...

    def mixer_block(self, h: mx.array, cache: Any, tokens: np.ndarray | None = None,
                    positions: mx.array | None = None) -> mx.array: ...

    def mlp_block(self, h: mx.array) -> mx.array: ...


class CausalLM(Protocol):
    """A loaded model of any architecture: what decode, the caches, the split and the server call."""

    args: Args
    model: Any  # the backbone: embed_tokens, layers, and `begin` / `run_layer` / `end` (the prefill wavefront)
    mtp: Any  # the MTP head, or None

    @property
    def has_mtp(self) -> bool: ...

    @property
    def hidden_width(self) -> int: ...  # width of the hidden `__call__` returns (what the MTP head reads)

    @property
    def on_disk(self) -> list[tuple[str, int]]: ...  # (what, bytes) read from the checkpoint's files as needed

    @property
    def layers(self) -> list[DecoderLayer]: ...

    def __call__(self, tokens: mx.array, cache: ModelCache | None = None) -> tuple[mx.array, mx.array]: ...

    def logits(self, hidden: mx.array) -> mx.array: ...

    def mtp_hidden(self, next_tokens: mx.array, hidden: mx.array, cache: list | None = None, *args,
                   **kwargs) -> mx.array: ...

    def draft_logits(self, z: mx.array) -> mx.array: ...

    def make_cache(self) -> ModelCache: ...


class Architecture(Protocol):
    """One architecture, as the loader, the planner, the quantizer and the CLI ask it."""

    name: str  # as errors and reports name it: "qwen3_5", "qwen4_exp"
    model_types: tuple[str, ...]  # the config.json model_types it reads
    required_fields: tuple[str, ...]  # text-config sizes a config must carry (checked before parsing)
    quantized_kv: bool  # whether its caches may store attention KV quantized (`--kv-bits`)
    across_hosts: bool  # whether the pipeline across hosts (`--hosts`, hetero.distributed) runs it
    reads_images: bool  # whether its checkpoints' vision tower is read (images in the prompt)
    drafter_model_type: str | None  # the model_type of the MTP head's folder mlx-vlm writes beside a converted
    # checkpoint (`<dir>-mtp`, the head's tensors without their `mtp.` prefix); None: no such folder is read

    def parse(self, config: dict) -> Args:
        """config.json -> typed arguments; one-line HeteroError on a bad or missing field."""

    def sanitize(self, args: Args, weights: dict[str, mx.array], zero_centred: bool = True) -> dict[str, mx.array]:
        """Checkpoint tensors -> the model's parameters (canonical names, layouts, the norms' +1 exactly once;
        `zero_centred`: the files' writer's word on the norms, for a layout whose tensors do not tell)."""

    def derived(self, name: str) -> bool:
        """Whether a stored tensor is one `sanitize` drops because the config determines it (any dtype passes)."""

    def build(self, args: Args, with_mtp: bool) -> CausalLM:
        """The model with lazily initialised parameters (no memory until evaluated)."""

    def keep_on_disk(self, model: CausalLM, weights: dict[str, mx.array], path: Path, tensors: dict) -> None:
        """Point the parameters the model reads from the checkpoint's files as needed at those files, and drop
        them from the loaded `weights` unread (`tensors`: the checkpoint's name -> `TensorInfo`)."""

    def stored_as_is(self, path: Path, tensors: dict) -> dict[str, mx.array]:
        """Tensors a converted (quantized) copy carries over exactly as the checkpoint stores them."""

    def shape(self, args: Args) -> Shape:
        """What the planner prices beyond the fields every `Args` has."""
