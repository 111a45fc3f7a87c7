"""Shared pieces of ``thinwire train`` and ``thinwire compare``: config resolution, pre-flight
checks (so bad data fails in one line before any worker starts) and running one config."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from thinwire import config as config_mod
from thinwire.config import Config
from thinwire.errors import UsageError

SHORTCUTS = {"workers": "runtime.workers", "steps": "train.steps", "out": "run.out"}


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML config file (sections as below)")
    parser.add_argument("--workers", type=int, metavar="N", help="shortcut for --runtime.workers")
    parser.add_argument("--steps", type=int, metavar="N", help="shortcut for --train.steps")
    parser.add_argument("--out", metavar="DIR", help="shortcut for --run.out")
    parser.add_argument("--resume", action="store_true", help="shortcut for --run.resume true")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for short, dotted in SHORTCUTS.items():
        if getattr(args, short, None) is not None:
            out[dotted] = getattr(args, short)
    if getattr(args, "resume", False):
        out["run.resume"] = True
    if getattr(args, "no_progress", False):
        out["run.progress"] = False
    out.update(config_mod.overrides_from_args(args))
    return out


def preflight(cfg: Config) -> None:
    """Load the data once here and check every shard holds a batch: one-line errors, exit 2."""
    from thinwire.trainer import load_data, make_stream

    if cfg.data.dir and not Path(cfg.data.dir).is_dir():
        raise UsageError(f"data.dir: {cfg.data.dir} is not a directory; pass the folder holding "
                         "the dataset files, or leave it empty for the standard places")
    ds = load_data(cfg)
    for rank in range(cfg.runtime.workers):
        try:
            make_stream(cfg, ds, rank, cfg.runtime.workers)
        except ValueError as exc:
            raise UsageError(f"data: worker {rank}: {exc}") from None


def prepare_run_dir(cfg: Config) -> Path:
    run_dir = cfg.run_dir
    if run_dir.exists() and not cfg.run.resume:
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(config_mod.dumps(cfg))
    return run_dir


def run_config(cfg: Config) -> dict[str, Any]:
    """Train one config on its local workers; returns the run's summary."""
    from thinwire.launch import WorkerFailed, launch

    preflight(cfg)
    run_dir = prepare_run_dir(cfg)
    try:
        launch(run_dir, cfg.runtime.workers)
    except WorkerFailed as exc:
        raise SystemExit(f"thinwire: {cfg.run_name}: {exc}") from None
    return json.loads((run_dir / "summary.json").read_text())  # type: ignore[no-any-return]
