"""Metrics loggers: where the trainer's records go.

The trainer hands each record (the two kinds of :mod:`thinwire.metrics`: ``train`` every
``train.log_every`` steps, ``eval`` at evaluation points) to :class:`Loggers`, which passes it to
every logger named by ``run.loggers`` (a comma list of :data:`LOGGERS` names, default
``jsonl``):

- ``jsonl``: ``metrics.jsonl`` in the run directory, always on: it is the run's own record,
  which ``thinwire report``, ``compare``'s plots and ``--resume`` read;
- ``tensorboard``: TensorBoard event files in ``RUN_DIR/tensorboard`` (``tensorboard --logdir
  RUN_DIR``), through ``torch.utils.tensorboard``; the optional extra
  ``pip install 'thinwire[tensorboard]'``. Every numeric field of a record is a scalar tagged
  ``kind/field`` (``train/loss``, ``eval/accuracy``, ``train/sent_bytes``) at the record's step.

A logger is a class with ``__init__(run_dir, *, resume_step)``, ``write(record)`` and
``close()`` (:class:`Logger`); another is one more line in :data:`LOGGERS`. On resume
(``resume_step`` not None) a logger drops what it holds after that step: the JSONL file is cut
there, TensorBoard is told to purge the later events (``purge_step``), so a resumed run's
records are the uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from thinwire.metrics import JsonlWriter
from thinwire.options import OptionError, Registry


class Logger(ABC):
    """Receives the trainer's metric records (module docstring)."""

    @abstractmethod
    def __init__(self, run_dir: Path, *, resume_step: int | None = None) -> None: ...

    @abstractmethod
    def write(self, record: dict[str, Any]) -> None:
        """One record: ``kind`` (train or eval), ``step`` and the record's fields."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release what the logger holds."""

    @classmethod
    def missing(cls) -> str | None:
        """What must be installed for this logger (None: nothing)."""
        return None


class JsonlLogger(Logger):
    """``metrics.jsonl``: one JSON object a line (the run directory's record)."""

    def __init__(self, run_dir: Path, *, resume_step: int | None = None) -> None:
        self._writer = JsonlWriter(run_dir / "metrics.jsonl", resume_step=resume_step)

    def write(self, record: dict[str, Any]) -> None:
        self._writer.write(record)

    def close(self) -> None:
        self._writer.close()


class TensorBoardLogger(Logger):
    """TensorBoard event files in ``RUN_DIR/tensorboard``, one scalar per numeric field.

    A failed write (ENOSPC...) is a one-line UsageError naming the event file; TensorBoard's
    writer thread, which meets the error first, ends without printing it."""

    def __init__(self, run_dir: Path, *, resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        _quiet_writer_threads()
        self._file: Path | str = run_dir / "tensorboard"
        with self._named():
            # purge_step: TensorBoard discards the events at and after it that an earlier
            # attempt wrote; records at exactly resume_step were written before the checkpoint
            self._writer = SummaryWriter(log_dir=str(self._file), purge_step=None
                                         if resume_step is None else resume_step + 1)
            self._file = self._writer._get_file_writer().event_writer._file_name

    @contextlib.contextmanager
    def _named(self) -> Iterator[None]:
        """An OSError of the event file's writer as a one-line UsageError naming the file."""
        from thinwire.errors import UsageError
        from thinwire.rundir import describe_os_error

        try:
            yield
        except OSError as exc:
            raise UsageError("tensorboard: " + describe_os_error(exc, self._file)) from None

    def write(self, record: dict[str, Any]) -> None:
        kind, step = record.get("kind", "train"), int(record["step"])
        with self._named():
            for key, value in record.items():
                if key in ("kind", "step") or isinstance(value, bool):
                    continue
                if isinstance(value, (int, float)):
                    self._writer.add_scalar(f"{kind}/{key}", float(value), global_step=step)
            self._writer.flush()

    def close(self) -> None:
        with self._named():
            self._writer.close()

    @classmethod
    def missing(cls) -> str | None:
        if importlib.util.find_spec("tensorboard") is None:
            return "the tensorboard package (pip install 'thinwire[tensorboard]')"
        return None


def _quiet_writer_threads() -> None:
    """Install, once, a thread excepthook that drops the OSError ending TensorBoard's writer
    thread (the foreground call that follows raises the same error, named); every other
    thread's exception goes to the hook that was there."""
    previous = threading.excepthook
    if getattr(previous, "thinwire_quiet", False):
        return

    def hook(args: Any) -> None:
        if not (isinstance(args.exc_value, OSError)
                and type(args.thread).__name__ == "_AsyncWriterThread"):
            previous(args)

    hook.thinwire_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


LOGGERS: Registry[type[Logger]] = Registry("logger", {
    "jsonl": "thinwire.loggers:JsonlLogger",
    "tensorboard": "thinwire.loggers:TensorBoardLogger",
})
"""Every metrics logger by name (``run.loggers``)."""

REQUIRED = "jsonl"
"""The logger every run has: the run directory's record."""


def parse_loggers(text: str) -> tuple[str, ...]:
    """``run.loggers``'s names, checked: known, installed, and including ``jsonl`` (a one-line
    :class:`~thinwire.options.OptionError` naming the fix otherwise)."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    for name in names:
        if name not in LOGGERS:
            raise OptionError(f"run.loggers: unknown logger {name!r}; known: "
                             f"{', '.join(LOGGERS.names())}")
        need = LOGGERS.get(name).missing()
        if need is not None:
            raise OptionError(f"run.loggers: {name} needs {need}")
    if REQUIRED not in names:
        raise OptionError(f"run.loggers: {REQUIRED} is the run's own record (report, compare and "
                         f"--resume read metrics.jsonl); use {','.join((REQUIRED, *names))}")
    return names


class Loggers:
    """The loggers of one run, opened in ``run_dir``: each record goes to all of them."""

    def __init__(self, names: Sequence[str], run_dir: Path, *,
                 resume_step: int | None = None) -> None:
        self.loggers = [LOGGERS.get(n)(run_dir, resume_step=resume_step) for n in names]

    def write(self, record: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.write(record)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
