"""Who stores which units, and which elements travel between whom: pure numpy, no messages.

Ownership: every unit of every group is stored by one rank, together with the elements of every
tensor that unit indexes (along a tensor's *first* cut, its owner dimension; whole for a tensor
belonging to one dealt unit).
  - central deployment (Yuan et al.'s "central" code): rank 0 owns every unit, holds the full
    model and scatters and gathers every subnet; traffic concentrates on its link;
  - sharded deployment: rank o owns a contiguous block of ~1/n of every group's units, so no
    rank holds the full model and subnet pieces travel directly between owners and workers.
Tensors shared by every subnet are replicated on every rank and averaged with one all-reduce
per round (:mod:`thinwire.strategies.ist.core`).

A *piece* is what owner o sends worker w at the start of a round and gets back at its end: for
each cut tensor, the elements indexed by the units w holds that o owns (and w's units of the
tensor's other cut dimensions). Piece sizes follow from the partition alone, so both ends know
them without a message; :func:`piece_numel` is also the IST traffic formula's core. Every
element travels in the plan's wire dtype (:attr:`~thinwire.models.adapter.ISTPlan.wire_dtype`),
so a piece's bytes are its elements times the wire itemsize, integer buffers included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from thinwire.models.adapter import FLOAT_DTYPES, Cut, ISTPlan, TensorPlan

Held = Mapping[str, Sequence[np.ndarray]]
"""``held[group][worker]``: sorted unit ids of a round (``partition_groups``)."""


def blocks(size: int, n: int, deployment: str) -> np.ndarray:
    """Unit-range bounds per rank, [n + 1]: rank o owns units [b[o], b[o + 1])."""
    if deployment == "central":
        return np.array([0] + [size] * n, dtype=np.int64)
    counts = [size // n + (1 if r < size % n else 0) for r in range(n)]
    return np.cumsum([0, *counts]).astype(np.int64)


class Ownership:
    """Unit ranges per rank for every group of a plan (module docstring)."""

    def __init__(self, plan: ISTPlan, n: int, deployment: str) -> None:
        if deployment not in ("central", "sharded"):
            raise ValueError(f"deployment {deployment!r}: use central or sharded")
        self.n = n
        self.deployment = deployment
        self.bounds = {g.name: blocks(g.size, n, deployment) for g in plan.groups}

    def owned(self, group: str, rank: int) -> tuple[int, int]:
        b = self.bounds[group]
        return int(b[rank]), int(b[rank + 1])

    def owner_of_unit(self, group: str, unit: int) -> int:
        return int(np.searchsorted(self.bounds[group], unit, side="right") - 1)

    def owner_of(self, t: TensorPlan) -> int | None:
        """The rank storing the whole of a dealt-unit tensor (None for other tensors)."""
        if t.unit is None:
            return None
        return self.owner_of_unit(*t.unit)

    def span(self, units: np.ndarray, group: str, rank: int) -> tuple[int, int]:
        """Positions [a, b) of sorted ``units`` that ``rank`` owns (a contiguous run)."""
        lo, hi = self.owned(group, rank)
        return int(np.searchsorted(units, lo)), int(np.searchsorted(units, hi))


def holds(t: TensorPlan, held: Held, worker: int) -> bool:
    """Whether ``worker``'s subnet contains (part of) tensor ``t``."""
    if t.unit is None:
        return True
    group, unit = t.unit
    units = held[group][worker]
    i = int(np.searchsorted(units, unit))
    return i < len(units) and int(units[i]) == unit


def cut_len(c: Cut, units: int) -> int:
    return c.segments * units * c.per_unit


def subnet_numel(t: TensorPlan, held: Held, worker: int) -> int:
    """Elements of ``t`` in ``worker``'s subnet."""
    if not holds(t, held, worker):
        return 0
    n = t.numel
    for c in t.cuts:
        n = n // t.shape[c.dim] * cut_len(c, len(held[c.group][worker]))
    return n


def piece_numel(t: TensorPlan, own: Ownership, held: Held, owner: int, worker: int) -> int:
    """Elements of ``t`` that ``owner`` sends ``worker`` (0 for shared tensors)."""
    if t.shared:
        return 0
    if t.unit is not None:
        return t.numel if own.owner_of(t) == owner and holds(t, held, worker) else 0
    first, *rest = t.cuts
    a, b = own.span(held[first.group][worker], first.group, owner)
    n = t.numel // t.shape[first.dim] * cut_len(first, b - a)
    for c in rest:
        n = n // t.shape[c.dim] * cut_len(c, len(held[c.group][worker]))
    return n


def piece_matrix(plan: ISTPlan, own: Ownership, held: Held, *, state_copies: int = 0
                 ) -> np.ndarray:
    """Bytes [owner, worker] of every piece of a round; the diagonal stays on its rank.

    ``state_copies``: optimizer-state tensors travelling with each parameter (``reindex``)."""
    n = own.n
    out = np.zeros((n, n), dtype=np.int64)
    for t in plan.tensors:
        if t.shared:
            continue
        copies = 1 if t.buffer else 1 + state_copies
        for o in range(n):
            for w in range(n):
                if o != w:
                    out[o, w] += piece_numel(t, own, held, o, w) * plan.wire_itemsize * copies
    return out


def shared_bytes(plan: ISTPlan, *, state_copies: int = 0) -> int:
    """Payload of the per-round all-reduce averaging the shared floating-point tensors (in the
    wire dtype; integer shared buffers advance alike on every rank and do not travel)."""
    total = 0
    for t in plan.tensors:
        if t.shared and t.dtype in FLOAT_DTYPES:
            total += t.numel * plan.wire_itemsize * (1 if t.buffer else 1 + state_copies)
    return total


def stored_numel(plan: ISTPlan, own: Ownership, rank: int) -> int:
    """Elements of the model ``rank`` stores (its owned slices and the shared tensors)."""
    total = 0
    for t in plan.tensors:
        if t.shared:
            total += t.numel
        elif t.unit is not None:
            total += t.numel if own.owner_of(t) == rank else 0
        else:
            c = t.cuts[0]
            lo, hi = own.owned(c.group, rank)
            total += t.numel // t.shape[c.dim] * cut_len(c, hi - lo)
    return total
