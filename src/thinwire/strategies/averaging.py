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


class LocalSGD:
    """Average ``model``'s parameters over all ranks after every ``sync_every``-th step of
    ``optimizer`` (an optimizer post-step hook; step 2 of the module docstring).

    ``comm`` defaults to ``Comm()`` (the default process group, bound lazily). Use it as a
    context manager, or call :meth:`close` to remove the hook."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, sync_every: int, *,
                 comm: Comm | None = None, tag: str = "average") -> None:
        if sync_every < 1:
            raise UsageError(f"LocalSGD sync_every must be >= 1, got {sync_every}")
        self.model = model
        self.optimizer = optimizer
        self.sync_every = sync_every
        self.comm = comm if comm is not None else Comm()
        self.tag = tag
        self.steps = 0
        self._hook = optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        self.steps += 1
        if self.steps % self.sync_every == 0:
            self.sync()

    def sync(self) -> None:
        """Step 2: average all parameters with one all-reduce."""
        flat = flat_params(self.model)
        self.comm.all_reduce(flat, op="avg", tag=self.tag)
        load_flat(self.model, flat)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])

    def close(self) -> None:
        self._hook.remove()

    def __enter__(self) -> LocalSGD:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
