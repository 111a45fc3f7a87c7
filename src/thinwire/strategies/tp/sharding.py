"""Tensor-parallel sharding of a model from its :class:`~thinwire.models.tensor_plan.TPPlan`
(the model's own data, ``ModelEntry.tensor``): per region, column-parallel layers (rows of
weight and bias, in units such as an attention head) and row-parallel ones (columns of the
weight; the bias whole). :func:`shard` rewrites the model in place:

  1. each column layer becomes a smaller ``nn.Linear`` holding rank t's rows (its heads, its
     neurons); each row layer a :class:`~thinwire.strategies.tp.operators.RowParallel` holding
     rank t's columns;
  2. without sequence parallelism, a region's input passes Megatron's *f* and a row layer's
     partial product *g* (:mod:`thinwire.strategies.tp.operators`), then the bias is added;
  3. with sequence parallelism the span of the plan (the blocks) runs on 1/tp of the sequence:
     its input is cut, its output restored; *f* and *g* become their sequence-parallel forms.
     Parameters of the span outside the split layers (LayerNorms, row biases) see only their
     slice: their gradients must be summed over the group after backward
     (:attr:`Sharded.span_replicated`).

:func:`gather_full` writes the full parameters back from every rank's slices (evaluation);
:func:`within` keeps the regions inside one part of the model (a pipeline stage);
:func:`split_dims` says what :func:`shard` would split without sharding (traffic and memory
formulas); :func:`tensor_plan` and :func:`check_split` are the one-line errors of a model
without a plan or a tp that does not divide it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from thinwire.errors import UsageError
from thinwire.runtime.comm import Comm
from thinwire.strategies.tp.operators import (
    Exchange,
    RowParallel,
    _Copy,
    _GatherSeq,
    _Split,
    _Unsplit,
)

if TYPE_CHECKING:
    from thinwire.models.tensor_plan import Region, TPPlan

__all__ = ["Sharded", "check_split", "gather_full", "shard", "split_dims", "tensor_plan",
           "within"]


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


@dataclass(frozen=True)
class Sharded:
    """What :func:`shard` did: the split parameters (name -> dim split) and the span's
    replicated parameters (gradients summed over tp with sequence parallelism)."""

    split: dict[str, int]
    span_replicated: tuple[str, ...]


def shard(model: nn.Module, plan: TPPlan, ex: Exchange, *,
          sequence_parallel: bool = False) -> Sharded:
    """Rewrite ``model`` in place into rank ``ex.comm.rank``'s tensor-parallel shard (steps 1-3
    of the module docstring). Every rank must start from the same model."""
    seq_dim = plan.seq_dim if sequence_parallel else None
    split: dict[str, int] = {}
    for i, region in enumerate(plan.regions):
        module = model.get_submodule(region.path)
        for name in region.column:
            split |= _split_column(module, region, name, ex)
        for j, name in enumerate(region.row):
            lin = module.get_submodule(name)
            assert isinstance(lin, nn.Linear)
            cols, n, t = lin.in_features, ex.size, ex.comm.rank
            lo, hi = t * cols // n, (t + 1) * cols // n
            bias = lin.bias.detach().clone() if lin.bias is not None else None
            _set(module, name, RowParallel(lin.weight.detach()[:, lo:hi].clone(), bias, ex,
                                           key=(8 * i + 2 + 2 * j), seq_dim=seq_dim))
            split[f"{region.path}.{name}.weight"] = 1
        if sequence_parallel:
            module.register_forward_pre_hook(
                lambda _m, args, k=8 * i: (_GatherSeq.apply(args[0], ex, k, plan.seq_dim),
                                           *args[1:]))
        else:
            module.register_forward_pre_hook(
                lambda _m, args, k=8 * i: (_Copy.apply(args[0], ex, k), *args[1:]))
    replicated: tuple[str, ...] = ()
    if sequence_parallel and plan.span:
        replicated = _split_sequence(model, plan, ex, split)
    return Sharded(split, replicated)


def _split_column(module: nn.Module, region: Region, name: str, ex: Exchange) -> dict[str, int]:
    """Step 1 for one column-parallel Linear of ``region``: keep this rank's rows (a
    contiguous 1/n of its output units); the split dimension of its parameters."""
    n, t = ex.size, ex.comm.rank
    lin = module.get_submodule(name)
    assert isinstance(lin, nn.Linear)
    rows = lin.out_features
    if rows % (region.unit * n):
        raise UsageError(f"tensor: {region.path}.{name} has {rows // region.unit} units, "
                         f"not divisible by parallel.tp={n}; choose a tp dividing it")
    lo, hi = t * rows // n, (t + 1) * rows // n
    new = nn.Linear(lin.in_features, hi - lo, bias=lin.bias is not None,
                    device=lin.weight.device, dtype=lin.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(lin.weight[lo:hi])
        if lin.bias is not None:
            new.bias.copy_(lin.bias[lo:hi])
    _set(module, name, new.to(lin.weight.device))
    out = {f"{region.path}.{name}.weight": 0}
    if lin.bias is not None:
        out[f"{region.path}.{name}.bias"] = 0
    return out


def _split_sequence(model: nn.Module, plan: TPPlan, ex: Exchange,
                    split: dict[str, int]) -> tuple[str, ...]:
    """Sequence parallelism over ``plan.span``: its input split along the sequence on entry,
    gathered on exit; returns the span's parameters that stay whole on every rank."""
    n, key = ex.size, 8 * len(plan.regions)
    first, last = model.get_submodule(plan.span[0]), model.get_submodule(plan.span[-1])

    def enter(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        if x.shape[plan.seq_dim] % n:
            raise UsageError(f"tensor: sequence parallelism needs the sequence length "
                             f"({x.shape[plan.seq_dim]}) divisible by parallel.tp={n}")
        return (_Split.apply(x, ex, key, plan.seq_dim), *args[1:])

    first.register_forward_pre_hook(enter)
    last.register_forward_hook(lambda _m, _a, out: _Unsplit.apply(out, ex, key + 1, plan.seq_dim))
    prefixes = tuple(p + "." for p in plan.span)
    return tuple(name for name, _ in model.named_parameters()
                 if name.startswith(prefixes) and name not in split)


def gather_full(model: nn.Module, sharded: Sharded, comm: Comm, into: nn.Module | None) -> None:
    """Write the full parameters into ``into`` (when given) from every tp rank's slices
    (all-gathers tagged control: evaluation, not training). Every tp rank calls it."""
    full = dict(into.named_parameters()) if into is not None else {}
    for name, p in model.named_parameters():
        value = p.detach()
        if name in sharded.split:
            value = torch.cat(comm.all_gather(value.contiguous(), tag="control"),
                              sharded.split[name])
        if into is not None:
            with torch.no_grad():
                full[name].copy_(value)


def tensor_plan(cfg: Any, model: nn.Module, who: str = "method tensor") -> TPPlan:
    """The model's :class:`TPPlan` from its registry entry, or a one-line error naming
    ``who`` asked and the models that have one."""
    from thinwire.models import MODELS

    entry = MODELS.get(cfg.model.name)
    if entry.tensor is None:
        offered = [n for n, e in MODELS.entries() if e.tensor is not None]
        raise UsageError(f"{who}: model {cfg.model.name} offers no tensor-parallel plan; "
                         f"use a model that does ({', '.join(offered)})")
    return entry.tensor(model)


def within(plan: TPPlan, model: nn.Module, part: nn.Module) -> TPPlan:
    """The regions of ``plan`` whose module lies inside ``part`` (e.g. one pipeline stage of
    ``model``), without a sequence-parallel span: a part of the model is sharded alone."""
    from thinwire.models.tensor_plan import TPPlan

    inside = {id(m) for m in part.modules()}
    regions = tuple(r for r in plan.regions if id(model.get_submodule(r.path)) in inside)
    return TPPlan(regions, (), plan.seq_dim, plan.width, plan.seq_len)


def split_dims(model: nn.Module, plan: TPPlan) -> dict[str, int]:
    """The parameters :func:`shard` splits (name -> dim), without sharding: what
    :attr:`Sharded.split` will hold, for traffic formulas and memory counts."""
    out: dict[str, int] = {}
    for region in plan.regions:
        module = model.get_submodule(region.path)
        for name in region.column:
            out[f"{region.path}.{name}.weight"] = 0
            if getattr(module.get_submodule(name), "bias", None) is not None:
                out[f"{region.path}.{name}.bias"] = 0
        for name in region.row:
            out[f"{region.path}.{name}.weight"] = 1
    return out


def check_split(cfg: Any, model: nn.Module, who: str = "method tensor") -> TPPlan:
    """The model's plan splits ``parallel.tp`` ways (one-line errors naming ``who``): the model
    has a plan, no dropout, and tp divides every column layer's units."""
    plan = tensor_plan(cfg, model, who)
    tp = cfg.parallel.tp
    if getattr(cfg.model.options, "dropout", 0.0):
        raise UsageError(f"{who}: model.dropout must be 0 (the ranks of a tensor-parallel group "
                         "would draw different dropout masks for the same activations)")
    for region in plan.regions:
        module = model.get_submodule(region.path)
        for name in region.column:
            lin = module.get_submodule(name)
            assert isinstance(lin, nn.Linear)
            rows = lin.out_features
            if (rows // region.unit) % tp:
                raise UsageError(f"parallel.tp={tp} does not divide the {rows // region.unit} "
                                 f"units of {region.path}.{name}; choose a tp that does")
    return plan
