"""A real one-worker run inside the test process, for the run-directory tests that need many
finished runs: the launcher's side (:func:`thinwire.run.run_directory`: claim, lock, resume
checks, ``config.toml``) and then the worker entry's own body (:func:`thinwire.worker._run`,
what ``torchrun -m thinwire.worker`` executes; without torchrun's environment it trains on one
process, no process group). Only the process boundary of :func:`thinwire.launch.launch` is left
out (it costs seconds per run; the subprocess tests beside these go through it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from thinwire import config as config_mod
from thinwire import run as run_mod
from thinwire import worker

TINY = {"data.name": "digits", "model.hidden": "8", "train.batch_size": "8",
        "train.steps": "4", "train.eval_every": "0", "runtime.workers": "1",
        "run.progress": "false", "method.name": "dp", "model.norm": "none",
        "runtime.threads": "1"}


def tiny_config(out: Path, name: str = "dp", **extra: Any) -> Any:
    return config_mod.load(None, {**TINY, "run.out": str(out), "run.name": name,
                                  **{k.replace("__", "."): str(v) for k, v in extra.items()}})


def train_inproc(cfg: Any) -> Path:
    """Train ``cfg`` (one worker) through the run directory rules; the final run directory.
    Raises what the command line would report in one line (UsageError)."""
    with run_mod.run_directory(cfg) as rd:
        rc = worker._run(rd.path / "config.toml")
        assert rc == 0
    return rd.final


def train_here(run: Path, base: dict[str, Any], **over: Any) -> None:
    """The trainer alone on one process in ``run`` (created), config ``base`` with ``over``
    (dotted keys): no run-directory rules, for tests of what the trainer writes."""
    import torch

    from thinwire.runtime.comm import Comm
    from thinwire.trainer import Trainer

    run.mkdir(parents=True, exist_ok=True)
    cfg = config_mod.load(None, {**base, "run.out": str(run.parent), "run.name": run.name,
                                 **over})
    Trainer(cfg, Comm.local(), torch.device("cpu"), run).run()
