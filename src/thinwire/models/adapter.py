"""IST adapters: how a model is cut into independent subnetworks, as pure data plus a hook.

Independent Subnetwork Training (Yuan et al., VLDB 2022; ResIST, Dun et al., UAI 2022; GIST,
Wolfe et al.) partitions a model's *units* among workers each round. What a unit is depends on
the model: the neurons of a hidden layer, the attention heads of a layer, the channels of a
convolution, the residual blocks of a stage. An adapter describes a model as:

- :class:`UnitGroup`: a set of interchangeable units cut together each round. ``disjoint``
  groups (widths: neurons, heads, hidden features) give every unit to exactly one worker;
  ``dealt`` groups (depth: ResIST's residual blocks) give every unit to at least one worker and
  average blocks held by several;
- :class:`TensorPlan`: one parameter or persistent buffer and how units index it: per
  :class:`Cut`, a dimension whose elements belong to the units of a group (``per_unit`` elements
  each, repeated over ``segments`` consecutive blocks for packed tensors such as a fused q|k|v
  projection); or ``unit`` = (group, u) when the whole tensor belongs to one unit of a dealt
  group; a tensor with neither is *shared* by every subnet and averaged over all workers;
- ``scaled_inputs``: modules whose input is made of a group's units, where inverted-dropout
  scaling multiplies the input by (units in the group) / (units held);
- :meth:`ISTAdapter.configure`: the model-side changes a subnet needs beyond tensor shapes
  (a LayerNorm's ``normalized_shape``, which residual blocks are enabled), and
  :meth:`ISTAdapter.configure_eval`, applied to the assembled full model for evaluation
  (ResIST's test-time scaling of partitioned blocks);
- :meth:`ISTAdapter.install_scaling`: where the inverted-dropout factors act (by default a
  forward pre-hook on every module of ``scaled_inputs``; a model whose forward calls a layer's
  weights functionally places them elsewhere);
- ``default_local_steps``: the local steps per round the method's literature uses for this model
  family (10; ResIST: 50), the ``ist`` method's K when its ``local_steps`` is left at 0.

The plan is pure data (names, shapes, integers): the planner prices IST from it without a model.
:func:`linear_stack` finds the plan of any chain of ``nn.Linear`` layers with optional
``BatchNorm1d`` / ``LayerNorm`` between them, by probing the order in which a forward pass calls
them; it is the MLP's adapter and the default for a user's own fully connected model.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from thinwire.errors import UsageError

GROUP_KINDS = ("disjoint", "dealt")
FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class UnitGroup:
    """``size`` units cut together each round (``kind``: disjoint or dealt)."""

    name: str
    size: int
    kind: str = "disjoint"

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"unit group {self.name}: kind {self.kind!r} not in {GROUP_KINDS}")
        if self.size < 1:
            raise ValueError(f"unit group {self.name}: size must be >= 1")


@dataclass(frozen=True)
class Cut:
    """Dimension ``dim`` of a tensor is indexed by the units of ``group``.

    Element layout along ``dim``: ``segments`` consecutive blocks, each holding ``per_unit``
    elements per unit in unit order; unit u's elements in block s are
    ``s * size * per_unit + u * per_unit + [0, per_unit)``. A subnet holding units U keeps the
    same layout with U in place of all units."""

    group: str
    dim: int
    per_unit: int = 1
    segments: int = 1


@dataclass(frozen=True)
class TensorPlan:
    """One parameter (``buffer=False``) or persistent buffer of the model and how it is cut."""

    name: str
    shape: tuple[int, ...]
    cuts: tuple[Cut, ...] = ()
    unit: tuple[str, int] | None = None
    buffer: bool = False
    dtype: str = "float32"

    @property
    def shared(self) -> bool:
        """Held whole by every subnet (averaged over all workers after a round)."""
        return not self.cuts and self.unit is None

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def itemsize(self) -> int:
        return int(np.dtype(self.dtype).itemsize) if self.dtype != "bfloat16" else 2


@dataclass(frozen=True)
class ISTPlan:
    """The pure-data description of a model for IST (module docstring)."""

    groups: tuple[UnitGroup, ...]
    tensors: tuple[TensorPlan, ...]
    scaled_inputs: tuple[tuple[str, str], ...] = ()
    batch_normalised: bool = False
    """Every cut group is followed by a norm using batch statistics (IST's original scaling)."""
    default_local_steps: int = 10
    """K when the ``ist`` method's ``local_steps`` is 0 (the adapter's ``default_local_steps``)."""
    default_optimizer_state: str = "reindex"
    """The optimizer state across rounds when IST's ``optimizer_state`` is ``auto`` (the
    adapter's ``default_optimizer_state``)."""

    @property
    def wire_dtype(self) -> str:
        """The dtype subnet pieces travel in: the widest floating-point dtype of the plan's
        tensors (float32 when none). Integer buffers (BatchNorm's ``num_batches_tracked``) ride
        along in it, exactly while they stay below 2**24 (float32) or 2**8 (bfloat16)."""
        floats = [t.dtype for t in self.tensors if t.dtype in FLOAT_DTYPES]
        return min(floats, key=FLOAT_DTYPES.index) if floats else "float32"

    @property
    def wire_itemsize(self) -> int:
        return 2 if self.wire_dtype == "bfloat16" else int(np.dtype(self.wire_dtype).itemsize)

    def group(self, name: str) -> UnitGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def validate(self) -> None:
        """Every cut names a group and matches its tensor's dimension; raises ValueError."""
        sizes = {g.name: g for g in self.groups}
        for t in self.tensors:
            for c in t.cuts:
                if c.group not in sizes:
                    raise ValueError(f"{t.name}: cut by unknown group {c.group}")
                g = sizes[c.group]
                if g.kind != "disjoint":
                    raise ValueError(f"{t.name}: dimensions can be cut only by disjoint groups")
                want = c.segments * g.size * c.per_unit
                if not 0 <= c.dim < len(t.shape) or t.shape[c.dim] != want:
                    raise ValueError(f"{t.name}: dim {c.dim} of {t.shape} should hold "
                                     f"{c.segments} x {g.size} x {c.per_unit} = {want} elements")
            if len({c.dim for c in t.cuts}) != len(t.cuts):
                raise ValueError(f"{t.name}: a dimension is cut twice")
            if t.unit is not None:
                if t.cuts:
                    raise ValueError(f"{t.name}: a tensor owned by one unit has no cuts")
                owner = sizes.get(t.unit[0])
                if owner is None or owner.kind != "dealt" or not 0 <= t.unit[1] < owner.size:
                    raise ValueError(f"{t.name}: unit {t.unit} is not a unit of a dealt group")

    def sizes(self, held: Mapping[str, np.ndarray]) -> dict[str, int]:
        return {g.name: len(held[g.name]) for g in self.groups}


class ISTAdapter:
    """A model's IST description (:class:`ISTPlan`) and its model-side hooks.

    Subclasses override :meth:`configure` and :meth:`configure_eval` where the model needs more
    than tensor shapes changed; ``scales`` lists the activation-scaling modes the model supports,
    the first being its default (``none`` always means: no scaling in training and none at
    evaluation, so :meth:`configure_eval` is skipped); ``default_local_steps`` is the model
    family's K (module docstring); ``default_optimizer_state`` its optimizer state across rounds
    (``reindex``: the state is dealt with its units, the measured choice for fully connected
    and attention models; ``reset`` for convolutional ones, where dealing the state does not
    help and costs the state's bytes: docs/benchmarks/ist-quality.md, "IST's quality")."""

    scales: tuple[str, ...] = ("dropout", "none")
    default_local_steps: ClassVar[int] = 10
    default_optimizer_state: str = "reindex"

    def __init__(self, plan: ISTPlan) -> None:
        plan.validate()
        self.plan = dataclasses.replace(plan, default_local_steps=self.default_local_steps,
                                        default_optimizer_state=self.default_optimizer_state)

    def configure(self, model: nn.Module, held: Mapping[str, np.ndarray] | None) -> None:
        """Make ``model`` run as the subnet holding ``held`` units (None: the full model)."""
        del model, held

    def configure_eval(self, model: nn.Module, n: int) -> None:
        """Adjust an assembled full model for evaluation after training with ``n`` subnets."""
        del model, n

    def install_scaling(self, model: nn.Module, factors: Sequence[tuple[str, float]]
                        ) -> list[Any]:
        """Inverted dropout: multiply the input of module ``name`` by ``factor`` for every
        (name, factor) (a forward pre-hook each); returns the handles to remove after the
        round."""
        modules = dict(model.named_modules())
        return [modules[name].register_forward_pre_hook(
                    lambda _m, args, f=factor: (args[0] * f, *args[1:]))
                for name, factor in factors]


# --- fully connected stacks ---------------------------------------------------------------------
_NORMS = (nn.BatchNorm1d, nn.LayerNorm)


@dataclass
class _Probe:
    order: list[str] = field(default_factory=list)


def _call_order(model: nn.Module, in_features: int) -> list[str]:
    """Names of the leaf modules in the order a forward pass calls them (one probe batch, on a
    copy: running statistics of the model itself stay untouched)."""
    model = copy.deepcopy(model)
    probe = _Probe()
    handles = []
    for name, mod in model.named_modules():
        if next(mod.children(), None) is None:
            handles.append(mod.register_forward_pre_hook(
                lambda _m, _i, name=name: probe.order.append(name)))
    param = next(model.parameters())
    was = model.training
    try:
        with torch.no_grad():
            model.train()
            model(torch.zeros(2, in_features, dtype=param.dtype, device=param.device))
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    return probe.order


class LinearStackAdapter(ISTAdapter):
    """IST for a chain of ``nn.Linear`` layers (Yuan et al.'s fully connected networks).

    Hidden layer i (the outputs of Linear i, i < L) is one disjoint group ``hidden.i``:
    1. Linear 0's weight rows (and bias) are cut by ``hidden.0``; the input width is whole;
    2. Linear i's weight (0 < i < L) is cut by ``hidden.i`` (rows) and ``hidden.i-1`` (columns):
       only the block joining a worker's own neurons of both layers travels and trains;
    3. Linear L's weight columns are cut by ``hidden.L-1``; its bias is shared;
    4. a BatchNorm1d / LayerNorm after Linear i (i < L) has its per-neuron weight, bias and
       running statistics cut by ``hidden.i``; a norm after Linear L is shared;
    5. inverted-dropout scaling multiplies the input of Linear i > 0 by width / held.
    """

    def __init__(self, plan: ISTPlan, norms: Mapping[str, str]) -> None:
        super().__init__(plan)
        self.norms = dict(norms)  # LayerNorm module name -> group
        self.scales = ("batchnorm", "dropout", "none") if plan.batch_normalised else (
            "dropout", "none")

    def configure(self, model: nn.Module, held: Mapping[str, np.ndarray] | None) -> None:
        """Step 4: a cut LayerNorm normalises over the held neurons only."""
        modules = dict(model.named_modules())
        for name, group in self.norms.items():
            mod = modules[name]
            size = self.plan.group(group).size if held is None else len(held[group])
            if isinstance(mod, nn.LayerNorm):
                mod.normalized_shape = (size,)
            elif isinstance(mod, nn.BatchNorm1d):
                mod.num_features = size


def linear_stack(model: nn.Module) -> LinearStackAdapter:
    """The IST plan of ``model`` if it is a chain of Linear layers (module docstring).

    Raises :class:`UsageError` naming the first module that does not fit, with the fix."""
    modules = dict(model.named_modules())
    calls, lin_calls = _stack_calls(model, modules)
    widths = []
    for a, b in zip(lin_calls[:-1], lin_calls[1:]):
        la, lb = modules[a], modules[b]
        assert isinstance(la, nn.Linear) and isinstance(lb, nn.Linear)
        if la.out_features != lb.in_features:
            raise UsageError(f"{a} ({la.out_features} outputs) does not feed {b} "
                             f"({lb.in_features} inputs); IST needs a chain of Linear layers")
        widths.append(la.out_features)
    groups = tuple(UnitGroup(f"hidden.{i}", w) for i, w in enumerate(widths))
    tensors, scaled, norms, batch_after = _stack_tensors(modules, calls, len(lin_calls) - 1)
    plan = ISTPlan(groups=groups, tensors=tuple(tensors), scaled_inputs=tuple(scaled),
                   batch_normalised=len(batch_after) == len(widths))
    return LinearStackAdapter(plan, norms)


def _stack_calls(model: nn.Module, modules: dict[str, nn.Module]) -> tuple[list[str], list[str]]:
    """The Linear and norm layers in call order, and the Linear ones alone; refuses a model
    that is not a chain of them (one line each, with the fix)."""
    linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
    if len(linears) < 2:
        raise UsageError(f"IST found {len(linears)} Linear layer(s) in {type(model).__name__}; "
                         "a fully connected stack needs >= 2 (a hidden layer to cut), or pass "
                         "an adapter for this model")
    first = modules[linears[0]]
    assert isinstance(first, nn.Linear)
    calls: list[str] = []
    for name in _call_order(model, first.in_features):
        mod = modules[name]
        if isinstance(mod, (nn.Linear, *_NORMS)):
            calls.append(name)
        elif any(True for _ in mod.parameters(recurse=False)):
            raise UsageError(f"IST cannot cut {name} ({type(mod).__name__}) of "
                             f"{type(model).__name__} automatically; it handles Linear, "
                             "BatchNorm1d and LayerNorm layers: pass an adapter for this model")
    if len(set(calls)) != len(calls):
        raise UsageError(f"{type(model).__name__} calls a layer twice; IST needs each layer "
                         "used once per forward: pass an adapter for this model")
    lin_calls = [n for n in calls if isinstance(modules[n], nn.Linear)]
    if set(lin_calls) != set(linears):
        unused = sorted(set(linears) - set(lin_calls))
        raise UsageError(f"{type(model).__name__}: Linear layers {unused} are not used by the "
                         "forward pass; IST needs every parameter trained")
    return calls, lin_calls


def _stack_tensors(modules: dict[str, nn.Module], calls: Sequence[str], last: int
                   ) -> tuple[list[TensorPlan], list[tuple[str, str]], dict[str, str], set[int]]:
    """Every tensor's cuts in the chain ``calls`` (``last``: the output layer's index): a
    Linear's rows by its own hidden group and columns by the previous one (its input scaled),
    a norm's parameters and buffers by the group it follows. Also the scaled inputs, the
    norms' groups, and the hidden layers followed by a BatchNorm1d on batch statistics."""
    tensors: list[TensorPlan] = []
    scaled: list[tuple[str, str]] = []
    norms: dict[str, str] = {}
    batch_after: set[int] = set()
    layer = -1
    for name in calls:
        mod = modules[name]
        if isinstance(mod, nn.Linear):
            layer += 1
            w_cuts: list[Cut] = []
            if layer < last:
                w_cuts.append(Cut(f"hidden.{layer}", 0))
            if layer > 0:
                w_cuts.append(Cut(f"hidden.{layer - 1}", 1))
                scaled.append((name, f"hidden.{layer - 1}"))
            tensors.append(TensorPlan(f"{name}.weight", tuple(mod.weight.shape), tuple(w_cuts)))
            if mod.bias is not None:
                b_cuts = (Cut(f"hidden.{layer}", 0),) if layer < last else ()
                tensors.append(TensorPlan(f"{name}.bias", tuple(mod.bias.shape), b_cuts))
            continue
        if layer < 0:
            raise UsageError(f"{name} normalises the input before any Linear layer; IST cannot "
                             "cut it automatically: pass an adapter for this model")
        cut = (Cut(f"hidden.{layer}", 0),) if layer < last else ()
        if cut:
            norms[name] = f"hidden.{layer}"
            if isinstance(mod, nn.BatchNorm1d) and not mod.track_running_stats:
                batch_after.add(layer)
        for pname, p in mod.named_parameters(recurse=False):
            tensors.append(TensorPlan(f"{name}.{pname}", tuple(p.shape), cut))
        for bname, b in mod.named_buffers(recurse=False):
            if b.dim() == 0:  # num_batches_tracked: advances alike on every worker
                tensors.append(TensorPlan(f"{name}.{bname}", (), (), buffer=True,
                                          dtype=str(b.dtype).replace("torch.", "")))
            else:
                tensors.append(TensorPlan(f"{name}.{bname}", tuple(b.shape), cut, buffer=True))
    return tensors, scaled, norms, batch_after


def subnet_shape(t: TensorPlan, sizes: Mapping[str, int], groups: Sequence[UnitGroup]) -> tuple[int, ...]:
    """Shape of ``t`` in a subnet holding ``sizes[group]`` units of each group."""
    shape = list(t.shape)
    for c in t.cuts:
        shape[c.dim] = c.segments * sizes[c.group] * c.per_unit
    del groups
    return tuple(shape)
