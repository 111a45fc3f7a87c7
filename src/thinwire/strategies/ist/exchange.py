"""Moving subnets between the ranks that store the full model and the workers that train them.

Ownership: every hidden neuron of every layer is owned by one rank, which stores the slices of
the parameters indexed by that neuron (see :mod:`thinwire.strategies.ist.mlp`). Parameters shared
by every subnet are stored whole on rank 0.
  - central deployment (Yuan et al.'s "central" code): rank 0 owns every neuron, so it holds the
    full model and scatters and gathers all subnets; traffic concentrates on its link;
  - sharded deployment: each rank owns a contiguous block of ~1/n of every layer's neurons, so
    no rank holds the full model; subnet pieces travel directly between owners and workers.

Because worker j's neurons are sorted and owner blocks are contiguous ranges, the neurons that
owner o sends to worker j form a contiguous range of worker j's subnet: a *piece*. Piece sizes
follow from the partition alone, so both ends know them without a message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from thinwire.strategies.ist.mlp import ParamSpec


@dataclass(frozen=True)
class Ownership:
    """``blocks[layer][rank] = (start, stop)`` of the neurons that rank owns."""

    blocks: tuple[tuple[tuple[int, int], ...], ...]

    @staticmethod
    def central(widths: Sequence[int], n: int) -> Ownership:
        return Ownership(tuple(tuple((0, w) if r == 0 else (w, w) for r in range(n)) for w in widths))

    @staticmethod
    def sharded(widths: Sequence[int], n: int) -> Ownership:
        blocks = []
        for w in widths:
            bounds = np.cumsum([0] + [w // n + (1 if r < w % n else 0) for r in range(n)])
            blocks.append(tuple((int(bounds[r]), int(bounds[r + 1])) for r in range(n)))
        return Ownership(tuple(blocks))

    def range_in(self, layer: int, owner: int, group: np.ndarray) -> tuple[int, int]:
        """Positions [a, b) of ``group`` (sorted neurons) that ``owner`` owns."""
        lo, hi = self.blocks[layer][owner]
        return int(np.searchsorted(group, lo)), int(np.searchsorted(group, hi))


def piece_numel(specs: Sequence[ParamSpec], own: Ownership, owner: int,
                groups: Sequence[np.ndarray], copies: int = 1) -> int:
    """Elements of the piece ``owner`` sends to the worker holding ``groups`` (x copies)."""
    total = 0
    for s in specs:
        if s.owner_dim is None or s.owner_layer is None:
            total += int(np.prod(s.shape)) if owner == 0 else 0
            continue
        a, b = own.range_in(s.owner_layer, owner, groups[s.owner_layer])
        other = 1
        for d, size in enumerate(s.shape):
            if d == s.owner_dim:
                continue
            other *= len(groups[s.other_layer]) if d == s.other_dim and s.other_layer is not None else size
        total += (b - a) * other
    return total * copies


def _index(s: ParamSpec, own: Ownership, owner: int, groups: Sequence[np.ndarray]
           ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int]]:
    """Local owner-dim indices into the owner's stored slice, other-dim indices, subnet range."""
    assert s.owner_layer is not None
    g = groups[s.owner_layer]
    a, b = own.range_in(s.owner_layer, owner, g)
    lo = own.blocks[s.owner_layer][owner][0]
    local = torch.as_tensor(g[a:b] - lo, dtype=torch.long)
    other = (torch.as_tensor(groups[s.other_layer], dtype=torch.long)
             if s.other_dim is not None and s.other_layer is not None else None)
    return local, other, (a, b)


def extract(specs: Sequence[ParamSpec], store: Sequence[Sequence[torch.Tensor]], own: Ownership,
            owner: int, groups: Sequence[np.ndarray]) -> torch.Tensor:
    """Owner side: the flat piece for the worker holding ``groups``.

    ``store[k]`` lists, for parameter k, the owner's stored tensors (the parameter and, when
    optimizer state travels, its state buffers), each sliced to the owned block.
    """
    parts: list[torch.Tensor] = []
    for s, tensors in zip(specs, store):
        for t in tensors:
            if s.owner_dim is None:
                if owner == 0:
                    parts.append(t.reshape(-1))
                continue
            local, other, _ = _index(s, own, owner, groups)
            x = t.index_select(s.owner_dim, local)
            if other is not None and s.other_dim is not None:
                x = x.index_select(s.other_dim, other)
            parts.append(x.reshape(-1))
    return torch.cat(parts) if parts else torch.empty(0)


def write_back(specs: Sequence[ParamSpec], store: Sequence[Sequence[torch.Tensor]], own: Ownership,
               owner: int, groups: Sequence[np.ndarray], piece: torch.Tensor) -> None:
    """Owner side: copy a returned piece into the owned blocks (shared params are skipped:
    the caller averages them)."""
    i = 0
    for s, tensors in zip(specs, store):
        for t in tensors:
            if s.owner_dim is None:
                if owner == 0:
                    i += t.numel()
                continue
            local, other, _ = _index(s, own, owner, groups)
            shape = list(t.shape)
            shape[s.owner_dim] = len(local)
            if other is not None and s.other_dim is not None:
                shape[s.other_dim] = len(other)
            n = int(np.prod(shape))
            block = piece[i:i + n].view(shape)
            i += n
            if other is None:
                t.index_copy_(s.owner_dim, local, block)
            elif s.owner_dim == 0:
                t[local[:, None], other[None, :]] = block
            else:
                t[other[:, None], local[None, :]] = block
    assert i == piece.numel(), (i, piece.numel())


def shared_parts(specs: Sequence[ParamSpec], piece: torch.Tensor, own: Ownership,
                 groups: Sequence[np.ndarray], copies: int) -> list[torch.Tensor]:
    """The shared-parameter tensors inside a piece from/to rank 0, in spec order."""
    out = []
    i = 0
    for s in specs:
        for _ in range(copies):
            if s.owner_dim is None:
                n = int(np.prod(s.shape))
                out.append(piece[i:i + n].view(s.shape))
                i += n
            else:
                i += piece_numel([s], own, 0, groups)
    return out


def load_piece(specs: Sequence[ParamSpec], sub: Sequence[Sequence[torch.Tensor]], own: Ownership,
               owner: int, groups: Sequence[np.ndarray], piece: torch.Tensor) -> None:
    """Worker side: place a piece from ``owner`` into the subnet tensors ``sub``."""
    i = 0
    for s, tensors in zip(specs, sub):
        for t in tensors:
            if s.owner_dim is None:
                if owner == 0:
                    t.copy_(piece[i:i + t.numel()].view_as(t))
                    i += t.numel()
                continue
            _, _, (a, b) = _index(s, own, owner, groups)
            view = t.narrow(s.owner_dim, a, b - a)
            view.copy_(piece[i:i + view.numel()].view_as(view))
            i += view.numel()


def take_piece(specs: Sequence[ParamSpec], sub: Sequence[Sequence[torch.Tensor]], own: Ownership,
               owner: int, groups: Sequence[np.ndarray]) -> torch.Tensor:
    """Worker side: the piece of the trained subnet that goes back to ``owner``."""
    parts: list[torch.Tensor] = []
    for s, tensors in zip(specs, sub):
        for t in tensors:
            if s.owner_dim is None:
                if owner == 0:
                    parts.append(t.reshape(-1))
                continue
            _, _, (a, b) = _index(s, own, owner, groups)
            parts.append(t.narrow(s.owner_dim, a, b - a).reshape(-1))
    return torch.cat(parts) if parts else torch.empty(0)
