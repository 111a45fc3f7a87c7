"""thinwire.rundir: names, markers, modes, the lock, staged replacement and atomic writes.
Every case that deletes today (``--run.name ../victim``, ``.``, an absolute name, an unrelated
``out/dp``, a failed re-run, two jobs on one directory) is checked to leave the files alone."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from harness import one_line
from tmpfs import fill, tiny_tmpfs

from thinwire import rundir
from thinwire.errors import UsageError


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", ["../victim", ".", "..", "/tmp/abs", "a/b", "a\\b", "a\0b",
                                  "x" * 101, ".hidden", "", "a\nb", "..\\x"])
def test_bad_names_are_one_line_errors(name: str) -> None:
    with pytest.raises(UsageError) as e:
        rundir.check_name(name)
    assert "run.name" in one_line(e.value)


def test_plain_names_pass() -> None:
    for name in ("dp", "dp-lr0.1", "ist(K=10,central)", "x" * 100, "a.b", "résumé"):
        assert rundir.check_name(name) == name


@pytest.mark.parametrize("name", ["../victim", ".", "/ABS"])
def test_escaping_names_delete_nothing(tmp_path: Path, name: str) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / "other-run.txt").write_text("keep me too")
    before = tree(tmp_path)
    name = name.replace("/ABS", str(victim))
    for flags in ({}, {"overwrite": True}, {"resume": True}):
        with pytest.raises(UsageError):
            rundir.open_run(out, name, **flags)
    assert tree(tmp_path) == before


def test_an_unmarked_directory_is_never_touched(tmp_path: Path) -> None:
    foreign = tmp_path / "dp"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for flags in ({}, {"overwrite": True}, {"resume": True}):
        with pytest.raises(UsageError) as e:
            rundir.open_run(tmp_path, "dp", **flags)
        assert str(foreign) in one_line(e.value) and "not created by thinwire" in str(e.value)
    assert (foreign / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_links_and_files_in_place_of_a_run_are_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    rundir.mark(target)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "dp").symlink_to(target)
    (tmp_path / "out" / "ls").write_text("a file")
    for name in ("dp", "ls"):
        with pytest.raises(UsageError):
            rundir.open_run(tmp_path / "out", name, overwrite=True)
    assert target.is_dir() and (tmp_path / "out" / "ls").read_text() == "a file"


def test_new_then_rerun_needs_a_flag(tmp_path: Path) -> None:
    with rundir.open_run(tmp_path, "dp") as rd:
        assert rd.mode == "new" and rd.path == tmp_path / "dp" and rundir.is_run_dir(rd.path)
        (rd.path / "summary.json").write_text("{}")
        rd.commit()
    with pytest.raises(UsageError) as e:
        rundir.open_run(tmp_path, "dp")
    assert "--run.overwrite" in one_line(e.value) and "--run.resume" in str(e.value)
    assert (tmp_path / "dp" / "summary.json").read_text() == "{}"


def test_overwrite_swaps_in_only_on_success(tmp_path: Path) -> None:
    with rundir.open_run(tmp_path, "dp") as rd:
        (rd.path / "summary.json").write_text("old")
        rd.commit()
    # a failed replacement: the previous run is untouched and the staging directory is gone
    before = tree(tmp_path / "dp")
    with pytest.raises(RuntimeError), rundir.open_run(tmp_path, "dp", overwrite=True) as rd:
        assert rd.mode == "replace" and rd.path != rd.final and rd.path.parent == tmp_path
        (rd.path / "summary.json").write_text("half")
        raise RuntimeError("worker died")
    assert tree(tmp_path / "dp") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dp"]
    # a successful one replaces it
    with rundir.open_run(tmp_path, "dp", overwrite=True) as rd:
        (rd.path / "summary.json").write_text("new")
        assert (tmp_path / "dp" / "summary.json").read_text() == "old"
        assert rd.commit() == tmp_path / "dp"
    assert (tmp_path / "dp" / "summary.json").read_text() == "new"
    assert rundir.is_run_dir(tmp_path / "dp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dp"]


def test_overwrite_when_the_old_run_vanished_meanwhile(tmp_path: Path) -> None:
    import shutil

    rundir.open_run(tmp_path, "dp").close()
    with rundir.open_run(tmp_path, "dp", overwrite=True) as rd:
        (rd.path / "a").write_text("new")
        shutil.rmtree(tmp_path / "dp")
        rd.commit()
    assert (tmp_path / "dp" / "a").read_text() == "new"


def test_overwrite_without_rename_exchange(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rundir, "_rename_exchange", lambda a, b: False)
    with rundir.open_run(tmp_path, "dp") as rd:
        (rd.path / "a").write_text("old")
    with rundir.open_run(tmp_path, "dp", overwrite=True) as rd:
        (rd.path / "a").write_text("new")
        rd.commit()
    assert (tmp_path / "dp" / "a").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dp"]


def test_leftovers_of_a_killed_job_are_recovered(tmp_path: Path) -> None:
    with rundir.open_run(tmp_path, "dp") as rd:
        (rd.path / "a").write_text("old")
    # killed mid-replacement: a stale staging directory is dropped, the run kept
    stale = rundir.staging_path(tmp_path, "dp")
    stale.mkdir()
    rundir.mark(stale)
    with rundir.open_run(tmp_path, "dp", resume=True) as rd:
        assert rd.path == tmp_path / "dp"
    assert not stale.exists() and (tmp_path / "dp" / "a").read_text() == "old"
    # killed between the two renames of the fallback swap: the finished new run is promoted
    os.replace(tmp_path / "dp", rundir.replaced_path(tmp_path, "dp"))
    stale.mkdir()
    rundir.mark(stale)
    (stale / "a").write_text("new")
    rundir.open_run(tmp_path, "dp", resume=True).close()
    assert (tmp_path / "dp" / "a").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dp"]
    # a hidden entry thinwire did not make is refused, not removed
    stale.mkdir()
    with pytest.raises(UsageError):
        rundir.open_run(tmp_path, "dp", resume=True)
    assert stale.is_dir()


def test_resume_is_in_place_and_needs_a_run(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as e:
        rundir.open_run(tmp_path, "dp", resume=True)
    assert "nothing to resume" in one_line(e.value)
    with pytest.raises(UsageError):
        rundir.open_run(tmp_path, "dp", resume=True, overwrite=True)
    with rundir.open_run(tmp_path, "dp") as rd:
        (rd.path / "checkpoints").mkdir()
    with rundir.open_run(tmp_path, "dp", resume=True) as rd:
        assert rd.mode == "resume" and rd.path == rd.final == tmp_path / "dp"
        assert (rd.path / "checkpoints").is_dir()


def test_a_users_folder_that_looks_like_a_run_is_never_claimed(tmp_path: Path) -> None:
    """A folder of the user's with thinwire's layout is not adopted on resume
    (the marker used to be written into it, and --overwrite then deleted thesis.txt)."""
    old = tmp_path / "results"
    (old / "checkpoints").mkdir(parents=True)
    (old / "config.toml").write_text("[run]\n")
    (old / "thesis.txt").write_text("years of work")
    before = tree(tmp_path)
    for flags in ({"resume": True}, {"overwrite": True}, {}, {"resume": True}):
        with pytest.raises(UsageError) as e:
            rundir.open_run(tmp_path, "results", **flags)
        assert "not created by thinwire" in one_line(e.value)
    assert tree(tmp_path) == before
    assert not rundir.is_run_dir(old)


def test_a_second_job_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    with rundir.open_run(tmp_path, "dp") as rd:
        with pytest.raises(UsageError) as e:
            rundir.open_run(tmp_path, "dp", resume=True)
        msg = one_line(e.value)
        assert "another thinwire job" in msg and str(rd.final) in msg and str(os.getpid()) in msg
        other = rundir.open_run(tmp_path, "ist")  # another name is independent
        other.close()
    rundir.open_run(tmp_path, "dp", resume=True).close()  # released


def test_the_lock_dies_with_its_holder(tmp_path: Path) -> None:
    rundir.open_run(tmp_path, "dp").close()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from thinwire import rundir
        rd = rundir.open_run({str(tmp_path)!r}, "dp", resume=True)
        print("locked", flush=True)
        time.sleep(600)  # the lock holder under test: it holds until the test kills it
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(UsageError):
            rundir.open_run(tmp_path, "dp", resume=True)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        rundir.open_run(tmp_path, "dp", resume=True).close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_the_lock_is_not_inherited_by_children(tmp_path: Path) -> None:
    with rundir.open_run(tmp_path, "dp") as rd:
        assert rd._lock is not None and rd._lock.fd is not None
        assert not os.get_inheritable(rd._lock.fd)


def test_output_root_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "out"
    f.write_text("x")
    with pytest.raises(UsageError) as e:
        rundir.open_run(f, "dp")
    assert "is a file" in one_line(e.value) and f.read_text() == "x"
    with pytest.raises(UsageError):
        rundir.open_run(f / "sub", "dp")


def test_output_root_not_writable(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        with tiny_tmpfs(tmp_path / "ro", "64k", read_only=True) as ro:
            with pytest.raises(UsageError) as e:
                rundir.open_run(ro, "dp")
            assert "EROFS" in one_line(e.value) or "not writable" in str(e.value)
        return
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(UsageError) as e:
        rundir.open_run(ro, "dp")
    assert "not writable" in one_line(e.value)


def test_write_text_simulated_enospc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC simulated at fsync (where delayed allocation reports it)."""
    target = tmp_path / "config.toml"

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UsageError) as e:
        rundir.write_text(target, "[run]\n" * 100)
    msg = one_line(e.value)
    assert "ENOSPC" in msg and str(target) in msg
    assert list(tmp_path.iterdir()) == []  # no empty config.toml, no temporary file


def test_write_text_real_enospc_keeps_the_old_content(tmp_path: Path) -> None:
    """A real full file system (a 64 KiB tmpfs; skipped where mounting is not allowed)."""
    with tiny_tmpfs(tmp_path / "mnt", "64k") as mnt:
        target = mnt / "config.toml"
        rundir.write_text(target, "old\n")
        fill(mnt)
        with pytest.raises(UsageError) as e:
            rundir.write_text(target, "x" * 100_000)
        assert "ENOSPC" in one_line(e.value) and str(target) in str(e.value)
        assert target.read_text() == "old\n"
        assert sorted(p.name for p in mnt.iterdir()) == ["config.toml", "filler"]
        # a run directory cannot even be created: nothing half-made is left
        (mnt / "filler").write_bytes(b"")
        fill(mnt)
        with pytest.raises(UsageError):
            rundir.open_run(mnt, "dp")
        assert not (mnt / "dp").exists()
