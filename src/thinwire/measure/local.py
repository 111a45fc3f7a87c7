"""A run's local work, measured without its communication: the method's own Strategy on a
communicator that moves nothing.

:class:`Silent` answers every call of :class:`~thinwire.runtime.comm.Comm` at once, as rank
``rank`` of ``world`` ranks: collectives return their input (an all-gather, ``world`` copies of
it), an exchange or a receive fills its buffers with zeros, a send is done when posted,
nothing is recorded. It is not ``distributed``, so a method that would wrap the model in DDP
trains it directly. On it a method's Strategy does everything but the wire: the worker's steps
on the part of the model it trains, and its local work at each synchronisation (repartitioning
and moving subnets into place, flattening parameters, an outer optimizer step). Two uses,
neither naming a method:

1. :func:`run_shape`: the widths of the model rank 0 trains in a step (the full MLP for a
   replicated method, a subnet for IST), read by a forward pre-hook, averaged over the steps of
   two synchronisation periods; the time model's compute FLOPs follow from them;
2. :func:`sync_overhead`: seconds per synchronisation period beyond its steps, rank 0's time of
   a period minus S times the mean of the steps strictly inside one (periods of S <= 2 steps
   have none inside and count 0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from thinwire.runtime.comm import Comm

if TYPE_CHECKING:
    from collections.abc import Sequence

    from thinwire.config import Config
    from thinwire.data import Dataset


class Silent(Comm):
    """Rank ``rank`` of ``world`` ranks whose calls move nothing (module docstring)."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self._bound = (rank, world)
        self._local = True

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum", tag: str = "") -> torch.Tensor:
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor, *, tag: str = "") -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(tensor)
        return fut

    def all_gather(self, tensor: torch.Tensor, *, tag: str = "") -> list[torch.Tensor]:
        return [tensor.clone() for _ in range(self.world_size)]

    def all_gather_async(self, tensor: torch.Tensor, *, tag: str = "") -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(tensor.reshape(-1).repeat(self.world_size))
        return fut

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, tag: str = "") -> torch.Tensor:
        return tensor

    def barrier(self, *, tag: str = "") -> None:
        return None

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]],
                 recvs: Sequence[tuple[int, torch.Tensor]], *, tag: str = "") -> None:
        for _, buf in recvs:
            buf.zero_()

    def send(self, tensor: torch.Tensor, dst: int, *, tag: str = "") -> None:
        return None

    def isend(self, tensor: torch.Tensor, dst: int, *, tag: str = "") -> Any:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut

    def recv(self, tensor: torch.Tensor, src: int, *, tag: str = "") -> torch.Tensor:
        return tensor.zero_()


@dataclass(frozen=True)
class RunShape:
    """What :func:`run_shape` found for one run config."""

    name: str
    """The run's name."""
    trained: tuple[float, ...]
    """Mean widths of the MLP rank 0 trains in a step (input, hidden..., output)."""
    sync_every: int
    """Steps between synchronisations (S, the method's ``sync_every``)."""
    codec: str
    """The codec spec the method encodes with ("none": none)."""

    @property
    def key(self) -> tuple[int, ...]:
        """``trained`` rounded: the MLP the calibration times for this run."""
        return tuple(max(1, round(w)) for w in self.trained)


def _strategy(cfg: Config, dataset: Dataset, comm: Comm) -> tuple[torch.nn.Module, Any, Any]:
    """The run's model, its Strategy on ``comm`` (CPU), and the run's batch stream."""
    from thinwire.builders import build_model, build_strategy, make_stream
    from thinwire.data.task import task_for

    model = build_model(cfg, dataset)
    strategy = build_strategy(cfg, comm, torch.device("cpu"), task_for(dataset), model)
    shard, shards = strategy.data_shard()
    return model, strategy, make_stream(cfg, dataset, shard, shards)


def run_shape(cfg: Config, dataset: Dataset, periods: int = 2) -> RunShape:
    """Step 1: rank 0's trained widths over ``periods`` synchronisation periods."""
    every = cfg.sync_every
    model, strategy, stream = _strategy(cfg, dataset, Silent(0, cfg.runtime.workers))
    seen: list[tuple[int, ...]] = []

    def record(module: torch.nn.Module, _args: Any) -> None:
        mats = [p for p in module.parameters() if p.dim() == 2 and p.numel()]
        if mats:
            seen.append((mats[0].shape[1], *(int(p.shape[0]) for p in mats)))

    handle = model.register_forward_pre_hook(record)
    try:
        for step in range(periods * every):
            strategy.train_step(stream.batch(step), step)
    finally:
        handle.remove()
        strategy.close()
    mean = tuple(sum(w[i] for w in seen) / len(seen) for i in range(len(seen[0])))
    codec = str(getattr(cfg.method.options, "compressor", "none"))
    return RunShape(cfg.run_name, mean, every, codec)


def step_times(cfg: Config, dataset: Dataset, rank: int, periods: int) -> list[float]:
    """Seconds of each step of ``periods`` periods on :class:`Silent` as ``rank`` (after one
    period of warm-up)."""
    _, strategy, stream = _strategy(cfg, dataset, Silent(rank, cfg.runtime.workers))
    every = cfg.sync_every
    times: list[float] = []
    try:
        for step in range((periods + 1) * every):
            t0 = time.perf_counter()
            strategy.train_step(stream.batch(step), step)
            if step >= every:
                times.append(time.perf_counter() - t0)
    finally:
        strategy.close()
    return times


def sync_overhead(times: Sequence[float], every: int) -> float:
    """Step 2: mean over periods of (period time - S x mean inner step); 0 when S <= 2."""
    if every <= 2:
        return 0.0
    periods = [times[i:i + every] for i in range(0, len(times) - every + 1, every)]
    inner = [t for p in periods for t in p[1:-1]]
    mean_inner = sum(inner) / len(inner)
    return max(0.0, sum(sum(p) - every * mean_inner for p in periods) / len(periods))
