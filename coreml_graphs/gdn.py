"""The GDN input-projection graph (piece `gdn_in_proj`): only the `z` rows of a Gated DeltaNet layer's input
projection.

    x (1, hidden, 1, S) -> input_layernorm -> in_proj_z[rows] x -> (1, rows, 1, S)

Only z may leave the exact path: qkv, b and a feed the conv and the recurrence, where an approximation would
compound over the whole context; z only gates the output norm token by token (shared/DESIGN.md section 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from coremltools.converters.mil.mil import Program, Var

from coreml_graphs.ops import build_program, conv1x1, rms_norm
from coreml_graphs.palette import Palettized


@dataclass(frozen=True)
class GDNInProjShape:
    """Static shape of one `gdn_in_proj` program (z rows)."""

    hidden: int
    rows: int  # z rows in the slice (<= 16384)
    chunk: int  # S
    eps: float

    def inputs(self) -> dict[str, tuple[int, ...]]:
        return {"x": (1, self.hidden, 1, self.chunk)}

    def outputs(self) -> dict[str, tuple[int, ...]]:
        return {"z": (1, self.rows, 1, self.chunk)}


@dataclass
class GDNInProjWeights:
    """input_layernorm's effective scale and the slice's in_proj_z rows."""

    norm: np.ndarray  # [hidden]
    z: np.ndarray | Palettized  # [rows, hidden]


def build_gdn_in_proj(shape: GDNInProjShape, w: GDNInProjWeights) -> Program:
    """The `gdn_in_proj` program: input `x`, output its `z` rows."""

    def body(inp: dict[str, Var]) -> dict[str, Var]:
        x = rms_norm(inp["x"], w.norm, shape.eps, axis=1, name="input_norm")  # (1, hidden, 1, S)
        return {"z": conv1x1(x, w.z, "z_proj")}  # (1, rows, 1, S)

    return build_program(shape.inputs(), body, w)
