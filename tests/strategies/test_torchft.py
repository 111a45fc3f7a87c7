"""thinwire's Streaming DiLoCo beside torchft's (``benchmarks/torchft_side_by_side.py``, torchft's
lighthouse binary, gloo on loopback): the same model, data and two workers give the same
parameters after three outer steps, and both runs report their step time and bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parents[2]


def test_streaming_diloco_agrees_with_torchft(tmp_path: Path) -> None:
    """Guards the claim that thinwire's DiLoCo with fragments, overlap and merge is torchft's
    algorithm: two strided fragments, tau = 1, alpha = 0.5, Nesterov outer SGD. Tolerance: the
    merge is torchft's lerp against thinwire's alpha x + (1 - alpha) y, one rounding apart per
    merge (|theta| ~ 1: 1.2e-7 each, 6 merges); any difference in the schedule, the fragments
    or the outer step is orders of magnitude larger (one inner step moves theta by ~1e-3)."""
    out = tmp_path / "side.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "torchft_side_by_side.py"), "--workers", "2",
         "--outer-steps", "3", "--period", "4", "--fragments", "2", "--delay", "1",
         "--alpha", "0.5", "--set", "data.name=teacher", "--set", "model.hidden=32,32",
         "--repeats", "2", "--timeout", "200", "--json", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["max_abs_diff"] <= 1e-6, res["max_abs_diff"]
    for rank in res["per_rank"]:
        assert rank["torchft_commits"] == 6  # 3 outer steps x 2 fragments
        # two repeats, interleaved; every one compared above
        assert len(rank["torchft_step_s"]) == len(rank["thinwire_step_s"]) == 2
        assert min(rank["torchft_step_s"]) > 0 and min(rank["thinwire_step_s"]) > 0
        # gloo's writes carry the ledger's bytes plus its message headers
        assert rank["thinwire_ledger_sent"] <= rank["thinwire_wchar"]
        assert rank["thinwire_wchar"] < 2 * rank["thinwire_ledger_sent"]
    assert "torchft" in run.stdout and "thinwire" in run.stdout
