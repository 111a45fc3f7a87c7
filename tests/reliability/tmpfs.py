"""A tiny tmpfs for real ENOSPC / EROFS tests: mounted when this process may mount (root with
CAP_SYS_ADMIN), unmounted afterwards; the tests skip when it cannot be mounted (their
monkeypatched twins simulate the errno instead)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tiny_tmpfs(where: Path, size: str, *, read_only: bool = False) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the simulated test covers it")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(root: Path) -> None:
    """Fill the file system at ``root`` until the next write fails with ENOSPC."""
    import os

    fd = os.open(root / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
