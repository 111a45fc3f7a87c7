"""Metrics loggers (thinwire.loggers): JSONL always, TensorBoard event files on request, both
rewound on resume; bad ``run.loggers`` values are one-line config errors."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from thinwire import checkpoint
from thinwire.config import load
from thinwire.loggers import parse_loggers
from thinwire.metrics import read_jsonl
from thinwire.options import OptionError
from thinwire.runtime.comm import Comm
from thinwire.trainer import Trainer

RUN = {"data.name": "digits", "model.hidden": "16", "train.batch_size": 16, "train.steps": 8,
       "train.log_every": 2, "train.eval_every": 4, "run.checkpoint_every": 4,
       "run.progress": False, "run.loggers": "jsonl,tensorboard"}


def _train(tmp: Path, **over: object) -> Path:
    run = tmp / "run"
    run.mkdir(parents=True, exist_ok=True)
    cfg = load(None, {**RUN, "run.out": str(tmp), **over})
    Trainer(cfg, Comm.local(), torch.device("cpu"), run).run()
    return run


def _scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _from_jsonl(run: Path, kind: str, key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == kind]


def _close(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    """Same steps, values equal to float32 (TensorBoard stores scalars as float32)."""
    return [s for s, _ in a] == [s for s, _ in b] and all(
        math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-30) for (_, x), (_, y) in zip(a, b))


def test_tensorboard_holds_every_numeric_field_of_the_jsonl_records(tmp_path: Path) -> None:
    run = _train(tmp_path)
    tb = _scalars(run)
    for kind, key in [("train", "loss"), ("train", "lr"), ("train", "sent_bytes"),
                      ("eval", "accuracy"), ("eval", "nll")]:
        want = _from_jsonl(run, kind, key)
        assert want and _close(tb[f"{kind}/{key}"], want), (kind, key, tb.get(f"{kind}/{key}"))
    assert [s for s, _ in tb["train/loss"]] == [2, 4, 6, 8]
    assert "eval/metric" not in tb  # strings are not scalars


def test_a_resumed_run_rewinds_tensorboard_as_it_rewinds_the_jsonl(tmp_path: Path) -> None:
    """A run to step 8 whose events after its step-4 checkpoint are then redone by a resume:
    TensorBoard (purge_step) and metrics.jsonl show each step once, with the resumed values,
    which equal an uninterrupted run's."""
    full = _train(tmp_path / "full")
    cut = _train(tmp_path / "cut")
    # a crash before the step-8 checkpoint was sealed: drop it, and resume from step 4
    shutil.rmtree(checkpoint.step_dir(cut, 8))
    assert checkpoint.latest_step(cut) == 4
    _train(tmp_path / "cut", **{"run.resume": True})
    a, b = _scalars(full), _scalars(cut)
    assert a.keys() == b.keys()
    for tag in ("train/loss", "eval/accuracy"):
        assert [s for s, _ in b[tag]] == [s for s, _ in a[tag]], tag
        assert _close(a[tag], b[tag]), tag
    assert _from_jsonl(cut, "train", "loss") == _from_jsonl(full, "train", "loss")


@pytest.mark.parametrize("text,message", [
    ("tensorboard", "jsonl is the run's own record"),
    ("jsonl,wandb", "unknown logger 'wandb'; known: jsonl, tensorboard"),
])
def test_bad_loggers_are_one_line_config_errors(text: str, message: str) -> None:
    with pytest.raises(OptionError, match=message) as e:
        load(None, {"run.loggers": text})
    assert "\n" not in str(e.value) and str(e.value).startswith("run.loggers: ")
    assert parse_loggers("jsonl, tensorboard,jsonl") == ("jsonl", "tensorboard")


def test_tensorboard_on_a_full_disk_is_one_line_naming_the_event_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """The writer thread meets ENOSPC first: it ends quietly (no "Exception in thread"), and
    the next write is a one-line error naming the event file, not the folder."""
    import errno

    from tensorboard.summary.writer import record_writer

    from thinwire.errors import UsageError
    from thinwire.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path)

    def full(self: object, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    with pytest.raises(UsageError) as exc:
        for step in range(20):
            logger.write({"kind": "train", "step": step, "loss": 1.0})
    text = str(exc.value)
    assert "\n" not in text and "ENOSPC" in text and "events.out.tfevents." in text, text
    assert str(tmp_path / "tensorboard") in text, text
    with pytest.raises(UsageError):
        logger.close()
    err = capfd.readouterr().err
    assert "Exception in thread" not in err and "Traceback" not in err, err
