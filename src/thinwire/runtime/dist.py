"""Process-group set-up and clean teardown for one worker.

The worker reads the environment torchrun's elastic agent provides (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the same entry runs under
``thinwire train --workers N`` on one machine and under an external multi-node ``torchrun``.
Backend: nccl when the device is CUDA, gloo otherwise (``runtime.backend gloo`` on CUDA runs
gloo with CUDA tensors: several ranks on one device). nccl carries no CPU tensor, and the group
is not given a second backend for them: the device rule of :mod:`thinwire.runtime.comm` (every
tensor of every call on the run's device) holds on every backend, so a run that passes on CPU
hands nccl only CUDA tensors. Every collective carries the configured timeout, so a dead or
stuck peer ends the job with an error instead of a hang.

Under thinwire's own launcher the workers reach the launcher's store (torch's "agent store",
``TORCHELASTIC_USE_AGENT_STORE``). That store lives as long as the launcher, across elastic
restarts of the worker group, and torch (2.13) adds no per-restart prefix to the keys, so a
restarted group would read the previous group's addresses and fail to connect. Here each
restart gets its own key space (:func:`attempt_store`); tested by
``tests/reliability/test_elastic_restart.py``. Under an external torchrun the environment is used
as torch documents it (agents on several nodes need not agree on a restart count).
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from thinwire.config import RuntimeConfig
from thinwire.errors import UsageError
from thinwire.runtime.comm import Comm


def pick_device(rt: RuntimeConfig, local_rank: int) -> torch.device:
    if rt.device == "cuda" or (rt.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UsageError("runtime.device: cuda requested but no CUDA device is visible; "
                             "use --runtime.device cpu")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def pick_backend(rt: RuntimeConfig, device: torch.device) -> str:
    if rt.backend != "auto":
        if rt.backend == "nccl" and device.type != "cuda":
            raise UsageError("runtime.backend: nccl needs CUDA devices; use gloo on CPU")
        return rt.backend
    return "nccl" if device.type == "cuda" else "gloo"


def init_from_env(rt: RuntimeConfig) -> torch.device:
    """Initialise the default process group from torchrun's environment; returns the device."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = rt.threads or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    device = pick_device(rt, local_rank)
    if "RANK" in os.environ and not dist.is_initialized():
        timeout = timedelta(seconds=rt.timeout_s)
        backend = pick_backend(rt, device)
        device_id = device if backend == "nccl" else None  # binds nccl's communicator eagerly
        store = attempt_store(timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        else:
            dist.init_process_group(backend, store=store,
                                    rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout,
                                    device_id=device_id)
    return device


def initialised() -> bool:
    """Whether this process is in a process group."""
    return dist.is_available() and dist.is_initialized()


def attempt_store(timeout: timedelta) -> dist.Store | None:
    """A client of the launcher's store, prefixed by the restart count, when this worker was
    started by :func:`thinwire.launch.launch` (``THINWIRE_LAUNCHER_PID``) and told to use the
    agent's store; None otherwise (``init_process_group`` reads the environment itself)."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or not os.environ.get("THINWIRE_LAUNCHER_PID")):
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return dist.PrefixStore(f"/thinwire/{run_id}/attempt_{attempt}", client)


def teardown(comm: Comm) -> None:
    """A control barrier through ``comm``, then destroy the group (callers drop DDP objects
    first: a live DDP can abort a gloo rank at interpreter exit)."""
    gc.collect()
    if dist.is_initialized():
        try:
            comm.barrier()
        finally:
            dist.destroy_process_group()
