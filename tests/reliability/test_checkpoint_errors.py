"""Every corrupt or mismatched checkpoint is one line naming the file and the fix; writes that
fail (ENOSPC) are one line and keep the previous checkpoint; resume without a checkpoint is an
error, not a silent fresh start. Library level here; ``test_resume_cli.py`` runs the command."""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path

import pytest
import torch
from ckpt_cases import state, write_run
from tmpfs import fill, tiny_tmpfs

from thinwire import checkpoint
from thinwire.checkpoint import CheckpointError
from thinwire.errors import UsageError


class Opaque:
    """Not loadable with weights_only=True."""


def corrupt(run: Path, how: str) -> Path:
    d = checkpoint.step_dir(run, 10)
    f = d / "rank1.pt"
    data = f.read_bytes()
    if how == "truncated":
        f.write_bytes(data[: len(data) // 2])
    elif how == "random":
        f.write_bytes(os.urandom(len(data)))
    elif how == "empty":
        f.write_bytes(b"")
    elif how == "missing":
        f.unlink()
    elif how == "directory":
        f.unlink()
        f.mkdir()
    elif how == "complete-garbage":
        (d / "COMPLETE").write_bytes(b"\x00garbage\xff")
        return d / "COMPLETE"
    elif how == "complete-empty":
        (d / "COMPLETE").write_bytes(b"")
        return d / "COMPLETE"
    elif how == "other-world":
        (d / "COMPLETE").write_text("4\n")
        return d
    elif how == "refused-pickle":
        torch.save({"strategy": Opaque(), "trainer": {}}, f)
    elif how == "plain-pickle":
        f.write_bytes(pickle.dumps({"a": 1}))
    elif how == "list":
        torch.save([1, 2, 3], f)
    elif how == "no-strategy":
        torch.save({"trainer": state(1)["trainer"]}, f)
    elif how == "trainer-str":
        s = state(1)
        s["trainer"]["wall_s"] = "soon"
        torch.save(s, f)
    else:
        raise AssertionError(how)
    return f if how not in ("missing",) else d


CASES = ["truncated", "random", "empty", "missing", "directory", "complete-garbage",
         "complete-empty", "other-world", "refused-pickle", "plain-pickle", "list",
         "no-strategy", "trainer-str"]


@pytest.mark.parametrize("how", CASES)
def test_bad_checkpoint_is_one_line_naming_the_file(tmp_path: Path, how: str) -> None:
    run = write_run(tmp_path / "run")
    named = corrupt(run, how)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    with pytest.raises(CheckpointError) as e:
        checkpoint.require_resumable(run, 2)
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, UsageError)
    assert str(named) in msg, msg
    if how == "other-world":
        assert "--runtime.workers 4" in msg
    else:
        # the fix: fall back to the previous complete checkpoint
        assert f"delete {checkpoint.step_dir(run, 10)}" in msg and "step 5" in msg, msg
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing left behind
    # the rank that reads its own file reports the same way
    with pytest.raises(CheckpointError):
        checkpoint.load_rank(run, 10, 1, 2)


def test_weights_only_stays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    real = torch.load

    def spy(*a: object, **k: object) -> object:
        seen.append(k.get("weights_only"))
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "load", spy)
    run = write_run(tmp_path / "run")
    assert checkpoint.require_resumable(run, 2) == 10
    assert seen and all(w is True for w in seen)


def test_resume_without_checkpoint_is_an_error(tmp_path: Path) -> None:
    for run in (tmp_path / "absent", tmp_path / "empty"):
        (tmp_path / "empty" / "checkpoints").mkdir(parents=True, exist_ok=True)
        with pytest.raises(CheckpointError) as e:
            checkpoint.require_resumable(run, 2)
        assert "no complete checkpoint" in str(e.value) and "\n" not in str(e.value)


def test_an_unsealed_newer_step_is_ignored(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    checkpoint.save_rank(run, 15, 0, state(0))  # rank 1 died before saving step 15
    (checkpoint.step_dir(run, 15) / "rank1.pt.tmp").write_bytes(b"partial")
    assert checkpoint.require_resumable(run, 2) == 10


def _enospc(fd: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_save_simulated_enospc_keeps_the_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = write_run(tmp_path / "run")
    monkeypatch.setattr(os, "fsync", _enospc)
    with pytest.raises(CheckpointError) as e:
        checkpoint.save_rank(run, 15, 0, state(0))
    msg = str(e.value)
    assert "ENOSPC" in msg and str(checkpoint.step_dir(run, 15) / "rank0.pt") in msg
    assert "step 10, is kept" in msg and "\n" not in msg
    assert list(checkpoint.step_dir(run, 15).iterdir()) == []
    with pytest.raises(CheckpointError) as e:
        checkpoint.mark_complete(run, 10, 2)
    assert "COMPLETE" in str(e.value) and "ENOSPC" in str(e.value)
    monkeypatch.undo()
    assert checkpoint.require_resumable(run, 2) == 10


def test_save_real_enospc_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """A real full file system: a 512 KiB tmpfs (skipped where mounting is not allowed)."""
    with tiny_tmpfs(tmp_path / "mnt", "512k") as mnt:
        run = write_run(mnt / "run", steps=(5,))
        fill(mnt)
        big = {**state(0), "strategy": {"model": {"w": torch.zeros(200_000)}}}
        with pytest.raises(CheckpointError) as e:
            checkpoint.save_rank(run, 10, 0, big)
        assert "ENOSPC" in str(e.value) and "step 5, is kept" in str(e.value)
        assert not any(p.name.endswith(".tmp") for p in run.rglob("*"))
        (mnt / "filler").unlink()
        assert checkpoint.require_resumable(run, 2) == 5
