"""IST that keeps training when a worker dies: rounds on a torchft quorum, no restart.

Independent Subnetwork Training (Yuan et al., VLDB 2022; Shulgin & Richtarik, ICML 2024) with
its rounds on torchft's quorum (:class:`~thinwire.runtime.ft.Replica`): a worker lost mid-round
loses only its round, and the units are dealt over the workers alive at the next round. In a
user's loop, one process per worker, exactly as :class:`~thinwire.strategies.ist.core.IST`::

    ist = FaultTolerantIST(model, optimizer, replica_id="worker3", lighthouse=ADDRESS,
                           workers=4, min_workers=2, example_input=x, local_steps=10)
    for x, y in loader:                  # the round's batches: a pure function of ist.round
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()                 # every K-th step closes a round
    ist.finish()                         # the full model on every live worker

Central deployment, the stored model on ``keepers`` workers (default 2): every keeper holds the
whole model (rank 0's store of central IST) and applies the same write-back to it, so the copies
stay equal bit for bit, and losing every keeper but one loses nothing.

Round r:
  1. begin (the round's first forward): torchft forms the quorum; a worker that joined is
     behind and receives a live peer's boundary state (the round, the keepers, the tensors every
     subnet shares and the optimizer's state names and scalars: :meth:`_ft_state`), over the
     ledger's ``recovery`` tag. The live workers, named by the numbers their ``replica_id`` ends
     in, are read off the quorum (no message): sorted, they are the round's workers 0..m-1;
  2. keepers lost since the last round are replaced by the first live non-keepers (in that
     order), each sent the whole stored model (and its optimizer-state slices) by the first
     live keeper, tagged ``recovery``; none left: the job ends with one line;
  3. the partition of round r is drawn over the m live workers (``partition_groups(groups, m,
     seed, r, overlap)``, overlap 0 resolved against m), so every live worker computes the
     same one; the first live keeper sends each worker its subnet (tag ``subnet``); every
     member then agrees (:meth:`~thinwire.runtime.ft.ManagedComm.agree`), and a failed
     agreement (a worker lost during the scatter) repeats steps 1-3 on a new quorum;
  4. K optimizer steps of the user's loop, no messages;
  5. close (after the K-th step): a quorum of the round's workers still alive (torchft's
     ``shrink_only``: a worker waiting to join waits for the next round); each sends its
     trained pieces to every live keeper, and the deltas of the shared tensors are all-gathered;
     every member agrees; a failed agreement repeats step 5 with the survivors (nothing was
     written yet);
  6. agreed: the vote commits the round (torchft's step = rounds closed); every keeper writes
     back the live workers' pieces in worker order, as central IST does: a lost worker's units
     keep their round-start values (with overlap > 1, the mean of their live holders; dealt
     units, the mean of their live holders' updates); every member sets the shared tensors to
     base + (sum of the live workers' deltas, in worker order) / (live workers).

With an outer optimizer (``outer_lr``/``outer_momentum``, :class:`IST`'s step 5) every worker
takes the outer step on what it stores after step 6 (keepers: the whole model; others: the
shared tensors), its momentum kept per stored tensor: a new keeper receives the cut tensors'
with the store (step 2), a joiner the shared tensors' with its boundary state (step 1), both
tagged ``recovery``.

Sharded deployment (``deployment="sharded"``): :class:`FaultTolerantIST` builds a
:class:`ShardedFaultTolerantIST` instead (its store in
:mod:`~thinwire.strategies.ist.fault_sharded`), which keeps every block of units on
``keepers`` workers (no worker stores the whole model) and runs the same steps with the
blocks in place of the whole store; it refuses the outer optimizer (its blocks do not carry
the momentum yet).

One concept, one file (over 400 lines): IST's round on a torchft quorum (its live sets, keepers,
agreement and a joiner's state).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from thinwire.errors import UsageError
from thinwire.models.adapter import ISTAdapter
from thinwire.runtime.comm import Comm
from thinwire.runtime.ft import RECOVERY, FaultToleranceError, Replica
from thinwire.strategies.ist import pieces as pc
from thinwire.strategies.ist import subnet as sn
from thinwire.strategies.ist.core import IST
from thinwire.strategies.ist.elements import View
from thinwire.strategies.ist.fault_sharded import ShardedStore
from thinwire.strategies.ist.partition import resolve_overlap
from thinwire.strategies.ist.store import Dealt, Overlap

__all__ = ["FaultTolerantIST", "ShardedFaultTolerantIST", "replica_number"]


def replica_number(replica_id: str) -> int:
    """The number a worker's ``replica_id`` ends in (torchft's rule); one line when none."""
    digits = len(replica_id) - len(replica_id.rstrip("0123456789"))
    if not digits:
        raise FaultToleranceError(f"FaultTolerantIST replica_id {replica_id!r} ends in no "
                                  "number; give each worker an id ending in a distinct number "
                                  "(e.g. worker3)")
    return int(replica_id[-digits:])


def _refuse(deployment: str, adapter: Any,
            example_input: Any, keepers: int, workers: int, overlap: int, replica: Any,
            replica_id: str | None, lighthouse: str | None) -> None:
    """What :class:`FaultTolerantIST` cannot run, in one line each (module docstring)."""
    if deployment not in ("central", "sharded"):
        raise UsageError(f"IST deployment {deployment!r}: use central or sharded")
    if adapter is None and example_input is None:
        raise FaultToleranceError(
            "FaultTolerantIST needs the model's plan before its first quorum: pass "
            "example_input= (a batch of the model's input) or adapter=")
    if keepers < 1 or workers < 1:
        raise FaultToleranceError(f"FaultTolerantIST workers={workers} keepers={keepers}: "
                                  "give at least 1 of each")
    if not 0 <= overlap <= workers:
        raise UsageError(f"IST overlap {overlap}: use 1 to the number of workers "
                         f"({workers}), or 0 (auto: half the live workers)")
    if replica is None and (replica_id is None or lighthouse is None):
        raise FaultToleranceError("FaultTolerantIST: give replica_id and lighthouse, or a "
                                  "replica")
    if replica is not None and (replica_id is not None or lighthouse is not None):
        raise FaultToleranceError("FaultTolerantIST: give a replica or replica_id and "
                                  "lighthouse, not both")


class FaultTolerantIST(IST):
    """IST over a torchft quorum (module docstring, steps 1-6).

    ``workers``: the configured number of workers (the most a round may have: the adapter's
    cut groups need at least that many units); ``keepers``: how many live workers store the
    whole model (sharded: each block of units); ``replica_id`` (ending in a distinct number),
    ``lighthouse``,
    ``min_workers``, ``timeout``, ``quorum_timeout``, ``host``: as for
    :class:`~thinwire.runtime.ft.Replica`; the other arguments as for :class:`IST`, with the
    plan known up front (``example_input`` or ``adapter``: a joining worker's state is read
    before its first forward). :attr:`log` holds (round, workers at its start, workers that
    closed it) per closed round; :attr:`comm` is the live quorum's communicator (its ledger
    holds every byte, recovery under ``recovery``).

    ``replica``: a replica built already (the trainer's, ``thinwire.ft_trainer``) instead of
    ``replica_id``/``lighthouse``; it is then the caller's to close. For the trainer, the
    round's quorum is opened by :meth:`begin_round`, :attr:`clock` counts the job's steps
    (rounds closed times K plus the steps of the open round) and :attr:`history` holds each
    closed round's (clock, workers that closed it, kept, workers that began it).
    """

    def __new__(cls, *args: Any, deployment: str = "central", **kwargs: Any
                ) -> FaultTolerantIST:
        """``deployment="sharded"`` builds the sharded store's class (module docstring)."""
        del args, kwargs
        if cls is FaultTolerantIST and deployment == "sharded":
            cls = ShardedFaultTolerantIST
        return super().__new__(cls)

    def __init__(self, model: nn.Module, optimizers: torch.optim.Optimizer |
                 Sequence[torch.optim.Optimizer], *, replica_id: str | None = None,
                 lighthouse: str | None = None, workers: int, min_workers: int = 1,
                 keepers: int = 2, replica: Replica | None = None,
                 deployment: str = "central", adapter: ISTAdapter | None = None,
                 example_input: Any = None, overlap: int = 0, outer_lr: float = 1.0,
                 outer_momentum: float = 0.0, timeout: float = 30.0,
                 quorum_timeout: float = 60.0, host: str = "127.0.0.1",
                 **kwargs: Any) -> None:
        _refuse(deployment, adapter, example_input, keepers, workers,
                overlap, replica, replica_id, lighthouse)
        self.number = replica_number(replica.replica_id if replica is not None
                                     else str(replica_id))
        self.workers = workers
        self.keepers_wanted = keepers
        self._overlap_arg = overlap
        self._keepers: list[int] = []
        self._order: list[int] = []
        self._members: list[int] = []
        self.log: list[tuple[int, list[int], list[int]]] = []
        self.joined_at: int | None = None
        self._owns_replica = replica is None
        if replica is None:
            replica = Replica(str(replica_id), str(lighthouse), min_workers=min_workers,
                              host=host, timeout=timeout, quorum_timeout=quorum_timeout,
                              device=next(model.parameters()).device)
        self.replica = replica
        self.replica.attach("subnet_training", self._ft_state, self._ft_load)
        # set up as one worker storing everything (central IST's rank 0): every worker builds
        # the same model from the seed, so each starts as a keeper candidate
        try:
            super().__init__(model, optimizers, comm=Comm.local(ledger=self.replica.ledger),
                             deployment="central", adapter=adapter,
                             example_input=example_input, overlap=1, outer_lr=outer_lr,
                             outer_momentum=outer_momentum, **kwargs)
            for g in self.plan.groups:
                if g.kind == "disjoint" and g.size < workers:
                    raise UsageError(f"IST cuts {g.name} ({g.size} units) into {workers} "
                                     f"subnets; use >= {workers} units there or fewer workers")
        except BaseException:
            if self._owns_replica:  # no torchft thread or server outlives a refused set-up
                self.replica.close()
            raise
        self.comm = self.replica.comm
        self._store_view = self.view

    def _derived(self, example_input: Any, example_kwargs: Mapping[str, Any] | None = None
                 ) -> ISTAdapter:
        from thinwire.models.graph_adapter import derive_adapter

        return derive_adapter(self.model, example_input, min_units=max(2, self.workers),
                              example_kwargs=example_kwargs, **self._derive)

    # --- the state a joining worker receives (step 1) ------------------------------------------
    def _shared(self) -> list[Any]:
        return [t for t in self.plan.tensors if t.shared]

    def _ft_state(self) -> dict[str, Any]:
        keys = self.opt_state.travelling()
        return {"round": self.round, "keepers": list(self._keepers),
                "keys": list(self.opt_state.keys),
                "scalars": {k: v for k, v in self.opt_state.scalars.items()
                            if isinstance(v, (torch.Tensor, int, float))},
                "shared": {t.name: [x.clone() for x in self._store.stored(t, keys)]
                           for t in self._shared()},
                "outer": {t.name: self._store.outer[t.name].clone() for t in self._shared()
                          if t.name in self._store.outer}}

    def _ft_load(self, state: dict[str, Any]) -> None:
        self.round = int(state["round"])
        self._keepers = [int(k) for k in state["keepers"]]
        self.opt_state.keys = tuple(state["keys"])
        self.opt_state.scalars = dict(state["scalars"])
        self.joined_at = self.round
        self._thin()
        if self.opt_state.keys and self.opt_state.reindex:
            self._store.start_state(self.opt_state.keys)
        keys = self.opt_state.travelling()
        with torch.no_grad():
            for t in self._shared():
                for x, y in zip(self._store.stored(t, keys), state["shared"][t.name]):
                    x.copy_(y)
        self._store.outer = {k: v.to(self.device).clone() for k, v in state["outer"].items()}

    # --- what a worker stores ------------------------------------------------------------------
    @property
    def keeper(self) -> bool:
        """Whether this worker stores the whole model (a keeper)."""
        return self.number in self._keepers

    @property
    def keepers(self) -> list[int]:
        """The workers storing the whole model, by replica number (the first sends subnets)."""
        return list(self._keepers)

    def _thin(self) -> None:
        """Not a keeper: drop the stored cut slices (only the shared tensors stay)."""
        st = self._store
        for t in self.plan.tensors:
            if t.shared or t.name not in st.slices:
                continue
            st.outer.pop(t.name, None)  # a keeper's outer momentum goes with its store
            if t.unit is not None:
                st.slices.pop(t.name)
                st.state.pop(t.name, None)
                continue
            dim = t.cuts[0].dim
            st.slices[t.name] = st.slices[t.name].narrow(dim, 0, 0).clone()
            for k, x in st.state.get(t.name, {}).items():
                st.state[t.name][k] = x.narrow(dim, 0, 0).clone()

    def _cut_params(self) -> list[Any]:
        return [t for t in self.plan.tensors if not t.shared and not t.buffer]

    def _store_numel(self) -> int:
        """Elements of the whole store a new keeper receives (cut slices, then their state,
        then their outer momentum when there is an outer optimizer)."""
        keys = self.opt_state.travelling()
        outer = self.outer != (1.0, 0.0)
        return (self._store.owned_numel(0)
                + sum(t.numel for t in self._cut_params()) * (len(keys) + outer))

    def _store_payload(self) -> torch.Tensor:
        keys = self.opt_state.travelling()
        st = self._store
        state = [st.state[t.name][k].reshape(-1) for t in self._cut_params() for k in keys]
        if self.outer != (1.0, 0.0):  # none before the first close: zero, the same first step
            state += [st.outer[t.name].reshape(-1) if t.name in st.outer
                      else torch.zeros(t.numel, device=self.device) for t in self._cut_params()]
        return self._store_view.flat([st.owned_flat(), *state])

    def _load_store_payload(self, flat: torch.Tensor) -> None:
        """A new keeper: the whole store from a keeper's payload (central: an owner's slice of
        every tensor is the whole tensor)."""
        st, keys = self._store, self.opt_state.travelling()
        full = {t.name: torch.empty(t.shape, device=self.device,
                                    dtype=self._tensors[t.name].dtype)
                for t in self.plan.tensors if not t.shared}
        owned = st.owned_numel(0)
        with torch.no_grad():
            st.unpack_owner(0, flat[:owned], full)
            st.slices.update(full)
            at = owned
            for t in self._cut_params():
                st.state.setdefault(t.name, {})
                for k in keys:
                    x = st.slices[t.name]
                    st.state[t.name][k] = flat[at:at + t.numel].view(t.shape).to(x.dtype).clone()
                    at += t.numel
            for t in self._cut_params() if self.outer != (1.0, 0.0) else ():
                x = st.slices[t.name]
                st.outer[t.name] = flat[at:at + t.numel].view(t.shape).to(x.dtype).clone()
                at += t.numel

    # --- steps 1-3 -----------------------------------------------------------------------------
    def _rank_of(self, number: int) -> int:
        return self._members.index(number)

    def _live_keepers(self) -> list[int]:
        live = [k for k in self._keepers if k in self._members]
        if not live:
            raise FaultToleranceError(
                f"fault tolerance: every worker storing the model (keepers {self._keepers}) "
                f"was lost in round {self.round}; the last checkpoint is intact: restart from "
                "it, and give FaultTolerantIST more keepers")
        return live

    def _enter_round(self) -> None:
        """Step 1: join the round's quorum; its members and step become this round's."""
        self.replica.begin()
        self._members = self.replica.members()
        self.round = self.replica.step

    def begin_round(self) -> None:
        """Steps 1-3 (module docstring)."""
        if not self._may_begin():
            return
        while True:
            self._enter_round()
            if not self._keepers:  # the first round: every worker holds the seed's model
                self._keepers = sorted(self._members)[:self.keepers_wanted]
                if not self.keeper:
                    self._thin()
            live = self._live_keepers()
            order = sorted(self._members)
            want = min(self.keepers_wanted, len(order)) - len(live)
            new = [x for x in order if x not in live][:max(0, want)]
            ok = self._recover_keepers(live[0], new)
            if ok and self._scatter(order, live[0]):
                self._keepers = live + new
                break
            if self.number in new:
                self._thin()

    def _recover_keepers(self, primary: int, new: list[int]) -> bool:
        """Step 2: the whole store from the first live keeper to each new keeper."""
        if not new:
            return True
        sends, recvs = [], []
        if self.number == primary:
            payload = self._store_payload()
            sends = [(self._rank_of(k), payload) for k in new]
        elif self.number in new:
            buf = torch.empty(self._store_numel(), device=self.device, dtype=self.wire)
            recvs = [(self._rank_of(primary), buf)]
        self.comm.exchange(sends, recvs, tag=RECOVERY)
        ok = self.replica.manager.errored() is None
        if ok and recvs:
            self._load_store_payload(recvs[0][1])
        return ok

    def _scatter(self, order: list[int], primary: int) -> bool:
        """Step 3: the round's partition over the live workers, each one's subnet from the
        first live keeper, the model's tensors swapped for the subnet's; True when every
        member agrees the scatter went through."""
        m, me = len(order), order.index(self.number)
        self.n, self.rank = m, me
        self.overlap = min(resolve_overlap(self._overlap_arg, m), m)
        held = self._partition(self.round)
        view = View(self.plan, pc.Ownership(self.plan, m, "central"), me, self.device,
                    self.wire)
        keys = self.opt_state.travelling()
        sends, recvs = [], []
        if self.number == primary:
            sends = [(self._rank_of(order[w]), self._store.extract(held, w, keys))
                     for w in range(m) if w != me and view.piece_size(held, 0, w, keys)]
        elif size := view.piece_size(held, 0, me, keys):
            recvs = [(self._rank_of(primary), torch.empty(size, device=self.device,
                                                          dtype=self.wire))]
        self.comm.exchange(sends, recvs, tag=self.tag)
        if not self.replica.comm.agree(True):
            return False
        pieces = [(0, buf) for _, buf in recvs]
        if self.number == primary and view.piece_size(held, 0, me, keys):
            pieces = [(0, self._store.extract(held, me, keys))]
        self._install_subnet(view, held, order, pieces)
        return True

    def _install_subnet(self, view: View, held: dict[str, tuple[Any, ...]], order: list[int],
                        pieces: Sequence[tuple[int, torch.Tensor]]) -> None:
        """The agreed round's subnet into the model: the pieces (owner, flat) loaded, the
        optimizer's state installed, the adapter configured, the round open."""
        me = order.index(self.number)
        keys = self.opt_state.travelling()
        self.held, self.view, self._order = held, view, order
        sub = sn.allocate(view, held, self._store, self._tensors, keys)
        for owner, piece in pieces:
            sn.load(view, held, sub, owner, piece, keys)
        with torch.no_grad():
            for name, xs in sub.items():
                self._tensors[name].data = xs[0]
        self.opt_state.install(self._tensors, sub)
        self._adapter().configure(self.model, {g: u[me] for g, u in held.items()})
        self._install_scaling()
        self.active = True
        self.in_round = 0

    # --- steps 5-6 -----------------------------------------------------------------------------
    def end_round(self) -> None:
        """Steps 5-6 (module docstring)."""
        sub = self._trained_subnet()
        order, held, view = self._order, self.held, self.view
        keys = self.opt_state.travelling()
        mine = sn.take(view, held, sub, 0, keys)
        while True:
            live = self._close_quorum(order)
            keepers = self._live_keepers()
            sends = ([(self._rank_of(k), mine) for k in keepers if k != self.number]
                     if mine.numel() else [])
            recvs = ([(x, torch.empty(size, device=self.device, dtype=self.wire))
                      for x in live if x != self.number
                      and (size := view.piece_size(held, 0, order.index(x), keys))]
                     if self.keeper else [])
            self.comm.exchange([(d, t) for d, t in sends],
                               [(self._rank_of(x), b) for x, b in recvs], tag=self.tag)
            shared = self._gather_shared(sub, keys, live)
            if self.replica.comm.agree(shared is not None) and self.replica.commit():
                break
        assert shared is not None
        outer = self.outer != (1.0, 0.0)
        with torch.no_grad():
            before = ({k: x.clone() for k, x in self._store.parameter_slices().items()}
                      if outer else {})
            if self.keeper:
                got = dict(recvs)
                got[self.number] = mine
                dealt: Dealt = {}
                ov: Overlap | None = {} if self.overlap > 1 else None
                for x in live:
                    if x in got:
                        self._store.write_back(held, order.index(x), got[x], keys, dealt, ov)
                self._store.average_dealt(dealt, keys)
                if ov is not None:
                    self._store.average_overlap(ov, keys)
            self._apply_shared(sub, keys, shared, len(live))
            if outer:  # every worker moves its stored slices (the shared ones at least) alike
                self._store.outer_step(before, *self.outer)
        self._keepers = keepers
        self.log.append((self.round, list(order), live))
        self._end_common()

    def _close_quorum(self, order: list[int]) -> list[int]:
        """Step 5's quorum: the round's workers still alive, in worker order."""
        self.replica.begin(shrink_only=True)
        self._members = self.replica.members()
        if any(x not in order for x in self._members):
            raise FaultToleranceError(
                f"fault tolerance: round {self.round} closed with workers {self._members}, "
                f"not all of which began it ({order}); torchft's shrink_only quorum should "
                "have excluded a joiner")
        return [x for x in order if x in self._members]

    def _gather_shared(self, sub: sn.Subnet, keys: Sequence[str], live: list[int]
                       ) -> list[torch.Tensor] | None:
        """Every live worker's deltas of the shared floating-point tensors, in worker order
        (an all-gather: the sum is then taken in one order on every member, a pure function
        of the live set); None when the gather failed."""
        deltas = [(x - base).reshape(-1) for t in self._shared()
                  for base, x in zip(self._store.stored(t, keys), sub[t.name])
                  if base.is_floating_point()]
        if not deltas:
            return []
        flat = self._store_view.flat(deltas)
        got = self.comm.all_gather(flat, tag="shared")
        if self.replica.manager.errored() is not None:
            return None
        by_number = dict(zip(self._members, got))
        return [by_number[x] for x in live]

    def _apply_shared(self, sub: sn.Subnet, keys: Sequence[str], shared: list[torch.Tensor],
                      live: int) -> None:
        """Shared tensors at base + (sum of the live workers' deltas) / live; integer buffers
        take this worker's own values, as in :class:`IST`."""
        total = None
        for d in shared:
            total = d.clone() if total is None else total.add_(d)
        at = 0
        for t in self._shared():
            for base, x in zip(self._store.stored(t, keys), sub[t.name]):
                if not base.is_floating_point():
                    base.copy_(x)
                    continue
                assert total is not None
                base.add_(total[at:at + base.numel()].view_as(base).to(base.dtype),
                          alpha=1.0 / live)
                at += base.numel()

    # --- the full model ------------------------------------------------------------------------
    def full_tensors(self) -> dict[str, torch.Tensor] | None:
        """Every tensor whole, on a keeper (no message; None elsewhere), at a round boundary."""
        self._ready("was asked for the full model")
        if self.active:
            raise UsageError(f"IST: the full model was asked for mid-round (step {self.in_round}"
                             f" of {self.K} of round {self.round}); ask at a round boundary")
        if not self.keeper:
            return None
        st = self._store
        full = {t.name: torch.empty(t.shape, device=self.device,
                                    dtype=self._tensors[t.name].dtype)
                for t in self.plan.tensors if not t.shared}
        st.unpack_owner(0, st.owned_flat(), full)
        full.update({t.name: st.slices[t.name].clone() for t in self._shared()})
        return full

    def full_model(self, to: int = 0, *, tag: str = "control") -> nn.Module | None:
        """The full model on every keeper (a copy; None on other workers), with no message: a
        keeper stores it whole. ``to`` and ``tag`` are :class:`IST`'s, unused here."""
        del to, tag
        full = self.full_tensors()
        return None if full is None else self._model_from(full)

    def finish(self, *, tag: str = "switch") -> nn.Module:
        """The user's model becomes the full model on every live worker: the first live keeper
        broadcasts its store over the last quorum (one line if a worker is lost meanwhile)."""
        self._ready("was asked to finish")
        self._live_keepers()
        primary = [k for k in self._keepers if k in self._members][0]
        flat = (self._store.owned_flat() if self.number == primary else
                torch.empty(self._store.owned_numel(0), device=self.device, dtype=self.wire))
        self.comm.broadcast(flat, src=self._rank_of(primary), tag=tag)
        if self.replica.manager.errored() is not None:
            raise FaultToleranceError("fault tolerance: a worker was lost while the full model "
                                      "was sent; a keeper still stores it (full_model())")
        full = {t.name: torch.empty(t.shape, device=self.device,
                                    dtype=self._tensors[t.name].dtype)
                for t in self.plan.tensors if not t.shared}
        self._store.unpack_owner(0, flat, full)
        full.update({t.name: self._store.slices[t.name].clone() for t in self._shared()})
        return self._install_full(full)

    # --- what the trainer records (thinwire.ft_trainer) ----------------------------------------
    @property
    def clock(self) -> int:
        """The job's step count: rounds closed times K, plus the open round's steps (a joiner
        takes the round from its peer)."""
        return self.round * self.K + (self.in_round if self.active else 0)

    @property
    def history(self) -> list[tuple[int, list[int], bool, list[int]]]:
        """Each closed round's (clock at its close, workers that closed it, kept: always,
        workers that began it)."""
        return [((r + 1) * self.K, list(closed), True, list(began))
                for r, began, closed in self.log]

    @property
    def writes_checkpoint(self) -> bool:
        """Whether this worker writes the run's checkpoint: the first live keeper (it stores
        the whole model)."""
        live = [k for k in self._keepers if k in self._members]
        return bool(live) and live[0] == self.number

    def close(self) -> None:
        """Remove IST's hooks, leave the quorum (torchft's threads and servers stop) when
        the replica is this object's own."""
        super().close()
        if self._owns_replica:
            self.replica.close()


class ShardedFaultTolerantIST(ShardedStore, FaultTolerantIST):
    """:class:`FaultTolerantIST` with the sharded store (every block of units on ``keepers``
    workers: :mod:`~thinwire.strategies.ist.fault_sharded`), which
    ``FaultTolerantIST(..., deployment="sharded")`` builds."""
