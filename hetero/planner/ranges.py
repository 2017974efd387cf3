"""Activation ranges of the ANE's pieces, and what the plan does with them.

The ANE computes in fp16, whose range ends at 65,504. Real LLMs carry "massive activations": a few MLP channels whose
gate x up reaches 1e5 and more on many tokens, writing residual channels of 1e4. A program holding such a channel
fills with inf, and the split falls back to GPU-only on every prompt. So the ranges are measured on the GPU lane
(`hetero.pipeline.calibrate`), and the plan keeps the ANE inside fp16 by construction:

- MLP (and MoE shared-expert) channels move in blocks of `BLOCK` (the quantization group and the lookup tables' 64
  input channels). A block whose gate, up or silu(gate) x up reached `SAFE` stays on the GPU lane; the ANE's share is
  the first channels of an order that puts every safe block first, so any share holds only safe ones.
- Each program's output carries a power-of-two scale 2^-shift folded into its last weights (exact in binary), chosen
  so that the largest output measured is at most `SAFE`; the merge multiplies by 2^shift.
- The programs read normed inputs (the GPU lane's norms), which stay bounded however large the residual grows.

`SAFE` = 2^12 leaves a factor of 16 below fp16's largest number for text that reaches further than the calibration.

Ranges only grow (`Ranges.merge`): the GPU lane tracks the largest normed input and ANE output of every split piece
on every chunk it runs (`hetero.pipeline.split`), and a prompt whose program still returns non-finite values is
measured on the GPU lane; both are merged into the saved ranges and the split is re-planned with them.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace

import numpy as np

from hetero.planner.cost import prefill_flops
from hetero.planner.slices import PieceSlice

FP16_MAX = 65504.0
SAFE = 2.0**12
BLOCK = 64
REFRESH_GROWTH = 1.25  # a chunk's value past the saved one by more than this is merged into the saved ranges
CHANNEL_PIECES = ("mlp", "shared_expert")  # pieces whose units may be chosen by range (token-local SwiGLU channels)


def shift_for(largest: float) -> int:
    """The k >= 0 for which largest x 2^-k <= SAFE."""
    return max(0, math.ceil(math.log2(largest / SAFE))) if largest > SAFE else 0


@dataclass
class PieceRange:
    """One layer's piece: the order its units may leave in, how many may, and the largest values measured.

    `order` lists the piece's blocks of `block` channels, those that may leave first (empty: units in their own
    order, every one may leave). `act_max` is the largest |value| inside the program over the units that may leave
    (gate, up and silu(gate) x up; z for the GDN piece), `out_max` the largest |output| of the share the plan gives
    the ANE, before its 2^-`out_shift`. `block_max` (channel pieces) holds every block's largest gate, up or
    silu(gate) x up in the layer's own order: what the order, `safe_units` and `act_max` are derived from
    (`by_blocks`), so that two measurements merge."""

    units: int
    safe_units: int
    input_max: float
    act_max: float = 0.0
    out_max: float = 0.0
    out_shift: int = 0
    order: list[int] = field(default_factory=list)
    block: int = BLOCK
    block_max: list[float] = field(default_factory=list)  # channel pieces: each block's largest gate, up, act

    def channels(self, start: int, stop: int) -> np.ndarray:
        """The units at positions [start, stop) of the order (channel indices)."""
        if not self.order:
            return np.arange(start, stop)
        perm = (np.array(self.order)[:, None] * self.block + np.arange(self.block)).reshape(-1)  # [units]
        return perm[start:stop]

    @classmethod
    def by_blocks(cls, units: int, block: int, input_max: float, block_max: list[float]) -> "PieceRange":
        """A channel piece from its blocks' largest values: the blocks ordered safe-first (no order where all are
        safe), the safe ones counted, their largest value the piece's `act_max`."""
        per_block = np.asarray(block_max, np.float64)
        safe, unsafe = np.flatnonzero(per_block < SAFE).tolist(), np.flatnonzero(per_block >= SAFE).tolist()
        return cls(units, len(safe) * block, input_max, float(per_block[safe].max()) if safe else 0.0,
                   order=[] if not unsafe else safe + unsafe, block=block, block_max=[float(b) for b in block_max])

    def merge(self, other: "PieceRange") -> "PieceRange":
        """The range that holds both measurements: every largest value the larger of the two, the blocks re-ordered
        by their merged maxima, the output's shift re-chosen. Where the ANE's channels change, the new share's
        output is only known as the larger of the two measured (the GPU lane's tracking refreshes it)."""
        if self.block_max and other.block_max and len(self.block_max) == len(other.block_max):
            r = PieceRange.by_blocks(self.units, self.block, max(self.input_max, other.input_max),
                                     np.maximum(self.block_max, other.block_max).tolist())
        else:
            r = replace(self, input_max=max(self.input_max, other.input_max), act_max=max(self.act_max, other.act_max),
                        safe_units=min(self.safe_units, other.safe_units))
        r.out_max = max(self.out_max, other.out_max)
        r.out_shift = max(self.out_shift, other.out_shift, shift_for(r.out_max))
        return r

    def headroom_bits(self) -> float:
        """log2(fp16's largest / the largest value the program meets, after its output scale): how far every
        measured value stays inside fp16."""
        largest = max(self.input_max, self.act_max, self.out_max * 2.0**-self.out_shift, 1e-30)
        return math.log2(FP16_MAX / largest)


