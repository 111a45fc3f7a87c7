"""Data parallelism (``dp``): DistributedDataParallel with its traffic through the ledger.

Every step: 1. forward and backward on the worker's batch; 2. DDP buckets the gradients and
calls our communication hook, which averages each bucket with one all-reduce through
:class:`~thinwire.runtime.comm.Comm` (or, with ``method.compressor``, encodes it, exchanges the
encoding with the collective that fits it and decodes); 3. the optimizer steps on the averaged
gradient, so every replica stays identical.

Parity: with the same global batch, n workers x batch b match one worker x batch n b up to
floating-point summation order (when the model has no batch-statistics layers).
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from thinwire.runtime.comm import Comm
from thinwire.strategies.base import Context, ReplicatedStrategy


def allreduce_hook(comm: Comm) -> Any:
    """The plain DDP hook: average a bucket with one all-reduce through the ledger."""

    def hook(_state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
        buf = bucket.buffer()
        buf.div_(comm.world_size)
        return comm.all_reduce_async(buf, tag="grad")

    return hook


def codec_args(m: Any) -> tuple[str, dict[str, Any]]:
    """The method config's codec name and the options that codec declares."""
    from thinwire.compression import CODECS

    known = {f.name for f in dataclasses.fields(CODECS.get(m.compressor).options)}
    values = {"ratio": m.ratio, "levels": m.levels, "rank": m.rank, "ef": m.error_feedback}
    return m.compressor, {k: v for k, v in values.items() if k in known}


class DataParallel(ReplicatedStrategy):
    name = "dp"

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        super().__init__(ctx, model)
        self.ddp: nn.Module
        if self.comm.distributed:
            self.ddp = DDP(self.model, device_ids=None if ctx.device.type == "cpu" else [ctx.device])
            state, hook = self._hook()
            self.ddp.register_comm_hook(state, hook)
        else:
            self.ddp = self.model

    def _hook(self) -> tuple[Any, Any]:
        if self.cfg.method.compressor == "none":
            return None, allreduce_hook(self.comm)
        from thinwire.compression import ddp_hook

        name, options = codec_args(self.cfg.method)
        return ddp_hook(name, comm=self.comm, seed=self.cfg.train.seed, **options)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> float:
        return self.local_step(self.ddp, x, y, step)

    def close(self) -> None:
        # DDP can abort a gloo rank at interpreter exit; drop it before the group goes.
        del self.ddp
        del self.opt
        gc.collect()
