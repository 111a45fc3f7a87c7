"""Step 1 of :mod:`thinwire.models.graph`: the forward as a torch.fx graph at module
granularity (symbolic tracing; fx's meta tracer where the forward branches on a shape)."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx.experimental import meta_tracer

from thinwire.errors import UsageError
from thinwire.models.graph.errors import cannot_trace
from thinwire.models.graph.rules import module_rule


class _Leaves:
    """Tracing policy shared by both tracers: modules whose rule is a leaf (torch's
    attention and transformer modules, timm's attention) and the modules marked shared are kept
    one node; the module being traced when tracing fails is
    kept for the error message."""

    shared: set[str]
    failed_at: str | None

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        rule = module_rule(m)
        if qualname in self.shared or (rule is not None and rule.leaf):
            return True
        return super().is_leaf_module(m, qualname)  # type: ignore[misc]

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)  # type: ignore[misc]
        except Exception:
            if self.failed_at is None:
                self.failed_at = self.path_of_module(m)  # type: ignore[attr-defined]
            raise


class _SymbolicTracer(_Leaves, fx.Tracer):
    def __init__(self, shared: Sequence[str]) -> None:
        super().__init__()
        self.shared, self.failed_at = set(shared), None
        self.proxy_buffer_attributes = True  # a buffer sliced by a shape stays in the graph


class _MetaTracer(_Leaves, meta_tracer.MetaTracer):
    def __init__(self, shared: Sequence[str]) -> None:
        super().__init__()
        self.shared, self.failed_at = set(shared), None


def example_args(example_input: Any) -> tuple[Any, ...]:
    return tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)


def trace(model: nn.Module, args: tuple[Any, ...], shared: Sequence[str]) -> fx.GraphModule:
    """Symbolic tracing first (no values needed); where the forward branches on a shape
    (``if x.dim() != 4``), the meta tracer, whose proxies carry the example's shapes."""
    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(args) > len(params):
        raise UsageError(f"IST example_input has {len(args)} values, {type(model).__name__}"
                         f".forward takes {len(params)}; pass one value per forward argument")
    concrete = {p.name: a for p, a in zip(params, args) if not isinstance(a, torch.Tensor)}
    concrete.update({p.name: p.default for p in params[len(args):]})
    symbolic = _SymbolicTracer(shared)
    try:
        graph = symbolic.trace(model, concrete_args=concrete or None)
        return fx.GraphModule(symbolic.root, graph)
    except Exception as e:  # noqa: BLE001 - retried with shapes, then one line
        first = e
    # the meta tracer's values are the example itself, on its own device, so that a device
    # read in the forward (torch.arange(..., device=x.device)) records the real one
    meta_args = {p.name: a for p, a in zip(params, args) if isinstance(a, torch.Tensor)}
    meta = _MetaTracer(shared)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            graph = meta.trace(model, meta_args=meta_args, concrete_args=concrete or None)
        return fx.GraphModule(meta.root, graph)
    except Exception:  # noqa: BLE001 - any tracing failure is the same one-line error
        pass
    where = meta.failed_at or symbolic.failed_at or ""
    text = str(first).strip()
    reason = text.splitlines()[0][:120] if text else type(first).__name__
    raise UsageError(cannot_trace(model, where, dict(model.named_modules()).get(where), reason))
