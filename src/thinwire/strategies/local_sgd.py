"""Local SGD (``localsgd``): independent local steps, parameters averaged every H steps.

Stich, "Local SGD Converges Fast and Communicates Little" (ICLR 2019); Lin et al., "Don't Use
Large Mini-Batches, Use Local SGD" (ICLR 2020). Every step: 1. a local optimizer step on the
worker's own batch; 2. after every H-th step, all parameters are flattened into one buffer and
averaged with a single all-reduce, and written back. Optimizer state stays local (it is not
averaged), as in torch's PeriodicModelAverager. With H = 1 and plain SGD this is data
parallelism up to the order of averaging.

:class:`LocalSGD` does this around a user's own model and optimizer (the shape torchft users
know)::

    with thinwire.LocalSGD(model, optimizer, sync_every=10):
        for x, y in loader:
            optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from thinwire.errors import UsageError
from thinwire.options import check, opt
from thinwire.runtime.comm import Comm
from thinwire.strategies.base import (
    Batch,
    Context,
    ReplicatedStrategy,
    flat_params,
    load_flat,
)
from thinwire.strategies.entry import MethodEntry
from thinwire.strategies.traffic import Layout, Traffic, averaging_traffic


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


@dataclass(frozen=True)
class Options:
    period: int = opt(10, "local steps between model averages (H)")

    def __post_init__(self) -> None:
        check(self.period >= 1, "method.period", "must be >= 1")


class LocalSGDStrategy(ReplicatedStrategy):
    name = "localsgd"

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        super().__init__(ctx, model)
        self.local = LocalSGD(self.model, self.opt, ctx.options.period, comm=self.comm)

    def train_step(self, batch: Batch, step: int) -> float:
        return self.standard_step(self.model, self.opt, batch, step)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "local": self.local.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.local.load_state_dict(state["local"])

    def close(self) -> None:
        self.local.close()


def traffic(layout: Layout, options: Options, workers: int, steps: int, seed: int,
            optimizer_states: int = 0) -> Traffic:
    del seed, optimizer_states
    return averaging_traffic(layout, options.period, workers, steps)


METHOD = MethodEntry(
    name="localsgd", summary="local SGD: H local steps, then average the models",
    strategy="thinwire.strategies.local_sgd:LocalSGDStrategy", options=Options,
    label=lambda o: f"localsgd(H={o.period})", sync_every=lambda o: o.period, traffic=traffic,
    memory=("recompute",), rescalable=lambda o: True)
