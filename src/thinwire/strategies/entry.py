"""The method registry's vocabulary: one :class:`MethodEntry` per method, in the method's module,
and the typed capabilities a method may add to it.

A method's module holds everything about it: its options dataclass (the ``[method]`` keys beyond
``name``), its label, its checks, the pure function giving its traffic for given shapes
(:mod:`thinwire.strategies.traffic`) and the :class:`~thinwire.strategies.base.Strategy` the
trainer runs. Registering it is one line in :data:`thinwire.strategies.METHODS`; nothing else in
the library names it.

What a method can do beyond the fields every entry has is in its entry's type: the module's
entry class implements the protocols below that it has (``class _Entry(MethodEntry,
Rescalable): def rescalable(self, options) -> bool: ...``), and every reader asks for a
capability with ``isinstance`` (the protocols are ``runtime_checkable``) and then calls it as a
typed method, so mypy checks both sides and a misspelt capability is a type error, not a miss
found at run time:

- :class:`HasRunLayout`: the traffic formula reads a run's layout (a pipeline's stage plan,
  tensor-parallel shapes), so the planner's comparisons, which have a model's layout only, do
  not price the method (:attr:`MethodEntry.planned`);
- :class:`Rescalable`: a checkpoint resumes at another number of workers;
- :class:`ModelDefaults`: options with the model's own defaults filled in (IST's K);
- :class:`Shares`: a worker's part of a model the method cuts its own way;
- :class:`Compressed`: the codec of its options and the same options without it;
- :class:`Bucketed`: DDP's bucket traffic and ZeRO-1's parameter owners;
- :class:`Staged`: a pipeline's stage plan, message bytes and pass order;
- :class:`Subnets`: the elements a worker's subnet trains and the workers holding each unit.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from thinwire.options import NoOptions

if TYPE_CHECKING:
    from torch import nn

    from thinwire.models.adapter import ISTPlan
    from thinwire.strategies.traffic import Layout, Traffic

TrafficFormula = Callable[["Layout", Any, int, int, int, int], "Traffic"]
"""``traffic(layout, options, workers, steps, seed, optimizer_states)``: the exact ledger
bytes of a run."""


def _one(options: Any) -> int:
    del options
    return 1


@dataclass(frozen=True)
class WideShapes:
    """An extreme-classification network's shapes (``Layout.wide`` of
    :mod:`thinwire.strategies.traffic`, read by the planner and by the traffic formulas of
    methods that shard the wide layer): ``features`` x ``hidden`` the lower layers' input matrix,
    ``labels`` the wide layer's width, ``nnz`` an input row's slots, ``label_cols`` a row's label
    slots and ``batch`` the samples a worker reads a step."""

    features: int
    hidden: int
    labels: int
    nnz: int
    label_cols: int
    batch: int


@dataclass(frozen=True)
class WorkerShare:
    """What one worker of a method holds and computes (:meth:`Shares.share`)."""

    params: float
    """Parameters (elements) the worker holds and updates."""
    flops_per_sample: float
    """Training FLOPs a step, per sample of the worker's batch."""
    other_bytes: float = 0.0
    """Bytes the worker holds beside its parameters' states and activations (hash tables)."""
    updated: float | None = None
    """Parameters its optimizer updates a step (sparse updates touch fewer; None: all)."""


@dataclass(frozen=True)
class Recovery:
    """What a fault-tolerant method's joining worker receives from a live peer (torchft's
    recovery, the ledger's ``recovery`` tag) and what a failure discards, as data the planner
    prices (:mod:`thinwire.planner.failure`): the bytes follow from the model's parameters,
    buffers and optimizer, the time lost from the planned step time.

    A restart-based recovery loads a one-worker checkpoint that holds the same state, so the
    planner prices its load with the same bytes."""

    copies: float = 1.0
    """fp32 tensors the size of the model's parameters: the model itself (1), plus the
    method's own (DiLoCo's theta_g and outer momentum, SparseLoCo's theta, DeMo's second copy
    of the parameters; IST's new keeper: the whole store)."""
    buffers: bool = True
    """Whether the model's buffers (batch-norm statistics) travel with it."""
    optimizer: bool = True
    """Whether the (inner) optimizer's per-element state and per-tensor scalars travel (a
    method whose momentum is each worker's own starts it at zero instead)."""
    lost_steps: float = 1.0
    """Steps of every survivor's work one failure discards: the refused step (dp, DeMo), the
    refused round (the periodic methods), none (IST: only the lost worker's round)."""
    parts: tuple[str, ...] = ("model", "optimizer")
    """What the copies are, for the planner's report."""


