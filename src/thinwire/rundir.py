"""Run directories: created by thinwire, marked, never anything outside them touched.

(Minimal form; the locking and staging guarantees are completed in this module.)
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

from thinwire.errors import UsageError

MARKER = ".thinwire-run"


def prepare(run_dir: Path, *, resume: bool, overwrite: bool, config_text: str) -> Path:
    if run_dir.exists() and not resume:
        if not overwrite:
            raise UsageError(f"run directory {run_dir} exists; pass --resume to continue it or "
                             "--overwrite to replace it")
        if not (run_dir / MARKER).is_file():
            raise UsageError(f"{run_dir} was not made by thinwire; refusing to replace it")
        shutil.rmtree(run_dir)
    if resume and not run_dir.is_dir():
        raise UsageError(f"--resume: {run_dir} does not exist; start the run without --resume")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / MARKER).write_text("thinwire run directory\n")
    (run_dir / "config.toml").write_text(config_text)
    return run_dir


@contextlib.contextmanager
def claim(run_dir: Path, *, resume: bool, overwrite: bool, config_text: str) -> Iterator[Path]:
    yield prepare(run_dir, resume=resume, overwrite=overwrite, config_text=config_text)
