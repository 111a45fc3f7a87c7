"""Sharded IST that keeps training when a worker dies: every block of units on two workers.

Independent Subnetwork Training (Yuan et al., VLDB 2022; Shulgin & Richtarik, ICML 2024) in
its sharded deployment (each worker stores a slice of every layer's units, the pieces travel
point to point) on torchft's quorum, as :class:`~thinwire.strategies.ist.fault.FaultTolerantIST`
runs the central one. Built by ``FaultTolerantIST(..., deployment="sharded")``: this module's
:class:`ShardedStore` placed before FaultTolerantIST
(:class:`~thinwire.strategies.ist.fault.ShardedFaultTolerantIST`).

The store: every cut group's units are cut into ``workers`` (the configured number) contiguous
*blocks*, the sharded deployment's ownership of that many ranks
(:class:`~thinwire.strategies.ist.pieces.Ownership`); block b holds, for every tensor, the
elements its units index (and their optimizer-state slices). Each block is stored by
``keepers`` live workers (default 2, its *holders*; the first, its primary, sends the
subnets), so losing any one worker loses nothing; the tensors every subnet shares are
whole on every worker, as in the central deployment. The blocks keep their shape for the
whole job: a change of the live set moves whole blocks between workers, never re-cuts them.

Round r (steps as FaultTolerantIST's):
  1. begin: torchft forms the quorum (a joiner is healed with the boundary state, the holders
     included); the live workers, sorted, are the round's workers 0..m-1;
  2. the holders are recomputed (:func:`assign`, a pure function of the last holders, which
     live worker has which block, read with one all-gather of an n-byte flag per worker, and
     the live set, so every member computes the same): a block keeps its live holders; one
     that lost a holder gets the least loaded live worker; then, while two workers' loads
     differ by more than one block, the most loaded hands one block to the least loaded (a
     joiner becomes a holder here). Each new holder receives the block (values and
     optimizer state) from its first surviving holder, tagged ``recovery``. A block with no
     live holder (both of its workers lost in one round) ends the job in one line naming it;
  3. the partition of round r over the m live workers, as central; each block's primary sends
     every worker its piece of that block (one message per primary and worker, tag
     ``subnet``); every member agrees, and a failed agreement repeats steps 1-3;
  4. K optimizer steps of the user's loop, no messages;
  5. close: a quorum of the round's workers still alive (``shrink_only``); each sends its
     trained piece of every block to both of the block's live holders (one message per
     holder: about twice the sharded deployment's write-back, less what a worker holds
     itself), the shared tensors' deltas are all-gathered; every member agrees, a failed
     agreement repeats step 5;
  6. agreed and committed: every holder writes back each of its blocks from the live workers'
     pieces in worker order, exactly as the sharded owner does (a lost worker's units keep
     their round-start values; overlapping units the mean of their live holders), so the two
     copies of a block stay equal bit for bit; the shared tensors as central.

The full model exists on no worker between rounds: :meth:`full_tensors` and ``full_model``
answer None (no message outside a round); :meth:`finish` assembles it on every live worker
over the last quorum (each block from its first live holder), and the lowest live worker
keeps the whole store, optimizer state included, as a one-worker state (:meth:`state_dict`,
the checkpoint the trainer writes at the end).

Why whole blocks on ``keepers`` workers instead of a re-shard over the live set at every change
(the sharded deployment's ownership of m ranks): a re-shard moves about every unit whenever m
changes (the ranges of all ranks shift), while a block move sends only what lost a copy (after
one loss of n workers, about 2/n of the model); the pieces, the write-back and their sizes are
the sharded deployment's own (:mod:`.pieces`, :class:`~thinwire.strategies.ist.store.Store`,
unchanged); the cost is balance: with m < n live workers a worker holds up to ceil(2n/m)
blocks. Why the trained pieces go to both holders rather than the primary forwarding its
written block: the pieces sum to r times the model (r = overlap), a block forward to one
times, so forwarding is cheaper for r >= 2 but adds a second hop after the write-back and a
second agreement; both holders writing the same pieces in the same order keeps the copies
equal with one exchange, as the central keepers do.

One concept, one file (over 400 lines): the sharded store of IST on a torchft quorum (its
blocks, their holders and their moves, the round's scatter, write-back and assembly).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from thinwire.errors import UsageError
from thinwire.models.adapter import TensorPlan
from thinwire.runtime.ft import RECOVERY, FaultToleranceError
from thinwire.runtime.ledger import CONTROL
from thinwire.strategies.ist import pieces as pc
from thinwire.strategies.ist import subnet as sn
from thinwire.strategies.ist.core import IST
from thinwire.strategies.ist.elements import View, element_index
from thinwire.strategies.ist.partition import resolve_overlap
from thinwire.strategies.ist.store import Dealt, Overlap, Store

if TYPE_CHECKING:
    from thinwire.runtime.ft import Replica

    class _Host(IST):
        """What :class:`ShardedStore` uses of FaultTolerantIST, which follows it in the MRO
        (for the type checker only: at run time the mixin's base is :class:`IST`)."""

        replica: Replica
        number: int
        workers: int
        keepers_wanted: int
        log: list[tuple[int, list[int], list[int]]]
        _members: list[int]
        _order: list[int]
        _overlap_arg: int

        def _shared(self) -> list[Any]: ...
        def _thin(self) -> None: ...
        def _enter_round(self) -> None: ...
        def _rank_of(self, number: int) -> int: ...
        def _close_quorum(self, order: list[int]) -> list[int]: ...
        def _install_subnet(self, view: View, held: dict[str, tuple[Any, ...]],
                            order: list[int],
                            pieces: Sequence[tuple[int, torch.Tensor]]) -> None: ...
        def _gather_shared(self, sub: sn.Subnet, keys: Sequence[str], live: list[int]
                           ) -> list[torch.Tensor] | None: ...
        def _apply_shared(self, sub: sn.Subnet, keys: Sequence[str],
                          shared: list[torch.Tensor], live: int) -> None: ...
        def _ft_state(self) -> dict[str, Any]: ...
        def _ft_load(self, state: dict[str, Any]) -> None: ...
else:
    _Host = IST

__all__ = ["ShardedStore", "assign", "initial_holders"]


def initial_holders(blocks: int, order: Sequence[int], copies: int) -> list[list[int]]:
    """The first round's holders: block b on the live workers b, b + 1, ... (mod m)."""
    m = len(order)
    return [[order[(b + j) % m] for j in range(min(copies, m))] for b in range(blocks)]


def assign(holders: Sequence[Sequence[int]], have: Sequence[set[int]], order: Sequence[int],
           copies: int) -> list[list[int]]:
    """Step 2: the next holders of every block, a pure function of the last ``holders``, which
    live workers ``have`` each block and the live workers ``order`` (sorted). A block keeps
    the live workers holding it (its last holders first, primary first); one short of
    min(copies, m) holders gets the least loaded live worker (ties: the lowest number); then,
    while loads differ by more than one block, the most loaded worker (ties: the highest
    number) hands its last such block to the least loaded. A block no live worker has raises
    ValueError with its index."""
    want = min(copies, len(order))
    out = [[h for h in hs if h in have[b]] + sorted(have[b] - set(hs))
           for b, hs in enumerate(holders)]
    for b, hs in enumerate(out):
        if not hs:
            raise ValueError(b)
        del hs[want:]
    load = {x: 0 for x in order}
    for hs in out:
        for h in hs:
            load[h] += 1
    for hs in out:
        while len(hs) < want:
            x = min((x for x in order if x not in hs), key=lambda x: (load[x], x))
            hs.append(x)
            load[x] += 1
    while True:
        hi = max(order, key=lambda x: (load[x], x))
        lo = min(order, key=lambda x: (load[x], x))
        if load[hi] - load[lo] <= 1:
            return out
        b = next(b for b in reversed(range(len(out))) if hi in out[b] and lo not in out[b])
        out[b][out[b].index(hi)] = lo
        load[hi] -= 1
        load[lo] += 1


class ShardedStore(_Host):
    """The sharded store of :class:`~thinwire.strategies.ist.fault.FaultTolerantIST` (module
    docstring, steps 1-6): a mixin placed before it
    (:class:`~thinwire.strategies.ist.fault.ShardedFaultTolerantIST`, which
    ``FaultTolerantIST(..., deployment="sharded")`` builds), so this module needs nothing of
    that one's; the arguments are FaultTolerantIST's, ``keepers`` the workers storing each
    block. :attr:`holders` lists each block's holders (primary first)."""

    def __init__(self, model: nn.Module, optimizers: Any, **kwargs: Any) -> None:
        self._holders: list[list[int]] | None = None
        self._blocks: dict[int, Store] = {}
        self._final: dict[str, Any] | None = None
        if (kwargs.get("outer_lr", 1.0), kwargs.get("outer_momentum", 0.0)) != (1.0, 0.0):
            raise FaultToleranceError(
                "sharded FaultTolerantIST: outer_lr/outer_momentum keep momentum its blocks "
                "do not carry yet; leave them at 1 and 0")
        super().__init__(model, optimizers, **kwargs)
        self.deployment = "sharded"
        self._own = pc.Ownership(self.plan, self.workers, "sharded")

    # --- the blocks ----------------------------------------------------------------------------
    @property
    def holders(self) -> list[list[int]]:
        """Each block's holders by replica number, primary first (empty before round 0)."""
        return [list(hs) for hs in self._holders or []]

    @property
    def keepers(self) -> list[int]:
        """The workers storing at least one block."""
        return sorted({h for hs in self._holders or [] for h in hs})

    @property
    def keeper(self) -> bool:
        return bool(self._blocks)

    def _block_view(self, b: int) -> View:
        return View(self.plan, self._own, b, self.device, self.wire)

    def _block_tensors(self, b: int) -> list[tuple[TensorPlan, list[int]]]:
        """Block b's tensors and their shapes, in the plan's order (a block store's slices)."""
        out = []
        for t in self.plan.tensors:
            if t.shared:
                continue
            if t.unit is not None:
                if self._own.owner_of(t) == b:
                    out.append((t, list(t.shape)))
                continue
            c = t.cuts[0]
            lo, hi = self._own.owned(c.group, b)
            shape = list(t.shape)
            shape[c.dim] = pc.cut_len(c, hi - lo)
            out.append((t, shape))
        return out

    def _payload_numel(self, b: int, state: bool) -> int:
        """Elements of block b's payload (its values, then with ``state`` their optimizer
        state for every travelling key)."""
        keys = self.opt_state.travelling() if state else ()
        return sum(int(np.prod(shape)) * (1 + (0 if t.buffer else len(keys)))
                   for t, shape in self._block_tensors(b))

    def _payload(self, b: int, state: bool) -> torch.Tensor:
        st = self._blocks[b]
        keys = self.opt_state.travelling() if state else ()
        extra = [st.state[t.name][k].reshape(-1) for t, _ in self._block_tensors(b)
                 if not t.buffer for k in keys]
        return st.view.flat([st.owned_flat(), *extra])

    def _block_from(self, b: int, flat: torch.Tensor, state: bool) -> Store:
        """Block b's store from its payload (:meth:`_payload`)."""
        st = Store(self._block_view(b), None)
        keys = self.opt_state.travelling() if state else ()
        at = 0
        with torch.no_grad():
            for t, shape in self._block_tensors(b):
                size = int(np.prod(shape))
                dtype = self._tensors[t.name].dtype
                st.slices[t.name] = flat[at:at + size].view(shape).to(dtype).clone()
                at += size
            for t, shape in self._block_tensors(b):
                if t.buffer or not keys:
                    continue
                size = int(np.prod(shape))
                st.state[t.name] = {}
                for k in keys:
                    x = flat[at:at + size].view(shape)
                    st.state[t.name][k] = x.to(self._tensors[t.name].dtype).clone()
                    at += size
        assert at == flat.numel(), (at, flat.numel())
        return st

    def _first_blocks(self, order: list[int]) -> None:
        """Round 0: every worker built the model from the seed; each keeps its blocks."""
        self._holders = initial_holders(self.workers, order, self.keepers_wanted)
        whole = self._store.slices
        for b, hs in enumerate(self._holders):
            if self.number in hs:
                st = Store(self._block_view(b), whole)
                for t in self._shared():
                    st.slices.pop(t.name, None)
                self._blocks[b] = st
        self._thin()

    def _harvest_state_keys(self) -> None:
        if self.opt_state.harvest():
            self._store.start_state(self.opt_state.keys)
            for st in self._blocks.values():
                st.start_state(self.opt_state.keys)

    def _lost(self, holders: Sequence[Sequence[int]], b: int) -> FaultToleranceError:
        groups = [f"{g.name}[{lo}:{hi}]" for g in self.plan.groups[:2]
                  for lo, hi in [self._own.owned(g.name, b)]]
        more = ", ..." if len(self.plan.groups) > 2 else ""
        return FaultToleranceError(
            f"fault tolerance: every worker storing block {b} of the sharded store (units "
            f"{', '.join(groups)}{more}; workers {list(holders[b])}) was lost in round "
            f"{self.round}; the last checkpoint is intact: restart from it, and give "
            "FaultTolerantIST more keepers")

    # --- the state a joining worker receives ---------------------------------------------------
    def _ft_state(self) -> dict[str, Any]:
        return {**super()._ft_state(), "holders": self.holders}

    def _ft_load(self, state: dict[str, Any]) -> None:
        super()._ft_load(state)
        self._holders = [[int(h) for h in hs] for hs in state["holders"]]
        self._blocks = {}

    # --- steps 1-3 -----------------------------------------------------------------------------
    def begin_round(self) -> None:
        """Steps 1-3 (module docstring)."""
        if not self._may_begin():
            return
        while True:
            self._enter_round()
            order = sorted(self._members)
            if self._holders is None:
                self._first_blocks(order)
            have = self._possession()
            holders = None
            if have is not None:
                try:
                    holders = assign(self._holders or [], have, order, self.keepers_wanted)
                except ValueError as exc:
                    raise self._lost(self._holders or [], int(exc.args[0])) from None
            ok = holders is not None and self._move_blocks(holders, have or [])
            if holders is not None and ok and self._scatter_blocks(order, holders):
                self._holders = holders
                for b in [b for b in self._blocks if self.number not in holders[b]]:
                    del self._blocks[b]
                return
            if not ok:
                self.replica.comm.agree(False)

    def _possession(self) -> list[set[int]] | None:
        """Which live workers have each block (one all-gather of a flag per block); None when
        the gather failed."""
        n = len(self._holders or [])
        flags = torch.zeros(n, device=self.device)
        for b in self._blocks:
            flags[b] = 1.0
        got = self.comm.all_gather(flags, tag=CONTROL)
        if self.replica.manager.errored() is not None:
            return None
        return [{x for x, f in zip(self._members, got) if f[b].item() == 1.0} for b in range(n)]

    def _move_blocks(self, holders: list[list[int]], have: list[set[int]]) -> bool:
        """Step 2's moves: each new holder of a block receives it from its first holder that
        has it (one message per pair of workers, the blocks in order, tag ``recovery``)."""
        sends: dict[int, list[torch.Tensor]] = {}
        recvs: dict[int, list[tuple[int, int]]] = {}
        for b, hs in enumerate(holders):
            src = next((h for h in hs if h in have[b]), min(have[b]))
            for h in hs:
                if h in have[b]:
                    continue
                if self.number == src:
                    sends.setdefault(h, []).append(self._payload(b, True))
                elif self.number == h:
                    recvs.setdefault(src, []).append((b, self._payload_numel(b, True)))
        bufs = {s: torch.empty(sum(n for _, n in bs), device=self.device, dtype=self.wire)
                for s, bs in recvs.items()}
        self.comm.exchange([(self._rank_of(h), torch.cat(ps)) for h, ps in sends.items()],
                           [(self._rank_of(s), buf) for s, buf in bufs.items()], tag=RECOVERY)
        if self.replica.manager.errored() is not None:
            return False
        for s, bs in recvs.items():
            for b, piece in _split(bufs[s], bs):
                self._blocks[b] = self._block_from(b, piece, True)
        return True

    def _scatter_blocks(self, order: list[int], holders: list[list[int]]) -> bool:
        """Step 3: each block's primary sends every worker its piece of the block; True when
        every member agrees the scatter went through (the subnet is then in the model)."""
        m, me = len(order), order.index(self.number)
        self.n, self.rank = m, me
        self.overlap = min(resolve_overlap(self._overlap_arg, m), m)
        held = self._partition(self.round)
        view = View(self.plan, self._own, me, self.device, self.wire)
        keys = self.opt_state.travelling()
        mine = [b for b, hs in enumerate(holders) if hs[0] == self.number]
        sends = []
        for w, x in enumerate(order):
            parts = [self._blocks[b].extract(held, w, keys) for b in mine
                     if x != self.number and view.piece_size(held, b, w, keys)]
            if parts:
                sends.append((self._rank_of(x), torch.cat(parts)))
        sizes: dict[int, list[tuple[int, int]]] = {}
        for b, hs in enumerate(holders):
            if hs[0] != self.number and (size := view.piece_size(held, b, me, keys)):
                sizes.setdefault(hs[0], []).append((b, size))
        bufs = {p: torch.empty(sum(n for _, n in bs), device=self.device, dtype=self.wire)
                for p, bs in sizes.items()}
        self.comm.exchange(sends, [(self._rank_of(p), buf) for p, buf in bufs.items()],
                           tag=self.tag)
        if not self.replica.comm.agree(True):
            return False
        pieces = [(b, self._blocks[b].extract(held, me, keys)) for b in mine
                  if view.piece_size(held, b, me, keys)]
        for p, bs in sizes.items():
            pieces += _split(bufs[p], bs)
        self._install_subnet(view, held, order, pieces)
        return True

    # --- steps 5-6 -----------------------------------------------------------------------------
    def end_round(self) -> None:
        """Steps 5-6 (module docstring)."""
        sub = self._trained_subnet()
        order, held, view = self._order, self.held, self.view
        holders = self._holders or []
        keys = self.opt_state.travelling()
        me = order.index(self.number)
        mine = {b: sn.take(view, held, sub, b, keys) for b in range(len(holders))
                if view.piece_size(held, b, me, keys)}
        while True:
            live = self._close_quorum(order)
            for b, hs in enumerate(holders):
                if not any(h in live for h in hs):
                    raise self._lost(holders, b)
            got = self._send_back(order, live, mine)
            shared = self._gather_shared(sub, keys, live)
            if self.replica.comm.agree(shared is not None) and self.replica.commit():
                break
        assert shared is not None
        with torch.no_grad():
            self._write_blocks(order, live, mine, got)
            self._apply_shared(sub, keys, shared, len(live))
        self.log.append((self.round, list(order), live))
        self._end_common()

    def _send_back(self, order: list[int], live: list[int], mine: dict[int, torch.Tensor]
                   ) -> dict[int, list[tuple[int, torch.Tensor]]]:
        """Step 5: this worker's piece of every block to each of its live holders; the live
        workers' pieces of this worker's blocks, by worker, (block, piece) in block order."""
        holders, held, keys = self._holders or [], self.held, self.opt_state.travelling()
        dests = sorted({h for hs in holders for h in hs if h in live and h != self.number})
        sends = []
        for h in dests:
            parts = [mine[b] for b in sorted(mine) if h in holders[b]]
            if parts:
                sends.append((self._rank_of(h), torch.cat(parts)))
        ours = [b for b, hs in enumerate(holders) if self.number in hs]
        sizes = {x: [(b, size) for b in ours
                     if (size := self.view.piece_size(held, b, order.index(x), keys))]
                 for x in live if x != self.number}
        bufs = {x: torch.empty(sum(n for _, n in bs), device=self.device, dtype=self.wire)
                for x, bs in sizes.items() if bs}
        self.comm.exchange(sends, [(self._rank_of(x), buf) for x, buf in bufs.items()],
                           tag=self.tag)
        return {x: _split(buf, sizes[x]) for x, buf in bufs.items()}

    def _write_blocks(self, order: list[int], live: list[int], mine: dict[int, torch.Tensor],
                      got: dict[int, list[tuple[int, torch.Tensor]]]) -> None:
        """Step 6: every block this worker holds from the live workers' pieces, in worker
        order, as the sharded owner writes them back."""
        keys = self.opt_state.travelling()
        pieces = {x: dict(ps) for x, ps in got.items()}
        pieces[self.number] = mine
        for b, st in sorted(self._blocks.items()):
            dealt: Dealt = {}
            ov: Overlap | None = {} if self.overlap > 1 else None
            for x in live:
                piece = pieces.get(x, {}).get(b)
                if piece is not None:
                    st.write_back(self.held, order.index(x), piece, keys, dealt, ov)
            st.average_dealt(dealt, keys)
            if ov is not None:
                st.average_overlap(ov, keys)

    # --- the full model ------------------------------------------------------------------------
    def full_tensors(self) -> dict[str, torch.Tensor] | None:
        """None: no worker stores the whole model between rounds (:meth:`finish` assembles
        it)."""
        self._ready("was asked for the full model")
        return None

    def finish(self, *, tag: str = "switch") -> nn.Module:
        """The user's model becomes the full model on every live worker: each block from its
        first live holder to every live worker without it, over the last quorum (with its
        optimizer state to the lowest live worker, which keeps the one-worker state:
        :meth:`state_dict`); one line if a worker is lost meanwhile."""
        self._ready("was asked to finish")
        if self.active:
            raise UsageError(f"IST: finish() mid-round (step {self.in_round} of {self.K} of "
                             f"round {self.round}); finish at a round boundary")
        order, holders = sorted(self._members), self._holders or []
        for b, hs in enumerate(holders):
            if not any(h in order for h in hs):
                raise self._lost(holders, b)
        writer = order[0]
        src = [next(h for h in hs if h in order) for hs in holders]
        sends = []
        for x in order:
            parts = [self._payload(b, x == writer) for b, hs in enumerate(holders)
                     if src[b] == self.number and x not in hs]
            if x != self.number and parts:
                sends.append((self._rank_of(x), torch.cat(parts)))
        sizes = {s: [(b, self._payload_numel(b, self.number == writer))
                     for b, hs in enumerate(holders) if src[b] == s and self.number not in hs]
                 for s in order if s != self.number}
        bufs = {s: torch.empty(sum(n for _, n in bs), device=self.device, dtype=self.wire)
                for s, bs in sizes.items() if bs}
        self.comm.exchange(sends, [(self._rank_of(s), buf) for s, buf in bufs.items()], tag=tag)
        if self.replica.manager.errored() is not None:
            raise FaultToleranceError("fault tolerance: a worker was lost while the full model "
                                      "was assembled; the last checkpoint is intact: restart "
                                      "from it")
        stores = dict(self._blocks)
        for s, buf in bufs.items():
            for b, piece in _split(buf, sizes[s]):
                stores[b] = self._block_from(b, piece, self.number == writer)
        full, state = self._assemble(stores, self.number == writer)
        if self.number == writer:
            self._final = self._one_worker_state(full, state)
        return self._install_full(full)

    def _assemble(self, stores: dict[int, Store], with_state: bool
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Every tensor whole from the blocks (and, ``with_state``, every travelling optimizer
        state whole, by ``name|key``); the shared tensors from this worker's copy."""
        keys = self.opt_state.travelling() if with_state else ()
        full: dict[str, torch.Tensor] = {}
        state: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for b, st in sorted(stores.items()):
                for t, _ in self._block_tensors(b):
                    like = self._tensors[t.name]
                    xs = [(t.name, st.slices[t.name])]
                    if not t.buffer:
                        xs += [(f"{t.name}|{k}", st.state[t.name][k]) for k in keys]
                    for name, x in xs:
                        target = (full if "|" not in name else state).setdefault(
                            name, torch.empty(t.shape, device=self.device, dtype=like.dtype))
                        self._place(b, t, x, target)
            for t in self._shared():
                full[t.name] = self._store.slices[t.name].clone()
                if not t.buffer:
                    for k in keys:
                        state[f"{t.name}|{k}"] = self._store.state[t.name][k].clone()
        return full, state

    def _place(self, b: int, t: TensorPlan, x: torch.Tensor, target: torch.Tensor) -> None:
        """Block b's slice ``x`` of tensor ``t`` into the full-size ``target``."""
        if t.unit is not None:
            target.copy_(x)
            return
        c = t.cuts[0]
        lo, hi = self._own.owned(c.group, b)
        if hi == lo:
            return
        rows = element_index(c, self.plan.group(c.group).size,
                             torch.arange(lo, hi, device=self.device))
        target.index_copy_(c.dim, rows, x.to(target.dtype))

    def _one_worker_state(self, full: dict[str, torch.Tensor], state: dict[str, torch.Tensor]
                          ) -> dict[str, Any]:
        """The assembled store as :meth:`IST.state_dict` of one worker storing everything
        (central IST's rank 0), so the checkpoint loads into any IST."""
        return {"round": self.round, "store": {k: x.clone() for k, x in full.items()},
                "state_keys": list(self.opt_state.keys), "state_store": state,
                "scalar_state": {k: v for k, v in self.opt_state.scalars.items()
                                 if isinstance(v, (torch.Tensor, int, float))},
                "outer": {}}

    def state_dict(self) -> dict[str, Any]:
        """After :meth:`finish`, on the lowest live worker: the whole store as one worker's
        state (:meth:`IST.state_dict`'s form); elsewhere, at a round boundary, this worker's
        share: the round, the holders, its blocks' slices and optimizer-state slices by block,
        the shared tensors (no worker stores the whole model)."""
        if self._final is not None:
            return self._final
        self._ready("was asked for its state")
        if self.active:
            raise UsageError("IST.state_dict() mid-round; checkpoint at a round boundary")
        return {"round": self.round, "holders": self.holders,
                "blocks": {b: {"store": dict(st.slices), "state_store": {
                    f"{n}|{k}": x for n, d in st.state.items() for k, x in d.items()}}
                    for b, st in sorted(self._blocks.items())},
                "shared": {t.name: self._store.slices[t.name] for t in self._shared()}}

    @property
    def writes_checkpoint(self) -> bool:
        """Whether this worker writes the run's checkpoint: the lowest live worker, after
        :meth:`finish` (which gave it the whole store)."""
        return self._final is not None

    def stored_numel(self) -> int:
        """Elements this worker stores between rounds: its blocks and the shared tensors."""
        return (sum(st.numel() for st in self._blocks.values())
                + sum(self._store.slices[t.name].numel() for t in self._shared()))

    @property
    def state_store(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer-state slices stored beside the blocks (``name#block``) and the shared
        tensors."""
        out = {f"{n}#{b}": d for b, st in self._blocks.items() for n, d in st.state.items()}
        out.update({t.name: self._store.state[t.name] for t in self._shared()
                    if t.name in self._store.state})
        return out


def _split(flat: torch.Tensor, sizes: Sequence[tuple[int, int]]
           ) -> list[tuple[int, torch.Tensor]]:
    """A message of concatenated pieces back into (block, piece)."""
    out: list[tuple[int, torch.Tensor]] = []
    at = 0
    for b, n in sizes:
        out.append((b, flat[at:at + n]))
        at += n
    assert at == flat.numel(), (at, flat.numel())
    return out
