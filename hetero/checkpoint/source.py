"""Where a checkpoint's files are (a directory, a hub id, or the bundled model) and its config.json, read and
checked before anything is built from it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hetero.checkpoint.config_checks import check_config
from hetero.errors import HeteroError
from hetero.models.architectures import BY_MODEL_TYPE

BUNDLED_MODEL = Path(__file__).parents[1] / "bundled"
SMALL_FILES = ["config.json", "generation_config.json", "*.index.json", "tokenizer*", "chat_template.jinja"]


def is_hub_id(model: str) -> bool:
    return "/" in model and not Path(model).exists() and not model.startswith((".", "/", "~")) and model.count("/") == 1


def resolve(model: str | os.PathLike | None, weights: bool = True) -> Path:
    """A local directory for `model` (a path, a hub id, or None for the bundled model).

    For a hub id only the small files are fetched when `weights` is False; the hub library honours
    HF_HUB_OFFLINE and answers from its local cache.
    """
    if model is None:
        return BUNDLED_MODEL
    model = str(model)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise HeteroError(f"--model {model} is a file; pass the checkpoint directory that holds config.json")
    if not is_hub_id(model):
        raise HeteroError(f"--model {model}: no such directory, and not a hub id of the form org/name")
    from huggingface_hub import snapshot_download

    patterns = SMALL_FILES + (["*.safetensors"] if weights else [])
    try:
        return Path(snapshot_download(model, allow_patterns=patterns))
    except Exception as e:  # the hub library raises many types; the user needs one line
        offline = " (HF_HUB_OFFLINE is set and it is not in the local cache)" if os.environ.get("HF_HUB_OFFLINE") else ""
        raise HeteroError(
            f"could not fetch {model} from the hub{offline}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            f"; pass a local checkpoint directory instead"
        ) from None


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise HeteroError(f"{file} is missing: a checkpoint directory needs config.json")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError) as e:
        raise HeteroError(f"{file} is not valid JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__}); re-download it") from None
    except OSError as e:
        raise HeteroError(f"cannot read {file}: {e.strerror}") from None
    check_config(config, str(file))
    # a supported architecture's sizes must all be there; other model types are refused by name later
    arch = BY_MODEL_TYPE.get(config.get("model_type"))
    return check_config(config, str(file), required=arch.required_fields if arch is not None else ())


def check_generation_config(path: Path) -> None:
    """generation_config.json, when present and JSON, must be an object with token ids where ids go."""
    file = path / "generation_config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
    except (ValueError, UnicodeDecodeError, RecursionError):
        return  # unreadable: the engine ignores it (config.json and the tokenizer still name EOS)
    if not isinstance(config, dict):
        raise HeteroError(f"{file} must hold a JSON object, got a JSON {type(config).__name__}; fix or delete it")
    check_config({"eos_token_id": config.get("eos_token_id")}, str(file))
