"""Strategies, one file per method, built by name."""

from __future__ import annotations

import importlib

from torch import nn

from thinwire.strategies.base import Context, Strategy

# method name -> "module:Class"; imported on use.
REGISTRY: dict[str, str] = {
    "dp": "thinwire.strategies.data_parallel:DataParallel",
    "localsgd": "thinwire.strategies.local_sgd:LocalSGD",
    "diloco": "thinwire.strategies.diloco:DiLoCo",
    "ist": "thinwire.strategies.ist.strategy:IST",
}


def build_strategy(ctx: Context, model: nn.Module) -> Strategy:
    module, _, cls = REGISTRY[ctx.cfg.method.name].partition(":")
    return getattr(importlib.import_module(module), cls)(ctx, model)  # type: ignore[no-any-return]


__all__ = ["REGISTRY", "Context", "Strategy", "build_strategy"]
