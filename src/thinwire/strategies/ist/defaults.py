"""IST's recommended configuration: the one source of the defaults of ``thinwire.IST``
(:class:`~thinwire.strategies.ist.core.IST`) and of the trainer's ``ist`` method
(:class:`~thinwire.strategies.ist.method.Options`), and the published algorithm beside it.

Chosen from the ablation of ``python benchmarks/ist_quality.py`` (docs/BENCHMARKS.md, "IST's
quality"; docs/IST.md, "Getting a good model out of IST"):
  1. ``OVERLAP = 0``, auto: each unit of a cut group on max(1, n // 2) workers
     (:func:`~thinwire.strategies.ist.partition.resolve_overlap`);
  2. ``OPTIMIZER_STATE = "auto"``: the model family's (the plan's
     ``default_optimizer_state``: the state dealt with its units, reset for convolutional models;
     :func:`~thinwire.strategies.ist.optstate.reindexes`);
  3. ``RESIDUAL = "whole"``: a derived adapter keeps a residual stream whole and cuts its
     branches (:func:`~thinwire.models.graph_adapter.derive_adapter`).
``PUBLISHED`` is Yuan et al.'s IST (VLDB 2022) as its code runs it: disjoint subnets and fresh
optimizer state every round; ``PUBLISHED_SPEC`` is the trainer's method spec for it. The
trainer's labels name what departs from it. Plain constants: importing them costs nothing."""

from __future__ import annotations

OVERLAP = 0
OPTIMIZER_STATE = "auto"
RESIDUAL = "whole"

PUBLISHED: dict[str, int | str] = {"overlap": 1, "optimizer_state": "reset"}
PUBLISHED_SPEC = "ist:" + ",".join(f"{k}={v}" for k, v in PUBLISHED.items())
