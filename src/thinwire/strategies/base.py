"""The Strategy interface: how a method trains, communicates, and reports what each worker holds.

A strategy receives the full model (built identically on every rank from the run's seed) and a
:class:`Context` (config, device, communication layer and mesh, the task's loss); the trainer
calls ``train_step`` for every step, asks ``eval_model`` at evaluation points (the config aligns
them with the method's synchronisation points), saves ``state_dict`` in checkpoints and reads
``memory``. It states its topology: which data shard a rank reads (:meth:`Strategy.data_shard`:
ranks of a pipeline or tensor group share one), which rank's loss is logged (``loss_rank``) and
which rank evaluates (the one whose ``eval_model`` is not None).

Most methods wrap the model and optimizer with the public objects a user would use in their own
loop (DDP with a ledger hook, :class:`~thinwire.strategies.averaging.LocalSGD`,
:class:`~thinwire.strategies.ist.core.IST`) and run :meth:`Strategy.standard_step`: the schedule's
learning rate, forward, the task's loss, backward, optional clipping, the optimizer step.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from thinwire.runtime.comm import Comm
from thinwire.strategies.memory import ActivationMeter, apply_recompute, state_bytes

if TYPE_CHECKING:
    from thinwire.config import Config, TrainConfig
    from thinwire.runtime.mesh import Mesh

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Context:
    cfg: Config
    comm: Comm
    device: torch.device
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    mesh: Mesh | None = None
    replica: Any = None
    """A :class:`~thinwire.runtime.ft.Replica` when the run keeps training over a torchft quorum
    (``runtime.fault_tolerance``); ``comm`` is then its :class:`~thinwire.runtime.ft.ManagedComm`."""

    @property
    def options(self) -> Any:
        """The method's own options."""
        return self.cfg.method.options


@dataclass(frozen=True)
class MemoryReport:
    """Bytes a worker holds (:mod:`thinwire.strategies.memory` says how each is measured).

    ``params``, ``grads``, ``optimizer``: training state at rest (local shards under ZeRO);
    ``param_count``: parameters the worker trains (with gradients and optimizer state);
    ``stored_count``: parameters it keeps without training them (IST's model storage);
    ``activations``: bytes kept for backward at the end of the largest forward pass;
    ``gathered``: parameter bytes a sharded model holds gathered at that point;
    ``host``: bytes of the above kept in host memory while training on another device.
    """

    params: int
    grads: int
    optimizer: int
    param_count: int
    stored_count: int = 0
    activations: int = 0
    gathered: int = 0
    host: int = 0

    @property
    def total(self) -> int:
        """Training state at rest."""
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        """State + activations + gathered parameters when the backward pass starts."""
        return self.total + self.activations + self.gathered


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
    """Bytes of the optimizer's state tensors (local shards; scalar step counts excluded)."""
    from thinwire.strategies.memory import distinct_bytes

    return distinct_bytes(v for state in opt.state.values() for v in state.values()
                          if isinstance(v, torch.Tensor) and v.dim() > 0)


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
    """One method of distributed training as the trainer runs it; one module per method."""

    name: ClassVar[str] = ""
    replicated: ClassVar[bool] = False
    """Whether every worker trains the whole model (:class:`ReplicatedStrategy`)."""

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.comm = ctx.comm
        self.loss_fn = ctx.loss
        self._full_params = sum(p.numel() for p in model.parameters())
        self.meter = ActivationMeter(model=model)

    def recompute(self, model: nn.Module) -> None:
        """Apply ``[memory] recompute`` to ``model`` (the model entry's blocks or selective
        parts) and measure the inputs the checkpoints keep."""
        mode = self.cfg.memory.recompute
        if mode == "none":
            return
        from thinwire.models import MODELS

        entry = MODELS.get(self.cfg.model.name)
        held = apply_recompute(model, entry.blocks if mode == "block" else entry.selective)
        self.meter = ActivationMeter(held, model)

    # --- topology ------------------------------------------------------------------------------
    def data_shard(self) -> tuple[int, int]:
        """(shard index, number of shards) this rank reads: by default every rank its own."""
        return self.comm.rank, self.comm.world_size

    loss_rank: int = 0
    """The rank whose training loss the metrics record."""

    # --- training ------------------------------------------------------------------------------
    def standard_step(self, forward: nn.Module, opt: torch.optim.Optimizer, batch: Batch,
                      step: int) -> float:
        """One optimizer step of ``forward`` (the model or a wrapper of it) on ``batch``."""
        x, y = batch
        set_lr(opt, lr_at(self.cfg.train, step))
        forward.train()
        opt.zero_grad(set_to_none=True)
        with self.meter.measure():
            loss = self.loss_fn(forward(x), y)
        loss.backward()
        if self.cfg.train.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(
                [p for g in opt.param_groups for p in g["params"]], self.cfg.train.clip_norm)
        opt.step()
        return float(loss.detach())

    @abstractmethod
    def train_step(self, batch: Batch, step: int) -> float:
        """One local optimizer step on this worker's batch (and whatever communication the method
        does at this step); returns the training loss of the batch."""

    @abstractmethod
    def eval_model(self) -> nn.Module | None:
        """The full model at a synchronisation point, on the rank that evaluates; None
        elsewhere. Every rank calls it (a sharded strategy assembles here)."""

    def observe(self, step: int, value: float | None, higher_is_better: bool) -> None:  # noqa: B027
        """After an evaluation at ``step``, on every rank: the metric's ``value`` on the rank
        that evaluated, None on the others (a rule that acts on it decides on that rank and
        tells the others through ``self.comm``). A no-op by default."""

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

    replicated: ClassVar[bool] = True

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        super().__init__(ctx, model)
        self.model = model.to(ctx.device)
        self.opt: Any = make_optimizer(self.model.parameters(), self.cfg.train)
        self.recompute(self.model)

    def train_step(self, batch: Batch, step: int) -> float:
        """The standard step on the replica (a method whose communication is in hooks of the
        model or the optimizer needs no other)."""
        return self.standard_step(self.model, self.opt, batch, step)

    def eval_model(self) -> nn.Module | None:
        return self.model if self.comm.rank == 0 else None

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])

    def memory(self) -> MemoryReport:
        """Measured from the tensors (:func:`thinwire.strategies.memory.state_bytes`)."""
        params = list(self.model.parameters())
        p, g, o, host = state_bytes(params, self.opt.state.values(), self.ctx.device)
        return MemoryReport(params=p, grads=g, optimizer=o, param_count=self._full_params,
                            activations=self.meter.peak, host=host)


class WrappedStrategy(ReplicatedStrategy):
    """A replicated method whose work is done by one of thinwire's public wrappers of a model
    and its optimizer (:class:`~thinwire.strategies.averaging.LocalSGD`, DiLoCo, SparseLoCo),
    the same object a user puts around their own loop: its hooks act inside the standard step,
    its state is checkpointed under ``state_key`` beside the replica's, and closing the
    strategy closes it. A subclass sets ``self.wrapper`` in its constructor."""

    state_key: ClassVar[str]
    wrapper: Any

    @property
    def quorum(self) -> Any:
        """Over a torchft quorum, what opens each round's quorum (``begin_round``) and records
        it (``clock``, ``history``): the wrapper (``thinwire.ft_trainer``)."""
        return self.wrapper

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), self.state_key: self.wrapper.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.wrapper.load_state_dict(state[self.state_key])

    def close(self) -> None:
        self.wrapper.close()
