"""DiLoCo (``diloco``): local inner steps, outer Nesterov momentum on the averaged pseudo-gradient.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023),
Algorithm 1. Every worker holds the global parameters theta_g (identical on all ranks) and its
replica theta_i, starting equal. Each outer round:
  1. H = ``sync_every`` inner optimizer steps on the worker's own batches (the paper's inner
     optimizer is AdamW: ``--train.optimizer adamw``; its state stays local across rounds);
  2. pseudo-gradient delta_i = theta_g - theta_i;
  3. delta = mean_i delta_i: one all-reduce through the ledger, tagged ``average`` (the bytes
     of local SGD's model average), or a codec's exchange (with error feedback where it has it);
  4. the model is reset to theta_g, delta is set as its gradient, and the outer optimizer steps
     (the paper: SGD, lr 0.7, Nesterov momentum 0.9); theta_g <- the model.

Local SGD is the special case outer lr 1, momentum 0: theta_g - (theta_g - mean_i theta_i) =
mean_i theta_i, equal up to one rounding per element (tested).

:class:`DiLoCo` runs this around a user's model, inner and outer optimizers (torchft's shape)::

    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    with thinwire.DiLoCo(model, inner_optimizer, outer, sync_every=500):
        ...  # the usual loop with inner_optimizer.step()
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from thinwire.compression.registry import check_codec
from thinwire.errors import UsageError
from thinwire.options import check, opt
from thinwire.runtime.comm import Comm
from thinwire.strategies.base import (
    Batch,
    Context,
    MemoryReport,
    ReplicatedStrategy,
    optimizer_bytes,
)
from thinwire.strategies.entry import MethodEntry
from thinwire.strategies.traffic import Layout, Traffic, averaging_traffic


class DiLoCo:
    """DiLoCo's outer loop around ``model`` (module docstring): after every ``sync_every``-th
    step of ``inner_optimizer``, steps 2-4. ``codec``: a compressor (``thinwire.compression``)
    for the pseudo-gradient, or None for a plain all-reduce."""

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: torch.optim.Optimizer, sync_every: int, *,
                 comm: Comm | None = None, codec: Any = None, tag: str = "average") -> None:
        if sync_every < 1:
            raise UsageError(f"DiLoCo sync_every must be >= 1, got {sync_every}")
        self.model = model
        self.inner = inner_optimizer
        self.outer = outer_optimizer
        self.sync_every = sync_every
        self.comm = comm if comm is not None else Comm()
        self.codec = codec
        self.tag = tag
        self.steps = 0
        self.params = [p for p in model.parameters()]
        self.global_params = [p.detach().clone() for p in self.params]
        self._hook = inner_optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        self.steps += 1
        if self.steps % self.sync_every == 0:
            self.sync()

    def sync(self) -> None:
        """Steps 2-4."""
        with torch.no_grad():
            # 2. pseudo-gradient
            delta = torch.cat([(g - p).reshape(-1) for g, p in zip(self.global_params,
                                                                    self.params)])
            # 3. its mean over workers
            if self.codec is None:
                self.comm.all_reduce(delta, op="avg", tag=self.tag)
            else:
                from thinwire.compression import average_async

                fut, _ = average_async(self.comm, self.codec, delta,
                                       self.steps // self.sync_every, tag=self.tag,
                                       shapes=[tuple(p.shape) for p in self.params])
                delta = fut.wait()
            # 4. outer step from theta_g
            at = 0
            for g, p in zip(self.global_params, self.params):
                p.copy_(g)
                p.grad = delta[at:at + p.numel()].view_as(p).clone()
                at += p.numel()
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for g, p in zip(self.global_params, self.params):
                g.copy_(p)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"steps": self.steps, "global": [g.clone() for g in self.global_params],
                               "outer": self.outer.state_dict()}
        if self.codec is not None:
            out["codec"] = self.codec.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        with torch.no_grad():
            for g, saved in zip(self.global_params, state["global"]):
                g.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        if self.codec is not None and "codec" in state:
            self.codec.load_state_dict(state["codec"])

    def close(self) -> None:
        self._hook.remove()

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Options:
    period: int = opt(10, "inner steps between outer steps (H)")
    outer_lr: float = opt(0.7, "outer Nesterov learning rate")
    outer_momentum: float = opt(0.9, "outer Nesterov momentum (0: plain SGD)")
    compressor: str = opt("none", "codec spec for the pseudo-gradient (none: plain all-reduce)")

    def __post_init__(self) -> None:
        check(self.period >= 1, "method.period", "must be >= 1")
        check(self.outer_lr > 0, "method.outer_lr", "must be > 0")
        check(0 <= self.outer_momentum < 1, "method.outer_momentum", "must be in [0, 1)")
        if self.compressor != "none":
            check_codec(self.compressor, "method.compressor")


class DiLoCoStrategy(ReplicatedStrategy):
    name = "diloco"

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        super().__init__(ctx, model)
        o: Options = ctx.options
        self.outer_opt = torch.optim.SGD(self.model.parameters(), lr=o.outer_lr,
                                         momentum=o.outer_momentum,
                                         nesterov=o.outer_momentum > 0)
        codec = None
        if o.compressor != "none":
            from thinwire.compression import build

            codec = build(o.compressor, seed=self.cfg.train.seed, rank=self.comm.rank)
        self.diloco = DiLoCo(self.model, self.opt, self.outer_opt, o.period, comm=self.comm,
                             codec=codec)

    def train_step(self, batch: Batch, step: int) -> float:
        return self.standard_step(self.model, self.opt, batch, step)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "diloco": self.diloco.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.diloco.load_state_dict(state["diloco"])

    def memory(self) -> MemoryReport:
        """Inner state as local SGD's; theta_g and the outer momentum count as optimizer state."""
        inner = super().memory()
        extra = sum(g.numel() * g.element_size() for g in self.diloco.global_params)
        return dataclasses.replace(
            inner, optimizer=inner.optimizer + extra + optimizer_bytes(self.outer_opt))

    def close(self) -> None:
        self.diloco.close()


def traffic(layout: Layout, options: Options, workers: int, steps: int, seed: int,
            optimizer_states: int = 0) -> Traffic:
    del seed, optimizer_states
    if options.compressor == "none":
        return averaging_traffic(layout, options.period, workers, steps)
    from thinwire.compression import build

    calls = build(options.compressor).collectives(layout.numel, [p.shape for p in layout.params])
    rounds = steps // options.period
    total = Traffic.none(workers)
    for op, payload in calls:
        total = total + Traffic.uniform(workers, op, [payload] * rounds)
    return total


def _label(o: Options) -> str:
    extra = ""
    if o.compressor != "none":
        from thinwire.compression import build

        extra = f"+{build(o.compressor).describe()}"
    return f"diloco(H={o.period}){extra}"


METHOD = MethodEntry(
    name="diloco", summary="DiLoCo: H inner steps, outer Nesterov step on the mean pseudo-gradient",
    strategy="thinwire.strategies.diloco:DiLoCoStrategy", options=Options, label=_label,
    sync_every=lambda o: o.period, traffic=traffic, memory=("recompute",),
    rescalable=lambda o: o.compressor == "none")  # a codec's residuals are per rank, as in dp
