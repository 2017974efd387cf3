"""What a request leaves out or asks for beyond the engine: sampling defaults from the checkpoint's
`generation_config.json`, and the fields the engine does not implement yet, refused by name instead of ignored.

Hugging Face's rule for `generation_config.json` holds: `do_sample: false` (or no file) means greedy decoding,
whatever temperature the file lists; `do_sample: true` makes its `temperature`, `top_p`, `top_k` and `min_p` the
defaults of a request that omits them (Qwen publishes sampled settings there, e.g. 0.6 / 0.95 / 20).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from hetero.validate import MIN_P, NONNEG, TOP_K, TOP_P

log = logging.getLogger("hetero.server")

GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
BOUNDS = {"temperature": NONNEG, "top_p": TOP_P, "top_k": TOP_K, "min_p": MIN_P}


def sampling_defaults(model_dir: Path) -> dict[str, float | int]:
    """{temperature, top_p, top_k, min_p} a request gets for each field it omits (greedy unless the checkpoint's
    generation_config.json sets `do_sample: true`; a value out of range there is skipped with a warning)."""
    out = dict(GREEDY)
    file = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return out  # absent or unreadable: the loader's pre-flight has already said so when it matters
    if not isinstance(config, dict) or config.get("do_sample") is not True:
        return out
    for name, bound in BOUNDS.items():
        value = config.get(name)
        if value is None:
            continue
        why = bound.problem(value)
        if why is not None:
            log.warning("%s: %s %s; requests that omit it decode with %s", file, name, why, out[name])
            continue
        out[name] = int(value) if name == "top_k" else float(value)
    return out


# field -> (is the value neutral, what to do instead)
UNSUPPORTED = {
    "suffix": (lambda v: v == "", "leave it out (this server has no fill-in-the-middle)"),
}


def refuse_unimplemented(body: dict, names: tuple[str, ...]) -> tuple[str, str] | None:
    """(field, one-line message) for the first of `names` the body sets to a value that would change the output (a
    field the engine does not implement yet); None when every such field is absent, null or neutral."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        neutral, instead = UNSUPPORTED[name]
        if not neutral(value) or isinstance(value, bool) and name != "echo":
            return name, f"'{name}' is not implemented by this server yet; {instead}"
    return None
