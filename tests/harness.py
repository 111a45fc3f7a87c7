"""Multi-process test harness: run a function on N gloo ranks with a free port and a hard timeout.

``run_workers(fn, world_size, *args)`` starts ``world_size`` processes (fork: ~1 s instead of a
fresh interpreter), initialises a gloo process group on a free loopback port, calls
``fn(comm, *args)`` on every rank with a :class:`thinwire.runtime.Comm`, tears the group down
cleanly and returns the per-rank return values (which must be picklable). A rank that raises
fails the test with its traceback; a rank that hangs is killed after ``timeout`` seconds and the
test fails naming it.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, queue: Any,
           args: tuple[Any, ...], timeout: float) -> None:
    import torch
    import torch.distributed as dist

    from thinwire.runtime.comm import Comm

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout))
        result = fn(Comm(), *args)
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        # plain pickle: torch's queue reductions share memory that dies with this process
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()  # flush the result before the hard exit
        os._exit(0)


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90) -> list[Any]:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, queue, args, timeout / 2))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, status, value = queue.get(timeout=timeout)
            except queue_mod.Empty:
                missing = sorted(set(range(world_size)) - set(results))
                raise AssertionError(f"ranks {missing} did not finish within {timeout} s") from None
            if status == "ok":
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
