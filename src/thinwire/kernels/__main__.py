"""``python -m thinwire.kernels``: build the compiled kernels into the cache now (``make`` runs
it), or say in one line why the pure-torch path will run."""

from __future__ import annotations

import subprocess
import sys

from thinwire.kernels import build


def main() -> int:
    try:
        build(verbose=True)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        print(f"thinwire: compiled CPU kernels unavailable ({e}); the pure-torch path will run",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
