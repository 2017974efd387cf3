"""On/off switches read from the environment: HETERO_PREFILL_WAVEFRONT (the two-lane CPU prefill,
`hetero.decode.wavefront`) and HETERO_FEW_ROW_KERNEL (hetero's own few-row CPU products, `hetero.host.kernels`).

Both are on unless set to 0, off, false or no (any case); 1, on, true, yes or an empty value leave them on. Any other
value is a mistake: it is said once on stderr, naming the variable and what it accepts, and the switch keeps its
default (on), so a typo never silently changes what runs.
"""

from __future__ import annotations

import os
import sys

OFF = ("0", "off", "false", "no")
ON = ("1", "on", "true", "yes", "")
_said: set[str] = set()


def switched_on(name: str) -> bool:
    """Whether the switch `name` is on (see the module)."""
    value = os.environ.get(name, "").strip().lower()
    if value in OFF:
        return False
    if value not in ON and name not in _said:
        _said.add(name)
        print(f"hetero: {name}={os.environ[name]!r} is neither on nor off; set it to 0 (off) or 1 (on). "
              "Leaving it on.", file=sys.stderr, flush=True)
    return True
