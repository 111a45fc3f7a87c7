"""A worker's side of a round: its subnet's tensors, filled from the owners' pieces and cut back
into pieces for them.

  1. :func:`allocate`: a tensor of the subnet's shape (and one per travelling optimizer-state
     name) for every tensor the worker holds; shared tensors start as the stored copy;
  2. :func:`load`: the piece from one owner placed into those tensors (the owner's units along
     the first cut, the worker's own units along the others);
  3. :func:`take`: after the round, the same elements cut out again as the piece going back to
     that owner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from thinwire.strategies.ist import pieces as pc
from thinwire.strategies.ist.elements import View, element_index
from thinwire.strategies.ist.store import Store

Subnet = dict[str, list[torch.Tensor]]
"""name -> [the subnet's tensor, *its optimizer state]."""


def allocate(view: View, held: pc.Held, store: Store, tensors: Mapping[str, torch.Tensor],
             keys: Sequence[str]) -> Subnet:
    """Step 1."""
    sub: Subnet = {}
    for t in view.plan.tensors:
        if not pc.holds(t, held, view.rank):
            continue
        like = store.slices.get(t.name)
        if like is None:  # a dealt unit owned elsewhere: shape and dtype from the plan
            like = tensors[t.name].data.new_empty(t.shape)
        shape = view.sub_shape(t, held, view.rank)
        sub[t.name] = [like.new_empty(shape) for _ in range(view.copies(t, keys))]
        if t.shared:
            for k, x in enumerate(store.stored(t, keys)):
                sub[t.name][k].copy_(x)
    return sub


def load(view: View, held: pc.Held, sub: Subnet, owner: int, piece: torch.Tensor,
         keys: Sequence[str]) -> None:
    """Step 2: the piece from ``owner`` into this rank's subnet tensors."""
    at = 0
    for t in view.plan.tensors:
        if pc.piece_numel(t, view.own, held, owner, view.rank) == 0:
            continue
        for x in sub[t.name][:view.copies(t, keys)]:
            if t.unit is not None:
                x.copy_(piece[at:at + x.numel()].view_as(x))
                at += x.numel()
                continue
            c = t.cuts[0]
            _, a, b = view.span(t, held, view.rank, owner)
            shape = list(x.shape)
            shape[c.dim] = pc.cut_len(c, b - a)
            size = int(np.prod(shape))
            rows = element_index(c, len(held[c.group][view.rank]),
                                 torch.arange(a, b, device=view.device))
            x.index_copy_(c.dim, rows, piece[at:at + size].view(shape).to(x.dtype))
            at += size
    assert at == piece.numel(), (at, piece.numel())


def take(view: View, held: pc.Held, sub: Subnet, owner: int, keys: Sequence[str]
         ) -> torch.Tensor:
    """Step 3: the piece of the trained subnet that goes back to ``owner``."""
    parts: list[torch.Tensor] = []
    for t in view.plan.tensors:
        if pc.piece_numel(t, view.own, held, owner, view.rank) == 0:
            continue
        for x in sub[t.name][:view.copies(t, keys)]:
            if t.unit is not None:
                parts.append(x.reshape(-1))
                continue
            c = t.cuts[0]
            _, a, b = view.span(t, held, view.rank, owner)
            rows = element_index(c, len(held[c.group][view.rank]),
                                 torch.arange(a, b, device=view.device))
            parts.append(x.index_select(c.dim, rows).reshape(-1))
    return view.flat(parts)
