"""Test-only worker entry: ``thinwire.worker`` that SIGKILLs itself at planned steps.

``THINWIRE_TEST_KILLS="attempt:rank:step,..."``: in restart attempt ``attempt``
(``TORCHELASTIC_RESTART_COUNT``), the worker of global rank ``rank`` kills itself with SIGKILL
just before training step ``step`` (as the OOM killer would), leaving the file
``RUN/killed.attemptA.rankR.stepS`` behind as evidence. Run as ``python -m faulty_worker``
with this folder on PYTHONPATH."""

from __future__ import annotations

import os
import signal
from typing import Any


def planned_step() -> int | None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    for item in filter(None, os.environ.get("THINWIRE_TEST_KILLS", "").split(",")):
        a, r, s = (int(x) for x in item.split(":"))
        if (a, r) == (attempt, rank):
            return s
    return None


def install(step: int) -> None:
    import thinwire.trainer as trainer_mod

    base = trainer_mod.Trainer

    class Faulty(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            inner = self.strategy.train_step
            note = self.run_dir / (f"killed.attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT')}"
                                   f".rank{os.environ.get('RANK')}.step{step}")

            def train_step(batch: Any, s: int) -> Any:
                if s == step:
                    note.touch()
                    os.kill(os.getpid(), signal.SIGKILL)
                return inner(batch, s)

            self.strategy.train_step = train_step  # type: ignore[method-assign]

    trainer_mod.Trainer = Faulty  # type: ignore[misc]


def main() -> int:
    step = planned_step()
    if step is not None:
        install(step)
    from thinwire.worker import main as worker_main

    return worker_main()


if __name__ == "__main__":
    raise SystemExit(main())
