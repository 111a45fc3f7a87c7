"""Make Fashion-MNIST available on this machine: ``python -m thinwire.data.setup``.

Steps:
  1. look for the four idx files in the loader's search order; if found, print one line and stop;
  2. as root with apt-get on the PATH, ``apt-get install -y dataset-fashion-mnist`` (running
     ``apt-get update`` and retrying only if the first install fails), then look again;
  3. with ``--download``, fetch the files from the canonical host into the user cache;
  4. otherwise print one line naming what is missing and how to get it.

Always exits 0 when the data stays missing: the tests use ``digits`` and ``teacher`` and skip the
Fashion-MNIST ones with a reason, so a machine without the data can still build and test.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

from thinwire.data.datasets import (
    FASHION_MNIST_FIX,
    download_fashion_mnist,
    find_fashion_mnist,
)
from thinwire.errors import UsageError

APT_PACKAGE = "dataset-fashion-mnist"


def _can_apt() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get") is not None


def _apt_install() -> str | None:
    """Install the Debian package quietly; None on success, else the tail of apt's output."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", APT_PACKAGE]
    result = subprocess.run(install, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, check=False)
        result = subprocess.run(install, capture_output=True, text=True, env=env, check=False)
    if result.returncode == 0:
        return None
    lines = (result.stderr or result.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit code {result.returncode}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run steps 1-4; returns the exit code (0)."""
    parser = argparse.ArgumentParser(prog="python -m thinwire.data.setup", description=__doc__)
    parser.add_argument("--data-dir", default=None, help="a directory to search first")
    parser.add_argument(
        "--download", action="store_true", help="fetch from the canonical host when missing"
    )
    args = parser.parse_args(argv)

    found = find_fashion_mnist(args.data_dir)
    if found is not None:
        print(f"Fashion-MNIST: found in {found}")
        return 0

    notes = []
    if _can_apt():
        error = _apt_install()
        found = find_fashion_mnist(args.data_dir)
        if found is not None:
            print(f"Fashion-MNIST: installed {APT_PACKAGE}, files in {found}")
            return 0
        notes.append(
            f"apt-get install {APT_PACKAGE} failed: {error or 'files not found after install'}"
        )
    if args.download:
        try:
            found = download_fashion_mnist()
            print(f"Fashion-MNIST: downloaded into {found}")
            return 0
        except UsageError as exc:
            notes.append(f"download failed: {exc.__cause__ or exc}")
    detail = f" ({'; '.join(notes)})" if notes else ""
    print(
        f"Fashion-MNIST: not found{detail}; tests that need it are skipped. "
        f"To get it: {FASHION_MNIST_FIX}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
