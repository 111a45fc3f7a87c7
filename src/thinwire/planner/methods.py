"""The methods thinwire trains, in the planner: bytes from their own traffic functions.

A strategy's ``method`` is empty (the planner's own data parallelism: a gradient all-reduce
per step, ZeRO stages; :mod:`thinwire.planner.sync`) or a method spec as ``thinwire train``
takes it: ``name[:key=value,...]`` of :data:`thinwire.strategies.METHODS` (``localsgd:period=20``)
or a shorthand a method declares (a codec's name: ``topk:ratio=0.01``). Nothing here names a
method; every fact comes from the method's registry entry:

1. resolve the spec to the entry and its options dataclass, defaults included (:func:`resolve`):
   the planner's defaults are the method's own, the ones ``thinwire train`` uses;
2. the model's :class:`~thinwire.strategies.traffic.Layout` (:func:`layout_of`): an MLP spec
   from its IST plan (:func:`thinwire.models.mlp.mlp_plan`, no model built), a counted module
   with an adapter (GPT, ResNet, GCN: ``model_spec_from_module(..., adapter=)``) from the
   adapter's plan, so IST is priced by the adapter's own cut and ``ist_traffic``; a transformer
   from the shapes of one device's shard (Narayanan et al. 2021: QKV, projection and FFN
   matrices split t ways, L/p layers, the first stage's embeddings); a counted model as one
   flat tensor of its parameters;
3. the steady state of a sync period of S = ``sync_every`` steps (on this model: the entry's
   ``options_for`` fills in the model's own defaults, IST's K from the plan): T(2S) - T(S) of
   the method's
   ``traffic`` (the first period differs: DDP's first step sends one bucket of everything, IST's
   first round moves no optimizer state), per step / S (:func:`per_step`);
4. what a worker trains: the whole model for methods whose Strategy is a
   :class:`~thinwire.strategies.base.ReplicatedStrategy`; otherwise the part the model's IST
   plan deals it, the mean over workers of round 0's subnet (:func:`worker_params`, the
   ``worker_numel`` of the :class:`~thinwire.strategies.entry.Subnets` entry), which needs a
   plan (MLP specs, counted modules with an adapter); :func:`worker_widths` (the compute and
   activation model of a subnet) is the MLP's; a method that cuts the model its own way gives
   a worker's part as its entry's ``share`` (:class:`~thinwire.strategies.entry.Shares`;
   :func:`method_share`: slide's shard of the wide layer, its active fraction's work and its
   hash tables).

torch is imported on use only (the registry's modules and the adapters need it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from thinwire.errors import UsageError
from thinwire.planner.specs import CountedSpec, MLPSpec, ModelSpec, TransformerSpec

if TYPE_CHECKING:
    from thinwire.models.adapter import ISTPlan
    from thinwire.strategies.entry import Bucketed, MethodEntry, Staged, Subnets, WorkerShare
    from thinwire.strategies.traffic import Layout, Traffic

OPTIMIZER_STATES = {"adam": 2, "momentum": 1, "sgd": 0}
"""Per-element optimizer state tensors (what travels with a parameter that moves its state)."""


@dataclass(frozen=True)
class Method:
    """A resolved method spec: its registry entry and options (step 1)."""

    spec: str
    entry: MethodEntry
    options: Any

    @property
    def label(self) -> str:
        """The method's own short name, e.g. ``localsgd(H=10)``."""
        return self.entry.label_of(self.options)

    @property
    def sync_every(self) -> int:
        """Steps between synchronisations (S)."""
        return int(self.entry.sync_every(self.options))

    @property
    def codec(self) -> str:
        """The codec spec the method encodes with (a
        :class:`~thinwire.strategies.entry.Compressed` entry's ``codec``; "none": none)."""
        from thinwire.strategies.entry import Compressed

        entry = self.entry
        return entry.codec(self.options) if isinstance(entry, Compressed) else "none"

    def without_codec(self) -> Method:
        """The same method with its codec switched off (a compressed entry's
        ``uncompressed``; the method itself when it has no codec)."""
        from thinwire.strategies.entry import Compressed

        entry = self.entry
        if not isinstance(entry, Compressed):
            return self
        return Method(self.spec + " (uncompressed)", entry, entry.uncompressed(self.options))


