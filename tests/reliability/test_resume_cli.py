"""``thinwire train --resume`` against bad checkpoints, and a disk that fills up mid-run, end to
end through the command line: one line naming the file and the fix, no traceback, the previous
checkpoint kept. Two tiny workers, 20 steps."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import stderr_lines
from tmpfs import tiny_tmpfs

from thinwire import checkpoint

pytestmark = pytest.mark.timeout(400)

ARGS = ["--workers", "2", "--data.name", "digits", "--model.hidden", "16",
        "--train.batch_size", "8", "--train.steps", "20", "--train.eval_every", "10",
        "--run.checkpoint_every", "10", "--no-progress"]


def train(out: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "thinwire", "train", "--out", str(out), *ARGS,
                           *extra], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("base")
    r = train(out)
    assert r.returncode == 0, r.stderr
    assert checkpoint.complete_steps(out / "dp") == [10, 20]
    return out


@pytest.mark.parametrize("how", ["truncated-rank1", "garbage-complete"])
def test_resume_from_a_bad_checkpoint_is_one_line(finished: Path, tmp_path: Path,
                                                   how: str) -> None:
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    step = checkpoint.step_dir(out / "dp", 20)
    if how == "truncated-rank1":
        f = step / "rank1.pt"
        f.write_bytes(f.read_bytes()[:100])
    else:
        f = step / "COMPLETE"
        f.write_bytes(b"\xde\xad garbage")
    r = train(out, "--resume")
    lines = stderr_lines(r.stderr)
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert str(f) in lines[0] and f"delete {step}" in lines[0] and "step 10" in lines[0], lines[0]
    assert "Traceback" not in r.stdout + r.stderr
    assert checkpoint.complete_steps(out / "dp") == [10, 20]  # nothing deleted


def test_resume_without_a_checkpoint_is_an_error(tmp_path: Path) -> None:
    r = train(tmp_path, "--resume")
    lines = stderr_lines(r.stderr)
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert ("no complete checkpoint" in lines[0] or "nothing to resume" in lines[0])
    assert "without --resume" in lines[0]
    assert not (tmp_path / "dp" / "summary.json").exists()  # no silent fresh start


def test_a_full_disk_mid_run_is_one_line_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    """A real 1.6 MiB tmpfs (skipped where mounting is not allowed; the simulated twins are in
    test_checkpoint_errors.py and test_rundir.py). Each checkpoint of this 256-256 MLP takes
    about 0.7 MB; the third one does not fit."""
    with tiny_tmpfs(tmp_path / "mnt", "1600k") as mnt:
        r = subprocess.run(
            [sys.executable, "-m", "thinwire", "train", "--out", str(mnt), "--workers", "2",
             "--data.name", "digits", "--model.hidden", "256,256", "--model.norm", "none",
             "--train.batch_size", "8", "--train.steps", "40", "--train.eval_every", "0",
             "--run.checkpoint_every", "5", "--no-progress"],
            capture_output=True, text=True, timeout=300)
        lines = stderr_lines(r.stderr)
        assert r.returncode != 0 and len(lines) == 1, r.stderr
        assert "ENOSPC" in lines[0] and str(mnt / "dp" / "checkpoints") in lines[0], lines[0]
        assert "is kept" in lines[0] and "Traceback" not in r.stderr
        run = mnt / "dp"
        last = checkpoint.latest_step(run)
        assert last is not None and last >= 5
        (mnt / "dp" / "metrics.jsonl").unlink()  # make room to read it back
        assert checkpoint.require_resumable(run, 2) == last
        assert not [p for p in run.rglob("*.tmp")]


def test_a_full_disk_while_writing_metrics_is_one_line(tmp_path: Path) -> None:
    """A 64 KiB tmpfs filled by metrics.jsonl (a record every step, no checkpoint until the
    end): one line naming ENOSPC and the run directory (skipped where mounting is not allowed)."""
    with tiny_tmpfs(tmp_path / "mnt", "64k") as mnt:
        r = subprocess.run(
            [sys.executable, "-m", "thinwire", "train", "--out", str(mnt), "--workers", "2",
             "--data.name", "digits", "--model.hidden", "16", "--train.batch_size", "8",
             "--train.steps", "5000", "--train.eval_every", "0", "--train.log_every", "1",
             "--no-progress"],
            capture_output=True, text=True, timeout=300)
        lines = stderr_lines(r.stderr)
        assert r.returncode != 0 and len(lines) == 1, r.stderr
        assert "ENOSPC" in lines[0] and str(mnt / "dp") in lines[0], lines[0]
        assert "Traceback" not in r.stderr
        assert (mnt / "dp" / "config.toml").stat().st_size > 0


def test_a_replicated_method_resumes_at_another_worker_count(finished: Path,
                                                            tmp_path: Path) -> None:
    """dp's state is the same on every rank, so a checkpoint of 2 workers resumes with 3 (each
    loads rank 0's file) and trains on from step 20 to 30; a method with per-worker state is
    refused with one line naming the worker count to use. Guards: elastic resume."""
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    with pytest.raises(checkpoint.CheckpointError, match="--runtime.workers 2"):
        checkpoint.require_resumable(out / "dp", 3)
    assert checkpoint.require_resumable(out / "dp", 3, rescalable=True) == 20
    r = train(out, "--resume", "--workers", "3", "--train.steps", "30")
    assert r.returncode == 0, r.stderr
    assert checkpoint.read_complete(out / "dp", 30) == 3
    import json

    summary = json.loads((out / "dp" / "summary.json").read_text())
    assert summary["workers"] == 3 and summary["steps"] == 30
    steps = [json.loads(line).get("step") for line in
             (out / "dp" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 30
