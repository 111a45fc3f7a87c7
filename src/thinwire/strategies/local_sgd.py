"""Local SGD (``localsgd``): independent local steps, parameters averaged every H steps.

Stich, "Local SGD Converges Fast and Communicates Little" (ICLR 2019); Lin et al., "Don't Use
Large Mini-Batches, Use Local SGD" (ICLR 2020). Every step: 1. a local optimizer step on the
worker's own batch; 2. after every H-th step, all parameters are flattened into one buffer and
averaged with a single all-reduce, and written back. Optimizer state stays local (it is not
averaged), as in torch's PeriodicModelAverager. With H = 1 and plain SGD this is data
parallelism up to the order of averaging.

:meth:`synchronize` is the hook subclasses (DiLoCo) override to change what happens at step 2.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from thinwire.strategies.base import (
    Context,
    MemoryReport,
    Strategy,
    flat_params,
    load_flat,
    lr_at,
    make_optimizer,
    memory_of,
    set_lr,
)


class LocalSGD(Strategy):
    name = "localsgd"

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        super().__init__(ctx, model)
        self.model = model.to(ctx.device)
        self.period = self.cfg.method.period
        self.opt = make_optimizer(self.model.parameters(), self.cfg.train)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> float:
        set_lr(self.opt, lr_at(self.cfg.train, step))
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.opt.step()
        if (step + 1) % self.period == 0:
            self.synchronize(step)
        return float(loss.detach())

    def synchronize(self, step: int) -> None:
        """Step 2: average all parameters with one all-reduce."""
        flat = flat_params(self.model)
        self.comm.all_reduce(flat, op="avg", tag="average")
        load_flat(self.model, flat)

    def eval_model(self) -> nn.Module | None:
        return self.model if self.comm.rank == 0 else None

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])

    def memory(self) -> MemoryReport:
        return memory_of(self.model.parameters(), self.opt)
