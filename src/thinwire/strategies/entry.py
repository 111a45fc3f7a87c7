"""The method registry's vocabulary: one :class:`MethodEntry` per method, in the method's module.

A method's module holds everything about it: its options dataclass (the ``[method]`` keys beyond
``name``), its label, its checks, the pure function giving its traffic for given shapes
(:mod:`thinwire.strategies.traffic`) and the :class:`~thinwire.strategies.base.Strategy` the
trainer runs. Registering it is one line in :data:`thinwire.strategies.METHODS`; nothing else in
the library names it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from thinwire.errors import UsageError
from thinwire.options import NoOptions

if TYPE_CHECKING:
    from torch import nn

    from thinwire.strategies.traffic import Layout, Traffic


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
    """What one worker of a method holds and computes (``MethodEntry.share``)."""

    params: float
    """Parameters (elements) the worker holds and updates."""
    flops_per_sample: float
    """Training FLOPs a step, per sample of the worker's batch."""
    other_bytes: float = 0.0
    """Bytes the worker holds beside its parameters' states and activations (hash tables)."""
    updated: float | None = None
    """Parameters its optimizer updates a step (sparse updates touch fewer; None: all)."""


@dataclass(frozen=True)
class MethodEntry:
    """One method of distributed training.

    - ``strategy``: ``"module:Class"`` of its :class:`~thinwire.strategies.base.Strategy`
      (imported when a run builds it);
    - ``label(options)``: a short human name, e.g. ``localsgd(H=10)``;
    - ``sync_every(options)``: steps between points where the full model is defined (evaluation
      and checkpoints happen only there);
    - ``check(cfg)``: cross-section checks of a config (one-line ``UsageError``);
    - ``check_model(cfg, model)``: checks against the built model (e.g. IST's widths >= workers);
    - ``traffic(layout, options, workers, steps, seed, optimizer_states)``: the exact ledger
      bytes of a run (:class:`~thinwire.strategies.traffic.Traffic`), a pure function used by
      the planner (``optimizer_states``: per-element state tensors of the optimizer, e.g. 2 for
      Adam, for methods that move optimizer state);
    - ``run_layout(cfg, model, batch)``: the :class:`~thinwire.strategies.traffic.Layout`
      the traffic formula reads for a run, when it needs more than the model's parameters (a
      pipeline's stage plan, tensor-parallel activation shapes, a wide layer's label slots),
      from the config, the built model and one step's (inputs, targets) (None: the model's
      layout);
      :func:`thinwire.measure.predict.run_layout` and ``run_traffic`` price a run with it;
    - ``memory``: the memory options of ``[memory]`` the method runs (``zero``, ``recompute``;
      :mod:`thinwire.strategies.memory`), others are a one-line error;
    - ``alias(name, values)``: method options for a shorthand name (``topk`` -> dp with the
      topk codec), or None when the name is not one of its shorthands;
    - ``planned``: whether the planner's method comparisons price it from a model's layout alone
      (False for a method whose traffic needs a run's plan, such as pipeline stages, which the
      planner prices from a transformer's dimensions in :mod:`thinwire.planner.pipeline`);
    - ``rescalable(options)``: whether a checkpoint resumes at another number of workers: the
      model (and what the method keeps beside the optimizer) is the same on every rank at a
      checkpoint, so every rank of the new run loads rank 0's state. False (the default) for
      state that is partitioned or private per rank (IST's subnets and store, codec residuals,
      model-parallel shards);
    - ``parallel``: the model-parallel degrees of ``[parallel]`` the method runs (``pp``,
      ``tp``); a degree above 1 that the method does not take is a one-line error, never
      silently ignored;
    - ``for_model(options, ist)``: the options with the model's own defaults filled in, given
      the model's IST adapter class or plan (anything with ``default_local_steps``; None when
      the model has none), e.g. IST's automatic K -> the model family's K. The config's
      synchronisation period and the planner's use it (:meth:`sync_every_for`);
    - ``defaults``: dotted options of other sections (``train.lr``) this method runs with
      when the config does not set them;
    - ``model_kinds``: the dataset kinds the method trains on (empty: any); a config that
      names no model gets the first registered model that takes one of them;
    - ``formulas``: further pure functions of the method by name, which the planner prices it
      with beyond ``traffic`` (:meth:`formula`): e.g. dp's ``buckets`` (DDP's bucket traffic),
      ``owners`` (ZeRO-1's parameter owners), a compressed method's ``codec`` (the codec spec
      of its options) and ``uncompressed`` (its options with the codec off), the
      pipeline's ``plan`` (its stage plan's class), ``message_bytes`` and ``order`` (its
      schedule's pass order), IST's ``worker_numel`` (elements a worker's subnet trains); the
      planner imports no method's module, only what its entry declares.
    - ``share(layout, options, workers)``: what one worker holds and computes
      (:class:`WorkerShare`) for a method that cuts the model its own way (a sharded wide
      layer), priced by the planner from the layout (None: the whole model, or the IST plan's
      subnet for methods that cut IST units);
    - ``regime``: where the method is measured to win, with the command that shows it (one
      sentence; ``thinwire compare`` prints it beside a comparison the method did not win, so
      a table it loses still names where it wins).
    """

    name: str
    summary: str
    strategy: str
    options: type = NoOptions
    label: Callable[[Any], str] | None = None
    sync_every: Callable[[Any], int] = _one
    check: Callable[[Any], None] | None = None
    check_model: Callable[[Any, nn.Module], None] | None = None
    traffic: Callable[[Layout, Any, int, int, int, int], Traffic] | None = None
    run_layout: Callable[[Any, nn.Module, tuple[Any, Any]], Layout] | None = None
    alias: Callable[[str, Mapping[str, str]], dict[str, str] | None] | None = None
    planned: bool = True
    rescalable: Callable[[Any], bool] = lambda options: False
    memory: tuple[str, ...] = ()
    parallel: tuple[str, ...] = ()
    for_model: Callable[[Any, Any], Any] | None = None
    defaults: Mapping[str, str] = field(default_factory=dict)
    model_kinds: tuple[str, ...] = ()
    share: Callable[[Layout, Any, int], WorkerShare] | None = None
    formulas: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    regime: str = ""

    def formula(self, name: str) -> Callable[..., Any]:
        """The method's declared function ``name`` (``formulas``); a one-line error if the
        method declares none of that name."""
        f = self.formulas.get(name)
        if f is None:
            raise UsageError(f"method {self.name}: declares no {name!r} formula; it has "
                             f"{', '.join(sorted(self.formulas)) or 'none'}")
        return f

    def partitioned(self) -> bool:
        """Whether a worker trains only a part of the model: the method's Strategy is not a
        :class:`~thinwire.strategies.base.ReplicatedStrategy` (its ``replicated`` is False;
        imports the method's module)."""
        import importlib

        module, _, cls = self.strategy.partition(":")
        return not getattr(importlib.import_module(module), cls).replicated

    def options_for(self, options: Any, ist: Any) -> Any:
        """``options`` with the model's defaults filled in (``for_model``; else unchanged)."""
        return self.for_model(options, ist) if self.for_model is not None else options

    def sync_every_for(self, options: Any, ist: Any) -> int:
        """Steps between synchronisations on a model whose IST adapter class or plan is
        ``ist``."""
        return int(self.sync_every(self.options_for(options, ist)))

    def label_of(self, options: Any) -> str:
        return self.label(options) if self.label is not None else self.name
