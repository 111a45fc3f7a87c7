"""Local SGD (``localsgd``): independent local steps, parameters averaged every H steps.

Stich, "Local SGD Converges Fast and Communicates Little" (ICLR 2019); Lin et al., "Don't Use
Large Mini-Batches, Use Local SGD" (ICLR 2020). Every step: 1. a local optimizer step on the
worker's own batch; 2. after every H-th step, all parameters are flattened into one buffer and
averaged with a single all-reduce, and written back. Optimizer state stays local (it is not
averaged), as in torch's PeriodicModelAverager. With H = 1 and plain SGD this is data
parallelism up to the order of averaging.

:class:`~thinwire.strategies.averaging.LocalSGD` does this around a user's own model and optimizer (the shape torchft users
know)::

    with thinwire.LocalSGD(model, optimizer, sync_every=10):
        for x, y in loader:
            optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from thinwire.options import check, opt
from thinwire.strategies.averaging import LocalSGD
from thinwire.strategies.base import Context, WrappedStrategy
from thinwire.strategies.entry import MethodEntry, Recovery, Rescalable
from thinwire.strategies.traffic import Layout, Traffic, averaging_traffic


@dataclass(frozen=True)
class Options:
    period: int = opt(10, "local steps between model averages (H)")

    def __post_init__(self) -> None:
        check(self.period >= 1, "method.period", "must be >= 1")


class LocalSGDStrategy(WrappedStrategy):
    name = "localsgd"
    state_key = "local"

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        super().__init__(ctx, model)
        self.wrapper = LocalSGD(self.model, self.opt, ctx.options.period, comm=self.comm,
                                replica=ctx.replica)



def traffic(layout: Layout, options: Options, workers: int, steps: int, seed: int,
            optimizer_states: int = 0) -> Traffic:
    del seed, optimizer_states
    return averaging_traffic(layout, options.period, workers, steps)


class LocalSGDEntry(MethodEntry, Rescalable):
    """localsgd's registry entry: every rank holds the same model at a checkpoint."""

    def rescalable(self, options: Options) -> bool:
        return True


METHOD = LocalSGDEntry(
    name="localsgd", summary="local SGD: H local steps, then average the models",
    strategy="thinwire.strategies.local_sgd:LocalSGDStrategy", options=Options,
    label=lambda o: f"localsgd(H={o.period})", sync_every=lambda o: o.period, traffic=traffic,
    memory=("recompute",), fault_tolerant=True,
    recovery=lambda o: Recovery(lost_steps=o.period))