@runtime_checkable
class HasRunLayout(Protocol):
    """The method's traffic formula reads a run's :class:`~thinwire.strategies.traffic.Layout`
    (a pipeline's stage plan, tensor-parallel activation shapes, a wide layer's label slots)."""

    def run_layout(self, cfg: Any, model: nn.Module, batch: tuple[Any, Any]) -> Layout:
        """The layout of a run, from the config, the built model and one step's (inputs,
        targets); :func:`thinwire.measure.predict.run_layout` and ``run_traffic`` price a run
        with it."""
        ...


@runtime_checkable
class Rescalable(Protocol):
    """A checkpoint of the method may resume at another number of workers."""

    def rescalable(self, options: Any) -> bool:
        """Whether, under ``options``, the model (and what the method keeps beside the
        optimizer) is the same on every rank at a checkpoint, so every rank of the new run loads
        rank 0's state (False for state that is partitioned or private per rank: codec
        residuals, fragments)."""
        ...


@runtime_checkable
class ModelDefaults(Protocol):
    """Some of the method's options default to the model's own values."""

    def for_model(self, options: Any, ist: Any) -> Any:
        """``options`` with the model's defaults filled in, given the model's IST adapter (the
        registry's ``ist``) or plan (None: the model has none), e.g. IST's automatic K; the
        config's synchronisation period and the planner's read it
        (:meth:`MethodEntry.sync_every_for`)."""
        ...


@runtime_checkable
class Shares(Protocol):
    """The method cuts the model its own way (a sharded wide layer)."""

    def share(self, layout: Layout, options: Any, workers: int) -> WorkerShare:
        """What one worker holds and computes, priced by the planner from the layout."""
        ...


@runtime_checkable
class Compressed(Protocol):
    """The method encodes what it exchanges with a codec of its options."""

    def codec(self, options: Any) -> str:
        """The codec spec of ``options`` ("none": uncompressed)."""
        ...

    def uncompressed(self, options: Any) -> Any:
        """``options`` with the codec off."""
        ...


@runtime_checkable
class Bucketed(Protocol):
    """The method averages gradients through DDP's buckets and may shard optimizer state."""

    def buckets(self, layout: Layout, codec: str, workers: int, steps: int) -> Traffic:
        """The ledger bytes of ``steps`` DDP steps through ``codec`` (the first one bucket of
        everything, later steps the rebuilt buckets)."""
        ...

    def owners(self, sizes: Sequence[int], n: int) -> list[int]:
        """ZeRO-1's owner rank of each parameter of these sizes over ``n`` ranks."""
        ...


@runtime_checkable
class Staged(Protocol):
    """The method cuts the model into pipeline stages."""

    def plan(self, stages: int, dp: int, batch: int, widths: tuple[tuple[int, ...], ...],
             stage_params: tuple[int, ...], clip: bool = False) -> Any:
        """The stage plan the traffic formula reads, for these stages, replicas, per-replica
        batch, per-sample shapes leaving each stage but the last, and stage sizes."""
        ...

    def message_bytes(self, plan: Any, options: Any
                      ) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """Per boundary, the encoded bytes of each micro-batch's activation and gradient, and
        the parameters each stage's bottleneck halves add."""
        ...

    def order(self, schedule: str, stage: int, stages: int, micro: int
              ) -> list[tuple[str, int]]:
        """The schedule's passes on ``stage``: ("F", m) and ("B", m) in order."""
        ...


@runtime_checkable
class Subnets(Protocol):
    """A worker trains a subnet of the model's IST plan."""

    def worker_numel(self, plan: ISTPlan, workers: int, overlap: int = 1) -> float:
        """Elements a worker's subnet trains when ``plan``'s units are dealt over ``workers``,
        each unit held by ``overlap`` workers (the mean over workers)."""
        ...

    def overlap(self, options: Any, workers: int) -> int:
        """Workers holding each unit of a cut group under ``options`` (resolved)."""
        ...


CAPABILITIES: tuple[type, ...] = (HasRunLayout, Rescalable, ModelDefaults, Shares, Compressed,
                                  Bucketed, Staged, Subnets)
"""Every capability a method's entry may have."""


def _unimplemented(cls: type) -> list[str]:
    """``capability.member`` for each member of a capability ``cls`` names as a base that
    ``cls`` leaves as the capability's own stub."""
    out = []
    for capability in CAPABILITIES:
        if issubclass(cls, capability):
            out += [f"{capability.__name__}.{name}" for name, member in vars(capability).items()
                    if callable(member) and not name.startswith("_")
                    and getattr(cls, name) is member]
    return out


