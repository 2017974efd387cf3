"""Per-machine settings that `hetero tune` measures and `hetero run` reuses (a small JSON file).

The file lives at $HETERO_HOME/settings.json, else $XDG_CONFIG_HOME/hetero/settings.json, else
~/.config/hetero/settings.json. A damaged file is ignored (and rewritten by the next tune), never trusted.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
from pathlib import Path


def settings_path() -> Path:
    if os.environ.get("HETERO_HOME"):
        return Path(os.environ["HETERO_HOME"]) / "settings.json"
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "hetero" / "settings.json"


def machine_id() -> str:
    """Settings measured on one machine do not carry over to another."""
    return f"{platform.system()}-{platform.machine()}-{os.cpu_count()}cpu-{platform.node()}"


def _read() -> dict:
    try:
        data = json.loads(settings_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}


def _write(data: dict) -> None:
    path = settings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".settings-")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)  # atomic: a reader sees the old file or the new one, never half of one


PLAIN = "off"  # the saved draft depth when plain decoding beat every depth: decode without MTP
DEFAULT_DRAFT_DEPTH = 3  # the MTP draft depth where nothing was tuned, calibrated or given (the one default)


def tuned_depth(model_id: str) -> int | str | None:
    """What `hetero tune` saved for this model on this machine: a draft depth, PLAIN ("off": plain decoding won,
    so decode plainly), or None (never tuned here, or a damaged entry)."""
    entry = _read().get(machine_id(), {}).get(model_id, {})
    depth = entry.get("draft_depth") if isinstance(entry, dict) else None
    if depth == PLAIN:
        return PLAIN
    return depth if isinstance(depth, int) and not isinstance(depth, bool) and depth > 0 else None


def save_tuning(model_id: str, result: dict) -> Path:
    """Store `result` (with `draft_depth`: the winning depth, or PLAIN when plain decoding won) for this model."""
    data = _read()
    data.setdefault(machine_id(), {})[model_id] = result
    _write(data)
    return settings_path()


def device_profile() -> dict | None:
    """The `this-machine` hardware profile `hetero tune --devices` measured here; None if never measured."""
    entry = _read().get(machine_id(), {}).get("device_profile")
    return entry if isinstance(entry, dict) else None


def save_device_profile(profile: dict) -> Path:
    """Store the measured `this-machine` profile for this machine."""
    data = _read()
    data.setdefault(machine_id(), {})["device_profile"] = profile
    _write(data)
    return settings_path()
