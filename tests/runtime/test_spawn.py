"""The spawn harness (runtime/spawn.py): a forked rank never frees what it inherited."""

from __future__ import annotations

import gc
from typing import Any

from harness import run_workers

from thinwire.runtime.comm import Comm


def _collect(comm: Comm) -> int:
    gc.collect()  # would run the inherited store's destructor, which joins a thread it lacks
    return comm.rank


def test_a_rank_does_not_collect_the_parents_garbage() -> None:
    """A store the parent still holds in a reference cycle (as a refused torchft replica leaves
    one until the parent's collector runs) owns a daemon thread the forked child does not have;
    freeing it in the child would hang the rank."""
    from torch.distributed import TCPStore

    gc.disable()  # the parent's own collector must not free it before the fork
    try:
        cycle: list[Any] = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)]
        cycle.append(cycle)
        del cycle  # garbage now, left for a collector
        assert run_workers(_collect, 2, timeout=30) == [0, 1]
    finally:
        gc.enable()
        gc.collect()  # the parent frees it, with its thread
