"""The one communication layer: every collective and point-to-point thinwire issues goes here.

Each call is written into the calling rank's :class:`~thinwire.runtime.ledger.Ledger`: the operation, the payload bytes
this rank hands to the collective, the bytes it sends and receives on the wire as estimated for
the collective's usual algorithm (ring all-reduce, ring all-gather, chain broadcast; exact for
point-to-point), the peers, the wall time and a tag. A comparison of methods is a comparison of
these counters. Wire figures for collectives are *estimates* (the backend chooses its own
algorithm); measured figures come from the kernel's interface counters (``thinwire bench``).

Traffic that is not part of a method's training (evaluation, metric reductions, checkpoint
barriers) is tagged ``control`` and kept out of the method's totals.

The device rule: every tensor a call carries lives on the run's device, control tensors
included (a CUDA run's process group is nccl's, which carries no CPU tensor). A communicator
that knows the run's device (given as ``device``, declared with :meth:`Comm.expect`, or found at
binding time from an nccl group) checks each call's tensors before the call, at every world
size, and raises :class:`CommDeviceError` naming the call, its tag and both devices; each ledger
entry records its tensor's device.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from thinwire.runtime.ledger import CONTROL, Ledger, LedgerEntry, nbytes, wire_estimate


class CommError(RuntimeError):
    """A communication object used without a process group (the message says what to do)."""


class CommDeviceError(RuntimeError):
    """A tensor handed to :class:`Comm` is not on the run's device (a program error: the
    message names the call, its tag and both devices)."""


def same_device(have: torch.device, want: torch.device) -> bool:
    """Whether a tensor on ``have`` is on ``want`` (an index-less ``want`` takes any index)."""
    return have.type == want.type and (want.index is None or have.index == want.index)


class Comm:
    """A process group plus its ledger. Pass it around; nothing here is global.

    ``Comm()`` binds to the default process group (or to ``group``) lazily, at its first use, so
    it may be made before ``torch.distributed.init_process_group``; used with no group
    initialised by then, it raises :class:`CommError` instead of silently acting as one rank.
    :meth:`local` is the explicit single-process communicator (world size 1, every call a no-op
    that records nothing): the single-process reference and one-worker runs.

    ``device`` is the run's device: every tensor of every call must be on it (module
    docstring), checked before the call whatever the world size, so a one-worker run finds a
    stray CPU tensor as a multi-GPU run would. Left None, it is the current CUDA device when
    the group turns out to be nccl's, and unchecked otherwise.
    """

    def __init__(self, group: Any = None, ledger: Ledger | None = None, *,
                 device: torch.device | str | None = None) -> None:
        self.group = group
        self._ledger = ledger
        self._bound: tuple[int, int] | None = None
        self._local = False
        self._device = None if device is None else torch.device(device)

    @classmethod
    def local(cls, ledger: Ledger | None = None, *,
              device: torch.device | str | None = None) -> Comm:
        """A one-rank communicator needing no process group."""
        c = cls(ledger=ledger, device=device)
        c._local = True
        c._bound = (0, 1)
        return c

    @property
    def device(self) -> torch.device | None:
        """The run's device every call's tensors must be on (None: not checked)."""
        return self._device

    def expect(self, device: torch.device | str) -> Comm:
        """Declare the run's device (the trainer does, before building a strategy); returns
        self. A communicator already declared for another device refuses."""
        dev = torch.device(device)
        if self._device is not None and not (same_device(dev, self._device)
                                             or same_device(self._device, dev)):
            raise CommDeviceError(f"Comm.expect({dev}): this communicator's run device is "
                                  f"already {self._device}")
        if self._device is None or dev.index is not None:
            self._device = dev
        return self

    def _check(self, op: str, tag: str, tensors: Sequence[torch.Tensor]) -> str:
        """The device rule for one call: every tensor on the run's device; returns the device
        recorded in the ledger entry."""
        self._bind()
        want = self._device
        for t in tensors:
            if want is not None and not same_device(t.device, want):
                raise CommDeviceError(
                    f"Comm.{op} (tag {tag or 'none'!r}): a tensor on {t.device}, but the run's "
                    f"device is {want}; make the tensor on the run's device (control tensors "
                    "included: docs/ARCHITECTURE.md, invariants)")
        return str(tensors[0].device) if tensors else ""

    def _bind(self) -> tuple[int, int]:
        if self._bound is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise CommError(
                    "thinwire.Comm used before torch.distributed.init_process_group: initialise "
                    "the process group first (torchrun sets the environment for it), or use "
                    "Comm.local() for a single process")
            self._bound = (dist.get_rank(self.group), dist.get_world_size(self.group))
            if self._device is None and _nccl_only(self.group):
                self._device = torch.device("cuda", torch.cuda.current_device())
        return self._bound

    @property
    def rank(self) -> int:
        return self._bind()[0]

    @property
    def world_size(self) -> int:
        return self._bind()[1]

    @property
    def distributed(self) -> bool:
        """Whether calls go to a process group (False for :meth:`local`)."""
        self._bind()
        return not self._local

    @property
    def ledger(self) -> Ledger:
        if self._ledger is None:
            self._ledger = Ledger(self.rank)
        return self._ledger

    # --- bookkeeping -------------------------------------------------------------------------
    def _log(self, op: str, payload: int, peers: str, seconds: float, tag: str,
             *, root: bool = False, exact: tuple[int, int] | None = None,
             device: str = "") -> None:
        sent, recv = exact if exact is not None else wire_estimate(op, payload, self.world_size, root=root)
        self.ledger.record(LedgerEntry(self.ledger.step, op, tag, payload, sent, recv, peers,
                                       seconds, exact is None and op not in ("send", "recv"),
                                       device))

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    # --- collectives -------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum", tag: str = "") -> torch.Tensor:
        """In-place all-reduce (``op``: sum, avg, max, min)."""
        dev = self._check("all_reduce", tag, [tensor])
        if self.world_size == 1:
            return tensor
        t0 = time.perf_counter()
        if op == "avg":
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
            tensor.div_(self.world_size)
        else:
            dist.all_reduce(tensor, op=_REDUCE[op], group=self.group)
        self._log("all_reduce", nbytes(tensor), "all", time.perf_counter() - t0, tag, device=dev)
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor, *, tag: str = "") -> torch.futures.Future:
        """Non-blocking sum all-reduce returning a Future of the reduced tensor (DDP hooks)."""
        dev = self._check("all_reduce", tag, [tensor])
        if self.world_size == 1:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(tensor)
            return fut
        t0 = time.perf_counter()
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        payload = nbytes(tensor)

        def done(f: torch.futures.Future) -> torch.Tensor:
            self._log("all_reduce", payload, "all", time.perf_counter() - t0, tag, device=dev)
            return f.value()[0]

        return work.get_future().then(done)

    def all_gather(self, tensor: torch.Tensor, *, tag: str = "") -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on all ranks), in rank order."""
        dev = self._check("all_gather", tag, [tensor])
        if self.world_size == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        t0 = time.perf_counter()
        dist.all_gather(out, tensor, group=self.group)
        self._log("all_gather", nbytes(tensor), "all", time.perf_counter() - t0, tag, device=dev)
        return out

    def all_gather_async(self, tensor: torch.Tensor, *, tag: str = "") -> torch.futures.Future:
        """Non-blocking all-gather into one flat tensor [world_size * numel] (DDP hooks)."""
        flat = tensor.reshape(-1)
        dev = self._check("all_gather", tag, [flat])
        if self.world_size == 1:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(flat.clone())
            return fut
        out = torch.empty(self.world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
        t0 = time.perf_counter()
        work = _GATHER_INTO(out, flat, group=self.group, async_op=True)
        payload = nbytes(flat)

        def done(_f: torch.futures.Future) -> torch.Tensor:
            self._log("all_gather", payload, "all", time.perf_counter() - t0, tag, device=dev)
            return out

        return work.get_future().then(done)

    def _logged(self, work: Any, op: str, payload: int, t0: float, tag: str, async_op: bool,
                dev: str) -> Any:
        """Record ``op`` and return its work handle (None when it ran synchronously). An
        asynchronous call is recorded when issued, so the ledger holds it before any wait; its
        seconds are the issue time only (the caller overlaps the rest with compute)."""
        self._log(op, payload, "all", time.perf_counter() - t0, tag, device=dev)
        return work if async_op else None

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, *,
                        async_op: bool = False, tag: str = "") -> Any:
        """All-gather ``tensor`` (every rank's, same size) into the flat ``output`` in rank
        order; with ``async_op`` the work handle (FSDP2's collective interface)."""
        dev = self._check("all_gather", tag, [output, tensor])
        if self.world_size == 1:
            output.copy_(tensor.reshape(output.shape))
            return None
        t0 = time.perf_counter()
        work = _GATHER_INTO(output, tensor, group=self.group, async_op=async_op)
        return self._logged(work, "all_gather", nbytes(tensor), t0, tag, async_op, dev)

    def reduce_scatter_into(self, output: torch.Tensor, tensor: torch.Tensor, *, op: Any = None,
                            async_op: bool = False, tag: str = "") -> Any:
        """Reduce ``tensor`` (the full input, same size on every rank) with ``op`` (a
        ``torch.distributed.ReduceOp``, default sum) and leave this rank's 1/n slice in
        ``output``; with ``async_op`` the work handle (FSDP2's collective interface)."""
        dev = self._check("reduce_scatter", tag, [output, tensor])
        if self.world_size == 1:
            output.copy_(tensor.reshape(output.shape))
            return None
        t0 = time.perf_counter()
        work = _SCATTER_FROM(output, tensor, op=op or dist.ReduceOp.SUM, group=self.group,
                             async_op=async_op)
        return self._logged(work, "reduce_scatter", nbytes(tensor), t0, tag, async_op, dev)

    def reduce_scatter(self, tensor: torch.Tensor, *, tag: str = "") -> torch.Tensor:
        """Sum ``tensor`` over ranks and return this rank's chunk of the sum along dim 0
        (dim 0 must be divisible by the world size)."""
        n = self.world_size
        dev = self._check("reduce_scatter", tag, [tensor])
        if n == 1:
            return tensor
        if tensor.shape[0] % n:
            raise ValueError(f"reduce_scatter: dim 0 of {tuple(tensor.shape)} is not divisible "
                             f"by {n} ranks")
        src = tensor.contiguous()
        out = torch.empty((src.shape[0] // n, *src.shape[1:]), dtype=src.dtype,
                          device=src.device)
        t0 = time.perf_counter()
        _SCATTER_FROM(out, src, group=self.group)
        self._log("reduce_scatter", nbytes(src), "all", time.perf_counter() - t0, tag,
                  device=dev)
        return out

    def all_to_all(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], *,
                   tag: str = "") -> None:
        """Personalised exchange: ``sends[j]`` goes to rank j, rank j's message for this rank
        lands in ``recvs[j]`` (own chunk copied locally). Posted as one batch of point-to-point
        messages (gloo has no list all-to-all), so the bytes are exact: one ledger entry with
        the bytes sent to and received from the other ranks."""
        n, me = self.world_size, self.rank
        if len(sends) != n or len(recvs) != n:
            raise ValueError(f"all_to_all: need {n} send and receive tensors")
        dev = self._check("all_to_all", tag, [*sends, *recvs])
        recvs[me].copy_(sends[me])
        if n == 1:
            return
        t0 = time.perf_counter()
        ops = [dist.P2POp(dist.isend, sends[j].contiguous(), self._global(j), self.group)
               for j in range(n) if j != me and sends[j].numel()]
        ops += [dist.P2POp(dist.irecv, recvs[j], self._global(j), self.group)
                for j in range(n) if j != me and recvs[j].numel()]
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        sent = sum(nbytes(sends[j]) for j in range(n) if j != me)
        recv = sum(nbytes(recvs[j]) for j in range(n) if j != me)
        self._log("all_to_all", sent, "all", time.perf_counter() - t0, tag, exact=(sent, recv),
                  device=dev)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, tag: str = "") -> torch.Tensor:
        dev = self._check("broadcast", tag, [tensor])
        if self.world_size == 1:
            return tensor
        t0 = time.perf_counter()
        dist.broadcast(tensor, src=self._global(src), group=self.group)
        self._log("broadcast", nbytes(tensor), f"src={src}", time.perf_counter() - t0, tag,
                  root=self.rank == src, device=dev)
        return tensor

    def barrier(self, *, tag: str = CONTROL) -> None:
        if self.world_size == 1:
            return
        t0 = time.perf_counter()
        dist.barrier(group=self.group)
        self._log("barrier", 0, "all", time.perf_counter() - t0, tag)

    # --- point to point ----------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, *, tag: str = "") -> None:
        dev = self._check("send", tag, [tensor])
        t0 = time.perf_counter()
        dist.send(tensor.contiguous(), dst=self._global(dst), group=self.group)
        b = nbytes(tensor)
        self._log("send", b, f"dst={dst}", time.perf_counter() - t0, tag, exact=(b, 0),
                  device=dev)

    def isend(self, tensor: torch.Tensor, dst: int, *, tag: str = "") -> Any:
        """Post a send and return its work handle (``wait()`` it; keep ``tensor`` unchanged and
        alive until then). Bytes are exact; the seconds are the posting's only."""
        dev = self._check("send", tag, [tensor])
        t0 = time.perf_counter()
        work = dist.isend(tensor, dst=self._global(dst), group=self.group)
        b = nbytes(tensor)
        self._log("send", b, f"dst={dst}", time.perf_counter() - t0, tag, exact=(b, 0),
                  device=dev)
        return work

    def recv(self, tensor: torch.Tensor, src: int, *, tag: str = "") -> torch.Tensor:
        dev = self._check("recv", tag, [tensor])
        t0 = time.perf_counter()
        dist.recv(tensor, src=self._global(src), group=self.group)
        b = nbytes(tensor)
        self._log("recv", b, f"src={src}", time.perf_counter() - t0, tag, exact=(0, b),
                  device=dev)
        return tensor

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]],
                 recvs: Sequence[tuple[int, torch.Tensor]], *, tag: str = "") -> None:
        """Post all sends and receives at once (no ordering deadlock), then wait for all.

        ``sends``: (dst, tensor); ``recvs``: (src, buffer). Bytes are exact, one entry a message.
        """
        dev = self._check("exchange", tag, [t for _, t in [*sends, *recvs]])
        t0 = time.perf_counter()
        ops = [dist.P2POp(dist.isend, t.contiguous(), self._global(d), self.group) for d, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self._global(s), self.group) for s, t in recvs]
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        dt = time.perf_counter() - t0
        for d, t in sends:
            self._log("send", nbytes(t), f"dst={d}", dt, tag, exact=(nbytes(t), 0), device=dev)
        for s, t in recvs:
            self._log("recv", nbytes(t), f"src={s}", dt, tag, exact=(0, nbytes(t)), device=dev)

    # --- small helpers -----------------------------------------------------------------------
    def gather_floats(self, values: Sequence[float], *, tag: str = CONTROL) -> list[list[float]]:
        """All ranks' small float vectors (metrics), tagged control by default; the tensor is
        made on the run's device (the device rule)."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self._device_for_new())
        return [x.tolist() for x in self.all_gather(t, tag=tag)]


    def _device_for_new(self) -> torch.device:
        """Where a tensor this layer makes for a call goes: the run's device, else the CPU."""
        self._bind()
        return self._device if self._device is not None else torch.device("cpu")


def _nccl_only(group: Any) -> bool:
    """Whether ``group`` (None: the default group) is carried by nccl alone, so every tensor
    of its calls must be a CUDA tensor."""
    try:
        return str(dist.get_backend(group)) == "nccl"
    except (RuntimeError, ValueError):
        return False


# torch >= 2.12 renames all_gather_into_tensor (deprecated alias kept) to all_gather_single
_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SCATTER_FROM = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
