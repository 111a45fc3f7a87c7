"""Strategies: one module per method, registered here by one line each.

``METHODS.get(name)`` imports the method's module and returns its
:class:`~thinwire.strategies.entry.MethodEntry` (options, label, checks, traffic formula and the
Strategy class the trainer runs). This package imports nothing heavy itself.
"""

from __future__ import annotations

from thinwire.options import Registry
from thinwire.strategies.entry import MethodEntry

METHODS: Registry[MethodEntry] = Registry("method", {
    "dp": "thinwire.strategies.data_parallel:METHOD",
    "localsgd": "thinwire.strategies.local_sgd:METHOD",
    "diloco": "thinwire.strategies.diloco:METHOD",
    "sparseloco": "thinwire.strategies.sparseloco:METHOD",
    "demo": "thinwire.strategies.demo:METHOD",
    "ist": "thinwire.strategies.ist.method:METHOD",
    "pipeline": "thinwire.strategies.pipeline.method:METHOD",
    "tensor": "thinwire.strategies.tensor:METHOD",
    "hybrid": "thinwire.strategies.hybrid:METHOD",
    "slide": "thinwire.strategies.slide.method:METHOD",
})
"""Every method by name."""

__all__ = ["METHODS", "MethodEntry"]
