"""The MLP slice graph: a share of the intermediate channels of a dense SwiGLU MLP, returning the partial sum.

    x (1, hidden, 1, S) -> down[:, I_s](silu(gate[I_s] x) * up[I_s] x) -> (1, hidden, 1, S)

`x` is post_attention_layernorm's output, which the GPU lane computes (it needs it for its own channels): a normed
row is bounded (|x_i| <= sqrt(hidden) x |w_i|) however large the residual stream grows, and no epsilon (1e-6,
subnormal in fp16) enters the program. `I_s` is any set of channels (the planner keeps those whose activations
would leave fp16's range on the GPU), and the export may scale `down` by a power of two to keep the output well
inside fp16 (`hetero.pipeline.ranges`): the manifest records it and the merge undoes it exactly.

The slice's channels are processed in groups of at most 16384 (the ANE's axis limit: Qwen3.5-27B has 17408),
whose down projections add up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, Var

from hetero.coreml.graphs.ops import MAX_AXIS, blocks, build_program, conv1x1
from hetero.coreml.graphs.palette import Palettized


@dataclass(frozen=True)
class MLPShape:
    """Static shape of one MLP slice program."""

    hidden: int
    channels: int  # intermediate channels in the slice
    chunk: int  # S
    channel_block: int = MAX_AXIS

    def inputs(self) -> dict[str, tuple[int, ...]]:
        return {"x": (1, self.hidden, 1, self.chunk)}

    def outputs(self) -> dict[str, tuple[int, ...]]:
        return {"out": (1, self.hidden, 1, self.chunk)}


@dataclass
class MLPWeights:
    """The slice's weights."""

    gate: np.ndarray | Palettized  # [channels, hidden]
    up: np.ndarray | Palettized  # [channels, hidden]
    down: np.ndarray | Palettized  # [hidden, channels]


def build_mlp(shape: MLPShape, w: MLPWeights) -> Program:
    """The MLP slice program: input `x`, output `out` (the slice's partial down_proj sum)."""

    def body(inp: dict[str, Var]) -> dict[str, Var]:
        x = inp["x"]  # (1, hidden, 1, S), normed
        out, start = None, 0
        for i, size in enumerate(blocks(shape.channels, shape.channel_block, 64)):
            rows = slice(start, start + size)
            g = conv1x1(x, w.gate[rows], f"gate_proj_{i}")  # (1, size, 1, S)
            u = conv1x1(x, w.up[rows], f"up_proj_{i}")  # (1, size, 1, S)
            a = mb.mul(x=mb.silu(x=g, name=f"silu_{i}"), y=u, name=f"act_{i}")  # (1, size, 1, S)
            d = conv1x1(a, w.down[:, rows], f"down_proj_{i}")  # (1, hidden, 1, S)
            out = d if out is None else mb.add(x=out, y=d, name=f"down_sum_{i}")
            start += size
        return {"out": out}

    return build_program(shape.inputs(), body, w)
