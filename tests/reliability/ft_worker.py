"""Test-only worker entry of a fault-tolerant run: ``thinwire.worker`` with planned faults.

Run as ``python -m ft_worker RUN/config.toml`` with this folder on PYTHONPATH, by
:func:`thinwire.launch.launch_replicas` (``THINWIRE_FT_WORKER`` is the worker's index):

- ``THINWIRE_TEST_FT_START="I,J,..."``: these workers begin their first round only once each of
  them is heartbeating (its ``RUN/workerK/ready`` exists), so the first quorum holds them all;
- ``THINWIRE_TEST_FT_KILL="I:S"``: worker I SIGKILLs itself inside step S (after its round's
  quorum formed: the round is lost for everyone), leaving ``RUN/workerI/killed``;
- ``THINWIRE_TEST_FT_JOIN="I:S:H"``: worker I starts only once worker 0 began step S
  (``RUN/worker0/reached``), and every other worker holds before step H until worker I is
  heartbeating and worker 0 has seen its quorum request alone in the lighthouse
  (``RUN/joiner_asking``), so worker I joins the quorum of the round starting at H (and no
  worker waits for that quorum while the joiner is still starting, however slow the machine).

At the end each worker saves its wrapper's state (``RUN/workerI/wrapper.pt``: theta_g, the
outer optimizer, the codec's state) for the test to compare.

Every wait is on a file's existence, bounded by 90 s (exit 2 when it runs out)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

LIMIT = 90.0


def wait_for(paths: list[Path]) -> None:
    deadline = time.monotonic() + LIMIT
    for p in paths:
        while not p.exists():
            if time.monotonic() > deadline:
                print(f"ft_worker: {p} never appeared", file=sys.stderr)
                os._exit(2)
            time.sleep(0.02)


def joiner_asking() -> None:
    """Wait until the lighthouse holds exactly one quorum request, the joiner's (every other
    worker holds), read off its own status page: torchft's fast quorum would otherwise form
    without a request that comes late."""
    from thinwire.runtime.ft import lighthouse_status

    deadline = time.monotonic() + LIMIT
    while time.monotonic() < deadline:
        if "only have 1 participants" in lighthouse_status(os.environ["THINWIRE_FT_LIGHTHOUSE"]):
            return
        time.sleep(0.05)
    print("ft_worker: the joiner's quorum request never reached the lighthouse", file=sys.stderr)
    os._exit(2)


def _pair(name: str) -> list[int]:
    return [int(x) for x in os.environ.get(name, "").replace(",", ":").split(":") if x]


def install(run: Path, me: int) -> None:
    import thinwire.ft_trainer as mod

    start = _pair("THINWIRE_TEST_FT_START")
    kill = _pair("THINWIRE_TEST_FT_KILL")
    join = _pair("THINWIRE_TEST_FT_JOIN")
    base = mod.FaultTolerantTrainer

    class Faulty(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            (run / f"worker{me}" / "ready").touch()  # heartbeating since the replica was built
            if me in start:
                wait_for([run / f"worker{k}" / "ready" for k in start])
            inner = self.strategy.train_step

            def train_step(batch: Any, s: int) -> Any:
                if kill and (me, s) == (kill[0], kill[1]):
                    (run / f"worker{me}" / "killed").touch()
                    os.kill(os.getpid(), signal.SIGKILL)
                if join and me == 0 and s == join[1]:
                    (run / "worker0" / "reached").touch()
                return inner(batch, s)

            self.strategy.train_step = train_step  # type: ignore[method-assign]

        def run(self) -> Any:
            out = super().run()
            import torch

            torch.save(self.strategy.quorum.state_dict(), run / f"worker{me}" / "wrapper.pt")
            return out

        def _next_step(self, step: int) -> int:
            if join and me != join[0] and step == join[2]:
                wait_for([run / f"worker{join[0]}" / "ready"])
                if me == 0:  # the joiner's request alone in the lighthouse, then the others'
                    joiner_asking()
                    (run / "joiner_asking").touch()
                wait_for([run / "joiner_asking"])
            return int(super()._next_step(step))

    mod.FaultTolerantTrainer = Faulty  # type: ignore[misc]


def main() -> int:
    from thinwire.worker import die_with_parent

    die_with_parent()  # a joiner held back still ends with the launcher
    run = Path(sys.argv[1]).parent
    me = int(os.environ["THINWIRE_FT_WORKER"])
    join = _pair("THINWIRE_TEST_FT_JOIN")
    if join and me == join[0]:
        wait_for([run / "worker0" / "reached"])
    install(run, me)
    from thinwire.worker import main as worker_main

    return worker_main()


if __name__ == "__main__":
    from thinwire.worker import exit_now

    exit_now(main())
