"""Independent Subnetwork Training (``ist``) for fully connected networks.

Yuan, Wolfe, Dun, Tang, Kyrillidis, Jermaine, "Distributed Learning of Deep Neural Networks
using Independent Subnet Training", VLDB 2022 (arXiv 1910.02120); analysed by Shulgin &
Richtarik, ICML 2024. Round r covers steps [r K, (r + 1) K):
  1. every rank draws the round's partition from (seed, r) with the shared
     :class:`~thinwire.strategies.ist.partition.Partitioner`: no message;
  2. the ranks storing the model send each worker the pieces of its subnet (central: rank 0
     holds everything; sharded: each rank holds ~1/n of every layer's neurons);
  3. each worker trains its subnet for K local optimizer steps on its own shard; with
     ``method.scale = dropout`` hidden activations are multiplied by n (inverted dropout); with
     ``batchnorm`` (the original code's choice) batch statistics re-normalise each neuron;
  4. the workers send the trained pieces back; owners write the disjoint blocks in place, and
     rank 0 averages the few parameters every subnet shares (the output bias): the shared
     parameter moves by the mean of the workers' updates, so unchanged copies leave it bitwise
     unchanged. Cross blocks between two workers' groups are not touched.
Optimizer state: ``reset`` starts a fresh optimizer each round (the original code); ``reindex``
keeps full-size state on the owners and ships its slices with the parameters (more bytes per
round, continuity of momentum / Adam moments across repartitions).
Hybrid: with ``method.switch_at = S`` the run switches to local SGD (period ``method.period``)
on the full model at step S: IST's early speed without its accuracy ceiling (ResIST's converse,
which warmed up with local SGD).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from thinwire.models.mlp import MLP
from thinwire.strategies.base import (
    Context,
    MemoryReport,
    Strategy,
    lr_at,
    make_optimizer,
    set_lr,
)
from thinwire.strategies.ist import exchange as ex
from thinwire.strategies.ist.mlp import mlp_specs
from thinwire.strategies.ist.partition import Partitioner
from thinwire.strategies.local_sgd import LocalSGD


def state_names(opt_name: str, momentum: float) -> tuple[str, ...]:
    if opt_name == "adamw":
        return ("exp_avg", "exp_avg_sq")
    return ("momentum_buffer",) if momentum > 0 else ()


class IST(Strategy):
    name = "ist"

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        super().__init__(ctx, model)
        if not isinstance(model, MLP):
            raise TypeError("IST for fully connected networks needs thinwire.models.MLP")
        m, t = self.cfg.method, self.cfg.train
        self.template = model
        self.device = ctx.device
        self.n, self.rank = self.comm.world_size, self.comm.rank
        self.K = m.local_steps
        self.specs = mlp_specs(model)
        self.partitioner = Partitioner(model.hidden, self.n, seed=t.seed)
        widths = model.hidden
        self.own = (ex.Ownership.central(widths, self.n) if m.deployment == "central"
                    else ex.Ownership.sharded(widths, self.n))
        self.states = state_names(t.optimizer, t.momentum) if m.optimizer_state == "reindex" else ()
        self.copies = 1 + len(self.states)
        self.store = self._slice_store(model)
        self.hidden_scale = float(self.n) if m.scale == "dropout" else 1.0
        self.round_groups: list[tuple[np.ndarray, ...]] = []
        self.sub: MLP | None = None
        self.opt: torch.optim.Optimizer | None = None
        self.local: LocalSGD | None = None
        # The first optimizer a process builds imports torch's compiler stack (seconds); build
        # one now so that one-time cost lands at set-up, as it does for dp and localsgd, and not
        # in the first training step.
        make_optimizer([nn.Parameter(torch.zeros(1, device=self.device))], self.cfg.train)

    # --- storage -------------------------------------------------------------------------------
    def _slice_store(self, model: nn.Module) -> list[list[torch.Tensor]]:
        """This rank's owned slices of every parameter (and zeroed state buffers)."""
        params = dict(model.named_parameters())
        store = []
        for s in self.specs:
            full = params[s.name].detach()
            if s.owner_dim is None or s.owner_layer is None:
                t = full.clone() if self.rank == 0 else full.new_empty(0)
            else:
                lo, hi = self.own.blocks[s.owner_layer][self.rank]
                t = full.narrow(s.owner_dim, lo, hi - lo).clone()
            store.append([t.to(self.device)] + [torch.zeros_like(t, device=self.device)
                                                 for _ in self.states])
        return store

    def _groups_of(self, worker: int) -> tuple[np.ndarray, ...]:
        return tuple(layer[worker] for layer in self.round_groups)

    # --- steps 1-2: partition and scatter ------------------------------------------------------
    def _begin_round(self, r: int) -> None:
        part = self.partitioner(r)
        self.round_groups = list(part.groups)
        mine = self._groups_of(self.rank)
        sends = []
        for j in range(self.n):
            if j != self.rank and ex.piece_numel(self.specs, self.own, self.rank, self._groups_of(j), self.copies):
                sends.append((j, ex.extract(self.specs, self.store, self.own, self.rank, self._groups_of(j))))
        recvs = []
        for o in range(self.n):
            size = ex.piece_numel(self.specs, self.own, o, mine, self.copies)
            if o != self.rank and size:
                recvs.append((o, torch.empty(size, device=self.device)))
        self.comm.exchange(sends, recvs, tag="subnet")
        sizes = tuple(len(g) for g in mine)
        sub = MLP(self.template.input_dim, sizes, self.template.num_classes,
                  norm=self.template.norm, activation=self.template.activation).to(self.device)
        sub_tensors = self._sub_tensors(sub, fresh=True)
        if ex.piece_numel(self.specs, self.own, self.rank, mine, self.copies):
            own_piece = ex.extract(self.specs, self.store, self.own, self.rank, mine)
            ex.load_piece(self.specs, sub_tensors, self.own, self.rank, mine, own_piece)
        for o, buf in recvs:
            ex.load_piece(self.specs, sub_tensors, self.own, o, mine, buf)
        self.sub = sub
        self.opt = make_optimizer(sub.parameters(), self.cfg.train)
        if self.states:
            step = torch.tensor(float(r * self.K))
            for p, tensors in zip(sub.parameters(), sub_tensors):
                st: dict[str, Any] = dict(zip(self.states, tensors[1:]))
                if self.cfg.train.optimizer == "adamw":
                    st["step"] = step.clone()
                self.opt.state[p] = st

    def _sub_tensors(self, sub: MLP, *, fresh: bool) -> list[list[torch.Tensor]]:
        out = []
        for p in sub.parameters():
            if fresh or self.opt is None:
                extra = [torch.zeros_like(p) for _ in self.states]
            else:
                extra = [self.opt.state[p][k] for k in self.states]
            out.append([p.data] + extra)
        return out

    # --- step 4: gather and write back ---------------------------------------------------------
    def _end_round(self) -> None:
        assert self.sub is not None
        mine = self._groups_of(self.rank)
        sub_tensors = self._sub_tensors(self.sub, fresh=False)
        sends = []
        for o in range(self.n):
            if o != self.rank and ex.piece_numel(self.specs, self.own, o, mine, self.copies):
                sends.append((o, ex.take_piece(self.specs, sub_tensors, self.own, o, mine)))
        recvs = []
        for j in range(self.n):
            size = ex.piece_numel(self.specs, self.own, self.rank, self._groups_of(j), self.copies)
            if j != self.rank and size:
                recvs.append((j, torch.empty(size, device=self.device)))
        self.comm.exchange(sends, recvs, tag="subnet")
        pieces: list[tuple[int, torch.Tensor]] = list(recvs)
        if ex.piece_numel(self.specs, self.own, self.rank, mine, self.copies):
            pieces.append((self.rank, ex.take_piece(self.specs, sub_tensors, self.own, self.rank, mine)))
        for j, piece in pieces:
            ex.write_back(self.specs, self.store, self.own, self.rank, self._groups_of(j), piece)
        if self.rank == 0:
            self._average_shared(pieces)
        self.sub, self.opt = None, None

    def _average_shared(self, pieces: list[tuple[int, torch.Tensor]]) -> None:
        shared = [k for k, s in enumerate(self.specs) if s.owner_dim is None]
        if not shared:
            return
        copies = [ex.shared_parts(self.specs, piece, self.own, self._groups_of(j), self.copies)
                  for j, piece in pieces]
        for pos, k in enumerate(shared):
            for c, base in enumerate(self.store[k]):
                idx = pos * self.copies + c
                delta = sum(cp[idx] - base for cp in copies)
                base.add_(delta / self.n)  # type: ignore[operator]

    # --- step 3 and the trainer's interface ----------------------------------------------------
    def train_step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> float:
        switch = self.cfg.method.switch_at
        if switch and step >= switch:
            if self.local is None:
                self._switch_to_local_sgd()
            assert self.local is not None
            return self.local.train_step(x, y, step)
        if step % self.K == 0:
            self._begin_round(step // self.K)
        assert self.sub is not None and self.opt is not None
        set_lr(self.opt, lr_at(self.cfg.train, step))
        self.sub.train()
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.sub(x, hidden_scale=self.hidden_scale), y)
        loss.backward()
        self.opt.step()
        if (step + 1) % self.K == 0:
            self._end_round()
        return float(loss.detach())

    def _switch_to_local_sgd(self) -> None:
        """Hybrid schedule: every rank gets the full model, then local SGD continues."""
        full = self._assemble(to=list(range(self.n)), tag="switch")
        assert full is not None
        self.local = LocalSGD(self.ctx, full)

    def _assemble(self, to: list[int], tag: str) -> MLP | None:
        """The full model on the ranks in ``to`` from every owner's slices (parameters only)."""
        sends, recvs = [], []
        params = [ts[0] for ts in self.store]
        flat_mine = torch.cat([p.reshape(-1) for p in params])
        if flat_mine.numel():
            sends = [(d, flat_mine) for d in to if d != self.rank]
        if self.rank in to:
            for o in range(self.n):
                size = self._owned_numel(o)
                if o != self.rank and size:
                    recvs.append((o, torch.empty(size, device=self.device)))
        self.comm.exchange(sends, recvs, tag=tag)
        if self.rank not in to:
            return None
        full = MLP(self.template.input_dim, self.template.hidden, self.template.num_classes,
                   norm=self.template.norm, activation=self.template.activation).to(self.device)
        fparams = dict(full.named_parameters())
        for o, flat in [(self.rank, flat_mine), *recvs]:
            i = 0
            with torch.no_grad():
                for s in self.specs:
                    target = fparams[s.name]
                    if s.owner_dim is None or s.owner_layer is None:
                        if o == 0:
                            target.copy_(flat[i:i + target.numel()].view_as(target))
                            i += target.numel()
                        continue
                    lo, hi = self.own.blocks[s.owner_layer][o]
                    view = target.narrow(s.owner_dim, lo, hi - lo)
                    view.copy_(flat[i:i + view.numel()].view_as(view))
                    i += view.numel()
        return full

    def _owned_numel(self, o: int) -> int:
        total = 0
        for s in self.specs:
            if s.owner_dim is None or s.owner_layer is None:
                total += int(np.prod(s.shape)) if o == 0 else 0
            else:
                lo, hi = self.own.blocks[s.owner_layer][o]
                total += (hi - lo) * s.row_size
        return total

    def eval_model(self) -> nn.Module | None:
        if self.local is not None:
            return self.local.eval_model()
        return self._assemble(to=[0], tag="control")

    def state_dict(self) -> dict[str, Any]:
        if self.local is not None:
            return {"local": self.local.state_dict()}
        return {"store": {f"{s.name}:{c}": t for s, ts in zip(self.specs, self.store)
                          for c, t in enumerate(ts)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "local" in state:
            self._switch_to_local_sgd_from_state(state["local"])
            return
        for s, ts in zip(self.specs, self.store):
            for c, t in enumerate(ts):
                t.copy_(state["store"][f"{s.name}:{c}"])

    def _switch_to_local_sgd_from_state(self, state: dict[str, Any]) -> None:
        full = MLP(self.template.input_dim, self.template.hidden, self.template.num_classes,
                   norm=self.template.norm, activation=self.template.activation)
        self.local = LocalSGD(self.ctx, full)
        self.local.load_state_dict(state)

    def memory(self) -> MemoryReport:
        if self.local is not None:
            return self.local.memory()
        groups = self.partitioner(0).of(self.rank)
        sizes = tuple(len(g) for g in groups)
        sub_count = sum(int(np.prod(s.subnet_shape(sizes))) for s in self.specs)
        stored = sum(t.numel() for ts in self.store for t in ts[:1])
        state_stored = sum(t.numel() for ts in self.store for t in ts[1:])
        # the local optimizer keeps one buffer per parameter per state tensor (momentum; Adam's
        # two moments), whether or not that state travels between rounds
        buffers = len(state_names(self.cfg.train.optimizer, self.cfg.train.momentum))
        opt_bytes = 4 * buffers * sub_count
        return MemoryReport(params=4 * (sub_count + stored), grads=4 * sub_count,
                            optimizer=opt_bytes + 4 * state_stored, param_count=sub_count,
                            stored_count=stored)
