"""`--cpu-durations=N`: the N tests (and modules) that used the most CPU, as pytest's `--durations` lists wall time.

On a machine others share, a test's wall time says more about their work than about the test; its CPU time (user +
system, of the worker's process and of the subprocesses it waited for: servers, CLIs, ranks, builds) does not. A
module fixture's cost counts on the test that first needed it. Works under pytest-xdist: each worker measures its
tests and the numbers ride on the reports to the controller, which prints the table after the run.
"""

from __future__ import annotations

import resource
from collections import defaultdict

import pytest

_START = pytest.StashKey[float]()
_KEY = "cpu_s"


def _cpu() -> float:
    """User + system seconds of this process and of its waited-for children so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="show the N tests and modules that used the most CPU (0: all tests)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_START] = _cpu()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "teardown" and _START in item.stash:
        report.user_properties.append((_KEY, round(_cpu() - item.stash[_START], 3)))
    return report


class _Table:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "teardown":
            for key, value in report.user_properties:
                if key == _KEY:
                    self.seconds[report.nodeid] = value

    def pytest_terminal_summary(self, terminalreporter, config):
        n = config.getoption("cpu_durations")
        if not self.seconds:
            return
        modules: dict[str, float] = defaultdict(float)
        for nodeid, s in self.seconds.items():
            modules[nodeid.split("::")[0]] += s
        write = terminalreporter.write_line
        terminalreporter.section(f"CPU seconds: {sum(self.seconds.values()):.0f} in {len(self.seconds)} tests")
        for nodeid, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])[: n or None]:
            write(f"{s:8.2f}s  {nodeid}")
        write("by module:")
        for module, s in sorted(modules.items(), key=lambda kv: -kv[1])[: n or None]:
            write(f"{s:8.2f}s  {module}")


def pytest_configure(config):
    if config.getoption("cpu_durations") is not None and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Table(), "cpu-durations-table")
