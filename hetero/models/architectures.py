"""config.json's model_type -> the architecture that reads it (`hetero.models.interface.Architecture`).

Adding an architecture: its folder under models/, and its name in `ARCHITECTURES`.
"""

from __future__ import annotations

from hetero.errors import HeteroError
from hetero.models.interface import Architecture, Args, Shape
from hetero.models.qwen3_5.architecture import QWEN3_5
from hetero.models.qwen4_exp.architecture import QWEN4_EXP

ARCHITECTURES: tuple[Architecture, ...] = (QWEN3_5, QWEN4_EXP)
BY_MODEL_TYPE: dict[str, Architecture] = {t: a for a in ARCHITECTURES for t in a.model_types}
SUPPORTED_MODEL_TYPES = tuple(BY_MODEL_TYPE)
DRAFTER_MODEL_TYPES = tuple(a.drafter_model_type for a in ARCHITECTURES if a.drafter_model_type)


def architecture(model_type: str | None) -> Architecture:
    """The architecture of a config's model_type; one HeteroError line naming the supported ones otherwise."""
    if model_type not in BY_MODEL_TYPE:
        raise HeteroError(f"unsupported model_type {model_type!r}: hetero runs {', '.join(SUPPORTED_MODEL_TYPES)} "
                          "checkpoints")
    return BY_MODEL_TYPE[model_type]


def parse_args(config: dict) -> Args:
    """config.json -> the typed arguments of its architecture (`Architecture.parse`)."""
    return architecture(config.get("model_type")).parse(config)


def shape(args: Args) -> Shape:
    """What the planner prices for `args` beyond the fields every architecture's arguments share."""
    return architecture(args.model_type).shape(args)
