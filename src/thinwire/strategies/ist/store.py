"""What one rank stores between rounds, and the owner's side of every exchange.

Every rank stores the slices of the units it owns (:class:`~thinwire.strategies.ist.pieces.Ownership`:
everything on rank 0 in the central deployment, ~1/n of every group in the sharded one), whole
copies of the tensors every subnet shares, and, with ``optimizer_state = reindex``, per-element
optimizer state of the same shapes (``state``: name -> state key -> slice). The owner side of a
round:
  1. :meth:`Store.extract`: the flat piece of a worker's subnet this rank stores (the scatter);
  2. :meth:`Store.write_back`: a returned piece into the stored slices; blocks of dealt units
     are collected and :meth:`Store.average_dealt` writes base + the mean of their holders'
     updates; with overlapping subnets (a unit held by several workers) the returned blocks of
     cut tensors are summed and counted per element instead, and :meth:`Store.average_overlap`
     writes each element the mean of the workers that trained it (one: its copy, bit for bit;
     none, a cross block: unchanged);
  3. :meth:`Store.average_shared`: shared tensors at store + (sum of the workers' updates) / n,
     one all-reduce;
  4. :meth:`Store.unpack_owner`: an owner's stored slices placed into full-size tensors (the
     assembled model);
  5. :meth:`Store.outer_step` (``outer_lr`` != 1 or ``outer_momentum`` > 0): the round's
     change of every stored parameter slice taken as a pseudo-gradient for an outer SGD step
     with Nesterov momentum, as DiLoCo's outer step (Douillard et al. 2023): IST's round is an
     outer step too, so the same optimizer applies (``outer`` holds its momentum buffers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from thinwire.models.adapter import TensorPlan
from thinwire.runtime.comm import Comm
from thinwire.strategies.ist import pieces as pc
from thinwire.strategies.ist.elements import View, element_index, put_block

Dealt = dict[str, list[list[torch.Tensor]]]
"""Returned copies of dealt-unit tensors: name -> per holder, [tensor, *state]."""

Overlap = dict[str, tuple[torch.Tensor, list[torch.Tensor]]]
"""Overlapping subnets: name -> (how many workers returned each element, the sum of the
returned blocks per copy [tensor, *state]), all shaped as the stored slice."""


class Store:
    """This rank's stored slices (module docstring)."""

    def __init__(self, view: View, tensors: Mapping[str, torch.Tensor] | None) -> None:
        """``view.rank``'s slices cut out of the full ``tensors``; None: an empty store, filled
        by its caller (a block received whole, :mod:`.fault_sharded`)."""
        self.view = view
        self.slices: dict[str, torch.Tensor] = {}
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.outer: dict[str, torch.Tensor] = {}
        if tensors is None:
            return
        plan, own, rank = view.plan, view.own, view.rank
        with torch.no_grad():
            for t in plan.tensors:
                full = tensors[t.name].detach()
                if t.shared:
                    self.slices[t.name] = full.clone()
                elif t.unit is not None:
                    if own.owner_of(t) == rank:
                        self.slices[t.name] = full.clone()
                else:
                    c = t.cuts[0]
                    lo, hi = own.owned(c.group, rank)
                    idx = element_index(c, plan.group(c.group).size,
                                        torch.arange(lo, hi, device=full.device))
                    self.slices[t.name] = full.index_select(c.dim, idx).clone()

    def start_state(self, keys: Sequence[str]) -> None:
        """Zero optimizer state of every stored parameter slice, once its keys are known."""
        for t in self.view.plan.tensors:
            if not t.buffer and t.name in self.slices:
                self.state[t.name] = {k: torch.zeros_like(self.slices[t.name]) for k in keys}

    def stored(self, t: TensorPlan, keys: Sequence[str]) -> list[torch.Tensor]:
        """The stored slice of ``t``, then its optimizer-state slices for ``keys``."""
        out = [self.slices[t.name]]
        if keys and not t.buffer:
            out += [self.state[t.name][k] for k in keys]
        return out

    def numel(self) -> int:
        return sum(x.numel() for x in self.slices.values())

    # --- step 1: the scatter ----------------------------------------------------------------
    def extract(self, held: pc.Held, worker: int, keys: Sequence[str]) -> torch.Tensor:
        """The flat piece for ``worker`` (this rank as the owner)."""
        v = self.view
        parts: list[torch.Tensor] = []
        for t in v.plan.tensors:
            if pc.piece_numel(t, v.own, held, v.rank, worker) == 0:
                continue
            for x in self.stored(t, keys):
                if t.unit is not None:
                    parts.append(x.reshape(-1))
                    continue
                units, _, _ = v.span(t, held, worker, v.rank)
                block = x.index_select(t.cuts[0].dim, v.store_rows(t, units))
                for dim, ix in v.other_index(t, held, worker):
                    block = block.index_select(dim, ix)
                parts.append(block.reshape(-1))
        return v.flat(parts)

    # --- step 2: write back -------------------------------------------------------------------
    def write_back(self, held: pc.Held, worker: int, piece: torch.Tensor,
                   keys: Sequence[str], dealt: Dealt, overlap: Overlap | None = None) -> None:
        """A returned piece into the stored slices (dealt units collected in ``dealt``; with
        ``overlap``, cut blocks summed and counted there instead of written)."""
        v = self.view
        at = 0
        for t in v.plan.tensors:
            if pc.piece_numel(t, v.own, held, v.rank, worker) == 0:
                continue
            targets = self.stored(t, keys)
            if t.unit is not None:
                copies = []
                for x in targets:
                    copies.append(piece[at:at + x.numel()].view_as(x))
                    at += x.numel()
                dealt.setdefault(t.name, []).append(copies)
                continue
            units, _, _ = v.span(t, held, worker, v.rank)
            others = v.other_index(t, held, worker)
            dims = [t.cuts[0].dim] + [d for d, _ in others]
            index = [v.store_rows(t, units)] + [ix for _, ix in others]
            for k, x in enumerate(targets):
                shape = list(x.shape)
                for d, ix in zip(dims, index):
                    shape[d] = len(ix)
                size = int(np.prod(shape))
                block = piece[at:at + size].view(shape).to(x.dtype)
                if overlap is None:
                    put_block(x, dims, index, block)
                else:
                    if t.name not in overlap:  # one count for the tensor and its state
                        overlap[t.name] = (torch.zeros_like(x, dtype=torch.int32),
                                           [torch.zeros_like(y) for y in targets])
                    count, sums = overlap[t.name]
                    if k == 0:
                        put_block(count, dims, index,
                                  torch.ones_like(block, dtype=torch.int32), add=True)
                    put_block(sums[k], dims, index, block, add=True)
                at += size
        assert at == piece.numel(), (at, piece.numel())

    def average_overlap(self, overlap: Overlap, keys: Sequence[str]) -> None:
        """Overlapping subnets: every element one or more workers trained becomes the mean of
        their copies (sum / count: a single copy is written as it came back); elements nobody
        trained (cross blocks) stay bitwise unchanged."""
        plans = {t.name: t for t in self.view.plan.tensors}
        for name, (count, sums) in overlap.items():
            hit, holders = count > 0, count.clamp(min=1)
            for base, total in zip(self.stored(plans[name], keys), sums):
                mean = total / holders.to(total.dtype)
                base.copy_(torch.where(hit, mean.to(base.dtype), base))

    def average_dealt(self, dealt: Dealt, keys: Sequence[str]) -> None:
        """Blocks held by several workers: base + mean of their updates (bitwise unchanged when
        no copy moved; integer buffers: the mean update rounded down); one holder: its copy."""
        plans = {t.name: t for t in self.view.plan.tensors}
        for name, copies in dealt.items():
            for k, base in enumerate(self.stored(plans[name], keys)):
                if len(copies) == 1:
                    base.copy_(copies[0][k])
                    continue
                delta = torch.zeros_like(base)
                for c in copies:
                    delta += c[k].to(base.dtype) - base
                if base.is_floating_point():
                    base.add_(delta / len(copies))
                else:
                    base.add_(torch.div(delta, len(copies), rounding_mode="floor"))

    # --- step 3: shared tensors ---------------------------------------------------------------
    def average_shared(self, sub: Mapping[str, list[torch.Tensor]], keys: Sequence[str],
                       comm: Comm, n: int) -> None:
        """Shared floating-point tensors: store + (sum of every worker's update) / n."""
        floats, deltas = [], []
        for t in self.view.plan.tensors:
            if not t.shared:
                continue
            for base, x in zip(self.stored(t, keys), sub[t.name]):
                if not base.is_floating_point() or n == 1:
                    base.copy_(x)
                    continue
                floats.append(base)
                deltas.append((x - base).reshape(-1))
        if not floats:
            return
        flat = self.view.flat(deltas)
        comm.all_reduce(flat, tag="shared")
        at = 0
        for base in floats:
            base.add_(flat[at:at + base.numel()].view_as(base), alpha=1.0 / n)
            at += base.numel()

    # --- step 5: the outer optimizer -----------------------------------------------------------
    def parameter_slices(self) -> dict[str, torch.Tensor]:
        """The stored slices of floating-point parameters (what the outer step moves)."""
        return {t.name: self.slices[t.name] for t in self.view.plan.tensors
                if not t.buffer and t.name in self.slices
                and self.slices[t.name].is_floating_point()}

    def outer_step(self, before: Mapping[str, torch.Tensor], lr: float, momentum: float
                   ) -> None:
        """Step 5: with g = before - after (the round's pseudo-gradient), b = momentum * b + g
        (b = g the first time) and u = g + momentum * b (Nesterov), the slice becomes
        before - lr * u, written as after - (lr * u - g): lr 1 and momentum 0 leave it
        bitwise as the round left it."""
        for name, after in self.parameter_slices().items():
            g = before[name] - after
            buf = self.outer.get(name)
            if buf is None:
                buf = self.outer[name] = g.clone()
            else:
                buf.mul_(momentum).add_(g)
            u = g + momentum * buf if momentum else g
            after.sub_(lr * u - g)

    # --- step 4: the assembled model ----------------------------------------------------------
    def owned_flat(self) -> torch.Tensor:
        """This rank's stored cut slices, flat (what it contributes to the full model)."""
        v = self.view
        return v.flat([self.slices[t.name].reshape(-1) for t in v.plan.tensors
                       if not t.shared and t.name in self.slices])

    def owned_numel(self, owner: int) -> int:
        """Elements of ``owner``'s :meth:`owned_flat`."""
        v = self.view
        total = 0
        for t in v.plan.tensors:
            if t.shared:
                continue
            if t.unit is not None:
                total += t.numel if v.own.owner_of(t) == owner else 0
            else:
                c = t.cuts[0]
                lo, hi = v.own.owned(c.group, owner)
                total += t.numel // t.shape[c.dim] * pc.cut_len(c, hi - lo)
        return total

    def unpack_owner(self, owner: int, flat: torch.Tensor,
                     full: Mapping[str, torch.Tensor]) -> None:
        """``owner``'s :meth:`owned_flat` into the full-size tensors ``full``."""
        v = self.view
        at = 0
        for t in v.plan.tensors:
            if t.shared:
                continue
            target = full[t.name]
            if t.unit is not None:
                if v.own.owner_of(t) == owner:
                    target.copy_(flat[at:at + t.numel].view(t.shape))
                    at += t.numel
                continue
            c = t.cuts[0]
            lo, hi = v.own.owned(c.group, owner)
            if hi == lo:
                continue
            g = v.plan.group(c.group)
            rows = element_index(c, g.size, torch.arange(lo, hi, device=v.device))
            shape = list(t.shape)
            shape[c.dim] = len(rows)
            size = int(np.prod(shape))
            target.index_copy_(c.dim, rows, flat[at:at + size].view(shape).to(target.dtype))
            at += size
        assert at == flat.numel(), (at, flat.numel())
