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

import torch
from torch import nn

from thinwire.strategies.base import Context, ReplicatedStrategy, flat_params, load_flat


class LocalSGD(ReplicatedStrategy):
    name = "localsgd"

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        super().__init__(ctx, model)
        self.period = self.cfg.method.period

    def train_step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> float:
        loss = self.local_step(self.model, x, y, step)
        if (step + 1) % self.period == 0:
            self.synchronize(step)
        return loss

    def synchronize(self, step: int) -> None:
        """Step 2: average all parameters with one all-reduce."""
        flat = flat_params(self.model)
        self.comm.all_reduce(flat, op="avg", tag="average")
        load_flat(self.model, flat)
