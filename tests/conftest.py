"""Test-session environment: no network, per-machine settings in a private folder (never ~/.config), and the
first-use MTP decision pinned.

A model with an MTP head that this machine never measured calibrates on first use (`hetero.decode.depth_calibration`: plain
against speculative decode speed, a timing race on a busy 2-core machine), and that decision is whether every
later request that leaves `mtp` to the default decodes speculatively. Tests must not depend on a race, so here
the decision is fixed before any engine loads: MTP at the depth the engine asks to calibrate (the documented
default where nothing was measured). A test that means MTP (or plain decoding) still says so in its request;
tests/test_tune.py measures the real calibration in its own settings home.
"""

import os
import random
import tempfile
import types

os.environ["HF_HUB_OFFLINE"] = "1"
# always a fresh home: a session reads no settings (tuned depths, device profiles) that it did not write itself
os.environ["HETERO_HOME"] = tempfile.mkdtemp(prefix="hetero-test-home-")
# hetero's CPU kernels are built once per machine, not per test home (every server a test starts loads them)
os.environ.setdefault("HETERO_KERNEL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "hetero", "kernels"))

import hetero  # noqa: E402  (before any test imports MLX: the fast BLAS is under it whatever the test order)
import hetero.engine  # noqa: E402
import pytest  # noqa: E402
from hetero.checkpoint.source import BUNDLED_MODEL, read_config  # noqa: E402
from hetero.host.settings import DEFAULT_DRAFT_DEPTH, save_tuning  # noqa: E402

PINNED = "pinned by tests/conftest.py"  # the `calibrated` field of a pinned decision


def pinned_calibration(engine, depth: int, report=print) -> int:
    """In place of `hetero.decode.depth_calibration.calibrate` in this process: saves MTP at `depth` for `engine` as first use
    would, without measuring anything."""
    save_tuning(engine.identity, {"draft_depth": depth, "calibrated": PINNED})
    return depth


hetero.engine.calibrate = pinned_calibration  # every engine of this process (test_tune.py puts the real one back)
# Subprocesses (`hetero run` / `hetero serve` on the bundled model) read the decision from the shared settings home:
# the bundled model's identity is fixed, so its entry is written now (Engine.identity's own code, without weights).
BUNDLED_IDENTITY = hetero.engine.Engine.identity.fget(types.SimpleNamespace(name="bundled",
                                                                            config=read_config(BUNDLED_MODEL)))
save_tuning(BUNDLED_IDENTITY, {"draft_depth": DEFAULT_DRAFT_DEPTH, "calibrated": PINNED})


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory):
    """The tiny checkpoint trained to emit tool calls (tests/tool_model.py): trained once per session."""
    from tool_model import write_tool_model

    return write_tool_model(tmp_path_factory.mktemp("tool-model"))


# A module that defines `engine` gets a live `hetero serve` on loopback for it (`server`) and the real SDK clients;
# a module that needs other server options defines its own `server`.
@pytest.fixture(scope="module")
def server(engine):
    from test_server import LiveServer

    live = LiveServer(engine)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def oai(server):
    return server.openai()


@pytest.fixture(scope="module")
def claude(server):
    return server.anthropic()


@pytest.fixture(scope="module")
def model(oai):
    """The served model's id, as the server lists it."""
    return oai.models.list().data[0].id


@pytest.hookimpl(tryfirst=True)  # before hypothesis's own pytest_configure reads --hypothesis-seed
def pytest_configure(config):
    """Every session runs its hypothesis tests from one seed, printed in the header and the summary, so that a
    failure found by a random draw can be rerun exactly (`--hypothesis-seed N`); a seed given is kept."""
    if config.getoption("hypothesis_seed") is None:
        config.option.hypothesis_seed = str(random.SystemRandom().randrange(2**32))


def rerun_line(config) -> str:
    seed = config.option.hypothesis_seed
    return f"hypothesis seed {seed} (rerun: pytest --hypothesis-seed={seed})"


def pytest_report_header(config):  # shown without -q
    return rerun_line(config)


def pytest_terminal_summary(terminalreporter, config):
    terminalreporter.write_line(rerun_line(config))
