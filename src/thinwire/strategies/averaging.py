"""Periodic parameter averaging around a user's own model and optimizer: :class:`LocalSGD`.

Stich, "Local SGD Converges Fast and Communicates Little" (ICLR 2019). The piece several methods
use: the ``localsgd`` method (:mod:`thinwire.strategies.local_sgd`) runs it as it is, and IST's
hybrid schedule (:mod:`thinwire.strategies.ist.method`) switches to it on the full model. It is
no method itself and names none:
  1. every optimizer step is local;
  2. after every ``sync_every``-th step all parameters are flattened into one buffer, averaged
     with a single all-reduce through the :class:`~thinwire.runtime.comm.Comm`, and written
     back. Optimizer state stays local.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from thinwire.errors import UsageError
from thinwire.runtime.comm import Comm
from thinwire.strategies.base import flat_params, load_flat


class PeriodicSync:
    """The skeleton of a wrapper that synchronises a user's replica after every
    ``sync_every``-th step of its optimizer (:class:`LocalSGD`, SparseLoCo, DiLoCo), written
    once:
      1. the period is checked (one line naming the wrapper if it is < 1);
      2. the subclass sets up its own state, then :meth:`_hook_on` registers an optimizer
         post-step hook (after its own checks, so a refused wrapper leaves no hook behind);
      3. the hook counts ``steps`` and calls :meth:`on_step`, by default :meth:`sync` after
         every ``sync_every``-th step;
      4. ``steps`` is the checkpointed state (subclasses add theirs);
      5. :meth:`close` removes the hook; every wrapper is a context manager that closes."""

    def __init__(self, model: nn.Module, sync_every: int, *, comm: Comm | None = None,
                 tag: str = "average") -> None:
        if sync_every < 1:
            raise UsageError(f"{type(self).__name__} sync_every must be >= 1, got {sync_every}")
        self.model = model
        self.sync_every = sync_every
        self.comm = comm if comm is not None else Comm()
        self.tag = tag
        self.steps = 0
        self._hook: Any = None

    def _hook_on(self, optimizer: torch.optim.Optimizer) -> None:
        self._hook = optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        self.steps += 1
        self.on_step()

    def on_step(self) -> None:
        """Step 3, after ``steps`` counted this step: :meth:`sync` on every period's last."""
        if self.steps % self.sync_every == 0:
            self.sync()

    def sync(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def __enter__(self) -> PeriodicSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalSGD(PeriodicSync):
    """Average ``model``'s parameters over all ranks after every ``sync_every``-th step of
    ``optimizer`` (an optimizer post-step hook; step 2 of the module docstring).

    ``comm`` defaults to ``Comm()`` (the default process group, bound lazily). Use it as a
    context manager, or call :meth:`close` to remove the hook."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, sync_every: int, *,
                 comm: Comm | None = None, tag: str = "average") -> None:
        super().__init__(model, sync_every, comm=comm, tag=tag)
        self.optimizer = optimizer
        self._hook_on(optimizer)

    def sync(self) -> None:
        """Step 2: average all parameters with one all-reduce."""
        flat = flat_params(self.model)
        self.comm.all_reduce(flat, op="avg", tag=self.tag)
        load_flat(self.model, flat)
