"""DiLoCo (``diloco``): local inner steps, outer Nesterov momentum on the averaged pseudo-gradient.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023),
Algorithm 1. Every worker holds the global parameters theta_g (identical on all ranks) and its
own replica theta_i, starting equal. Each outer round:
  1. H = ``method.period`` inner optimizer steps on the worker's own batches (the inner
     optimizer is ``train.optimizer``; the paper uses AdamW -- set ``train.optimizer = "adamw"``
     to follow it; its state stays local across rounds, as in the paper);
  2. pseudo-gradient delta_i = theta_g - theta_i;
  3. delta = mean_i delta_i: one all-reduce through the ledger, tagged ``average`` (the same
     bytes as local SGD's model average), or, with ``method.compressor`` other than ``none``,
     the compressed exchange of the DDP hooks (with error feedback where configured);
  4. outer step on theta_g with delta as its gradient: ``torch.optim.SGD(lr=method.outer_lr,
     momentum=method.outer_momentum, nesterov=True)`` (paper: lr 0.7, momentum 0.9; Nesterov
     needs momentum > 0, so momentum 0 runs plain SGD);
  5. every worker loads theta_g into its replica.

Local SGD is the special case outer lr 1, momentum 0: theta_g - (theta_g - mean_i theta_i) =
mean_i theta_i, the average local SGD takes, equal up to one rounding per element (tested).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from thinwire.compression import Compressor, average_async, build_codec
from thinwire.strategies.base import Context, MemoryReport, flat_params, load_flat, optimizer_bytes
from thinwire.strategies.data_parallel import codec_args
from thinwire.strategies.local_sgd import LocalSGD


class DiLoCo(LocalSGD):
    name = "diloco"

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        super().__init__(ctx, model)
        m = self.cfg.method
        # theta_g: leaf tensors the outer optimizer steps; .grad is set to delta each round
        self.global_params = [p.detach().clone() for p in self.model.parameters()]
        self.shapes = [tuple(p.shape) for p in self.global_params]
        self.outer_opt = torch.optim.SGD(self.global_params, lr=m.outer_lr,
                                         momentum=m.outer_momentum,
                                         nesterov=m.outer_momentum > 0)
        self.compressor: Compressor | None = None
        if m.compressor != "none":
            name, options = codec_args(m)
            self.compressor = build_codec(name, options, seed=self.cfg.train.seed,
                                          rank=self.comm.rank)

    def synchronize(self, step: int) -> None:
        """Steps 2-5, after the H-th inner step of a round (step 1 is LocalSGD's)."""
        theta_g = torch.cat([p.reshape(-1) for p in self.global_params])
        # 2. pseudo-gradient
        delta = theta_g - flat_params(self.model)
        # 3. its average over workers
        if self.compressor is None:
            self.comm.all_reduce(delta, op="avg", tag="average")
        else:
            fut, _ = average_async(self.comm, self.compressor, delta, step // self.period,
                                   tag="average", shapes=self.shapes)
            delta = fut.wait()
        # 4. outer Nesterov step on theta_g
        at = 0
        for p in self.global_params:
            p.grad = delta[at:at + p.numel()].view_as(p).clone()
            at += p.numel()
        self.outer_opt.step()
        # 5. every worker continues from theta_g
        load_flat(self.model, torch.cat([p.reshape(-1) for p in self.global_params]))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["global"] = [p.detach().clone() for p in self.global_params]
        state["outer_opt"] = self.outer_opt.state_dict()
        if self.compressor is not None:
            state["compressor"] = self.compressor.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            for p, saved in zip(self.global_params, state["global"]):
                p.copy_(saved)
        self.outer_opt.load_state_dict(state["outer_opt"])
        if self.compressor is not None and "compressor" in state:
            self.compressor.load_state_dict(state["compressor"])

    def memory(self) -> MemoryReport:
        """Inner state as local SGD's; theta_g and the outer momentum count as optimizer state."""
        inner = super().memory()
        extra = sum(p.numel() * p.element_size() for p in self.global_params)
        return dataclasses.replace(
            inner, optimizer=inner.optimizer + extra + optimizer_bytes(self.outer_opt))
