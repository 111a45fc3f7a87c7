"""Where a cut tensor's elements lie, seen from one rank: index arithmetic, no messages, no state.

A :class:`~thinwire.models.adapter.Cut` orders a dimension segment-major (every segment holds
``per_unit`` elements per unit, in unit order); :func:`element_index` turns unit positions into
element indices in that order, for the full tensor, an owner's slice or a subnet alike.
:class:`View` binds a plan to one rank (its ownership, device and wire dtype) and answers, for a
round's partition ``held``, which elements of a tensor a worker holds, which of them an owner
stores, and how large the piece between the two is (:mod:`~thinwire.strategies.ist.pieces`
counts the same elements in numpy, for the traffic formula).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from thinwire.models.adapter import Cut, ISTPlan, TensorPlan
from thinwire.strategies.ist import pieces as pc


def element_index(c: Cut, n_units: int, positions: torch.Tensor) -> torch.Tensor:
    """Element indices along ``c.dim`` of ``positions`` in a dimension holding ``n_units`` units
    (segment-major: every segment holds per_unit elements per unit, in unit order)."""
    step = n_units * c.per_unit
    within = torch.arange(c.per_unit, device=positions.device)
    one = (positions[:, None] * c.per_unit + within[None, :]).reshape(-1)
    if c.segments == 1:
        return one
    segs = torch.arange(c.segments, device=positions.device) * step
    return (segs[:, None] + one[None, :]).reshape(-1)


def put_block(t: torch.Tensor, dims: Sequence[int], index: Sequence[torch.Tensor],
              block: torch.Tensor, *, add: bool = False) -> None:
    """``t`` at ``index[k]`` along ``dims[k]`` (outer product of the indices) <- ``block``, or
    += ``block`` with ``add`` (the indices of one block are distinct)."""
    if len(dims) == 1:
        if add:
            t.index_add_(dims[0], index[0], block)
        else:
            t.index_copy_(dims[0], index[0], block)
        return
    order = [*dims, *(d for d in range(t.dim()) if d not in dims)]
    view, src = t.permute(order), block.permute(order)
    grid = tuple(ix.view(*([1] * k), -1, *([1] * (len(dims) - k - 1)))
                 for k, ix in enumerate(index))
    if add:
        view[grid] += src
    else:
        view[grid] = src


@dataclass(frozen=True)
class View:
    """A plan seen from ``rank`` of ``n``: ownership, device and the wire dtype of pieces."""

    plan: ISTPlan
    own: pc.Ownership
    rank: int
    device: torch.device
    wire: torch.dtype

    def units(self, held: pc.Held, group: str, worker: int) -> torch.Tensor:
        return torch.as_tensor(held[group][worker], dtype=torch.long, device=self.device)

    @staticmethod
    def copies(t: TensorPlan, keys: Sequence[str]) -> int:
        """The tensor plus its per-element optimizer state (``keys``: the state that travels)."""
        return 1 + (len(keys) if not t.buffer else 0)

    def span(self, t: TensorPlan, held: pc.Held, worker: int, owner: int
             ) -> tuple[torch.Tensor, int, int]:
        """The units of ``worker`` along ``t``'s first cut that ``owner`` stores, and their
        positions [a, b) among the worker's units."""
        c = t.cuts[0]
        units = held[c.group][worker]
        a, b = self.own.span(units, c.group, owner)
        return torch.as_tensor(units[a:b], dtype=torch.long, device=self.device), a, b

    def store_rows(self, t: TensorPlan, owner_units: torch.Tensor) -> torch.Tensor:
        """Indices along the first cut, in this rank's stored slice, of ``owner_units``."""
        c = t.cuts[0]
        lo, hi = self.own.owned(c.group, self.rank)
        return element_index(c, hi - lo, owner_units - lo)

    def other_index(self, t: TensorPlan, held: pc.Held, worker: int
                    ) -> list[tuple[int, torch.Tensor]]:
        """(dim, full-tensor indices) of the worker's units along ``t``'s other cuts."""
        return [(c.dim, element_index(c, self.plan.group(c.group).size,
                                      self.units(held, c.group, worker)))
                for c in t.cuts[1:]]

    def sub_shape(self, t: TensorPlan, held: pc.Held, worker: int) -> list[int]:
        shape = list(t.shape)
        for c in t.cuts:
            shape[c.dim] = pc.cut_len(c, len(held[c.group][worker]))
        return shape

    def piece_size(self, held: pc.Held, owner: int, worker: int, keys: Sequence[str]) -> int:
        return sum(pc.piece_numel(t, self.own, held, owner, worker) * self.copies(t, keys)
                   for t in self.plan.tensors)

    def flat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """One wire-dtype buffer of ``parts``."""
        if not parts:
            return torch.empty(0, device=self.device, dtype=self.wire)
        return torch.cat([p.to(self.wire) for p in parts])
