"""Test-session environment: no network, and per-machine settings in a private folder (never ~/.config)."""

import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HETERO_HOME", tempfile.mkdtemp(prefix="hetero-test-home-"))
