"""The Strategy interface: how a method trains, communicates, and reports what each worker holds.

A strategy receives the full model (built identically on every rank from the run's seed), a
:class:`Context` (config, device, communication layer) and, each step, the worker's own batch.
The trainer knows nothing else about it: it calls ``train_step`` for every step, asks for
``eval_model`` at evaluation points (which the config aligns with the strategy's synchronisation
points), and saves ``state_dict`` in checkpoints.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from thinwire.config import Config, TrainConfig
from thinwire.runtime.comm import Comm


@dataclass(frozen=True)
class Context:
    cfg: Config
    comm: Comm
    device: torch.device


@dataclass(frozen=True)
class MemoryReport:
    """Bytes a worker holds for training state (activations excluded).

    ``param_count``: parameters the worker trains (with gradients and optimizer state);
    ``stored_count``: parameters it keeps without training them (IST's model storage).
    """

    params: int
    grads: int
    optimizer: int
    param_count: int
    stored_count: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def lr_at(train: TrainConfig, step: int) -> float:
    """The learning rate of ``step`` under the configured schedule."""
    if train.schedule == "cosine":
        return 0.5 * train.lr * (1 + math.cos(math.pi * min(step, train.steps) / train.steps))
    return train.lr


def make_optimizer(params: Iterable[torch.nn.Parameter], train: TrainConfig) -> torch.optim.Optimizer:
    params = list(params)
    if train.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)
    return torch.optim.SGD(params, lr=train.lr, momentum=train.momentum,
                           weight_decay=train.weight_decay)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                total += v.numel() * v.element_size()
    return total


def memory_of(params: Iterable[torch.Tensor], opt: torch.optim.Optimizer | None) -> MemoryReport:
    ps = list(params)
    p_bytes = sum(p.numel() * p.element_size() for p in ps)
    return MemoryReport(params=p_bytes, grads=p_bytes, optimizer=optimizer_bytes(opt) if opt else 0,
                        param_count=sum(p.numel() for p in ps))


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def load_flat(model: nn.Module, flat: torch.Tensor) -> None:
    i = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(flat[i:i + n].view_as(p))
            i += n


class Strategy(ABC):
    """One method of distributed training. One file per method implements it."""

    name: ClassVar[str]

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.comm = ctx.comm
        self.loss_fn = nn.CrossEntropyLoss()
        self._full_params = sum(p.numel() for p in model.parameters())

    @abstractmethod
    def train_step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> float:
        """One local optimizer step on this worker's batch (and whatever communication the method
        does at this step); returns the training loss of the batch."""

    @abstractmethod
    def eval_model(self) -> nn.Module | None:
        """The full model at a synchronisation point, on ranks that hold it; None elsewhere."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything this rank needs to resume (weights_only-loadable tensors and numbers)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    @abstractmethod
    def memory(self) -> MemoryReport:
        """Parameters, gradients and optimizer state this worker holds while training."""

    def full_param_count(self) -> int:
        """Parameters of the full model."""
        return self._full_params

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release process-group-bound objects before the group is destroyed."""


class ReplicatedStrategy(Strategy):
    """A strategy where every worker trains the whole model (dp, localsgd, diloco).

    Holds the model and its local optimizer; rank 0's copy is the one evaluated, which callers
    only ask for at synchronisation points, where every replica is the same.
    """

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        super().__init__(ctx, model)
        self.model = model.to(ctx.device)
        self.opt = make_optimizer(self.model.parameters(), self.cfg.train)

    def local_step(self, forward: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int) -> float:
        """One optimizer step of ``forward`` (the model or a wrapper of it) on (x, y)."""
        set_lr(self.opt, lr_at(self.cfg.train, step))
        forward.train()
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(forward(x), y)
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def eval_model(self) -> nn.Module | None:
        return self.model if self.comm.rank == 0 else None

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])

    def memory(self) -> MemoryReport:
        return memory_of(self.model.parameters(), self.opt)
