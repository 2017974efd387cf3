"""The tiny trained checkpoints the tests run, shipped in tests/models/ beside the code that trains them.

    python tests/shipped_models.py [NAME ...]    retrain, verify and write tests/models/NAME (all when none named)

Each model is a real checkpoint (config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) plus `trained.json`: the key of the code that trained it, the seed, the steps and reply margin
the fit reached, what its verification checked, and the commit, machine and BLAS it was trained on. Tests read these
files as they are, so every machine runs the same bits: training is deterministic on one machine (fixed seeds, the
same steps) but not across machines, since MKL runs other kernels on other CPUs and a tiny model's greedy replies can
turn on a rounding. A model whose key is not the key of the training code in this checkout is refused in one line
that says how to retrain it. Training runs to a margin and the result is verified before it replaces the shipped
files, so a retrain on any machine gives a model that passes (or says why it does not).

- `tool`: tests/tool_model.py (a weather tool call, its answer, a think block; Qwen3.6 template).
- `agent-claude`, `agent-codex`, `agent-opencode`: tests/agent_model.py (each CLI's shell tool, then an answer,
  after any prompt the CLI sends).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS_DIR = HERE / "models"
TOOL_SOURCES = ["tool_model.py", "data/qwen3.6_chat_template.jinja"]
SOURCES = {  # name -> the files (under tests/) whose bytes make up the model's key
    "tool": TOOL_SOURCES,
    **{f"agent-{cli}": [*TOOL_SOURCES, "agent_model.py"] for cli in ("claude", "codex", "opencode")},
}
SEED = 0


class StaleModel(RuntimeError):
    """A shipped model that the training code in this checkout did not make."""


def key(name: str) -> str:
    """The key of the code that trains `name`: a hash of its source files' bytes."""
    h = hashlib.sha256()
    for source in SOURCES[name]:
        h.update(source.encode() + b"\0" + (HERE / source).read_bytes())
    return h.hexdigest()[:16]


def shipped(name: str, root: Path = MODELS_DIR) -> Path:
    """The checkpoint folder of shipped model `name` (under `root`), after checking that this checkout's code made
    it."""
    folder = root / name
    record = folder / "trained.json"
    if not record.is_file():
        raise StaleModel(f"tests/models/{name} is missing: run `python tests/shipped_models.py {name}`")
    made_by = json.loads(record.read_text())["key"]
    if made_by != key(name):
        raise StaleModel(f"tests/models/{name} was trained by other code (key {made_by}, this checkout's "
                         f"{key(name)}): retrain it with `python tests/shipped_models.py {name}` and commit it")
    return folder


def _train_and_verify(name: str, out: Path) -> tuple[dict, dict]:
    """Train `name` into `out`; returns (the fit, the verification's counts). Raises if a check fails."""
    if name == "tool":
        from tool_model import verify_tool_model, write_tool_model

        fit = write_tool_model(out, seed=SEED)
        return fit, verify_tool_model(out)
    from agent_model import verify_agent_model, write_agent_model

    cli = name.removeprefix("agent-")
    fit = write_agent_model(out, cli, seed=SEED)
    return fit, verify_agent_model(out, cli)


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=HERE, capture_output=True, text=True)
        return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines() if line.startswith("model name")),
               platform.processor())
    return f"{platform.system()} {platform.machine()}, {cpu}"


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def train(name: str) -> Path:
    """Retrain `name`, verify it, and replace tests/models/NAME with it (only once it passed)."""
    import hetero.host.blas as blas

    MODELS_DIR.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=MODELS_DIR, prefix=f".{name}.") as tmp:
        out = Path(tmp) / name
        fit, verified = _train_and_verify(name, out)
        record = {"key": key(name), "sources": SOURCES[name], "seed": SEED, "fit": fit, "verified": verified,
                  "seconds": round(time.perf_counter() - t0), "commit": _commit(),
                  "machine": _machine(),
                  "blas": blas.describe()}
        (out / "trained.json").write_text(json.dumps(record, indent=2) + "\n")
        final = MODELS_DIR / name
        shutil.rmtree(final, ignore_errors=True)
        out.rename(final)
    return final


if __name__ == "__main__":
    os.environ.setdefault("HETERO_HOME", tempfile.mkdtemp(prefix="hetero-train-home-"))  # verification's settings
    for model_name in sys.argv[1:] or list(SOURCES):
        if model_name not in SOURCES:
            sys.exit(f"unknown model {model_name!r}: one of {', '.join(SOURCES)}")
        done = train(model_name)
        print(f"{done.relative_to(HERE.parent)}: {json.loads((done / 'trained.json').read_text())}")
