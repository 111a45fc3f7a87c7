"""torchft's lighthouse as a process of its own, for a namespace of the testbed.

    python -m thinwire.testbed.lighthouse HOST MIN_WORKERS HEARTBEAT_MS JOIN_TIMEOUT_MS

1. starts :class:`thinwire.runtime.ft.Lighthouse` bound on ``HOST`` (a port it binds itself);
2. prints ``listening http://HOST:PORT`` once it listens (one line, flushed);
3. serves until its standard input closes or it is killed (the testbed kills every process of
   a namespace before deleting it), then shuts the server down.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("usage: python -m thinwire.testbed.lighthouse HOST MIN_WORKERS HEARTBEAT_MS "
              "JOIN_TIMEOUT_MS", file=sys.stderr)
        return 2
    from thinwire.runtime.ft import Lighthouse

    host, min_workers, heartbeat, join = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    with Lighthouse(min_workers, host=host, heartbeat_timeout_ms=heartbeat,
                    join_timeout_ms=join) as lh:
        print(f"listening {lh.address}", flush=True)
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
