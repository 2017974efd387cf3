"""Test-session environment: no network, and per-machine settings in a private folder (never ~/.config)."""

import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HETERO_HOME", tempfile.mkdtemp(prefix="hetero-test-home-"))

import hetero  # noqa: E402,F401  (before any test imports MLX: the fast BLAS is under it whatever the test order)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory):
    """The tiny checkpoint trained to emit tool calls (tests/tool_model.py): trained once per session."""
    from tool_model import write_tool_model

    return write_tool_model(tmp_path_factory.mktemp("tool-model"))
