"""Signals handled once: a second Ctrl-C while the job is torn down ends it cleanly within a
bound (one line, exit 130, no traceback), and leaves neither the staging directory and lock of
an ``--overwrite`` nor the launcher's temporary folder; an interrupted job leaves no
checkpoint temporary file in the run directory. Every process is killed in a ``finally``
(``reliability_procs.train_job``)."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
from harness import stderr_lines
from reliability_procs import alive, started, train_job, training

from thinwire import checkpoint, rundir

pytestmark = pytest.mark.timeout(300)


def test_ctrl_c_twice_during_an_overwrite_ends_cleanly_and_leaves_nothing(tmp_path: Path) -> None:
    old = tmp_path / "dp"
    old.mkdir()
    rundir.mark(old)
    (old / "summary.json").write_text("{}")  # the run being replaced: kept when interrupted
    with train_job(tmp_path, "--overwrite") as proc:
        workers = started(proc, 2)
        training(rundir.staging_path(tmp_path, "dp"))
        os.kill(proc.pid, signal.SIGINT)
        for _ in range(3):  # more Ctrl-C while the job is being torn down
            time.sleep(0.15)  # the spacing of the repeated signals is the behaviour under test
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)  # "within seconds": a hang fails here
    assert proc.returncode == 130, (proc.returncode, err)
    assert stderr_lines(err) == ["thinwire train: interrupted"], err
    for word in ("Traceback", "KeyboardInterrupt", "SignalException"):
        assert word not in out + err, err
    assert not any(alive(p) for p in workers)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dp"]  # no staging, no lock
    assert (old / "summary.json").read_text() == "{}"
    assert not list(Path(tempfile.gettempdir()).glob(f"thinwire-launch-{proc.pid}-*"))


def test_an_interrupted_job_leaves_no_checkpoint_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> None:
    """A worker ended by a signal's default action mid-write cannot remove its temporary file;
    the launcher removes what is left when the job ends, however it ends."""
    import thinwire.launch
    from thinwire.cli import main

    run = tmp_path / "dp"
    run.mkdir()
    rundir.mark(run)
    state = {"strategy": {}, "trainer": {k: 0.0 for k in checkpoint.TRAINER_KEYS}}
    checkpoint.save_rank(run, 2, 0, state)
    checkpoint.save_rank(run, 2, 1, state)
    checkpoint.mark_complete(run, 2, 2)
    stray = [checkpoint.step_dir(run, 4) / "rank1.pt.tmp", checkpoint.step_dir(run, 2) / "x.tmp"]
    for s in stray:
        s.parent.mkdir(parents=True, exist_ok=True)
        s.write_bytes(b"half a checkpoint")

    def interrupted(*args: object, **kwargs: object) -> None:
        raise thinwire.launch.Interrupted(int(signal.SIGINT))

    monkeypatch.setattr(thinwire.launch, "launch", interrupted)
    argv = ["train", "--data.name", "digits", "--model.hidden", "16", "--workers", "2",
            "--train.steps", "8", "--train.batch_size", "8", "--out", str(tmp_path), "--resume"]
    assert main(argv) == 130
    assert capsys.readouterr().err.strip() == "thinwire train: interrupted"
    assert not stray[0].exists() and stray[1].exists()  # only thinwire's own temporaries
    assert checkpoint.require_resumable(run, 2) == 2


def test_a_stale_staging_lock_of_a_dead_job_is_cleared(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A lock file a killed worker left beside the run (thinwire's tag, no holder) is removed
    by the next job on that run, in one line naming it; one still held, or a user's file of
    that name, is left."""
    old = tmp_path / "dp"
    old.mkdir()
    rundir.mark(old)
    stale = rundir.lock_path(tmp_path, rundir.staging_path(tmp_path, "dp").name)
    stale.write_text(f"{rundir.LOCK_TAG} pid 999999\n")
    with rundir.open_run(tmp_path, "dp", overwrite=True):
        assert not stale.exists()
    assert capsys.readouterr().err.strip().splitlines() == [
        f"thinwire: removed {stale}, a stale lock of a job that is gone"]
    users = rundir.lock_path(tmp_path, rundir.replaced_path(tmp_path, "dp").name)
    users.write_text("my notes\n")
    with rundir.open_run(tmp_path, "dp", overwrite=True):
        pass
    assert users.read_text() == "my notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [users.name, "dp"]
