"""Data parallelism that keeps training when a worker dies: any codec over a torchft quorum.

Every step, in a user's own loop (one process per replica group)::

    from thinwire.strategies.fault import FaultTolerantDP
    ft = FaultTolerantDP(model, optimizer, replica_id="3", lighthouse=ADDRESS,
                         min_workers=2, codec="topk:ratio=0.01")
    while ft.step_index < steps:
        ft.zero_grad()                                   # 1. quorum (and recovery)
        x, y = batch(ft.step_index, ft.replica_id)       # the step's batch: a pure function
        loss_fn(model(x), y).backward()
        ft.step()                                        # 2.-4.
    ft.close()

1. ``zero_grad``: torchft's ``Manager`` forms the step's quorum of live replica groups
   (:class:`thinwire.runtime.ft.Replica`); a joining group, or one that missed a commit,
   receives a live peer's state first (model, optimizer, the codec's shared state);
2. ``step``: the gradients of every parameter, flattened into one tensor, are averaged over
   the *live* quorum through the codec's exchange (``Compressor.average_async`` on a
   :class:`~thinwire.runtime.ft.ManagedComm`: divided by the live world size, every byte in
   the ledger);
3. the quorum votes (``Manager.should_commit``): the step is kept only if every member's
   exchange succeeded and at least ``min_workers`` took part;
4. kept: the average becomes the gradients and the optimizer steps; dropped (a member died
   mid-step): the gradients and the codec's state are put back as they were before the step
   (an error-feedback residual does not absorb an exchange that did not happen) and the
   optimizer does not step; the loop runs the same ``step_index`` again on the new quorum.

State, copied or fresh (docs/FAULT_TOLERANCE.md): a joining worker copies a live peer's model,
optimizer state, committed step count and the codec state every rank holds alike (PowerSGD's
warm-start Q); the codec's per-rank state (error-feedback residuals, PowerSGD's residuals)
starts at zero, since a peer's residual is the part of *that* peer's gradients it has not sent
yet: copying it would send it twice. A lost worker's residual is lost with it (its unsent
gradient mass, at most one step's compression error of one worker).

The codec's shared randomness is drawn at the committed step (``step_index``), so the members
of a quorum, a recovered one included, draw alike.

In the trainer (``thinwire train --method dp --runtime.fault_tolerance torchft``) the strategy
builds it on the run's :class:`~thinwire.runtime.ft.Replica` (``replica=``, torchft's
``Manager`` shape) and the trainer opens each step's quorum with :meth:`begin_round`;
:attr:`clock` (the committed steps) and :attr:`history` (each step's ``(clock, live workers,
kept)``) are what it records.
"""

from __future__ import annotations

from typing import Any

import torch

from thinwire.compression.base import Compressor
from thinwire.compression.registry import build_codec
from thinwire.runtime.ft import FaultToleranceError, Replica
from thinwire.strategies.grads import flatten, grads_of, unflatten_into

__all__ = ["FaultTolerantDP", "shared_codec_state"]

PER_RANK = ("residual.",)
"""Codec state keys (prefixes) that belong to one rank and start fresh on a joining worker."""


def shared_codec_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The part of a codec's ``state_dict`` every rank holds alike (copied to a joiner)."""
    return {k: v for k, v in state.items() if not k.startswith(PER_RANK)}