@dataclass
class Ranges:
    """The measured ranges of a split's pieces, per (layer, piece), and the calibration's size."""

    pieces: dict[tuple[int, str], PieceRange]
    tokens: int

    def get(self, layer: int, piece: str) -> PieceRange | None:
        return self.pieces.get((layer, piece))

    def headroom(self) -> dict[str, float]:
        """Piece kind -> the least headroom (bits) over its layers."""
        out: dict[str, float] = {}
        for (_, piece), r in self.pieces.items():
            out[piece] = round(min(out.get(piece, math.inf), r.headroom_bits()), 2)
        return out

    def kept_on_gpu(self) -> dict[str, int]:
        """Piece kind -> units kept on the GPU lane for range, over all layers."""
        out: dict[str, int] = {}
        for (_, piece), r in self.pieces.items():
            out[piece] = out.get(piece, 0) + r.units - r.safe_units
        return out

    def digest(self) -> str:
        """A short name for the channel orders and output scales (what an export built from them depends on)."""
        key = [(layer, piece, r.order, r.out_shift) for (layer, piece), r in sorted(self.pieces.items())]
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]

    def merge(self, other: "Ranges") -> "Ranges":
        """Both measurements in one (each piece `PieceRange.merge`d; a piece measured in one only is kept as it is):
        monotone, every value at least what either holds. `tokens` stays the calibration's."""
        pieces = dict(self.pieces)
        for key, r in other.pieces.items():
            pieces[key] = pieces[key].merge(r) if key in pieces else r
        return Ranges(pieces, self.tokens)

    def grown(self, seen: dict[tuple[int, str], tuple[float, float]]) -> "Ranges | None":
        """The ranges with the largest (normed input, ANE output) the GPU lane saw on a prompt's chunks per piece
        (`hetero.pipeline.split.SplitPrefill.observed`, output 0 where not tracked), or None when none passes its
        saved value by more than `REFRESH_GROWTH`."""
        pieces, grew = dict(self.pieces), False
        for key, (x, out) in seen.items():
            r = pieces.get(key)
            if r is None or (x <= r.input_max * REFRESH_GROWTH and out <= r.out_max * REFRESH_GROWTH):
                continue
            grew = True
            r = replace(r, input_max=max(r.input_max, x), out_max=max(r.out_max, out))
            r.out_shift = max(r.out_shift, shift_for(r.out_max))
            if key[1] == "gdn_in_proj":  # the program's values are its input and z, its output
                r.act_max = max(r.act_max, out)
            pieces[key] = r
        return Ranges(pieces, self.tokens) if grew else None

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "pieces": [{"layer": layer, "piece": piece, **vars(r)}
                                                  for (layer, piece), r in sorted(self.pieces.items())]}

    @classmethod
    def from_dict(cls, d: dict) -> "Ranges":
        pieces = {}
        for p in d["pieces"]:
            p = dict(p)
            key = (p.pop("layer"), p.pop("piece"))
            pieces[key] = PieceRange(**p)
        return cls(pieces, d["tokens"])


def within_range(plan, ranges: Ranges):
    """The plan with every slice cut to the units its layer may send to the ANE, its pieces' effective shares
    recounted and the cut said in their cap reasons; the plan carries `ranges` to the export and the runtime."""
    slices, cut = [], {}
    for s in plan.slices:
        r = ranges.get(s.layer, s.piece)
        stop = min(s.stop, r.safe_units) if r is not None else s.stop
        if stop < s.stop:
            cut[s.piece] = cut.get(s.piece, 0) + s.stop - stop
        if stop > s.start:
            slices.append(PieceSlice(s.layer, s.piece, s.start, stop))
    pieces = []
    for p in plan.pieces:
        if p.kind in cut and p.layers:
            total = sum(s.stop - s.start for s in slices if s.piece == p.kind)
            reason = (f"{cut[p.kind]} channels of {p.unit}s measured past fp16's safe range stay on the GPU lane"
                      if p.kind in CHANNEL_PIECES else f"{cut[p.kind]} units past fp16's safe range stay on the GPU")
            p = replace(p, ane_units=total // p.layers,
                        cap_reason="; ".join(filter(None, [p.cap_reason, reason])))
        pieces.append(p)
    return replace(plan, slices=slices, pieces=pieces, ranges=ranges,
                   flops=prefill_flops(pieces, plan.context, plan.chunk))
