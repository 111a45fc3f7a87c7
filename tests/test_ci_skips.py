"""The CI skip check (tests/ci_skips.py) on a throw-away suite run in a subprocess: a plain
skip fails the run under CI=true and is named; gpu- and netns-marked skips, xfails and runs
outside CI pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SUITE = '''
import pytest

@pytest.mark.gpu
def test_gpu():
    pytest.skip("no CUDA device")

@pytest.mark.netns
def test_netns():
    pytest.skip("not root")

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False

def test_ok():
    assert True
'''
PLAIN_SKIP = '''

def test_needs_data():
    pytest.skip("data not found")

@pytest.mark.skipif(True, reason="package missing")
def test_needs_package():
    pass
'''


def run_suite(tmp_path: Path, body: str, ci: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_suite.py").write_text(body)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    gpu: cuda\n    netns: root\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "ci_skips", "-p", "no:cacheprovider",
         "-p", "no:hypothesispytest", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_plain_skip_fails_ci_and_is_named(tmp_path: Path) -> None:
    out = run_suite(tmp_path, SUITE + PLAIN_SKIP, "TRUE")
    assert out.returncode == 1, out.stdout
    assert "2 skipped test(s) not marked gpu or netns" in out.stdout
    assert "test_needs_data: Skipped: data not found" in out.stdout
    assert "test_needs_package: Skipped: package missing" in out.stdout
    assert "test_gpu" not in out.stdout.split("not marked")[1]


def test_marked_skips_and_xfails_pass_ci(tmp_path: Path) -> None:
    out = run_suite(tmp_path, SUITE, "true")
    assert out.returncode == 0, out.stdout
    assert "1 passed, 2 skipped, 1 xfailed" in out.stdout


def test_outside_ci_a_skip_is_only_reported(tmp_path: Path) -> None:
    out = run_suite(tmp_path, SUITE + PLAIN_SKIP, None)
    assert out.returncode == 0, out.stdout
    assert "not marked" not in out.stdout and "4 skipped" in out.stdout
