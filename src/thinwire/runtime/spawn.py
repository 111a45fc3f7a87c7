"""Run a function on N forked gloo ranks on loopback: the small spawn harness.

``run_group(fn, n, *args)`` forks ``n`` processes (fork: ~1 s, not a fresh interpreter each),
joins them in a gloo process group through a file store in a fresh temporary directory (no
port is chosen for the rendezvous, so none can be taken between choosing and binding it; gloo's
own connections bind port 0 themselves), calls ``fn(comm, *args)`` on every
rank with a :class:`~thinwire.runtime.comm.Comm`, tears the group down (a control barrier, then
``destroy_process_group``) and returns the per-rank results (which must pickle). A rank that
raises ends the call with its traceback; ranks that do not answer within ``timeout`` seconds are
killed and named. Used by the multi-process tests and by the planner's calibration.

``new_session=True`` makes each rank lead its own session, as torch's elastic launcher starts a
run's workers: with Linux's autogroup scheduling the CPU is shared between sessions first, so
ranks left in the caller's session would measure a slower machine than real runs see.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import shutil
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


class RankFailed(RuntimeError):
    """A rank raised, or did not answer in time; the message names it."""


def rendezvous_dir() -> str:
    """A fresh private directory for a file store's rendezvous (``init_method`` =
    ``file://DIR/store``); the caller removes it when the group is done."""
    return tempfile.mkdtemp(prefix="thinwire-rdzv-")


def _entry(fn: Callable[..., Any], rank: int, world: int, store: str, queue: Any,
           args: tuple[Any, ...], collective_timeout: float, threads: int | None,
           new_session: bool) -> None:
    import torch
    import torch.distributed as dist

    from thinwire.runtime.comm import Comm

    # objects inherited from the parent are the parent's: the child's collector never frees
    # them (a destructor would act on the parent's resources, e.g. join a store's daemon
    # thread that only the parent has, and hang)
    gc.freeze()
    if new_session:
        os.setsid()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=collective_timeout))
        comm = Comm()
        result = fn(comm, *args)
        gc.collect()
        comm.barrier()
        dist.destroy_process_group()
        # plain pickle: torch's queue reductions share memory that dies with this process
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()  # flush the result before the hard exit
        os._exit(0)


def run_group(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90,
              collective_timeout: float | None = None, threads: int | None = None,
              new_session: bool = False) -> list[Any]:
    """``fn(comm, *args)`` on ``world_size`` forked gloo ranks; the per-rank results in order."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    where = rendezvous_dir()
    store = os.path.join(where, "store")
    extra = (collective_timeout or timeout / 2, threads, new_session)
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, store, queue, args, *extra))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            try:
                rank, status, value = queue.get(timeout=timeout)
            except queue_mod.Empty:
                missing = sorted(set(range(world_size)) - set(results))
                raise RankFailed(f"ranks {missing} did not finish within {timeout} s") from None
            if status != "ok":
                raise RankFailed(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(where, ignore_errors=True)
    return [results[r] for r in range(world_size)]
