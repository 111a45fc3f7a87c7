"""Periodic parameter averaging around a user's own model and optimizer: :class:`LocalSGD`.

Stich, "Local SGD Converges Fast and Communicates Little" (ICLR 2019). The piece several methods
use: the ``localsgd`` method (:mod:`thinwire.strategies.local_sgd`) runs it as it is, and IST's
hybrid schedule (:mod:`thinwire.strategies.ist.method`) switches to it on the full model. It is
no method itself and names none:
  1. every optimizer step is local;
  2. after every ``sync_every``-th step all parameters are flattened into one buffer, averaged
     with a single all-reduce through the :class:`~thinwire.runtime.comm.Comm`, and written
     back. Optimizer state stays local.

Every wrapper built on :class:`PeriodicSync` (LocalSGD, DiLoCo and Streaming DiLoCo,
SparseLoCo) also runs over a torchft quorum when given a
:class:`~thinwire.runtime.ft.Replica` (torchft's shape: ``LocalSGD(manager, model, ...)``), the
outer step being torchft's step (docs/FAULT_TOLERANCE.md):
  a. a round (the inner steps up to the next outer step) opens with a quorum of the live
     replica groups, at the first training forward pass of the round (a forward pre-hook; the
     trainer calls :meth:`PeriodicSync.begin_round` before it reads the step's batch); a joining
     replica receives a live peer's model, inner optimizer and the wrapper's shared state here
     (its per-rank state starts fresh: :meth:`PeriodicSync.shared_state`), and the round-start
     state is kept;
  b. the outer step's exchange runs on the quorum (:class:`~thinwire.runtime.ft.ManagedComm`:
     divided by the live world size);
  c. the quorum votes (``Manager.should_commit``): kept, the outer step is applied; refused (a
     member died in the round), every live member puts back the round-start state (model,
     inner optimizer, outer state, codec state, schedule position) and goes on, so an outer
     step is applied by every live worker or by none; the round's inner steps are lost.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from thinwire.errors import UsageError
from thinwire.runtime.comm import Comm
from thinwire.strategies.base import flat_params, load_flat

if TYPE_CHECKING:
    from thinwire.runtime.ft import Replica


class PeriodicSync:
    """The skeleton of a wrapper that synchronises a user's replica after every
    ``sync_every``-th step of its optimizer (:class:`LocalSGD`, SparseLoCo, DiLoCo), written
    once:
      1. the period is checked (one line naming the wrapper if it is < 1);
      2. the subclass sets up its own state, then :meth:`_hook_on` registers an optimizer
         post-step hook (after its own checks, so a refused wrapper leaves no hook behind);
      3. the hook counts ``steps`` and calls :meth:`on_step`, by default :meth:`sync` after
         every ``sync_every``-th step;
      4. ``steps`` is the checkpointed state (subclasses add theirs);
      5. :meth:`close` removes the hook; every wrapper is a context manager that closes.
    With a ``replica`` (module docstring, steps a-c) the communicator is the replica's
    :class:`~thinwire.runtime.ft.ManagedComm`; ``clock`` counts the job's inner steps (a joiner
    takes its peer's, a refused round does not put it back) and ``history`` holds each outer
    step's (``clock``, quorum members, kept)."""

    def __init__(self, model: nn.Module, sync_every: int, *, comm: Comm | None = None,
                 tag: str = "average", replica: Replica | None = None) -> None:
        if sync_every < 1:
            raise UsageError(f"{type(self).__name__} sync_every must be >= 1, got {sync_every}")
        if replica is not None and comm is not None and comm is not replica.comm:
            raise UsageError(f"{type(self).__name__}: give a comm or a replica (whose comm "
                             "is the quorum's), not both")
        self.model = model
        self.sync_every = sync_every
        self.replica = replica
        self.comm = replica.comm if replica is not None else (comm if comm is not None else Comm())
        self.tag = tag
        self.steps = 0
        self.clock = 0
        self.history: list[tuple[int, list[int], bool]] = []
        self._hook: Any = None
        self._pre: Any = None
        self._inner: torch.optim.Optimizer | None = None
        self._round: dict[str, Any] | None = None  # the round-start state while a round is open
        self._members: list[int] = []  # the round's quorum, by replica number

    def _hook_on(self, optimizer: torch.optim.Optimizer) -> None:
        self._inner = optimizer
        self._hook = optimizer.register_step_post_hook(self._after_step)
        if self.replica is not None:
            self._pre = self.model.register_forward_pre_hook(self._before_forward)
            self.replica.attach("periodic", self._ft_state, self._ft_load)

    def _after_step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        self.steps += 1
        self.clock += 1
        self.on_step()

    # --- over a torchft quorum (steps a-c) ----------------------------------------------------
    def _before_forward(self, module: nn.Module, _args: Any) -> None:
        if module.training:
            self.begin_round()

    def begin_round(self) -> None:
        """Step a: open the round's quorum (a joiner recovers here) and keep the round-start
        state; nothing when a round is open already or without a replica."""
        if self.replica is None or self._round is not None:
            return
        self.replica.begin()
        self._members = self.replica.members()
        self.on_quorum()
        self._round = copy.deepcopy(self._full_state())

    def resume_at(self, clock: int) -> None:
        """A resumed fault-tolerant run (``thinwire.ft_trainer``): the job's step count goes on
        from the checkpoint's step (``steps`` came with the wrapper's state)."""
        self.clock = int(clock)

    def on_quorum(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """After a quorum formed (the live rank is known): a subclass updates what depends on
        it (a codec's rank for its private randomness)."""

    def commit(self) -> bool:
        """Step c, after the outer step's exchange: the quorum's vote; on a refusal the
        round-start state is put back. True (always) without a replica."""
        if self.replica is None:
            return True
        if self._round is None:  # an outer step outside a round (sync() called directly)
            self.begin_round()
        kept = self.replica.commit()
        saved, self._round = self._round, None
        self.history.append((self.clock, list(self._members), kept))
        if not kept:
            assert saved is not None
            self._load_full(saved)
        return kept

    def shared_state(self) -> dict[str, Any]:
        """The wrapper's state a joining replica copies: :meth:`state_dict` less what belongs to
        one rank (a subclass drops its per-rank part: an error-feedback residual or
        accumulator, which a copy would send twice)."""
        return self.state_dict()

    def load_shared_state(self, state: dict[str, Any]) -> None:
        """A joiner's load of :meth:`shared_state`: its per-rank state starts fresh."""
        self.load_state_dict(state)

    def _ft_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "clock": self.clock,
                "inner": self._inner.state_dict() if self._inner is not None else {},
                "wrapper": self.shared_state()}

    def _ft_load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if self._inner is not None:
            self._inner.load_state_dict(state["inner"])
        self.load_shared_state(state["wrapper"])
        self.clock = int(state["clock"])

    def _full_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(),
                "inner": self._inner.state_dict() if self._inner is not None else {},
                "wrapper": self.state_dict()}

    def _load_full(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if self._inner is not None:
            self._inner.load_state_dict(copy.deepcopy(state["inner"]))
        self.load_state_dict(state["wrapper"])

    def on_step(self) -> None:
        """Step 3, after ``steps`` counted this step: :meth:`sync` on every period's last."""
        if self.steps % self.sync_every == 0:
            self.sync()

    def sync(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._pre is not None:
            self._pre.remove()
            self._pre = None

    def __enter__(self) -> PeriodicSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalSGD(PeriodicSync):
    """Average ``model``'s parameters over all ranks after every ``sync_every``-th step of
    ``optimizer`` (an optimizer post-step hook; step 2 of the module docstring).

    ``comm`` defaults to ``Comm()`` (the default process group, bound lazily); ``replica``
    runs it over a torchft quorum instead (module docstring, steps a-c). Use it as a context
    manager, or call :meth:`close` to remove the hook."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, sync_every: int, *,
                 comm: Comm | None = None, tag: str = "average",
                 replica: Replica | None = None) -> None:
        super().__init__(model, sync_every, comm=comm, tag=tag, replica=replica)
        self.optimizer = optimizer
        self._hook_on(optimizer)

    def sync(self) -> None:
        """Step 2: average all parameters with one all-reduce (over a quorum: kept only if
        the quorum commits, step c)."""
        flat = flat_params(self.model)
        self.comm.all_reduce(flat, op="avg", tag=self.tag)
        if self.commit():
            load_flat(self.model, flat)
