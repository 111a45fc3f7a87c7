"""A pytest plugin (loaded by conftest.py): under ``CI=true`` a skipped test fails the run
unless it is marked ``gpu`` (no CUDA device) or ``netns`` (not root, or no iproute2).

Whatever a test needs (data, packages, tools) comes with the project or its set-up, so on CI no
other test may skip quietly; the run's exit status becomes 1 and each such skip is listed with
its reason. ``tests/test_ci_skips.py`` runs this plugin on a throw-away suite.
"""

from __future__ import annotations

import os
import sys

import pytest

MAY_SKIP = ("gpu", "netns")
"""The marks of the only tests that may skip in CI."""

_may_skip: set[str] = set()
_skipped: list[str] = []


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _may_skip.update(item.nodeid for item in items
                     if any(item.get_closest_marker(m) for m in MAY_SKIP))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and report.nodeid not in _may_skip:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        _skipped.append(f"{report.nodeid}: {reason}")


def in_ci() -> bool:
    """``$CI`` is ``true`` (any case), as CI services set it."""
    return os.environ.get("CI", "").strip().lower() == "true"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not in_ci() or not _skipped:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"CI=true: {len(_skipped)} skipped test(s) not marked {' or '.join(MAY_SKIP)} "
             "(only those may skip in CI; install what the others need):", *_skipped]
    for line in lines:
        if reporter is not None:
            reporter.write_line(line, red=True)
        else:
            print(line, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
