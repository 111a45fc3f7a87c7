"""Step 1 of :mod:`thinwire.models.graph`: the forward as a torch.fx graph at module
granularity (symbolic tracing; fx's meta tracer where the forward branches on a shape)."""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx._pytree as fx_pytree
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
        if getattr(self, "_inside_leaf", False):
            # the meta tracer runs a leaf's forward on values to learn its output; the
            # modules that forward calls are its inside, not nodes of the graph
            return forward(*args, **kwargs)
        path = self.path_of_module(m)  # type: ignore[attr-defined]
        leaf = self.is_leaf_module(m, path)
        self._inside_leaf = leaf
        try:
            return super().call_module(m, forward, args, kwargs)  # type: ignore[misc]
        except Exception:
            if self.failed_at is None:
                self.failed_at = path
            raise
        finally:
            self._inside_leaf = False


class _SymbolicTracer(_Leaves, fx.Tracer):
    def __init__(self, shared: Sequence[str]) -> None:
        super().__init__()
        self.shared, self.failed_at = set(shared), None
        self.proxy_buffer_attributes = True  # a buffer sliced by a shape stays in the graph


class _MetaTracer(_Leaves, meta_tracer.MetaTracer):
    def __init__(self, shared: Sequence[str]) -> None:
        super().__init__()
        self.shared, self.failed_at = set(shared), None


def example_call(example_input: Any, example_kwargs: Mapping[str, Any] | None = None
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The forward's (positional, keyword) arguments of an example: a tensor (the one
    argument), a tuple or list (the positional arguments) or a dict (keyword arguments, as
    ``model(input_ids=x, attention_mask=m)``), and ``example_kwargs`` beside any of them."""
    kwargs = dict(example_kwargs or {})
    if isinstance(example_input, Mapping):
        clash = sorted(set(example_input) & set(kwargs))
        if clash:
            raise UsageError(f"IST example keywords {clash} are given twice (example_input and "
                             "example_kwargs); pass each once")
        return (), {**dict(example_input), **kwargs}
    if example_input is None:
        return (), kwargs
    args = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
    return args, kwargs


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
    """A traced forward: ``gm`` runs on ``inputs`` (one value per placeholder: the example's
    arguments in the forward's order, flattened for an exported graph); ``exported``: the graph
    is torch.export's (aten operators, parameters as ``get_attr`` nodes named as in the model,
    each node's ``nn_module_stack`` its modules)."""

    gm: fx.GraphModule
    inputs: tuple[Any, ...]
    exported: bool = False


def trace(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
          shared: Sequence[str]) -> Traced:
    """The forward called as ``model(*args, **kwargs)`` (``kwargs``: the user's keyword
    arguments, and :func:`call_kwargs`'s where the user gives none of the same name), traced:
    1. torch.fx's symbolic tracing (no values needed), kept at module granularity; 2. where
    the forward branches on a shape (``if x.dim() != 4``), fx's meta tracer, whose proxies carry
    the example's shapes; 3. where neither follows the forward (Hugging Face ``transformers``
    models: their forwards take ``**kwargs`` and decorated wrappers fx cannot enter),
    ``torch.export.export(strict=False)``, which runs the forward in Python and records aten
    operators (:mod:`thinwire.models.graph.aten` holds their rules). When all fail, one line
    names the innermost module and both tracers' reasons."""
    kwargs = {**call_kwargs(model), **kwargs}
    try:
        gm, inputs = _trace_fx(model, args, kwargs, shared)
        return Traced(gm, inputs)
    except _FxFailed as fx_failed:
        level = logging.root.manager.disable
        try:
            logging.disable(logging.ERROR)  # export logs its failure at length: one line here
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
        spec = getattr(gm, "_in_spec", None)
        flat = (fx_pytree.tree_flatten_spec((args, kwargs), spec) if spec is not None
                else pytree.tree_leaves((args, kwargs)))
        return Traced(cast(fx.GraphModule, gm), tuple(flat), exported=True)


class _FxFailed(Exception):
    """Neither fx tracer followed the forward: (innermost module's name, the module, reason)."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:120].strip() if text else type(e).__name__


def bind(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
         ) -> dict[str, Any]:
    """The example's value of each named argument of ``model.forward`` (given or default);
    one line naming the argument and the forward's own where they do not fit."""
    sig = inspect.signature(model.forward)
    params = list(sig.parameters.values())
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                              p.KEYWORD_ONLY)]
    takes = ", ".join(p.name for p in named) or "nothing"
    where = f"{type(model).__name__}.forward({takes})"
    positional = [p for p in named if p.kind != p.KEYWORD_ONLY]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(args) > len(positional) and not varargs:
        raise UsageError(f"IST example_input has {len(args)} positional values, {where} takes "
                         f"{len(positional)}; pass one value per forward argument")
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
    unknown = sorted(k for k in kwargs if k not in {p.name for p in named})
    if unknown and not var_kw:
        raise UsageError(f"IST example keywords {unknown} are not arguments of {where}; pass "
                         "the forward's own argument names")
    try:
        bound = sig.bind_partial(*args, **kwargs)
    except TypeError as e:
        raise UsageError(f"IST example arguments do not fit {where} ({e}); pass them as the "
                         "training loop calls the model") from None
    return {p.name: bound.arguments.get(p.name, p.default) for p in named}


def _trace_fx(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
              shared: Sequence[str]) -> tuple[fx.GraphModule, tuple[Any, ...]]:
    """Steps 1-2 of :func:`trace`: the graph and its inputs (one per named argument of the
    forward, in its order: fx makes a placeholder of each)."""
    values = bind(model, args, kwargs)
    extra = set(kwargs) - set(values)
    if extra:  # taken by the forward's **kwargs, which fx cannot trace: torch.export's
        raise _FxFailed("", None, f"keyword arguments {sorted(extra)} go to **kwargs")
    if len(args) > sum(1 for k in values if k not in kwargs):  # likewise *args
        raise _FxFailed("", None, f"{len(args)} positional arguments go to *args")
    concrete = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
    inputs = tuple(values.values())
    symbolic = _SymbolicTracer(shared)
    try:
        graph = symbolic.trace(model, concrete_args=concrete or None)
        return fx.GraphModule(symbolic.root, graph), inputs
    except Exception as e:  # noqa: BLE001 - retried with shapes, then one line
        first = e
    # the meta tracer's values are the example itself, on its own device, so that a device
    # read in the forward (torch.arange(..., device=x.device)) records the real one
    meta_args = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    meta = _MetaTracer(shared)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            graph = meta.trace(model, meta_args=meta_args, concrete_args=concrete or None)
        return fx.GraphModule(meta.root, graph), inputs
    except Exception:  # noqa: BLE001 - any tracing failure is the same one-line error
        pass
    where = meta.failed_at or symbolic.failed_at or ""
    raise _FxFailed(where, dict(model.named_modules()).get(where), _first_line(first))
