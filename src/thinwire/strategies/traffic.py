"""The traffic of a method as a pure function of the model's shapes: the ledger's bytes, exactly.

Each method's module gives ``traffic(layout, options, workers, steps, seed) -> Traffic``: the
totals every rank's ledger holds after a run of ``steps`` steps (control traffic excluded, as in
``summary.json``), and rank 0's calls per operation (what its communication time is made of).
The planner and the calibration use these functions instead of re-deriving bytes; tests hold
them equal to real runs' ledgers.

:class:`Layout` is what the functions know of a model: its parameters in registration order,
the order their gradients become ready in a backward pass (DDP fills its buckets in that order),
and, for models with IST units, the adapter's :class:`~thinwire.models.adapter.ISTPlan` (for a
pipeline run its stage plan, for a tensor-parallel run its activation shapes: what a method's
``run_layout`` adds from a run's config and one input batch). No
torch is needed to build one from shapes (:meth:`Layout.from_shapes`); :meth:`Layout.of_model`
probes a real model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from thinwire.models.adapter import ISTPlan
from thinwire.ring import ring_bytes

if TYPE_CHECKING:
    from torch import nn


def ring_all_reduce(payload: int, n: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``payload`` bytes
    (:mod:`thinwire.ring`, as the ledger counts them)."""
    return ring_bytes("all_reduce", payload, n)


def ring_all_gather(payload: int, n: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-gather of ``payload`` bytes per rank."""
    return ring_bytes("all_gather", payload, n)


def ring_reduce_scatter(payload: int, n: int) -> int:
    """Bytes one rank sends (and receives) in a ring reduce-scatter of ``payload`` bytes."""
    return ring_bytes("reduce_scatter", payload, n)


def wire(op: str, payload: int, n: int) -> int:
    if op == "all_reduce":
        return ring_all_reduce(payload, n)
    if op == "all_gather":
        return ring_all_gather(payload, n)
    if op == "reduce_scatter":
        return ring_reduce_scatter(payload, n)
    if op == "all_to_all":  # point-to-point messages: the payload is the bytes sent
        return payload
    raise ValueError(f"unknown collective {op!r}")


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    itemsize: int = 4

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Layout:
    """What a traffic formula knows of a model (module docstring)."""

    params: tuple[ParamInfo, ...]
    ready: tuple[int, ...] = ()
    """Indices into ``params`` in the order gradients become ready (default: reverse order)."""
    ist: ISTPlan | None = None
    pipeline: Any = None
    """A pipeline run's stage plan (:class:`thinwire.strategies.pipeline.plan.PipelinePlan`),
    for the traffic formula of methods that cut the model into stages."""
    tensor: Any = None
    """A tensor-parallel run's shapes (:class:`thinwire.strategies.tensor.TensorLayout`)."""
    tables: Any = None
    """A hybrid run's embedding tables and batch (:class:`thinwire.strategies.hybrid.HybridLayout`)."""
    clip: bool = False
    """Whether the run clips gradients (``train.clip_norm`` > 0): a model-parallel method's
    formula adds the all-reduce of the squared norm (set by the method's ``run_layout``)."""
    wide: Any = None
    """An extreme-classification network's shapes (:class:`thinwire.strategies.entry.WideShapes`; the planner's
    :class:`thinwire.planner.specs.XMLPShapes` is one), for methods that shard its wide layer."""

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def ready_order(self) -> tuple[ParamInfo, ...]:
        order = self.ready or tuple(range(len(self.params) - 1, -1, -1))
        return tuple(self.params[i] for i in order)

    @staticmethod
    def from_shapes(shapes: Sequence[tuple[str, tuple[int, ...]]], *,
                    ready: Sequence[int] = (), ist: ISTPlan | None = None) -> Layout:
        return Layout(tuple(ParamInfo(n, tuple(s)) for n, s in shapes), tuple(ready), ist)

    @staticmethod
    def of_model(model: nn.Module, example: Any = None, *, ist: ISTPlan | None = None) -> Layout:
        """The layout of a real model; with an ``example`` input, the gradient-ready order is
        probed with one forward and backward pass on a copy (the model is untouched)."""
        import copy

        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        infos = tuple(ParamInfo(n, tuple(p.shape), p.element_size()) for n, p in params)
        ready: list[int] = []
        if example is not None:
            probe = copy.deepcopy(model)
            index = {id(p): i for i, (_, p) in enumerate(probe.named_parameters())
                     if p.requires_grad}
            handles = [p.register_post_accumulate_grad_hook(lambda q: ready.append(index[id(q)]))
                       for p in probe.parameters() if p.requires_grad]
            try:
                probe.train()
                out = probe(example)
                out.float().sum().backward()
            finally:
                for h in handles:
                    h.remove()
            seen = set(ready)
            ready += [i for i in range(len(infos) - 1, -1, -1) if i not in seen]
        return Layout(infos, tuple(ready), ist)


@dataclass(frozen=True)
class Traffic:
    """Ledger totals of a run per rank, and rank 0's calls ``op -> (calls, wire bytes)``."""

    sent: tuple[int, ...]
    recv: tuple[int, ...]
    payload: tuple[int, ...]
    rank0_calls: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def sent_mean(self) -> float:
        return sum(self.sent) / len(self.sent)

    @property
    def payload_mean(self) -> float:
        return sum(self.payload) / len(self.payload)

    @staticmethod
    def none(n: int) -> Traffic:
        zero = (0,) * max(n, 1)
        return Traffic(zero, zero, zero)

    @staticmethod
    def uniform(n: int, op: str, payloads: Sequence[int]) -> Traffic:
        """Every rank issues the same collectives of these payloads."""
        if n <= 1:
            return Traffic.none(n)
        pay = sum(payloads)
        sent = sum(wire(op, p, n) for p in payloads)
        return Traffic((sent,) * n, (sent,) * n, (pay,) * n, {op: (len(payloads), sent)})

    def __add__(self, other: Traffic) -> Traffic:
        calls = dict(self.rank0_calls)
        for op, (c, b) in other.rank0_calls.items():
            c0, b0 = calls.get(op, (0, 0))
            calls[op] = (c0 + c, b0 + b)
        return Traffic(tuple(a + b for a, b in zip(self.sent, other.sent)),
                       tuple(a + b for a, b in zip(self.recv, other.recv)),
                       tuple(a + b for a, b in zip(self.payload, other.payload)), calls)


def averaging_traffic(layout: Layout, period: int, workers: int, steps: int) -> Traffic:
    """One all-reduce of every parameter (4 bytes each) per ``period`` steps: the traffic of
    any method that averages whole models periodically (local SGD; DiLoCo's outer step)."""
    return Traffic.uniform(workers, "all_reduce", [4 * layout.numel] * (steps // period))
