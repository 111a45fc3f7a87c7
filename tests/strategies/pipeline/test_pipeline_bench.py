"""The pipeline testbed benchmark's calibration and prediction run end to end (``--check``: no
namespaces, no training run): each stage's passes on a silent communicator, the stages' CPU over
loopback, and the planner's simulation and closed form of the step from them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from harness import DATA

ROOT = Path(__file__).resolve().parents[3]


def test_the_benchmark_calibrates_and_predicts_a_pipeline_step(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pipeline_thin_wire.py"), "--check",
         "--link", "100mbit,1gbit", "--runs", "none,int4", "--stages", "2", "--reps", "3",
         "--data-dir", str(DATA / "tinyshakespeare"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    found = re.findall(r"^(\w+) (\S+): predicted ([\d.]+) s/step \(isolated passes ([\d.]+), "
                       r"closed form ([\d.]+); CPU work ([\d.]+) s, isolated ([\d.]+) s", out.stdout, re.M)
    got = {(run, link): tuple(map(float, v)) for run, link, *v in found}
    assert set(got) == {(r, k) for r in ("none", "int4") for k in ("100mbit", "1gbit")}
    for (run, link), (sim, alone, closed, work, work_alone) in got.items():
        assert min(sim, alone, closed, work_alone) > 0, (run, link)
        assert work >= work_alone - 1e-9  # the passes are only ever scaled up
    # a 100 Mbit/s link makes the uncompressed pipeline slower than a 1 Gbit/s one, and int4's
    # 7.5x fewer bytes matter more on the slow link
    assert got[("none", "100mbit")][0] > got[("none", "1gbit")][0]
    assert got[("int4", "100mbit")][0] < got[("none", "100mbit")][0]
