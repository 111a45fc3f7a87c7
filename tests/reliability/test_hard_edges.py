"""Hard edges: inputs, faults and options that used to end in a traceback, run as a no-op or
leave a run that could never be finished; each now behaves as the README's Reliability section
promises."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from inproc import train_here

from thinwire.testbed.run import BenchFailed, run_processes


def test_a_worker_that_cannot_be_spawned_is_one_line_and_kills_the_others(
        tmp_path: Path) -> None:
    noexec = tmp_path / "worker.sh"
    noexec.write_text("#!/bin/sh\nexit 0\n")
    noexec.chmod(0o644)  # not executable: exec fails with EACCES, even as root
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]  # a rank that runs until killed
    # the sleeper outlives the 30 s deadline: BenchFailed (not BenchTimeout) says the failed
    # start ended the job before it
    with pytest.raises(BenchFailed) as exc:
        run_processes([(sleeper, {}), ([str(noexec)], {})], tmp_path, time.monotonic() + 30)
    text = str(exc.value)
    assert "\n" not in text and "worker rank 1 could not be started" in text, text
    assert "Permission denied" in text and str(noexec) in text, text
    out = subprocess.run(["pgrep", "-f", "import time; time.sleep(60)"], capture_output=True,
                         text=True).stdout.split()
    assert out == [], out  # the rank that did start was killed


# --- options accepted that did nothing -----------------------------------------------------------
PIPE = {"model.name": "gpt", "method.name": "pipeline", "parallel.pp": "2", "runtime.workers": "2"}


@pytest.mark.parametrize("over,where,applies", [
    ({**PIPE, "method.codec_fwd": "int8:exchange=scatter"}, "method.codec_fwd",
     "--method.compressor"),
    ({**PIPE, "method.codec_bwd": "fp4:exchange=scatter"}, "method.codec_bwd",
     "--method.compressor"),
    ({**PIPE, "method.overrides": "0@int8:exchange=scatter|none"}, "method.overrides",
     "--method.compressor"),
    ({**PIPE, "parallel.tp": "2", "runtime.workers": "4",
      "method.tp_codec": "int8:exchange=scatter"}, "method.tp_codec", "--method.compressor"),
    ({"model.name": "gpt", "method.name": "tensor", "parallel.tp": "2", "runtime.workers": "2",
      "method.codec": "fp4:exchange=scatter"}, "method.codec", "--method.compressor"),
    ({**PIPE, "method.codec_fwd": "lowrank:rank=4"}, "method.codec_fwd", "codec_bwd"),
])
def test_codec_options_that_do_nothing_where_given_are_refused(over: dict[str, str], where: str,
                                                               applies: str) -> None:
    from thinwire import config as config_mod
    from thinwire.errors import UsageError

    with pytest.raises(UsageError) as exc:
        config_mod.load(None, over)
    text = str(exc.value)
    assert "\n" not in text and text.startswith(where) and applies in text, text


def test_the_scattered_exchange_stays_where_it_averages() -> None:
    from thinwire import config as config_mod

    cfg = config_mod.load(None, {"method.name": "diloco", "method.compressor":
                                 "fp4:exchange=scatter"})
    assert "scatter" in cfg.method.options.compressor
    cfg = config_mod.load(None, {**PIPE, "method.codec_bwd": "lowrank:rank=4"})
    assert cfg.method.options.codec_bwd == "lowrank:rank=4"


class Trained(Exception):
    """Raised instead of a run: the command got past its checks."""


@pytest.mark.parametrize("argv,needle", [
    (["compare", "--target", "2", "--data.name", "digits"], "accuracy is a fraction"),
    (["compare", "--target", "0", "--data.name", "digits"], "(0, 1]"),
    (["compare", "--target", "0.5", "--model", "gpt", "--methods", "dp"], "at least 1"),
])
def test_a_target_the_metric_never_reaches_is_refused_before_training(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
        argv: list[str], needle: str) -> None:
    from thinwire import run as run_mod
    from thinwire.cli import main

    def trained(*args: object, **kwargs: object) -> None:
        raise Trained

    monkeypatch.setattr(run_mod, "run_config", trained)
    assert main([*argv, "--run.out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "--target" in err[0], err
    assert not (tmp_path / "runs").exists()


def test_report_refuses_an_accuracy_target_above_one(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from report_cases import write_report_run

    from thinwire.cli import main

    run = write_report_run(tmp_path / "runs" / "a")
    assert main(["report", str(run), "--target", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "accuracy is a fraction" in err[0], err
    assert main(["report", str(run), "--target", "0.5"]) == 0


# --- checkpoint writes refuse links planted in the run directory ---------------------------------
def test_checkpoint_writes_never_follow_a_link_planted_at_their_temporary_file(
        tmp_path: Path) -> None:
    from thinwire import checkpoint

    run = tmp_path / "run"
    d = checkpoint.step_dir(run, 4)
    d.mkdir(parents=True)
    victims = {name: tmp_path / f"victim-{name}" for name in ("rank0", "rank1", "COMPLETE")}
    for v in victims.values():
        v.write_text("precious\n")
    (d / "rank0.pt.tmp").symlink_to(victims["rank0"])  # a symbolic link
    os.link(victims["rank1"], d / "rank1.pt.tmp")  # a hard link: O_TRUNC would write through
    (d / "COMPLETE.tmp").symlink_to(victims["COMPLETE"])
    state = {"strategy": {}, "trainer": {k: 0.0 for k in checkpoint.TRAINER_KEYS}}
    for rank in (0, 1):
        checkpoint.save_rank(run, 4, rank, state)
    checkpoint.mark_complete(run, 4, 2)
    assert all(v.read_text() == "precious\n" for v in victims.values())
    for name in ("rank0.pt", "rank1.pt", "COMPLETE"):
        assert (d / name).is_file() and not (d / name).is_symlink(), name
    assert sorted(p.name for p in d.iterdir()) == ["COMPLETE", "rank0.pt", "rank1.pt"]
    assert checkpoint.require_resumable(run, 2) == 4


def test_an_interrupted_checkpoint_write_leaves_no_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from thinwire import checkpoint

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_rank(tmp_path, 4, 0, {"strategy": {}, "trainer": {}})
    assert list(checkpoint.step_dir(tmp_path, 4).iterdir()) == []


@pytest.mark.parametrize("plant", ["step_abc/", "COMPLETE", "step_00000008", "notes.txt"])
def test_what_a_resume_would_ignore_in_checkpoints_is_reported(tmp_path: Path,
                                                               plant: str) -> None:
    from thinwire import checkpoint

    run = tmp_path / "run"
    checkpoint.save_rank(run, 4, 0, {"strategy": {}, "trainer": {k: 0.0 for k in
                                                                 checkpoint.TRAINER_KEYS}})
    checkpoint.mark_complete(run, 4, 1)
    assert checkpoint.require_resumable(run, 1) == 4
    where = run / "checkpoints" / plant.rstrip("/")
    if plant.endswith("/"):
        where.mkdir()
        (where / "COMPLETE").write_text("1\n")
    else:
        where.write_text("1\n")
    with pytest.raises(checkpoint.CheckpointError) as exc:
        checkpoint.require_resumable(run, 1)
    text = str(exc.value)
    assert "\n" not in text and str(where) in text and "move it out" in text, text


# --- a run whose final write failed is never called complete --------------------------------------
RUN = {"data.name": "digits", "model.hidden": "16", "train.batch_size": 16, "train.steps": 8,
       "train.eval_every": 4, "run.checkpoint_every": 4, "run.progress": False}


def _train(run: Path, **over: object) -> None:
    train_here(run, RUN, **over)


@pytest.mark.parametrize("fails", ["summary.json", "model.pt", "ledger.rank0.json"])
def test_a_failed_final_write_is_redone_by_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  fails: str) -> None:
    import errno
    import json

    import torch

    from thinwire import checkpoint, rundir
    from thinwire.errors import UsageError
    from thinwire.metrics import read_jsonl

    whole, broken = tmp_path / "whole", tmp_path / "broken"
    _train(whole)
    real = rundir.replace_atomically

    def full_disk(path: Path, data: bytes, tmp: Path) -> None:
        if path.name == fails:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp))
        real(path, data, tmp)

    monkeypatch.setattr(rundir, "replace_atomically", full_disk)
    with pytest.raises(UsageError, match="ENOSPC"):
        _train(broken)
    monkeypatch.undo()
    assert not (broken / "summary.json").exists() and not (broken / fails).exists()
    assert checkpoint.final_state_problem(broken, 8).endswith("is missing")
    assert checkpoint.require_resumable(broken, 1, steps=8) == 8  # not "complete"
    _train(broken, **{"run.resume": True})
    assert checkpoint.final_state_problem(broken, 8) == ""
    a, b = (json.loads((d / "summary.json").read_text()) for d in (whole, broken))
    assert a["final"] == b["final"] and a["final_files"] == b["final_files"]
    assert b["final_files"] == ["model.pt", "ledger.rank0.json"]
    ma, mb = (torch.load(d / "model.pt", weights_only=True) for d in (whole, broken))
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    assert read_jsonl(whole / "metrics.jsonl") != [] and [
        r["step"] for r in read_jsonl(broken / "metrics.jsonl") if r["kind"] == "eval"] == [4, 8]
    with pytest.raises(checkpoint.CheckpointError, match="is complete"):
        checkpoint.require_resumable(broken, 1, steps=8)


def _method_names() -> list[str]:
    from thinwire.strategies import METHODS

    return list(METHODS.names())


@pytest.mark.parametrize("name", _method_names())
def test_clip_norm_is_taken_by_every_method(name: str) -> None:
    """Every registered method takes ``train.clip_norm`` (none refuses it any more), and a
    method whose Strategy is not a replica clips in the model-parallel step template, on the
    whole model's norm (held per method against torch's ``clip_grad_norm_`` by
    test_tensor.py, test_pipeline_3d.py, test_hybrid.py and, against one process holding
    every shard, tests/strategies/slide/)."""
    import importlib

    from thinwire import config as config_mod
    from thinwire.strategies import METHODS
    from thinwire.strategies.base import ReplicatedStrategy
    from thinwire.strategies.step import SteppedStrategy

    cfg = config_mod.load(None, {"method.name": name, "runtime.workers": "2",
                                 "train.clip_norm": "1.0"})
    assert cfg.train.clip_norm == 1.0
    module, _, cls = METHODS.get(name).strategy.partition(":")
    strategy = getattr(importlib.import_module(module), cls)
    if name in ("tensor", "pipeline", "hybrid", "slide"):
        assert issubclass(strategy, SteppedStrategy), name
    else:  # the standard step clips the replica's (or the subnet's) whole gradient
        assert issubclass(strategy, ReplicatedStrategy) or name == "ist", name
