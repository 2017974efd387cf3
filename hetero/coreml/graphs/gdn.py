"""The GDN input-projection graph (piece `gdn_in_proj`): only the `z` rows of a Gated DeltaNet layer's input
projection.

    x (1, hidden, 1, S) -> in_proj_z[rows] x -> (1, rows, 1, S)

`x` is input_layernorm's output, computed on the GPU lane (which runs the same norm for the recurrence's inputs):
bounded however large the residual stream grows, and no subnormal epsilon enters the program.

Only z may leave the exact path: qkv, b and a feed the conv and the recurrence, where an approximation would
compound over the whole context; z only gates the output norm token by token (shared/DESIGN.md section 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from coremltools.converters.mil.mil import Program, Var

from hetero.coreml.graphs.ops import build_program, conv1x1
from hetero.coreml.graphs.palette import Palettized


@dataclass(frozen=True)
class GDNInProjShape:
    """Static shape of one `gdn_in_proj` program (z rows)."""

    hidden: int
    rows: int  # z rows in the slice (<= 16384)
    chunk: int  # S

    def inputs(self) -> dict[str, tuple[int, ...]]:
        return {"x": (1, self.hidden, 1, self.chunk)}

    def outputs(self) -> dict[str, tuple[int, ...]]:
        return {"z": (1, self.rows, 1, self.chunk)}


@dataclass
class GDNInProjWeights:
    """The slice's in_proj_z rows."""

    z: np.ndarray | Palettized  # [rows, hidden]


def build_gdn_in_proj(shape: GDNInProjShape, w: GDNInProjWeights) -> Program:
    """The `gdn_in_proj` program: input `x`, output its `z` rows."""

    def body(inp: dict[str, Var]) -> dict[str, Var]:
        return {"z": conv1x1(inp["x"], w.z, "z_proj")}  # (1, hidden, 1, S) normed -> (1, rows, 1, S)

    return build_program(shape.inputs(), body, w)
