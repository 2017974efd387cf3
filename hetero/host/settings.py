"""Per-machine settings that `hetero tune` measures and `hetero run` reuses (a small JSON file).

The file lives at $HETERO_HOME/settings.json, else $XDG_CONFIG_HOME/hetero/settings.json, else
~/.config/hetero/settings.json. A damaged file is ignored (and rewritten by the next tune), never trusted.

Every measured entry carries what it was measured with (`measured_with`: hetero's version and a digest of the code
that decodes, MLX's version, the BLAS and its threads); the machine is the file's key. An entry measured with other
code, or whose verdict was inside the noise, is measured again at the next chance (`remeasure_reason`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path

from hetero.version import __version__


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


def tunings() -> dict:
    """Every entry saved for this machine: model id -> its verdict, and "device_profile"."""
    entries = _read().get(machine_id(), {})
    return {k: v for k, v in entries.items() if isinstance(v, dict)} if isinstance(entries, dict) else {}


def tuning(model_id: str) -> dict | None:
    """The whole saved entry for this model on this machine (None: none, or a damaged one)."""
    entry = _read().get(machine_id(), {}).get(model_id)
    return entry if isinstance(entry, dict) else None


# the code a decode speed depends on: a change to any of it can change which way is faster
_DECODE_CODE = ("decode", "models", "host/kernels", "host/blas.py")


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A digest of hetero's decoding code as installed (its Python and C sources under `_DECODE_CODE`)."""
    root, h = Path(__file__).resolve().parents[1], hashlib.sha256()
    for part in _DECODE_CODE:
        base = root / part
        for f in sorted([base] if base.is_file() else [*base.rglob("*.py"), *base.rglob("*.c")]):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def measured_with() -> dict:
    """What a measurement made now depends on besides the machine: hetero (its version and decoding code), MLX, and
    the BLAS library under it (its name and version: not its threads, which an environment variable changes from
    one run to the next)."""
    import mlx.core as mx

    from hetero.host import blas

    return {"hetero": f"{__version__}+{code_digest()}", "mlx": mx.__version__, "blas": blas.describe().split(" (")[0]}


def changed(stamp: dict | None) -> str | None:
    """What differs between `stamp` (an entry's `measured_with`) and now, in words; None when nothing does."""
    if not isinstance(stamp, dict):
        return "no record of what it was measured with"
    now = measured_with()
    moved = [k for k in now if stamp.get(k) != now[k]]
    return ", ".join(f"{k} {stamp.get(k)} -> {now[k]}" for k in moved) or None


def remeasure_reason(model_id: str) -> str | None:
    """Why this model's draft-depth verdict should be measured again now (None: it stands).

    Never measured here (the machine is the file's key); measured with other code (hetero, MLX, the BLAS:
    `changed`); a verdict left inside the noise
    (`verdict.settled` false); or a first-use decision of an earlier hetero, which timed one sample of each side. An
    entry without `measured_with` written otherwise (by hand, or by an earlier `hetero tune`) stands."""
    entry = tuning(model_id)
    if entry is None or "draft_depth" not in entry:
        return "never measured on this machine"
    if "measured_with" not in entry:
        return "decided by an earlier hetero from one sample each" if entry.get("calibrated") == "first use" else None
    moved = changed(entry["measured_with"])
    if moved is not None:
        return f"measured with other code ({moved})"
    verdict = entry.get("verdict")
    if isinstance(verdict, dict) and verdict.get("settled") is False:
        return "its last verdict was inside the noise"
    return None


def pin_tuning(model_id: str, depth: int | str, why: str) -> Path:
    """Save `depth` (or PLAIN) for this model as a settled verdict that stands until the code changes (tests pin
    the first-use decision this way; `hetero tune` replaces it)."""
    return save_tuning(model_id, {"draft_depth": depth, "calibrated": why, "measured_with": measured_with(),
                                  "verdict": {"settled": True, "why": why}})


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