@dataclass(frozen=True)
class MethodEntry:
    """One method of distributed training: what every method declares. What only some methods
    can do is in the type of the module's entry (the protocols of this module).

    - ``strategy``: ``"module:Class"`` of its :class:`~thinwire.strategies.base.Strategy`
      (imported when a run builds it: :meth:`strategy_class`);
    - ``traffic(layout, options, workers, steps, seed, optimizer_states)``: the exact ledger
      bytes of a run (:class:`~thinwire.strategies.traffic.Traffic`), a pure function used by
      the planner (``optimizer_states``: per-element state tensors of the optimizer, e.g. 2 for
      Adam, for methods that move optimizer state); over the model's layout, or the run's
      (:class:`HasRunLayout`);
    - ``label(options)``: a short human name, e.g. ``localsgd(H=10)``;
    - ``sync_every(options)``: steps between points where the full model is defined (evaluation
      and checkpoints happen only there);
    - ``check(cfg)``: cross-section checks of a config (one-line ``UsageError``);
    - ``check_model(cfg, model)``: checks against the built model (e.g. IST's widths >= workers);
    - ``memory``: the memory options of ``[memory]`` the method runs (``zero``, ``recompute``;
      :mod:`thinwire.strategies.memory`), others are a one-line error;
    - ``alias(name, values)``: method options for a shorthand name (``topk`` -> dp with the
      topk codec), or None when the name is not one of its shorthands;
    - ``parallel``: the model-parallel degrees of ``[parallel]`` the method runs (``pp``,
      ``tp``); a degree above 1 that the method does not take is a one-line error, never
      silently ignored;
    - ``defaults``: dotted options of other sections (``train.lr``) this method runs with
      when the config does not set them;
    - ``model_kinds``: the dataset kinds the method trains on (empty: any); a config that
      names no model gets the first registered model that takes one of them;
    - ``regime``: where the method is measured to win, with the command that shows it (one
      sentence; ``thinwire compare`` prints it beside a comparison the method did not win, so
      a table it loses still names where it wins);
    - ``fault_tolerant``: the method keeps training over a torchft quorum when a worker dies
      (``runtime.fault_tolerance torchft``: its strategy takes ``Context.replica``); others
      are refused in one line;
    - ``recovery(options)``: a fault-tolerant method's :class:`Recovery` (what a joiner
      receives, what a failure discards), which the planner prices.
    """

    name: str
    summary: str
    strategy: str
    traffic: TrafficFormula
    options: type = NoOptions
    label: Callable[[Any], str] | None = None
    sync_every: Callable[[Any], int] = _one
    check: Callable[[Any], None] | None = None
    check_model: Callable[[Any, nn.Module], None] | None = None
    alias: Callable[[str, Mapping[str, str]], dict[str, str] | None] | None = None
    memory: tuple[str, ...] = ()
    parallel: tuple[str, ...] = ()
    defaults: Mapping[str, str] = field(default_factory=dict)
    model_kinds: tuple[str, ...] = ()
    fault_tolerant: bool = False
    regime: str = ""
    recovery: Callable[[Any], Recovery] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A method's entry class that names a capability as its base defines every member of
        it (at import, a misspelt member is a ``TypeError``, as it is a type error to mypy)."""
        super().__init_subclass__(**kwargs)
        missing = _unimplemented(cls)
        if missing:
            raise TypeError(f"{cls.__name__} does not define {', '.join(missing)}; define each "
                            "member of a capability it names as a base")

    @property
    def planned(self) -> bool:
        """Whether the planner's method comparisons price it from a model's layout alone: its
        traffic needs no run's layout (:class:`HasRunLayout`; a pipeline's stages the planner
        prices from a transformer's dimensions in :mod:`thinwire.planner.pipeline`)."""
        return not isinstance(self, HasRunLayout)

    def strategy_class(self) -> Any:
        """The method's :class:`~thinwire.strategies.base.Strategy` class (imports the method's
        module; typed where it is used, this module imports no Strategy)."""
        module, _, cls = self.strategy.partition(":")
        return getattr(importlib.import_module(module), cls)

    def partitioned(self) -> bool:
        """Whether a worker trains only a part of the model: the method's Strategy is not a
        :class:`~thinwire.strategies.base.ReplicatedStrategy` (its ``replicated`` is False)."""
        return not self.strategy_class().replicated

    def rescales(self, options: Any) -> bool:
        """Whether a checkpoint under ``options`` resumes at another worker count
        (:class:`Rescalable`; False for a method that is not)."""
        return isinstance(self, Rescalable) and self.rescalable(options)

    def options_for(self, options: Any, ist: Any) -> Any:
        """``options`` with the model's defaults filled in (:class:`ModelDefaults`; else
        unchanged)."""
        return self.for_model(options, ist) if isinstance(self, ModelDefaults) else options

    def sync_every_for(self, options: Any, ist: Any) -> int:
        """Steps between synchronisations on a model whose IST adapter class or plan is
        ``ist``."""
        return int(self.sync_every(self.options_for(options, ist)))

    def label_of(self, options: Any) -> str:
        return self.label(options) if self.label is not None else self.name
