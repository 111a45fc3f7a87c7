"""Independent Subnetwork Training: :class:`IST` (the algorithm, usable in a user's own loop),
the partitions (:mod:`.partition`), the pieces that travel (:mod:`.pieces`) and the trainer's
method (:mod:`.method`). ``IST`` is imported on first use, so the numpy-only modules stay light."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "IST":
        from thinwire.strategies.ist.core import IST

        return IST
    raise AttributeError(f"module 'thinwire.strategies.ist' has no attribute {name!r}")
