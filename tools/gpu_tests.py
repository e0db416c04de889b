"""pytest with tools/gpu-check's options: the device and size of tests/test_gpu.py, and a
JSON line per test as it starts and as it ends, so that the kit reports every test that
ended even when it is stopped in the middle of the next.

    python tools/gpu_tests.py tests/test_gpu.py --gpu-device cuda --gpu-size full \\
        [--gpu-results FILE] [pytest's options]

Without them (`make test`) the tests run at tiny size on the CPU. FILE gets one JSON object
a line: {"collected": [node ids]}, then per test {"started": id} and {"test": id,
"outcome": passed|failed|skipped, "seconds", "figures": what the test gave
record_property, "why": the skip's reason or the failure's message, "error": the
failure's report}; a test whose teardown fails gets a second, failed, line.
"""

from __future__ import annotations

import json
import sys

import pytest

ERROR_CHARS = 4000  # of a failure's report


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpu", "tools/gpu-check: tests/test_gpu.py's device and size")
    group.addoption("--gpu-device", choices=("cuda", "cpu"),
                    help="where the gpu tests run (default: cpu)")
    group.addoption("--gpu-size", choices=("full", "tiny"),
                    help="how much of each test runs (default: tiny)")
    group.addoption("--gpu-results", metavar="FILE",
                    help="a JSON line per test as it starts and as it ends")


def pytest_configure(config: pytest.Config) -> None:
    if path := config.getoption("gpu_results"):
        config.pluginmanager.register(Results(path), "gpu-results")


class Results:
    """Writes the lines, each flushed as it is written (the kit may be killed next)."""

    def __init__(self, path: str) -> None:
        self.out = open(path, "w", buffering=1)  # noqa: SIM115 - open for the session

    def write(self, **record) -> None:
        self.out.write(json.dumps(record) + "\n")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.write(collected=[item.nodeid for item in session.items])

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.write(started=nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call" and report.outcome == "passed":
            return  # a setup or teardown that went well: the call's line says it
        if report.skipped:
            why = report.longrepr[2].removeprefix("Skipped: ")
        elif report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            why = crash.message if crash else report.longreprtext.splitlines()[-1]
        else:
            why = ""
        self.write(test=report.nodeid, outcome=report.outcome,
                   seconds=round(report.duration, 1), figures=dict(report.user_properties),
                   why=why, error=report.longreprtext[-ERROR_CHARS:] if report.failed else "")

    def pytest_unconfigure(self) -> None:
        self.out.close()


if __name__ == "__main__":
    # This module is the plugin: its hooks add the options and write the lines.
    sys.exit(pytest.main(sys.argv[1:], plugins=[sys.modules[__name__]]))
