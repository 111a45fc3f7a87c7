"""Hard edges: inputs, faults and options that used to end in a traceback, run as a no-op or
leave a run that could never be finished; each now behaves as the README's Reliability section
promises."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from thinwire.testbed.run import BenchFailed, run_processes


def test_a_worker_that_cannot_be_spawned_is_one_line_and_kills_the_others(
        tmp_path: Path) -> None:
    noexec = tmp_path / "worker.sh"
    noexec.write_text("#!/bin/sh\nexit 0\n")
    noexec.chmod(0o644)  # not executable: exec fails with EACCES, even as root
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    t0 = time.monotonic()
    with pytest.raises(BenchFailed) as exc:
        run_processes([(sleeper, {}), ([str(noexec)], {})], tmp_path, time.monotonic() + 30)
    text = str(exc.value)
    assert "\n" not in text and "worker rank 1 could not be started" in text, text
    assert "Permission denied" in text and str(noexec) in text, text
    assert time.monotonic() - t0 < 10
    out = subprocess.run(["pgrep", "-f", "import time; time.sleep(60)"], capture_output=True,
                         text=True).stdout.split()
    assert out == [], out  # the rank that did start was killed
