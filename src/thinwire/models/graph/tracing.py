"""Step 1 of :mod:`thinwire.models.graph`: the forward as a torch.fx graph at module
granularity (symbolic tracing; fx's meta tracer where the forward branches on a shape)."""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.fx.experimental import meta_tracer

from thinwire.errors import UsageError
from thinwire.models.graph.errors import cannot_trace
from thinwire.models.graph.rules import is_leaf


class _Leaves:
    """Tracing policy shared by both tracers: modules whose rule is a leaf (torch's
    attention and transformer modules, timm's attention) and the modules marked shared are kept
    one node; the module being traced when tracing fails is
    kept for the error message."""

    shared: set[str]
    failed_at: str | None

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname in self.shared or is_leaf(m):
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


def call_kwargs(model: nn.Module) -> dict[str, Any]:
    """Keyword arguments every traced and checked forward of ``model`` gets: ``use_cache=False``
    for a Hugging Face ``transformers`` model (its key/value cache is an inference object that
    neither tracer follows and IST never needs; pass the same in your training loop, or set
    ``model.config.use_cache = False``)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache") and "use_cache" in inspect.signature(
            model.forward).parameters:
        return {"use_cache": False}
    return {}


@dataclass
class Traced:
    """A traced forward: ``gm`` runs on ``inputs`` (the example, flattened for an exported
    graph); ``exported``: the graph is torch.export's (aten operators, parameters as
    ``get_attr`` nodes named as in the model, each node's ``nn_module_stack`` its modules)."""

    gm: fx.GraphModule
    inputs: tuple[Any, ...]
    exported: bool = False


def trace(model: nn.Module, args: tuple[Any, ...], shared: Sequence[str]) -> Traced:
    """1. torch.fx's symbolic tracing (no values needed), kept at module granularity; 2. where
    the forward branches on a shape (``if x.dim() != 4``), fx's meta tracer, whose proxies carry
    the example's shapes; 3. where neither follows the forward (Hugging Face ``transformers``
    models: their forwards take ``**kwargs`` and decorated wrappers fx cannot enter),
    ``torch.export.export(strict=False)``, which runs the forward in Python and records aten
    operators (:mod:`thinwire.models.graph.aten` holds their rules). When all fail, one line
    names the innermost module and both tracers' reasons."""
    try:
        return Traced(_trace_fx(model, args, shared), args)
    except _FxFailed as fx_failed:
        kwargs = call_kwargs(model)
        level = logging.root.manager.disable
        try:
            logging.disable(logging.WARNING)  # export logs its failure's graph at length
            # a failed export prints its partial graph to stderr: kept out of the one line
            with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
                warnings.simplefilter("ignore")
                ep = torch.export.export(model, args, kwargs=kwargs or None, strict=False)
            gm = ep.module()
        except Exception as e:  # noqa: BLE001 - reported with fx's reason, in one line
            where, module, why = fx_failed.args
            reason = f"torch.fx: {why}; torch.export: {_first_line(e)}"
            raise UsageError(cannot_trace(model, where, module, reason)) from None
        finally:
            logging.disable(level)
        flat = tuple(pytree.tree_leaves((args, kwargs)))
        return Traced(cast(fx.GraphModule, gm), flat, exported=True)


class _FxFailed(Exception):
    """Neither fx tracer followed the forward: (innermost module's name, the module, reason)."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:120].strip() if text else type(e).__name__


def _trace_fx(model: nn.Module, args: tuple[Any, ...], shared: Sequence[str]
              ) -> fx.GraphModule:
    """Steps 1-2 of :func:`trace`."""
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
    raise _FxFailed(where, dict(model.named_modules()).get(where), _first_line(first))
