"""Independent Subnetwork Training around a user's own model, optimizer and training loop.

Yuan, Wolfe, Dun, Tang, Kyrillidis, Jermaine, "Distributed Learning of Deep Neural Networks using
Independent Subnet Training", VLDB 2022 (arXiv 1910.02120); ResIST (Dun et al., UAI 2022) for
depth units; analysed by Shulgin & Richtarik, ICML 2024. The user keeps their loop, loss,
optimizer, schedule, clipping and autocast; :class:`IST` decides only which subnet each worker
trains, what travels and when::

    ist = thinwire.IST(model, optimizer, local_steps=10)     # after init_process_group
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()                 # every K-th step ends a round: subnets travel back
        if ist.at_boundary and want_eval:
            full = ist.full_model()      # the full model on rank 0 (None elsewhere)

The model object is the subnet: IST swaps the *data* of the model's own parameters for the
subnet's slices, so the optimizer (which holds the same parameter objects), schedulers and
clipping work unchanged, and a worker only ever holds its subnet plus the slices it stores.
Round r covers the K optimizer steps after its first forward pass:
  1. the first training forward of a round draws the round's partition from (seed, r) with no
     message (:func:`~thinwire.strategies.ist.partition.partition_groups`);
  2. the ranks storing the model send each worker the pieces of its subnet
     (:mod:`~thinwire.strategies.ist.pieces`: central, rank 0 stores everything; sharded, each
     rank ~1/n of every group's units); the subnet's tensors replace the model's parameter data;
     the optimizer state starts fresh (``reset``, the original code) or is re-indexed from the
     owners' full-size state (``reindex``);
  3. the user's loop takes K optimizer steps; with ``scale="dropout"`` the inputs of modules fed
     by cut units are multiplied by (units / units held) (inverted dropout, placed by the
     adapter's ``install_scaling``); ``batchnorm`` relies on batch-statistics norms after every
     cut layer (the original code's choice); ``eval`` leaves training alone and scales the
     assembled model at evaluation (the adapter's ``configure_eval``, ResIST's choice);
  4. after the K-th step (an optimizer post-step hook) the workers send the trained pieces back;
     owners write the disjoint blocks in place (elements held by several workers, as ResIST's
     shared blocks, are averaged); tensors every subnet shares are averaged with one all-reduce
     of their updates; cut blocks nobody trained (cross blocks between two workers' neurons)
     stay bitwise unchanged. Between rounds the model holds no data. With
     ``drop_last_step=True`` (the original code's behaviour, for exact comparisons with it) the
     pieces are taken just before the K-th step, whose update is then lost.
Evaluation happens only at round boundaries (:meth:`IST.full_model`); a forward in eval mode or
``full_model`` mid-round is a one-line error, as is an optimizer step with no forward in a round.

Pieces travel in one dtype per model (the plan's ``wire_dtype``, the widest floating-point dtype
of its tensors): integer buffers such as a BatchNorm's ``num_batches_tracked`` are cast to it on
the way and back, and every index tensor follows the model's device.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from thinwire.errors import UsageError
from thinwire.models.adapter import Cut, ISTAdapter, ISTPlan, TensorPlan, linear_stack
from thinwire.runtime.comm import Comm
from thinwire.strategies.ist import pieces as pc
from thinwire.strategies.ist.partition import partition_groups

DEPLOYMENTS = ("central", "sharded")
OPTIMIZER_STATES = ("reset", "reindex")


def _index(c: Cut, units_in_layout: int, positions: torch.Tensor) -> torch.Tensor:
    """Element indices along ``c.dim`` of ``positions`` in a layout of ``units_in_layout`` units
    (segment-major: every segment holds per_unit elements per unit, in unit order)."""
    step = units_in_layout * c.per_unit
    within = torch.arange(c.per_unit, device=positions.device)
    one = (positions[:, None] * c.per_unit + within[None, :]).reshape(-1)
    if c.segments == 1:
        return one
    segs = torch.arange(c.segments, device=positions.device) * step
    return (segs[:, None] + one[None, :]).reshape(-1)


def _put(t: torch.Tensor, dims: Sequence[int], index: Sequence[torch.Tensor],
         block: torch.Tensor) -> None:
    """``t`` at ``index[k]`` along ``dims[k]`` (outer product of the indices) <- ``block``."""
    if len(dims) == 1:
        t.index_copy_(dims[0], index[0], block)
        return
    order = [*dims, *(d for d in range(t.dim()) if d not in dims)]
    view, src = t.permute(order), block.permute(order)
    grid = [ix.view(*([1] * k), -1, *([1] * (len(dims) - k - 1))) for k, ix in enumerate(index)]
    view[tuple(grid)] = src


class IST:
    """Independent Subnetwork Training of ``model`` (module docstring).

    Args:
        model: the full model, built identically on every rank (same seed).
        optimizers: the optimizer (or list) over ``model.parameters()``; IST resets or re-indexes
            their per-parameter state at each repartition.
        comm: the communication layer (default ``Comm()``: the default process group).
        local_steps: K, optimizer steps per round.
        seed: seed of the partitions (identical on every rank).
        deployment: ``central`` (rank 0 stores the model) or ``sharded``.
        scale: activation scaling, one of the adapter's ``scales`` (default: its first).
        optimizer_state: ``reset`` (fresh state each round) or ``reindex`` (state travels).
        adapter: the model's :class:`~thinwire.models.adapter.ISTAdapter`; default: found
            automatically for a chain of Linear layers (:func:`linear_stack`).
        drop_last_step: the original code's round: the K-th step's update is discarded (the
            pieces go back as they were after K - 1 steps); needs K >= 2.
    """

    def __init__(self, model: nn.Module, optimizers: torch.optim.Optimizer |
                 Sequence[torch.optim.Optimizer], *, comm: Comm | None = None,
                 local_steps: int = 10, seed: int = 0, deployment: str = "central",
                 scale: str | None = None, optimizer_state: str = "reset",
                 adapter: ISTAdapter | None = None, tag: str = "subnet",
                 drop_last_step: bool = False) -> None:
        if local_steps < 1:
            raise UsageError(f"IST local_steps must be >= 1, got {local_steps}")
        if drop_last_step and local_steps < 2:
            raise UsageError("IST drop_last_step discards the K-th update of each round; it "
                             f"needs local_steps >= 2, got {local_steps}")
        if deployment not in DEPLOYMENTS:
            raise UsageError(f"IST deployment {deployment!r}: use central or sharded")
        if optimizer_state not in OPTIMIZER_STATES:
            raise UsageError(f"IST optimizer_state {optimizer_state!r}: use reset or reindex")
        self.model = model
        self.optimizers = ([optimizers] if isinstance(optimizers, torch.optim.Optimizer)
                           else list(optimizers))
        self.comm = comm if comm is not None else Comm()
        self.n, self.rank = self.comm.world_size, self.comm.rank
        self.K = local_steps
        self.seed = seed
        self.adapter = adapter if adapter is not None else linear_stack(model)
        self.plan: ISTPlan = self.adapter.plan
        self.scale = scale if scale is not None else self.adapter.scales[0]
        if self.scale not in self.adapter.scales:
            raise UsageError(f"IST scale {self.scale!r} is not available for "
                             f"{type(model).__name__}; use one of "
                             f"{', '.join(self.adapter.scales)}")
        self.reindex = optimizer_state == "reindex"
        self.drop_last_step = drop_last_step
        self.wire = getattr(torch, self.plan.wire_dtype)
        self.tag = tag
        self.own = pc.Ownership(self.plan, self.n, deployment)
        self._check_model()
        self.device = next(model.parameters()).device
        self.round = 0
        self.in_round = 0
        self.active = False
        self.finished = False
        self.held: dict[str, tuple[np.ndarray, ...]] = {}
        self.state_keys: tuple[str, ...] = ()
        self.scalar_state: dict[str, Any] = {}
        self.store: dict[str, torch.Tensor] = {}
        self.state_store: dict[str, dict[str, torch.Tensor]] = {}
        self._tensors = self._model_tensors(model)
        self._slice_store()
        self._scale_handles: list[Any] = []
        self._hooks: list[Any] = []
        self._kept: dict[str, list[torch.Tensor]] | None = None
        self._attach()

    # --- set-up --------------------------------------------------------------------------------
    def _check_model(self) -> None:
        names = {t.name for t in self.plan.tensors if not t.buffer}
        params = {n for n, _ in self.model.named_parameters()}
        if names != params:
            missing = sorted(params - names)[:3] or sorted(names - params)[:3]
            raise UsageError(f"IST adapter does not match {type(self.model).__name__}: "
                             f"parameters {missing} differ; pass the adapter of this model")
        for g in self.plan.groups:
            if g.kind == "disjoint" and g.size < self.n:
                raise UsageError(f"IST cuts {g.name} ({g.size} units) into {self.n} subnets; "
                                 f"use >= {self.n} units there or fewer workers")
        for t in self.plan.tensors:
            actual = dict(self.model.named_parameters()).get(t.name)
            if actual is not None and tuple(actual.shape) != t.shape:
                raise UsageError(f"IST adapter says {t.name} is {t.shape}, the model holds "
                                 f"{tuple(actual.shape)}; rebuild the adapter for this model")

    @staticmethod
    def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = dict(model.named_parameters())
        out.update(dict(model.named_buffers()))
        return out

    def _slice_store(self) -> None:
        """This rank's owned slices of every tensor; the model then holds nothing."""
        with torch.no_grad():
            for t in self.plan.tensors:
                full = self._tensors[t.name].detach()
                if t.shared:
                    self.store[t.name] = full.clone()
                elif t.unit is not None:
                    if self.own.owner_of(t) == self.rank:
                        self.store[t.name] = full.clone()
                else:
                    c = t.cuts[0]
                    lo, hi = self.own.owned(c.group, self.rank)
                    g = self.plan.group(c.group)
                    idx = _index(c, g.size, torch.arange(lo, hi, device=full.device))
                    self.store[t.name] = full.index_select(c.dim, idx).clone()
        self._release()

    def _attach(self) -> None:
        self._hooks = [self.model.register_forward_pre_hook(self._pre_forward)]
        self._hooks += [o.register_step_post_hook(self._post_step) for o in self.optimizers]
        if self.drop_last_step:
            self._hooks.append(self.optimizers[0].register_step_pre_hook(self._pre_step))

    def _detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _release(self) -> None:
        """Between rounds the model's tensors hold no data (and no gradients)."""
        for t in self.plan.tensors:
            x = self._tensors[t.name]
            x.data = x.data.new_empty(0)
            if isinstance(x, nn.Parameter):
                x.grad = None

    # --- hooks ---------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        del args
        if not module.training:
            where = (f"mid-round (step {self.in_round} of {self.K} of round {self.round})"
                     if self.active else "between rounds")
            raise UsageError(f"IST: the model was evaluated {where}; it holds one worker's "
                             "subnet or nothing. Evaluate ist.full_model() at a round boundary")
        if not self.active:
            self.begin_round()

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """``drop_last_step``: before the K-th step, keep the subnet as it is (with its optimizer
        state when that travels); the round ends with these pieces."""
        del optimizer, args, kwargs
        if self.active and self.in_round == self.K - 1:
            self._harvest_state_keys()
            self._kept = {name: [x.detach().clone() for x in xs]
                          for name, xs in self._subnet().items()}

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        del args, kwargs
        if not self.active:
            raise UsageError("IST: optimizer.step() was called with no forward pass in this "
                             "round; run the forward and backward before each step")
        if optimizer is not self.optimizers[-1]:
            return
        self.in_round += 1
        if self.in_round == self.K:
            self.end_round()

    @property
    def at_boundary(self) -> bool:
        """True between rounds, where the full model is defined (evaluate, checkpoint)."""
        return not self.active

    # --- step 1-2: partition and scatter -------------------------------------------------------
    def _partition(self, round_: int) -> dict[str, tuple[np.ndarray, ...]]:
        return partition_groups([(g.name, g.size, g.kind) for g in self.plan.groups], self.n,
                                self.seed, round_)

    def _units(self, group: str, worker: int) -> torch.Tensor:
        return torch.as_tensor(self.held[group][worker], dtype=torch.long, device=self.device)

    def _copies(self, t: TensorPlan, state: bool) -> int:
        return 1 + (len(self.state_keys) if state and not t.buffer and self.reindex else 0)

    def _store_rows(self, t: TensorPlan, owner_units: torch.Tensor) -> torch.Tensor:
        c = t.cuts[0]
        lo, hi = self.own.owned(c.group, self.rank)
        return _index(c, hi - lo, owner_units - lo)

    def _other_index(self, t: TensorPlan, worker: int) -> list[tuple[int, torch.Tensor]]:
        """(dim, full-layout indices) of the worker's units along ``t``'s other cuts."""
        return [(c.dim, _index(c, self.plan.group(c.group).size, self._units(c.group, worker)))
                for c in t.cuts[1:]]

    def _span(self, t: TensorPlan, worker: int, owner: int) -> tuple[torch.Tensor, int, int]:
        c = t.cuts[0]
        units = self.held[c.group][worker]
        a, b = self.own.span(units, c.group, owner)
        return torch.as_tensor(units[a:b], dtype=torch.long, device=self.device), a, b

    def _stored(self, t: TensorPlan, state: bool) -> list[torch.Tensor]:
        out = [self.store[t.name]]
        if state and self.reindex and not t.buffer and self.state_keys:
            out += [self.state_store[t.name][k] for k in self.state_keys]
        return out

    def _extract(self, worker: int, state: bool) -> torch.Tensor:
        """Owner side (this rank): the flat piece for ``worker``."""
        parts: list[torch.Tensor] = []
        for t in self.plan.tensors:
            if pc.piece_numel(t, self.own, self.held, self.rank, worker) == 0:
                continue
            for x in self._stored(t, state):
                if t.unit is not None:
                    parts.append(x.reshape(-1))
                    continue
                units, _, _ = self._span(t, worker, self.rank)
                block = x.index_select(t.cuts[0].dim, self._store_rows(t, units))
                for dim, ix in self._other_index(t, worker):
                    block = block.index_select(dim, ix)
                parts.append(block.reshape(-1))
        return self._flat(parts)

    def _flat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """One wire-dtype buffer of ``parts`` (module docstring)."""
        if not parts:
            return torch.empty(0, device=self.device, dtype=self.wire)
        return torch.cat([p.to(self.wire) for p in parts])

    def _piece_size(self, owner: int, worker: int, state: bool) -> int:
        return sum(pc.piece_numel(t, self.own, self.held, owner, worker) * self._copies(t, state)
                   for t in self.plan.tensors)

    def _sub_shape(self, t: TensorPlan, worker: int) -> list[int]:
        shape = list(t.shape)
        for c in t.cuts:
            shape[c.dim] = pc.cut_len(c, len(self.held[c.group][worker]))
        return shape

    def _load(self, sub: dict[str, list[torch.Tensor]], owner: int, piece: torch.Tensor,
              state: bool) -> None:
        """Worker side: place the piece from ``owner`` into this rank's subnet tensors."""
        at = 0
        for t in self.plan.tensors:
            if pc.piece_numel(t, self.own, self.held, owner, self.rank) == 0:
                continue
            for x in sub[t.name][:self._copies(t, state)]:
                if t.unit is not None:
                    x.copy_(piece[at:at + x.numel()].view_as(x))
                    at += x.numel()
                    continue
                c = t.cuts[0]
                _, a, b = self._span(t, self.rank, owner)
                shape = list(x.shape)
                shape[c.dim] = pc.cut_len(c, b - a)
                size = int(np.prod(shape))
                rows = _index(c, len(self.held[c.group][self.rank]),
                              torch.arange(a, b, device=self.device))
                x.index_copy_(c.dim, rows, piece[at:at + size].view(shape).to(x.dtype))
                at += size
        assert at == piece.numel(), (at, piece.numel())

    def begin_round(self) -> None:
        """Steps 1-2: draw the round's partition, move the subnets, load them into the model."""
        if self.finished:
            raise UsageError("IST has finished (the model is whole again); build a new IST")
        if self.active:
            return
        self.held = self._partition(self.round)
        state = self.reindex and bool(self.state_keys)
        sends = [(w, self._extract(w, state)) for w in range(self.n)
                 if w != self.rank and self._piece_size(self.rank, w, state)]
        recvs = [(o, torch.empty(size, device=self.device, dtype=self.wire))
                 for o in range(self.n)
                 if o != self.rank and (size := self._piece_size(o, self.rank, state))]
        self.comm.exchange(sends, recvs, tag=self.tag)
        sub: dict[str, list[torch.Tensor]] = {}
        for t in self.plan.tensors:
            if not pc.holds(t, self.held, self.rank):
                continue
            like = self.store.get(t.name)
            if like is None:  # a dealt unit owned elsewhere: shape and dtype from the plan
                like = self._tensors[t.name].data.new_empty(t.shape)
            shape = self._sub_shape(t, self.rank)
            n_copies = self._copies(t, state)
            sub[t.name] = [like.new_empty(shape) for _ in range(n_copies)]
            if t.shared:
                for k, x in enumerate(self._stored(t, state)):
                    sub[t.name][k].copy_(x)
        if self._piece_size(self.rank, self.rank, state):
            self._load(sub, self.rank, self._extract(self.rank, state), state)
        for o, buf in recvs:
            self._load(sub, o, buf, state)
        with torch.no_grad():
            for name, xs in sub.items():
                self._tensors[name].data = xs[0]
        self._init_optimizer_state(sub, state)
        self.adapter.configure(self.model, {g: units[self.rank] for g, units in self.held.items()})
        self._install_scaling()
        self.active = True
        self.in_round = 0

    def _init_optimizer_state(self, sub: dict[str, list[torch.Tensor]], state: bool) -> None:
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    opt.state.pop(p, None)
        if not state:
            return
        names = {id(x): n for n, x in self._tensors.items()}
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    name = names.get(id(p))
                    if name is None or name not in sub:
                        continue
                    st: dict[str, Any] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                          for k, v in self.scalar_state.items()}
                    st.update(zip(self.state_keys, sub[name][1:]))
                    opt.state[p] = st

    def _install_scaling(self) -> None:
        if self.scale != "dropout":
            return
        factors = []
        for mod_name, group in self.plan.scaled_inputs:
            factor = self.plan.group(group).size / len(self.held[group][self.rank])
            if factor != 1.0:
                factors.append((mod_name, factor))
        if factors:
            self._scale_handles = self.adapter.install_scaling(self.model, factors)

    # --- step 4: gather, write back, average ---------------------------------------------------
    def _harvest_state_keys(self) -> None:
        """After the first round: the optimizer's per-element state names (e.g. Adam's moments)."""
        if not self.reindex or self.state_keys:
            return
        keys: set[str] = set()
        scalars: dict[str, Any] = {}
        for opt in self.optimizers:
            for p, st in opt.state.items():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0:
                        keys.add(k)
                    elif k not in scalars:
                        scalars[k] = v
        self.state_keys = tuple(sorted(keys))
        self.scalar_state = scalars
        for t in self.plan.tensors:
            if not t.buffer and t.name in self.store:
                self.state_store[t.name] = {k: torch.zeros_like(self.store[t.name])
                                            for k in self.state_keys}

    def _subnet(self) -> dict[str, list[torch.Tensor]]:
        """This rank's trained subnet tensors, with their optimizer state when it travels."""
        states: dict[int, dict[str, Any]] = {}
        for opt in self.optimizers:
            for p, st in opt.state.items():
                states[id(p)] = st
        out: dict[str, list[torch.Tensor]] = {}
        for t in self.plan.tensors:
            if not pc.holds(t, self.held, self.rank):
                continue
            x = self._tensors[t.name].data
            xs = [x]
            if self.reindex and not t.buffer and self.state_keys:
                st = states.get(id(self._tensors[t.name]), {})
                xs += [st[k] if k in st else torch.zeros_like(x) for k in self.state_keys]
            out[t.name] = xs
        return out

    def _take(self, sub: dict[str, list[torch.Tensor]], owner: int) -> torch.Tensor:
        """Worker side: the piece of the trained subnet that goes back to ``owner``."""
        parts: list[torch.Tensor] = []
        for t in self.plan.tensors:
            if pc.piece_numel(t, self.own, self.held, owner, self.rank) == 0:
                continue
            for x in sub[t.name][:self._copies(t, True)]:
                if t.unit is not None:
                    parts.append(x.reshape(-1))
                    continue
                c = t.cuts[0]
                _, a, b = self._span(t, self.rank, owner)
                rows = _index(c, len(self.held[c.group][self.rank]),
                              torch.arange(a, b, device=self.device))
                parts.append(x.index_select(c.dim, rows).reshape(-1))
        return self._flat(parts)

    def _write_back(self, worker: int, piece: torch.Tensor,
                    dealt: dict[str, list[list[torch.Tensor]]]) -> None:
        """Owner side: a returned piece into the stored slices (dealt units collected)."""
        at = 0
        for t in self.plan.tensors:
            if pc.piece_numel(t, self.own, self.held, self.rank, worker) == 0:
                continue
            targets = self._stored(t, True)
            if t.unit is not None:
                copies = []
                for x in targets:
                    copies.append(piece[at:at + x.numel()].view_as(x))
                    at += x.numel()
                dealt.setdefault(t.name, []).append(copies)
                continue
            units, _, _ = self._span(t, worker, self.rank)
            dims = [t.cuts[0].dim] + [d for d, _ in self._other_index(t, worker)]
            index = [self._store_rows(t, units)] + [ix for _, ix in self._other_index(t, worker)]
            for x in targets:
                shape = list(x.shape)
                for d, ix in zip(dims, index):
                    shape[d] = len(ix)
                size = int(np.prod(shape))
                _put(x, dims, index, piece[at:at + size].view(shape).to(x.dtype))
                at += size
        assert at == piece.numel(), (at, piece.numel())

    def end_round(self) -> None:
        """Step 4: pieces back to their owners, shared tensors averaged, the model released."""
        if not self.active:
            raise UsageError("IST.end_round() outside a round")
        self._harvest_state_keys()
        sub = self._kept if self._kept is not None else self._subnet()
        self._kept = None
        sends = [(o, self._take(sub, o)) for o in range(self.n)
                 if o != self.rank and self._piece_size(o, self.rank, True)]
        recvs = [(w, torch.empty(size, device=self.device, dtype=self.wire))
                 for w in range(self.n)
                 if w != self.rank and (size := self._piece_size(self.rank, w, True))]
        self.comm.exchange(sends, recvs, tag=self.tag)
        dealt: dict[str, list[list[torch.Tensor]]] = {}
        with torch.no_grad():
            if self._piece_size(self.rank, self.rank, True):
                self._write_back(self.rank, self._take(sub, self.rank), dealt)
            for w, buf in sorted(recvs, key=lambda r: r[0]):
                self._write_back(w, buf, dealt)
            self._average_dealt(dealt)
            self._average_shared(sub)
        self._end_common()

    def _average_dealt(self, dealt: dict[str, list[list[torch.Tensor]]]) -> None:
        """Blocks held by several workers: base + mean of their updates (bitwise unchanged when
        no copy moved; integer buffers: the mean update rounded down); one holder: its copy."""
        plans = {t.name: t for t in self.plan.tensors}
        for name, copies in dealt.items():
            for k, base in enumerate(self._stored(plans[name], True)):
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

    def _average_shared(self, sub: dict[str, list[torch.Tensor]]) -> None:
        """Shared floating-point tensors: store + (sum of every worker's update) / n."""
        floats, deltas = [], []
        for t in self.plan.tensors:
            if not t.shared:
                continue
            for base, x in zip(self._stored(t, True), sub[t.name]):
                if not base.is_floating_point() or self.n == 1:
                    base.copy_(x)
                    continue
                floats.append(base)
                deltas.append((x - base).reshape(-1))
        if not floats:
            return
        flat = self._flat(deltas)
        self.comm.all_reduce(flat, tag="shared")
        at = 0
        for base in floats:
            base.add_(flat[at:at + base.numel()].view_as(base), alpha=1.0 / self.n)
            at += base.numel()

    def _end_common(self) -> None:
        for h in self._scale_handles:
            h.remove()
        self._scale_handles = []
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    opt.state.pop(p, None)
        self._release()
        self.adapter.configure(self.model, None)
        self.active = False
        self.round += 1
        self.in_round = 0

    # --- the full model ------------------------------------------------------------------------
    def _gather_full(self, to: Sequence[int], tag: str) -> dict[str, torch.Tensor] | None:
        """Every tensor whole on the ranks in ``to`` from every owner's slices."""
        if self.active:
            raise UsageError(f"IST: the full model was asked for mid-round (step {self.in_round}"
                             f" of {self.K} of round {self.round}); ask at a round boundary, "
                             "after the K-th optimizer step")
        mine = [self.store[t.name].reshape(-1) for t in self.plan.tensors
                if not t.shared and t.name in self.store]
        flat = self._flat(mine)
        sizes = [self._stored_numel(o) for o in range(self.n)]
        sends = [(d, flat) for d in to if d != self.rank and flat.numel()]
        recvs = ([(o, torch.empty(sizes[o], device=self.device, dtype=self.wire))
                  for o in range(self.n) if o != self.rank and sizes[o]]
                 if self.rank in to else [])
        self.comm.exchange(sends, recvs, tag=tag)
        if self.rank not in to:
            return None
        full: dict[str, torch.Tensor] = {}
        for t in self.plan.tensors:
            like = self.store.get(t.name)
            if like is not None and t.shared:
                full[t.name] = like.clone()
                continue
            dtype = like.dtype if like is not None else self._tensors[t.name].dtype
            full[t.name] = torch.empty(t.shape, device=self.device, dtype=dtype)
        for o, buf in [(self.rank, flat), *recvs]:
            self._unpack_owner(o, buf, full)
        return full

    def _stored_numel(self, owner: int) -> int:
        total = 0
        for t in self.plan.tensors:
            if t.shared:
                continue
            if t.unit is not None:
                total += t.numel if self.own.owner_of(t) == owner else 0
            else:
                c = t.cuts[0]
                lo, hi = self.own.owned(c.group, owner)
                total += t.numel // t.shape[c.dim] * pc.cut_len(c, hi - lo)
        return total

    def _unpack_owner(self, owner: int, flat: torch.Tensor, full: dict[str, torch.Tensor]) -> None:
        at = 0
        for t in self.plan.tensors:
            if t.shared:
                continue
            target = full[t.name]
            if t.unit is not None:
                if self.own.owner_of(t) == owner:
                    target.copy_(flat[at:at + t.numel].view(t.shape))
                    at += t.numel
                continue
            c = t.cuts[0]
            lo, hi = self.own.owned(c.group, owner)
            if hi == lo:
                continue
            g = self.plan.group(c.group)
            rows = _index(c, g.size, torch.arange(lo, hi, device=self.device))
            shape = list(t.shape)
            shape[c.dim] = len(rows)
            size = int(np.prod(shape))
            target.index_copy_(c.dim, rows, flat[at:at + size].view(shape).to(target.dtype))
            at += size
        assert at == flat.numel(), (at, flat.numel())

    def full_model(self, to: int = 0, *, tag: str = "control") -> nn.Module | None:
        """The full model on rank ``to`` (None elsewhere); every rank must call it, at a round
        boundary. A copy: training goes on in the user's model. ``tag`` labels the traffic in
        the ledger (``control``, evaluation, is kept out of the method's totals)."""
        full = self._gather_full([to], tag)
        if full is None:
            return None
        self._detach()
        try:
            clone = copy.deepcopy(self.model)
        finally:
            self._attach()
        tensors = self._model_tensors(clone)
        with torch.no_grad():
            for name, x in full.items():
                tensors[name].data = x
        self._configure_full(clone)
        return clone

    def _configure_full(self, model: nn.Module) -> None:
        """The full model as evaluated: every unit in place, then the adapter's evaluation-time
        adjustment unless ``scale`` is ``none``."""
        self.adapter.configure(model, None)
        if self.scale != "none":
            self.adapter.configure_eval(model, self.n)

    def finish(self, *, tag: str = "switch") -> nn.Module:
        """End IST: the user's model becomes the full model again on every rank (hooks removed,
        optimizer state cleared), configured as :meth:`full_model` evaluates it (so training
        goes on from the model the evaluations saw). The hybrid schedule's switch to local
        SGD."""
        full = self._gather_full(list(range(self.n)), tag)
        assert full is not None
        self._detach()
        with torch.no_grad():
            for name, x in full.items():
                self._tensors[name].data = x
        self._configure_full(self.model)
        self.finished = True
        return self.model

    def abandon(self) -> None:
        """End IST without communication: hooks removed, the model's tensors full-size but
        uninitialised (the caller loads a state into them, e.g. resuming past a switch)."""
        self._detach()
        with torch.no_grad():
            for t in self.plan.tensors:
                x = self._tensors[t.name]
                x.data = x.data.new_empty(t.shape)
        self._configure_full(self.model)
        self.finished = True

    # --- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's stored slices, optimizer-state slices and the round (at a boundary)."""
        if self.active:
            raise UsageError("IST.state_dict() mid-round; checkpoint at a round boundary")
        return {"round": self.round, "store": dict(self.store),
                "state_keys": list(self.state_keys),
                "state_store": {f"{n}|{k}": v for n, d in self.state_store.items()
                                for k, v in d.items()},
                "scalar_state": {k: v for k, v in self.scalar_state.items()
                                 if isinstance(v, (torch.Tensor, int, float))}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round = int(state["round"])
        with torch.no_grad():
            for name, x in state["store"].items():
                self.store[name].copy_(x)
        self.state_keys = tuple(state.get("state_keys", ()))
        self.scalar_state = dict(state.get("scalar_state", {}))
        self.state_store = {}
        for key, v in state.get("state_store", {}).items():
            name, _, k = key.partition("|")
            self.state_store.setdefault(name, {})[k] = v.to(self.device).clone()

    # --- what a worker holds -------------------------------------------------------------------
    def subnet_numel(self, round_: int | None = None, *, params_only: bool = True) -> int:
        """Elements of this rank's subnet in ``round_`` (default: the current one)."""
        held = self._partition(self.round if round_ is None else round_)
        return sum(pc.subnet_numel(t, held, self.rank) for t in self.plan.tensors
                   if not (params_only and t.buffer))

    def stored_numel(self) -> int:
        """Elements of the model this rank stores between rounds."""
        return sum(x.numel() for x in self.store.values())


def iter_optimizers(x: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]
                    ) -> list[torch.optim.Optimizer]:
    return [x] if isinstance(x, torch.optim.Optimizer) else list(x)


OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