@lru_cache(maxsize=256)
def resolve(spec: str) -> Method:
    """Step 1: ``name[:key=value,...]`` or a declared shorthand -> :class:`Method`; unknown
    names and options are one-line errors."""
    from thinwire.options import build_options, parse_spec
    from thinwire.strategies import METHODS

    name, values = parse_spec(spec, "--method")
    if name not in METHODS:
        name, values = _alias(name, values, spec)
    entry = METHODS.get(name)
    options = build_options(entry.options, values, "method", owner=f"method {name}")
    return Method(spec, entry, options)


def _alias(name: str, values: dict[str, str], spec: str) -> tuple[str, dict[str, str]]:
    """The method and options a shorthand stands for (a codec's name: compressed DP)."""
    from thinwire.strategies import METHODS

    for _, entry in METHODS.entries():
        if entry.alias is not None and (resolved := entry.alias(name, values)) is not None:
            options = dict(resolved)
            return options.pop("name"), options
    raise UsageError(f"--method {spec}: unknown method {name!r}; use one of "
                     f"{', '.join(METHODS.names())} or a codec name (e.g. topk:ratio=0.01)")


def method_that_is(capability: type, what: str) -> MethodEntry:
    """The first registered method whose entry is ``capability`` (a protocol of
    :mod:`thinwire.strategies.entry`, e.g. ``Staged``): how the planner finds, without naming
    it, the method whose own formulas it prices with (ZeRO's owners, a pipeline's stage plan,
    IST's subnets); a one-line error naming ``what`` if none is."""
    from thinwire.strategies import METHODS

    for _, entry in METHODS.entries():
        if isinstance(entry, capability):
            return entry
    raise UsageError(f"no registered method is {capability.__name__} ({what})")


def bucketed() -> Bucketed:
    """The method with DDP's buckets and ZeRO-1's owners
    (:class:`~thinwire.strategies.entry.Bucketed`)."""
    from thinwire.strategies.entry import Bucketed

    entry = method_that_is(Bucketed, "DDP's buckets and ZeRO-1's owners")
    assert isinstance(entry, Bucketed)
    return entry


def staged() -> Staged:
    """The method with a pipeline's stage plan, message bytes and pass order
    (:class:`~thinwire.strategies.entry.Staged`)."""
    from thinwire.strategies.entry import Staged

    entry = method_that_is(Staged, "a pipeline's stage plan")
    assert isinstance(entry, Staged)
    return entry


def subnets() -> Subnets:
    """The method whose workers train subnets of an IST plan
    (:class:`~thinwire.strategies.entry.Subnets`)."""
    from thinwire.strategies.entry import Subnets

    entry = method_that_is(Subnets, "a worker's subnet of an IST plan")
    assert isinstance(entry, Subnets)
    return entry


def default_methods() -> list[str]:
    """Every registered method priced from a model's layout alone (``planned``: its entry is
    no :class:`~thinwire.strategies.entry.HasRunLayout`), at its defaults, except the first
    (the runs' default method, plain data parallelism, which the planner's own data
    parallelism stands for)."""
    from thinwire.strategies import METHODS

    return [n for n, e in list(METHODS.entries())[1:] if e.planned]


def partitioned(method: Method) -> bool:
    """Step 4: whether a worker trains only a part of the model (its Strategy is not a
    ReplicatedStrategy; :meth:`~thinwire.strategies.entry.MethodEntry.partitioned`)."""
    return method.entry.partitioned()


