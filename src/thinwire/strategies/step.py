"""The train-step template of the model-parallel methods (tensor, pipeline, hybrid, slide).

Each of these methods cuts the model its own way, so its forward and backward passes (and the
exchange of activations, their gradients and the replicated parameters' gradients) are its own;
everything around them is the same for all of them and lives here, in
:meth:`SteppedStrategy.train_step`:

  1. :meth:`~SteppedStrategy.prepare` (the first batch may fix shapes: the pipeline's
     boundaries); the schedule's learning rate on every optimizer; train mode; gradients zeroed;
  2. :meth:`~SteppedStrategy.forward_backward`: the method's own pass on this rank's batch,
     returning its loss, every local gradient synchronised (``p.grad`` set);
  3. with ``train.clip_norm`` > 0: the whole model's gradient norm, the same on every rank
     (:meth:`~SteppedStrategy.grad_norm_sq`: the squares of the slices a rank holds summed over
     the ranks that hold the other slices, each replicated tensor counted once, as Megatron
     clips across its tensor-parallel ranks), and every local gradient scaled by
     min(1, clip_norm / (norm + 1e-6)), torch's ``clip_grad_norm_`` on the whole model;
  4. every optimizer steps, then :meth:`~SteppedStrategy.after_step`;
  5. :meth:`~SteppedStrategy.reduce_loss`: the loss the rank reports (by default its own).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from thinwire.runtime.comm import Comm
from thinwire.strategies.base import Batch, Strategy, lr_at, set_lr


def sq_norm(params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of the gradients of ``params`` (float32, shape [1], on
    ``device``); a sparse gradient counts its coalesced values, a missing one nothing."""
    out = torch.zeros(1, dtype=torch.float32, device=device)
    for p in params:
        g = p.grad
        if g is None:
            continue
        if g.is_sparse:
            g = g.coalesce().values()
        out += g.float().pow(2).sum()
    return out


def summed(sq: torch.Tensor, comm: Comm) -> torch.Tensor:
    """``sq`` summed over ``comm`` in place (one 4-byte all-reduce, tag ``grad``; none on one
    rank)."""
    if comm.world_size > 1:
        comm.all_reduce(sq, op="sum", tag="grad")
    return sq


class SteppedStrategy(Strategy):
    """A strategy whose step is the template of the module docstring (steps 1-5); a subclass
    supplies :meth:`optimizers`, :meth:`modules_to_train`, :meth:`forward_backward` and
    :meth:`grad_norm_sq`."""

    def prepare(self, batch: Batch) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Before step 1 of every step (set-up that needs the first batch)."""

    @abstractmethod
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers of this rank's parameters (every one steps each step)."""

    @abstractmethod
    def modules_to_train(self) -> list[nn.Module]:
        """The modules put in train mode before the pass."""

    @abstractmethod
    def forward_backward(self, batch: Batch, step: int) -> torch.Tensor | float:
        """Step 2: the method's forward and backward passes on this rank's batch, its gradients
        synchronised into ``p.grad``; returns this rank's loss."""

    @abstractmethod
    def grad_norm_sq(self) -> torch.Tensor:
        """Step 3: the squared gradient norm of the whole model, equal on every rank of the
        run (float32, shape [1], on the run's device; :func:`sq_norm` and :func:`summed`)."""

    def after_step(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """After the optimizers' step (SLIDE counts the update for its rebuild schedule)."""

    def reduce_loss(self, loss: torch.Tensor | float) -> float:
        """Step 5: the loss this rank reports."""
        return float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)

    def clip(self, max_norm: float) -> None:
        """Step 3: every local gradient scaled by min(1, max_norm / (norm + 1e-6))."""
        coef = (max_norm / (self.grad_norm_sq().sqrt() + 1e-6)).clamp(max=1.0).reshape(())
        for opt in self.optimizers():
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(coef.to(p.grad.dtype))

    def train_step(self, batch: Batch, step: int) -> float:
        """Steps 1-5 of the module docstring."""
        self.prepare(batch)  # 1.
        lr = lr_at(self.cfg.train, step)
        opts = self.optimizers()
        for opt in opts:
            set_lr(opt, lr)
        for m in self.modules_to_train():
            m.train()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss = self.forward_backward(batch, step)  # 2.
        if self.cfg.train.clip_norm > 0:  # 3.
            self.clip(self.cfg.train.clip_norm)
        for opt in opts:  # 4.
            opt.step()
        self.after_step()
        return self.reduce_loss(loss)  # 5.


__all__ = ["SteppedStrategy", "sq_norm", "summed"]