class FaultTolerantDP:
    """Data parallelism over a torchft quorum (module docstring: steps 1-4).

    ``model`` and ``optimizer`` are the user's; ``codec`` a codec spec or
    :class:`~thinwire.compression.base.Compressor` ("none": plain fp32 averaging);
    ``replica_id``, ``lighthouse``, ``min_workers``, ``timeout``, ``quorum_timeout``, ``host``
    as for :class:`~thinwire.runtime.ft.Replica`, or ``replica``: a replica built already (its
    seat is this object's; the others are then not given). ``clip_norm`` > 0 clips the
    averaged gradient's norm before the optimizer steps (as ``clip_grad_norm_`` after DDP's
    average). :attr:`comm` is the communicator (its ``ledger`` holds every call, recovery
    tagged ``recovery``); :attr:`step_index` the committed steps; :attr:`live` the live world
    size of the last step.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 replica_id: str | None = None, lighthouse: str | None = None,
                 min_workers: int = 1, codec: str | Compressor = "none", seed: int = 0,
                 timeout: float = 30.0, quorum_timeout: float = 60.0, host: str = "127.0.0.1",
                 device: torch.device | str | None = None, replica: Replica | None = None,
                 clip_norm: float = 0.0) -> None:
        self.model = model
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise FaultToleranceError("FaultTolerantDP: the model has no trainable parameter")
        dev = torch.device(device) if device is not None else self.params[0].device
        self.codec = (codec if isinstance(codec, Compressor)
                      else build_codec(codec, seed=seed, rank=0))
        if type(self.codec).__name__ == "ScatteredExchange":
            raise FaultToleranceError(
                f"FaultTolerantDP: codec {self.codec.describe()} exchanges with an all-to-all, "
                "not carried over a torchft quorum yet; drop exchange=scatter")
        if replica is None:
            if replica_id is None or lighthouse is None:
                raise FaultToleranceError("FaultTolerantDP: give replica_id and lighthouse, or "
                                          "a replica")
            replica = Replica(replica_id, lighthouse, min_workers=min_workers, host=host,
                              timeout=timeout, quorum_timeout=quorum_timeout, device=dev)
        elif replica_id is not None or lighthouse is not None:
            raise FaultToleranceError("FaultTolerantDP: give a replica or replica_id and "
                                      "lighthouse, not both")
        self.replica = replica
        self.replica.attach("data_parallel", self._state, self._load)
        self.replica_id = replica.replica_id
        self.comm = self.replica.comm
        self.clip_norm = clip_norm
        self.live = 0
        self.committed = 0
        self.dropped = 0
        self.history: list[tuple[int, list[int], bool]] = []
        self._open = False
        self._members: list[int] = []

    # --- state a joining worker receives -------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "codec": shared_codec_state(self.codec.state_dict())}

    def _load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        # shared state copied, per-rank state (residuals) fresh: zero
        self.codec.reset()
        self.codec.load_state_dict(dict(state["codec"]))

    @property
    def step_index(self) -> int:
        """Committed steps so far: the index of the step the loop runs next."""
        return self.replica.step

    @property
    def clock(self) -> int:
        """The job's step count (the trainer's), a joiner's taken from its peer: the committed
        steps (a dropped step is run again)."""
        return self.step_index

    def resume_at(self, clock: int) -> None:
        """A resumed run (``thinwire.ft_trainer``): the committed steps (torchft's step, this
        wrapper's clock) go on from the checkpoint's step on every resumed worker alike."""
        manager = self.replica.manager
        manager.load_state_dict({"step": int(clock),
                                 "batches_committed": manager.batches_committed()})

    def state_dict(self) -> dict[str, Any]:
        """The codec's state (this rank's residuals included) and the step counts."""
        return {"codec": self.codec.state_dict(), "step": self.step_index,
                "committed": self.committed, "dropped": self.dropped}

    # --- the step --------------------------------------------------------------------------
    def begin_round(self) -> None:
        """Step 1: this step's quorum (a joining worker recovers here); nothing if one is open."""
        if self._open:
            return
        self.replica.begin()
        self._members = self.replica.members()
        self._open = True
        self.live = self.comm.world_size
        # private randomness (QSGD's rounding) differs across the live ranks
        codec: Any = self.codec
        while codec is not None:
            codec.rank = self.comm.rank
            codec = getattr(codec, "inner", None)

    def zero_grad(self) -> None:
        """Step 1: the quorum (:meth:`begin_round`), then the gradients cleared."""
        self.begin_round()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> bool:
        """Steps 2-4: average over the live quorum, vote, apply or drop; True when applied."""
        self.begin_round()  # a step() without zero_grad() first
        kept = self._step()
        self._open = False
        self.history.append((self.step_index + (0 if kept else 1), list(self._members), kept))
        return kept

    def _step(self) -> bool:
        grads = grads_of(self.params)
        before = {k: v.clone() for k, v in self.codec.state_dict().items()}
        flat = flatten(grads)
        fut, _ = self.codec.average_async(self.comm, flat, self.step_index, key=0, tag="grad",
                                          shapes=[tuple(p.shape) for p in self.params])
        try:
            mean = fut.wait()
        except Exception as exc:  # a failure the manager's guard did not absorb
            self.replica.manager.report_error(exc)
            mean = None
        if self.replica.commit() and mean is not None:
            for p, g in zip(self.params, grads):
                if p.grad is None:
                    p.grad = g
            unflatten_into(mean.reshape(-1), [p.grad for p in self.params])  # type: ignore[misc]
            if self.clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.clip_norm)
            self.optimizer.step()
            self.committed += 1
            return True
        self.codec.reset()
        self.codec.load_state_dict(before)
        self.optimizer.zero_grad(set_to_none=True)
        self.dropped += 1
        return False

    def close(self) -> None:
        """Leave the quorum and stop torchft's threads and servers."""
        self.codec.close()
        self.replica.close()

    def __enter__(self) -> FaultTolerantDP:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