def mlp_ist_plan(model: MLPSpec) -> ISTPlan:
    """The IST plan of an MLP spec (:func:`thinwire.models.mlp.mlp_plan`)."""
    from thinwire.models.mlp import mlp_plan

    w = model.widths
    return mlp_plan(w[0], w[1:-1], w[-1], norm=model.norm)


def ist_plan(model: ModelSpec) -> ISTPlan | None:
    """The IST plan of a spec: an MLP's, a counted module's adapter plan, else None."""
    if isinstance(model, MLPSpec):
        return mlp_ist_plan(model)
    if isinstance(model, CountedSpec):
        return model.ist  # type: ignore[no-any-return]
    return None


def transformer_shapes(model: TransformerSpec, tp: int, pp: int
                       ) -> list[tuple[str, tuple[int, ...]]]:
    """One device's parameter shapes: L/p layers split t ways, the first stage's embeddings."""
    h, f, t = model.hidden, model.ffn, tp
    layer: list[tuple[str, tuple[int, ...]]] = [("qkv.weight", (3 * h // t, h)), ("qkv.bias", (3 * h // t,)),
             ("proj.weight", (h, h // t)), ("proj.bias", (h,)),
             ("fc1.weight", (f // t, h)), ("fc1.bias", (f // t,)),
             ("fc2.weight", (h, f // t)), ("fc2.bias", (h,)),
             ("ln1.weight", (h,)), ("ln1.bias", (h,)), ("ln2.weight", (h,)), ("ln2.bias", (h,))]
    shapes: list[tuple[str, tuple[int, ...]]] = [("tokens", (-(-model.vocab // t), h)),
                                                  ("positions", (model.seq, h))]
    for i in range(model.layers // pp):
        shapes += [(f"layers.{i}.{name}", shape) for name, shape in layer]
    return shapes


@lru_cache(maxsize=64)
def layout_of(model: ModelSpec, tp: int = 1, pp: int = 1) -> Layout:
    """Step 2: the layout the method's traffic function reads (module docstring)."""
    from thinwire.strategies.traffic import Layout

    plan = ist_plan(model)
    if plan is not None:
        return Layout.from_shapes([(t.name, t.shape) for t in plan.tensors if not t.buffer],
                                  ist=plan)
    wide = getattr(model, "wide", None)
    if wide is not None:  # an extreme-classification network: xmlp's parameters and shapes
        H = wide.hidden
        shapes = [("embed.weight", (wide.features, H)), ("bias", (H,)),
                  ("wide.weight", (wide.labels, H)), ("wide.bias", (wide.labels,))]
        return dataclasses.replace(Layout.from_shapes(shapes), wide=wide)
    if isinstance(model, TransformerSpec):
        return Layout.from_shapes(transformer_shapes(model, tp, pp))
    assert isinstance(model, CountedSpec)
    return Layout.from_shapes([("params", (model.params,))])


@dataclass(frozen=True)
class PerStep:
    """A method's traffic per optimizer step in the steady state (step 3)."""

    payload_mean: float
    """Ledger payload per worker (what summary.json's payload_per_worker_mean counts)."""
    sent_mean: float
    """Bytes a worker sends, the mean over workers."""
    sent_max: float
    """Bytes the busiest worker sends (rank 0 for central deployments)."""
    calls: tuple[tuple[str, float, float], ...]
    """Rank 0's (op, calls, wire bytes) per step: what its communication time is made of."""


def _minus(a: Traffic, b: Traffic, steps: int) -> PerStep:
    """(a - b) / steps, per worker and per rank-0 op."""
    sent = [(x - y) / steps for x, y in zip(a.sent, b.sent)]
    pay = [(x - y) / steps for x, y in zip(a.payload, b.payload)]
    calls = tuple((op, (c - b.rank0_calls.get(op, (0, 0))[0]) / steps,
                   (w - b.rank0_calls.get(op, (0, 0))[1]) / steps)
                  for op, (c, w) in sorted(a.rank0_calls.items()))
    return PerStep(sum(pay) / len(pay), sum(sent) / len(sent), max(sent), calls)


@lru_cache(maxsize=512)
def per_step(model: ModelSpec, spec: str, workers: int, tp: int, pp: int, optimizer: str,
             codec: bool = True) -> PerStep:
    """Step 3: the steady-state traffic per step of ``spec`` on ``workers`` replicas (or
    subnets) of ``model``'s per-device shard; ``codec=False``: with its codec switched off."""
    from thinwire.strategies.entry import Shares

    method = resolve(spec) if codec else resolve(spec).without_codec()
    layout = layout_of(model, tp, pp)
    options = method.entry.options_for(method.options, layout.ist)  # the model's own defaults
    period = int(method.entry.sync_every(options))
    if layout.ist is None and not isinstance(method.entry, Shares) and partitioned(method):
        raise UsageError(f"--method {spec}: {method.entry.name} cuts the model into units; the "
                         "planner has their plan for MLP specs (mlp-W0-...-WL) and for modules "
                         "counted with their adapter (model_spec_from_module(m, adapter=))")
    states = OPTIMIZER_STATES[optimizer]
    one = method.entry.traffic(layout, options, workers, period, 0, states)
    two = method.entry.traffic(layout, options, workers, 2 * period, 0, states)
    return _minus(two, one, period)


def method_share(model: ModelSpec, spec: str, workers: int) -> WorkerShare | None:
    """Step 4 for a method with its own ``share`` (:class:`~thinwire.strategies.entry.Shares`):
    one worker's part of ``model`` (None: the method has none, or no method)."""
    from thinwire.strategies.entry import Shares

    if not spec:
        return None
    method = resolve(spec)
    entry = method.entry
    if not isinstance(entry, Shares):
        return None
    return entry.share(layout_of(model), method.options, workers)



def work_share(model: ModelSpec, spec: str, workers: int) -> float:
    """The fraction of the full model's training FLOPs per sample a worker of a cutting
    method does (its ``share``, else its parameters' fraction)."""
    share = method_share(model, spec, workers)
    if share is not None:
        if isinstance(model, TransformerSpec):
            raise UsageError(f"{spec}: a worker's share of a transformer's work is not modelled")
        return share.flops_per_sample / model.flops_per_sample
    return worker_params(model, workers, spec) / model.params


def _overlap(spec: str, workers: int) -> int:
    """Workers holding each cut unit under ``spec`` (its ``overlap`` option resolved by a
    :class:`~thinwire.strategies.entry.Subnets` entry's ``overlap``, 0: auto; 1 where the
    method has no subnets, or no spec)."""
    from thinwire.strategies.entry import Subnets

    if not spec:
        return 1
    method = resolve(spec)
    entry = method.entry
    return int(entry.overlap(method.options, workers)) if isinstance(entry, Subnets) else 1


def worker_params(model: ModelSpec, workers: int, spec: str = "") -> float:
    """Step 4: parameters a worker trains when the model's IST plan deals its units over
    ``workers`` (round 0's subnets, each unit held by ``spec``'s overlap of workers, the mean
    over workers; the whole model for one worker), or the method's own ``share`` when
    ``spec``'s entry declares one."""
    share = method_share(model, spec, workers)
    if share is not None:
        return share.params
    if workers <= 1:
        return float(model.params)
    plan = ist_plan(model)
    if plan is None:
        raise UsageError(f"model {model.name}: the planner has IST plans for MLP specs and for "
                         "modules counted with their adapter only")
    return float(subnets().worker_numel(plan, workers, _overlap(spec, workers)))


def worker_widths(model: MLPSpec, workers: int, spec: str = "") -> tuple[float, ...]:
    """Step 4: the widths a worker's subnet has on average (each group's units x the
    overlap / workers)."""
    plan = mlp_ist_plan(model)
    w = model.widths
    r = _overlap(spec, workers)
    return (float(w[0]), *(g.size * r / workers for g in plan.groups), float(w[-1]))
