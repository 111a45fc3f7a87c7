"""Process-group set-up and clean teardown for one worker.

The worker reads the environment torchrun's elastic agent provides (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the same entry runs under
``thinwire train --workers N`` on one machine and under an external multi-node ``torchrun``.
Backend: nccl when the device is CUDA, gloo otherwise. Every collective carries the configured
timeout, so a dead or stuck peer ends the job with an error instead of a hang.
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
        dist.init_process_group(pick_backend(rt, device), timeout=timedelta(seconds=rt.timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return device


def initialised() -> bool:
    """Whether this process is in a process group."""
    return dist.is_available() and dist.is_initialized()


def teardown(comm: Comm) -> None:
    """A control barrier through ``comm``, then destroy the group (callers drop DDP objects
    first: a live DDP can abort a gloo rank at interpreter exit)."""
    gc.collect()
    if dist.is_initialized():
        try:
            comm.barrier()
        finally:
            dist.destroy_process_group()
