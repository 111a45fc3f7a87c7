"""Paths that used to lose data, each closed: thinwire never claims a user's folder,
never rewrites a finished run on --resume, writes every file of a run atomically, follows no
link inside a run directory, writes compare/report output only into folders it marked, and
holds one lock per run directory (worker entry included) in a file it names as its own.

Runs are real and tiny (one worker, 4 steps, in this process through :mod:`inproc`); the
command-line cases go through ``thinwire`` itself."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import one_line
from inproc import tiny_config, train_inproc
from report_cases import write_report_run
from tmpfs import fill, tiny_tmpfs

from thinwire import checkpoint, rundir, worker
from thinwire import run as run_mod
from thinwire.cli import main
from thinwire.errors import UsageError

pytestmark = pytest.mark.timeout(300)


def tree(root: Path) -> dict[str, bytes]:
    """Every regular file under ``root`` (links not followed) with its bytes."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run ``OUT/dp`` (checkpoint at step 4)."""
    out = tmp_path_factory.mktemp("finished")
    train_inproc(tiny_config(out))
    assert checkpoint.complete_steps(out / "dp") == [4]
    return out


def copy_of(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(finished, out, symlinks=True)
    return out


# --- 2. a finished run is never rewritten by --resume ---------------------------------------------
@pytest.mark.parametrize("steps", [4, 2])
def test_resume_of_a_finished_run_is_refused_and_keeps_it(finished: Path, tmp_path: Path,
                                                          steps: int) -> None:
    out = copy_of(finished, tmp_path)
    before = tree(out)
    with pytest.raises(UsageError) as e:
        train_inproc(tiny_config(out, run__resume="true", train__steps=steps))
    msg = one_line(e.value)
    assert ("is complete" if steps == 4 else "more than --train.steps 2") in msg, msg
    assert "--steps above 4" in msg
    assert tree(out) == before  # summary, config.toml, metrics: byte for byte


def test_resume_with_more_steps_continues_a_finished_run(finished: Path, tmp_path: Path) -> None:
    out = copy_of(finished, tmp_path)
    train_inproc(tiny_config(out, run__resume="true", train__steps=8))
    summary = json.loads((out / "dp" / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["final"]
    assert checkpoint.latest_step(out / "dp") == 8


# --- 3. atomic files; ENOSPC names the file ------------------------------------------------------
def test_a_full_disk_at_the_end_names_the_file_and_leaves_no_empty_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real tmpfs filled up just before the ledger and summary are written (after the last
    checkpoint and model.pt): one line naming ENOSPC and the file, and no empty ledger or
    summary left behind (they used to be left at 0 bytes, the error naming only the folder)."""
    from thinwire.trainer import Trainer

    with tiny_tmpfs(tmp_path / "mnt", "2m") as mnt:
        export = Trainer._export

        def export_then_fill(self: Trainer) -> None:
            export(self)
            fill(mnt)

        monkeypatch.setattr(Trainer, "_export", export_then_fill)
        with pytest.raises(UsageError) as e:
            train_inproc(tiny_config(mnt))
        msg = one_line(e.value)
        assert "ENOSPC" in msg and str(mnt / "dp" / "ledger.rank0.json") in msg, msg
        for n in ("summary.json", "ledger.rank0.json"):
            assert not (mnt / "dp" / n).exists()
        assert not [p for p in (mnt / "dp").iterdir() if ".tmp" in p.name]
        assert checkpoint.complete_steps(mnt / "dp") == [4]


def test_a_metrics_line_cut_short_is_dropped_a_damaged_one_named(finished: Path,
                                                                 tmp_path: Path) -> None:
    """A crash mid-append leaves a last line without its newline: resume drops it. A damaged
    line elsewhere is one line naming the file and line, with a fix that keeps the checkpoints
    (it used to advise --run.overwrite, which deletes them)."""
    out = copy_of(finished, tmp_path)
    metrics = out / "dp" / "metrics.jsonl"
    good = metrics.read_text()
    metrics.write_text(good + '{"kind": "train", "st')
    train_inproc(tiny_config(out, run__resume="true", train__steps=8))
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 8

    out2 = tmp_path / "out2"
    shutil.copytree(finished, out2)
    m2 = out2 / "dp" / "metrics.jsonl"
    m2.write_text("garbage\n" + good)
    with pytest.raises(UsageError) as e:
        train_inproc(tiny_config(out2, run__resume="true", train__steps=8))
    msg = one_line(e.value)
    assert f"{m2} line 1" in msg and "checkpoints are intact" in msg, msg
    assert "overwrite" not in msg
    assert checkpoint.complete_steps(out2 / "dp") == [4]


# --- 4. no link inside a run directory is followed -----------------------------------------------
@pytest.mark.parametrize("entry", ["metrics.jsonl", "summary.json", "ledger.rank0.json",
                                   "checkpoints", "launcher.log"])
def test_links_inside_a_run_directory_are_refused(finished: Path, tmp_path: Path,
                                                  entry: str) -> None:
    out = copy_of(finished, tmp_path)
    outside = tmp_path / "outside"
    run = out / "dp"
    if entry == "checkpoints":
        shutil.move(run / entry, outside)
    elif (run / entry).exists():
        shutil.move(run / entry, outside)
    else:
        outside.write_text("a user's log\n")
    os.symlink(outside, run / entry)
    before, before_out = tree(tmp_path), tree(outside) if outside.is_dir() else outside.read_bytes()
    with pytest.raises(UsageError) as e:
        train_inproc(tiny_config(out, run__resume="true", train__steps=8))
    msg = one_line(e.value)
    assert str(run / entry) in msg and "symbolic link" in msg, msg
    assert tree(tmp_path) == before
    assert (tree(outside) if outside.is_dir() else outside.read_bytes()) == before_out


def test_a_link_in_a_step_folder_is_refused(finished: Path, tmp_path: Path) -> None:
    out = copy_of(finished, tmp_path)
    step = checkpoint.step_dir(out / "dp", 4)
    shutil.move(step / "rank0.pt", tmp_path / "rank0.pt")
    os.symlink(tmp_path / "rank0.pt", step / "rank0.pt")
    with pytest.raises(UsageError, match="symbolic link"):
        train_inproc(tiny_config(out, run__resume="true", train__steps=8))


def test_atomic_writes_replace_a_link_never_follow_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    os.symlink(victim, tmp_path / "summary.json")
    rundir.write_text(tmp_path / "summary.json", "{}")
    assert victim.read_text() == "keep" and not (tmp_path / "summary.json").is_symlink()


# --- 5. compare and report write only into folders they marked ---------------------------------
def test_report_writes_only_into_a_folder_it_marked(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    write_report_run(runs / "dp")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "accuracy.png").write_bytes(b"a user's figure")
    os.symlink(theirs, runs / "report")
    before = tree(tmp_path)
    for argv in (["report", str(runs / "dp")],
                 ["report", str(runs / "dp"), "--plots", str(theirs)],
                 ["report", str(runs / "dp"), "--plots", "/proc/nope"],
                 ["report", str(runs / "dp"), "--target", "nan"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], err
    assert tree(tmp_path) == before
    (runs / "report").unlink()
    assert main(["report", str(runs / "dp")]) == 0
    assert rundir.is_report_dir(runs / "report")
    assert main(["report", str(runs / "dp")]) == 0  # its own folder: reused
    capsys.readouterr()


def test_compare_refuses_a_users_report_folder_before_training(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "compare.md").write_text("my notes")
    (tmp_path / "compare.md").write_text("my other notes")
    before = tree(tmp_path)
    assert main(["compare", "--out", str(tmp_path), "--methods", "dp", "--data", "digits",
                 "--steps", "2", "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "not created by thinwire" in err and str(tmp_path / "report") in err
    assert tree(tmp_path) == before and not (tmp_path / "dp").exists()


# --- 6. the lock: thinwire's own file, taken by the worker entry, removed at exit ----------------
def test_a_users_file_named_like_the_lock_is_never_truncated(tmp_path: Path) -> None:
    for name in (".dp.lock", ".dp.thinwire-lock"):
        (tmp_path / name).write_text("my data")
    with pytest.raises(UsageError) as e:
        rundir.open_run(tmp_path, "dp")
    assert "not thinwire's lock" in one_line(e.value)
    assert (tmp_path / ".dp.thinwire-lock").read_text() == "my data"
    assert (tmp_path / ".dp.lock").read_text() == "my data"
    assert not (tmp_path / "dp").exists()


def test_the_lock_is_removed_at_exit_and_a_stale_one_reused(tmp_path: Path) -> None:
    with rundir.open_run(tmp_path, "dp"):
        lock = rundir.lock_path(tmp_path, "dp")
        assert rundir.lock_holder(lock) == os.getpid()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dp"]
    lock.write_text(f"{rundir.LOCK_TAG} pid 999999\n")  # left by a killed job: ours, free
    rundir.open_run(tmp_path, "dp", resume=True).close()
    assert not lock.exists()


def test_the_worker_entry_takes_the_lock_of_a_live_job(finished: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``torchrun ... -m thinwire.worker A/dp/config.toml`` beside a live job in the same run
    directory: refused in one line (both used to run and exit 0); once the job ends the worker
    entry (here in this process, one worker) runs, and removes its lock at exit."""
    out = copy_of(finished, tmp_path)
    config = out / "dp" / "config.toml"
    config.write_text(config.read_text().replace("steps = 4", "steps = 6").replace(
        "resume = false", "resume = true"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("THINWIRE_")}
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time\nfrom thinwire import rundir\n"
                               f"rd = rundir.open_run({str(out)!r}, 'dp', resume=True)\n"
                               # the lock holder under test: it holds until killed
                               "print('locked', flush=True)\ntime.sleep(300)\n"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        r = subprocess.run([sys.executable, "-m", "thinwire.worker", str(config)],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 2 and f"another thinwire job (pid {holder.pid})" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert checkpoint.complete_steps(out / "dp") == [4]
    finally:
        holder.kill()
        holder.wait()
    monkeypatch.delenv("THINWIRE_LAUNCHER_PID", raising=False)
    assert worker._run(config) == 0
    assert checkpoint.latest_step(out / "dp") == 6
    assert not rundir.lock_path(out, "dp").exists()


# --- 1. (end to end) a user's folder is never claimed --------------------------------------------
def test_resume_then_overwrite_of_a_users_folder_deletes_nothing(tmp_path: Path) -> None:
    user = tmp_path / "results"
    (user / "checkpoints").mkdir(parents=True)
    (user / "config.toml").write_text("[run]\n")
    (user / "thesis.txt").write_text("years of work")
    before = tree(tmp_path)
    for flag in ("run__resume", "run__overwrite"):
        with pytest.raises(UsageError, match="not created by thinwire"):
            with run_mod.run_directory(tiny_config(tmp_path, "results", **{flag: "true"})):
                pass
    assert tree(tmp_path) == before
    assert not os.path.lexists(user / rundir.MARKER)


def test_write_errors_name_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(UsageError) as e:
        rundir.write_text(tmp_path / "summary.json", "{}")
    assert "ENOSPC" in one_line(e.value) and str(tmp_path / "summary.json") in str(e.value)
    assert list(tmp_path.iterdir()) == []
