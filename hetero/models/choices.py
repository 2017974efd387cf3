"""A prefill's discrete choices, each token's experts (`moe.Routes`) and each QSA query's kept keys
(`qwen4_exp.qsa.Selections`), recorded from one run and replayed in another run of the same prompt and chunks, as
one object: `--verify` compares a split with its reference on the same choices (hetero/pipeline/verification.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import mlx.nn as nn

from hetero.models import moe
from hetero.models.moe import Routes
from hetero.models.qwen4_exp import qsa
from hetero.models.qwen4_exp.qsa import Selections


def recording() -> bool:
    """Whether a `Choices` records or replays now. Its routes and selections are read on the host, which no compiled
    step can do: a layer then runs its uncompiled path, even for a few tokens over a warm cache."""
    return moe._routes[0] is not None or qsa._selections[0] is not None


class Choices:
    """`model`'s routes and selections, recorded (`replay` None) or replaying another `Choices`."""

    def __init__(self, model: nn.Module, replay: Choices | None = None):
        self.routes = Routes(model, replay.routes if replay is not None else None)
        self.selections = Selections(model, replay.selections if replay is not None else None)

    @property
    def any(self) -> bool:
        """Whether the model makes any such choice (it has routers or QSA indexers)."""
        return bool(self.routes.names or self.selections.names)

    @property
    def flips(self) -> int:
        """Choices the replaying run would have made otherwise."""
        return self.routes.flips + self.selections.flips

    def differs(self, other: Choices) -> int:
        """How many choices of this recording another recording of the same prompt made otherwise."""
        return self.routes.differs(other.routes) + self.selections.differs(other.selections)

    @contextlib.contextmanager
    def using(self) -> Iterator[Choices]:
        """Record or replay both kinds inside the block."""
        with self.routes.using(), self.selections.using():
            yield self
