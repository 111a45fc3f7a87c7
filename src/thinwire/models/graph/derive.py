""":func:`derive_adapter`: the steps of :mod:`thinwire.models.graph` in order, on a copy of
the model, and one subnet forward to check the plan."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from thinwire.errors import UsageError
from thinwire.models.graph.adapter import GraphAdapter
from thinwire.models.graph.emit import blocks_adapter, channels_adapter
from thinwire.models.graph.errors import cannot_run, subnet_fails
from thinwire.models.graph.groups import Graph
from thinwire.models.graph.propagate import Propagation, RunFailed, first_line
from thinwire.models.graph.tracing import call_kwargs, example_call, trace

RESIDUAL_MODES = ("whole", "channels", "blocks")
EMBEDDING_MODES = ("shared", "cut")

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
               "_backward_pre_hooks", "_forward_hooks_with_kwargs",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def _copy_without_hooks(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` without its hooks (they may hold anything: IST's own hold a
    process group)."""
    memo: dict[int, Any] = {}
    for m in model.modules():
        for attr in _HOOK_DICTS:
            d = m.__dict__.get(attr)
            if d is not None:
                memo[id(d)] = type(d)()
    return copy.deepcopy(model, memo)


def derive_adapter(model: nn.Module, example_input: Any, *, residual: str = "whole",
                   embeddings: str = "shared", shared: Sequence[str] = (),
                   min_units: int = 2, example_kwargs: Mapping[str, Any] | None = None
                   ) -> GraphAdapter:
    """The IST adapter of ``model`` from its graph (:mod:`thinwire.models.graph`), traced with
    ``example_input``: a tensor, a tuple of the forward's positional arguments, or a dict of its
    keyword arguments (``{"input_ids": x, "attention_mask": m}``, as a loop that calls
    ``model(input_ids=x, attention_mask=m)``).

    Args:
        residual: ``whole`` (the default: a residual stream, the channel group both sides of an
            addition share, stays whole on every subnet and is averaged; the units inside its
            branches, hidden channels, heads and FFN neurons, are cut), ``channels`` (the stream
            is cut like any other group: every norm over it then normalises over a subnet's
            share only; docs/IST.md, "Getting a good model out of IST") or ``blocks`` (ResIST:
            residual blocks are dealt units, nothing else is cut).
        embeddings: ``shared`` (embedding dimensions, and the residual stream they feed, stay
            whole) or ``cut`` (cut with the layers they feed).
        shared: names of submodules kept whole: not traced into, their tensors shared by every
            subnet, the channels they touch not cut (the escape hatch for a submodule the
            tracer cannot follow).
        min_units: a group with fewer units is shared (IST passes its number of workers).
        example_kwargs: keyword arguments of the forward beside a positional ``example_input``
            (``model(x, attention_mask=m)``: ``example_input=x, example_kwargs={...}``).

    Raises :class:`UsageError` (one line) for a model the tracer cannot follow and for a model
    with no unit to cut."""
    _check_options(model, residual, embeddings, shared)
    args, kwargs = example_call(example_input, example_kwargs)
    # traced and run on copies: the trace runs the modules on the example (BatchNorm statistics
    # move), the model itself stays untouched
    work = _copy_without_hooks(model)
    traced = trace(work, args, kwargs, shared)
    graph = Graph()
    prop = _propagate(model, work, traced, graph, embeddings, shared)
    persistent = dict(model.state_dict(keep_vars=True))
    params = dict(model.named_parameters())
    named = [*params.items(), *((n, b) for n, b in model.named_buffers() if n in persistent)]
    if residual == "blocks":
        adapter = blocks_adapter(model, traced.gm, prop.shapes, named, params, shared)
        _check_subnet(work, adapter, args, {**call_kwargs(work), **kwargs})
        return adapter
    for i in range(len(graph.groups)):
        g = graph.groups[i]
        if (embeddings == "shared" and g.embedding) or (residual == "whole" and g.stream):
            g.poisoned = True
            graph.groups[graph.find(i)].poisoned = True
    # a tied tensor under every name (an exported graph may read GPT-2's shared embedding as
    # lm_head.weight): the plan keeps its first name, the cuts of all its names
    tied = [*model.named_parameters(remove_duplicate=False),
            *((n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in persistent)]
    adapter = channels_adapter(model, graph, tied, params, min_units)
    _check_subnet(work, adapter, args, {**call_kwargs(work), **kwargs})
    return adapter


def _check_options(model: nn.Module, residual: str, embeddings: str,
                   shared: Sequence[str]) -> None:
    """One line for an unknown mode or a shared name that is not a submodule."""
    if residual not in RESIDUAL_MODES:
        raise UsageError(f"IST residual {residual!r}: use whole, channels or blocks")
    if embeddings not in EMBEDDING_MODES:
        raise UsageError(f"IST embeddings {embeddings!r}: use shared or cut")
    modules = dict(model.named_modules())
    unknown = [s for s in shared if s not in modules or not s]
    if unknown:
        raise UsageError(f"IST shared names {unknown} are not submodules of "
                         f"{type(model).__name__}; use names from model.named_modules()")


def _propagate(model: nn.Module, work: nn.Module, traced: Any, graph: Graph, embeddings: str,
               shared: Sequence[str]) -> Propagation:
    """Run the traced copy on the example in training mode, moving channel groups through
    ``graph`` by the rule table; a failing node is one line naming its module and op."""
    prop = Propagation(traced.gm, graph, embeddings, shared, exported=traced.exported,
                       owners=dict(work.named_modules()))
    was = work.training
    work.train()
    try:
        with torch.no_grad():
            prop.run(*traced.inputs)
    except RunFailed as e:
        raise UsageError(cannot_run(model, e.where, e.op, e.text)) from None
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - outside any node (the graph's own arguments)
        raise UsageError(cannot_run(model, "", "the traced graph", first_line(e))) from None
    finally:
        work.train(was)
    return prop


def _check_subnet(work: nn.Module, adapter: GraphAdapter, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> None:
    """One forward of a subnet holding the first half of every group's units, on the copy: a
    forward that fixes a cut width in code (``x.view(b, n, 4, 16)`` where 4 is a head count)
    fails here, in one line, and not in the first round."""
    plan = adapter.plan
    held = {g.name: np.arange(max(1, g.size // 2)) for g in plan.groups}
    tensors = {**dict(work.named_parameters()), **dict(work.named_buffers())}
    with torch.no_grad():
        for t in plan.tensors:
            x = tensors[t.name].data
            for c in t.cuts:
                size = plan.group(c.group).size
                units = torch.arange(len(held[c.group]), device=x.device)
                idx = (torch.arange(c.segments, device=x.device)[:, None] * size * c.per_unit
                       + (units[:, None] * c.per_unit
                          + torch.arange(c.per_unit, device=x.device)).reshape(1, -1))
                x = x.index_select(c.dim, idx.reshape(-1))
            tensors[t.name].data = x.clone()
        adapter.configure(work, held)
        running: list[str] = []  # the modules whose forward is under way, outermost first

        def enter(name: str) -> Any:
            return lambda *_: running.append(name)

        def leave(*_: Any) -> None:
            running.pop()

        hooks = [h for name, m in work.named_modules() if name
                 for h in (m.register_forward_pre_hook(enter(name)),
                           m.register_forward_hook(leave))]
        try:
            work.train()
            work(*args, **kwargs)
        except UsageError:  # a cut module's own refusal, already one line
            raise
        except Exception as e:  # noqa: BLE001 - reported in one line
            where = running[-1] if running else ""
            module = dict(work.named_modules()).get(where) if where else None
            raise UsageError(subnet_fails(work, where, module, first_line(e))) from None
        finally:
            for h in hooks:
                h.remove()
            adapter.configure(work, None)
