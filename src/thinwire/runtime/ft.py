"""Fault tolerance without a restart: thinwire's communicator on a torchft quorum.

torchft (Meta's fault-tolerant training engine; ``Manager``, lighthouse, checkpoint transport)
forms a *quorum* of live replica groups before every step: a replica group that died drops
out, a new one joins and recovers the live state from a peer, and a step is kept only if the
quorum's members vote to commit it. This module puts thinwire's one communication layer on
that engine, so every byte of a fault-tolerant run is in the same ledger as any other run:

1. :class:`Lighthouse` runs torchft's ``LighthouseServer`` (the quorum's coordinator) on an
   address of this machine, 127.0.0.1 by default; for many machines one lighthouse serves
   every replica group (docs/FAULT_TOLERANCE.md).
2. :class:`Replica` is one replica group's seat in the quorum: a torchft ``Manager`` over a
   reconfigurable ``ProcessGroupGloo`` (``ProcessGroupNCCL`` on CUDA), its TCP store, and
   torchft's ``PGTransport`` for recovery, whose point-to-point messages are written into the
   ledger as their own kind (tag ``recovery``).
3. :class:`ManagedComm` is a :class:`~thinwire.runtime.comm.Comm` whose rank and world size
   are the *live* quorum's (re-read every call), whose collectives run on the managed process
   group, and whose failures do not raise: the error is reported to the manager, the call
   returns its input, and the step's commit vote fails on every member, so the step is
   applied by none (``Manager.should_commit``).

The wrappers that use it (``thinwire.strategies.fault.FaultTolerantDP`` and the
``runtime.fault_tolerance`` option of the trainer) are the user's surface; this module knows no
method.

Listening addresses: the lighthouse, the manager's RPC server and the process group's store
listen on ``host`` (127.0.0.1 on one machine). torchft's ``Manager`` binds its RPC server to
every interface; :class:`Replica` binds it to ``host`` instead (the only change made to
torchft's behaviour).

One concept, one file (over 400 lines): thinwire's communication over torchft's quorum (the
lighthouse, a replica group and its ledgered transport and communicator).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch

from thinwire.runtime.comm import Comm
from thinwire.runtime.ledger import CONTROL, Ledger, nbytes

RECOVERY = "recovery"
"""The ledger tag of recovery transfers: a joining worker's state sent by a live peer."""

__all__ = ["RECOVERY", "FaultToleranceError", "Lighthouse", "ManagedComm", "Replica",
           "lighthouse_status",
           "replica_index"]


class FaultToleranceError(RuntimeError):
    """The quorum cannot go on (lighthouse lost, fewer live workers than ``min_workers``); the
    message is one line naming what happened and what to do."""


def _torchft() -> Any:
    try:
        import torchft
    except ImportError as exc:  # pragma: no cover - torchft is a dev extra
        raise FaultToleranceError(
            "fault tolerance needs torchft: pip install 'torchft-nightly' or the project's "
            f"dev extras ({exc})") from None
    return torchft


class Lighthouse:
    """torchft's lighthouse (the quorum coordinator) on ``host``, as a context manager.

    ``min_workers``: the fewest replica groups a quorum may have; ``join_timeout_ms``: how long
    a quorum waits for more replica groups than ``min_workers`` to join (a fresh job waits for
    the whole configured world); ``heartbeat_timeout_ms``: after how long without a heartbeat a
    replica group counts as lost.
    """

    def __init__(self, min_workers: int, *, host: str = "127.0.0.1", port: int = 0,
                 join_timeout_ms: int = 10_000, quorum_tick_ms: int = 50,
                 heartbeat_timeout_ms: int = 2_000) -> None:
        if min_workers < 1:
            raise FaultToleranceError(f"min_workers={min_workers}: give at least 1")
        from torchft._torchft import LighthouseServer

        self.min_workers = min_workers
        self._server: Any = LighthouseServer(
            bind=f"{host}:{port}", min_replicas=min_workers, join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms)
        # the server advertises the machine's name; workers reach it where it listens
        port_ = self._server.address().rsplit(":", 1)[1]
        self.address = f"http://{host}:{port_}"

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def lighthouse_status(address: str, timeout: float = 5.0) -> str:
    """The text of a lighthouse's own status page (``GET /status`` at ``address``, as
    :attr:`Lighthouse.address` gives it): the quorum it is forming, the requests it holds
    ("only have N participants ...") and the replica groups heartbeating."""
    import http.client

    host, port = address.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", "/status")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


_BIND_LOCK = threading.Lock()


@contextlib.contextmanager
def _manager_server_on(host: str) -> Iterator[None]:
    """While a ``Manager`` is built, its RPC server binds ``host`` instead of every interface
    (torchft hard-codes ``[::]``)."""
    import torchft.manager as tm

    original = tm.ManagerServer

    def bound(*args: Any, **kwargs: Any) -> Any:
        port = str(kwargs.get("bind", "[::]:0")).rsplit(":", 1)[1]
        kwargs["bind"] = f"{host}:{port}"
        return original(*args, **kwargs)

    with _BIND_LOCK:
        tm.ManagerServer = bound  # type: ignore[misc]
        try:
            yield
        finally:
            tm.ManagerServer = original  # type: ignore[misc]


class _CountingGroup:
    """The managed process group as torchft's ``PGTransport`` sees it: its sends and receives
    go through unchanged and each is written into the ledger, tagged :data:`RECOVERY` (exact
    bytes: the pickled metadata, its length, every tensor)."""

    def __init__(self, pg: Any, ledger: Callable[[], Ledger], device: torch.device) -> None:
        self._pg = pg
        self._ledger = ledger
        self._device = str(device)

    def _record(self, op: str, tensors: Sequence[torch.Tensor], peer: str) -> None:
        b = nbytes(tensors)
        sent, recv = (b, 0) if op == "send" else (0, b)
        from thinwire.runtime.ledger import LedgerEntry

        led = self._ledger()
        led.record(LedgerEntry(led.step, op, RECOVERY, b, sent, recv, peer, 0.0, False,
                               self._device))

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> Any:
        self._record("send", tensors, f"dst={dst_rank}")
        return self._pg.send(tensors, dst_rank, tag)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> Any:
        self._record("recv", tensors, f"src={src_rank}")
        return self._pg.recv(tensors, src_rank, tag)


class Replica:
    """One replica group's seat in a torchft quorum (steps, as torchft runs them):

    1. ``begin()`` before the forward pass: the quorum of this step is formed (synchronously,
       so a joining replica has the live state before it computes); when it changed, the
       process group is rebuilt over the live members, and a member behind the others
       receives a live peer's state through ``state_dict``/``load_state_dict`` over the
       process group (torchft's ``PGTransport``), ledgered as :data:`RECOVERY`;
    2. the step's exchanges go through :attr:`comm` (a :class:`ManagedComm`): the average is
       over the live members; a failed call is reported, never raised;
    3. ``commit()`` after the exchange: every member votes; True only if no member saw an
       error and at least ``min_workers`` took part; the caller applies the step only then.
       A member that missed a commit others made is behind at the next quorum and is healed
       from a peer (step 1), so the live members never diverge.

    ``replica_id`` names the group (any string; a restarted process may reuse it: the new one
    is a new member and recovers), ``lighthouse`` is the address of a :class:`Lighthouse`,
    ``timeout`` bounds each collective and the recovery (seconds), ``quorum_timeout`` how long
    a quorum may take to form: when it runs out (lighthouse gone, fewer live workers than
    ``min_workers``), :meth:`begin` raises :class:`FaultToleranceError` with one line.
    ``init_sync``: torchft's first-step synchronisation (members heal from one at step 0);
    False when every member builds the same initial state from the seed, as thinwire does.
    """

    def __init__(self, replica_id: str, lighthouse: str, *, min_workers: int,
                 state_dict: Callable[[], dict[str, Any]] | None = None,
                 load_state_dict: Callable[[dict[str, Any]], None] | None = None,
                 host: str = "127.0.0.1", timeout: float = 30.0, quorum_timeout: float = 60.0,
                 device: torch.device | str = "cpu", init_sync: bool = False,
                 ledger: Ledger | None = None) -> None:
        _torchft()
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.pg_transport import PGTransport

        if min_workers < 1:
            raise FaultToleranceError(f"min_workers={min_workers}: give at least 1")
        self.replica_id = replica_id
        self.min_workers = min_workers
        self.device = torch.device(device)
        self.ledger = ledger if ledger is not None else Ledger(0)
        self._quorum_timeout = quorum_timeout
        td = timedelta(seconds=timeout)
        self.pg: Any = (ProcessGroupNCCL(timeout=td) if self.device.type == "cuda"
                        else ProcessGroupGloo(timeout=td))
        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=quorum_timeout))
        transport = PGTransport(_CountingGroup(self.pg, lambda: self.ledger, self.device),  # type: ignore[arg-type]
                                timeout=td, device=self.device)
        if load_state_dict is not None:
            load_state_dict = _named_load("state", load_state_dict)
        with _manager_server_on(host):
            self.manager: Any = Manager(
                pg=self.pg, load_state_dict=load_state_dict, state_dict=state_dict,
                min_replica_size=min_workers, use_async_quorum=False, timeout=td,
                quorum_timeout=timedelta(seconds=quorum_timeout),
                connect_timeout=timedelta(seconds=min(timeout, quorum_timeout)),
                rank=0, world_size=1, store_addr=host, store_port=self._store.port,
                lighthouse_addr=lighthouse, replica_id=replica_id, hostname=host,
                heartbeat_interval=timedelta(milliseconds=100),
                checkpoint_transport=transport, init_sync=init_sync)
        self.comm = ManagedComm(self.manager, ledger=self.ledger, device=self.device)
        self.recoveries = 0
        self.index = replica_index(replica_id)

    def attach(self, key: str, state_dict: Callable[[], Any],
               load_state_dict: Callable[[Any], None]) -> None:
        """Add a part of the state a joining replica receives (``key`` names it; a wrapper
        built on this replica attaches its own: model, optimizers, outer state)."""
        self.manager.register_state_dict_fn(key, _named_load(key, load_state_dict), state_dict)

    @property
    def step(self) -> int:
        """Committed steps so far (the quorum's step: a recovered member takes its peer's)."""
        return int(self.manager.current_step())

    def begin(self, *, shrink_only: bool = False) -> None:
        """Step 1: form this step's quorum (and recover, when behind). ``shrink_only``: the
        quorum holds only members of the previous one (torchft's option: a worker waiting to
        join is left for a later quorum), for closing a round the members began together."""
        before = self.step
        try:
            self.manager.start_quorum(timeout=timedelta(seconds=self._quorum_timeout),
                                      shrink_only=shrink_only)
        except RecoveryFailed as exc:
            raise FaultToleranceError(str(exc)) from None
        except Exception as exc:  # torchft raises its RPC errors as RuntimeError
            raise FaultToleranceError(_quorum_problem(exc, self.min_workers,
                                                      self._quorum_timeout)) from None
        if self.step != before:
            self.recoveries += 1
        self.ledger.step = self.step

    def members(self) -> list[int]:
        """The live quorum's members in rank order, each named by the number its
        ``replica_id`` ends in (torchft's own rule for a replica group's global ranks, read
        off the process group's last configuration: no message)."""
        self.manager.wait_quorum()
        ranks = getattr(self.pg, "_global_ranks", None)
        if not ranks or len(ranks) != self.comm.world_size:
            raise FaultToleranceError(
                "fault tolerance: the quorum's members are unknown (the process group kept no "
                "global ranks); use a torchft with ProcessGroupWrapper.configure(global_ranks)")
        return [int(r) for r in ranks]

    def commit(self) -> bool:
        """Step 3: the quorum's vote on this step (apply it only when True)."""
        try:
            return bool(self.manager.should_commit())
        except RecoveryFailed as exc:
            raise FaultToleranceError(str(exc)) from None
        except Exception as exc:
            raise FaultToleranceError(_quorum_problem(exc, self.min_workers,
                                                      self._quorum_timeout)) from None

    def close(self) -> None:
        """Leave the quorum: the manager's server and transport stop (no thread is left)."""
        with contextlib.suppress(Exception):
            self.manager.shutdown(wait=False)
        with contextlib.suppress(Exception):
            self.pg.shutdown()


class RecoveryFailed(Exception):
    """A live peer's state, received by a joining (or healed) replica, did not load: a
    different problem from a quorum that does not form, named as such."""


def _named_load(key: str, load: Callable[[Any], None]) -> Callable[[Any], None]:
    """``load`` whose failure is a :class:`RecoveryFailed` naming the part of the state
    (``key``) and the cause, so the worker's one line says the recovery failed, not the
    quorum."""
    def loading(state: Any) -> None:
        try:
            load(state)
        except Exception as exc:  # noqa: BLE001 - any load failure is the same one line
            text = str(exc).strip().replace("\n", " ")
            raise RecoveryFailed(
                f"fault tolerance: the state received from a live peer did not load ({key}: "
                f"{text[:300]}); this worker cannot join: start it again to retry, the live "
                "workers go on") from None
    return loading


def replica_index(replica_id: str) -> int:
    """The number a replica id ends with (``"replica3"`` -> 3; torchft ranks by it), 0 if
    none."""
    m = re.search(r"(\d+)$", replica_id)
    return int(m.group(1)) if m else 0


def _quorum_problem(exc: BaseException, min_workers: int, waited: float) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"fault tolerance: no quorum of at least min_workers={min_workers} live workers "
            f"within {waited:g} s (lighthouse unreachable or too few workers left: {first[:200]}); "
            "the last checkpoint is intact: restart the job or lower min_workers")


class ManagedComm(Comm):
    """A :class:`Comm` on a torchft ``Manager``'s process group (module docstring, step 3).

    Rank and world size are the live quorum's, read at every call (a quorum changes between
    steps); ``op="avg"`` divides by the live world size. A collective that fails (a member
    died during it) reports the error to the manager and leaves its input in place, so the
    step's commit vote fails on every member; the ledger still records the call.
    """

    def __init__(self, manager: Any, ledger: Ledger | None = None, *,
                 device: torch.device | str | None = None) -> None:
        super().__init__(ledger=ledger, device=device)
        self.manager = manager

    def _bind(self) -> tuple[int, int]:
        self.manager.wait_quorum()
        rank = self.manager.participating_rank()
        return (0 if rank is None else int(rank), int(self.manager.num_participants()))

    @property
    def distributed(self) -> bool:
        return True

    @property
    def pg(self) -> Any:
        return self.manager._pg

    def _wait(self, work: Any) -> bool:
        try:
            work.wait()
            return True
        except Exception as exc:
            self.manager.report_error(exc)
            return False

    def _guard(self, fut: torch.futures.Future, default: Any) -> torch.futures.Future:
        return self.manager.wrap_future(fut, default)

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum", tag: str = "") -> torch.Tensor:
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        dev = self._check("all_reduce", tag, [tensor])
        if self.world_size == 1 or self.manager.errored():
            return tensor
        t0 = time.perf_counter()
        opts = AllreduceOptions()
        opts.reduceOp = {"sum": ReduceOp.SUM, "avg": ReduceOp.SUM, "max": ReduceOp.MAX,  # type: ignore[assignment]
                         "min": ReduceOp.MIN}[op]
        ok = self._wait(self.pg.allreduce([tensor], opts))
        if ok and op == "avg":
            tensor.div_(self.world_size)
        self._log("all_reduce", nbytes(tensor), "all", time.perf_counter() - t0, tag, device=dev)
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor, *, tag: str = "") -> torch.futures.Future:
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        dev = self._check("all_reduce", tag, [tensor])
        if self.world_size == 1 or self.manager.errored():
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(tensor)
            return fut
        t0 = time.perf_counter()
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]
        payload = nbytes(tensor)
        try:
            work = self.pg.allreduce([tensor], opts)
        except Exception as exc:
            self.manager.report_error(exc)
            fut = torch.futures.Future()
            fut.set_result(tensor)
            return fut

        def done(f: torch.futures.Future) -> torch.Tensor:
            self._log("all_reduce", payload, "all", time.perf_counter() - t0, tag, device=dev)
            return f.value()[0] if isinstance(f.value(), list) else tensor

        return self._guard(work.get_future(), [tensor]).then(done)

    def all_gather(self, tensor: torch.Tensor, *, tag: str = "") -> list[torch.Tensor]:
        from torch.distributed.distributed_c10d import AllgatherOptions

        dev = self._check("all_gather", tag, [tensor])
        n = self.world_size
        if n == 1:
            return [tensor]
        out = [torch.zeros_like(tensor) for _ in range(n)]
        if self.manager.errored():
            return out
        t0 = time.perf_counter()
        self._wait(self.pg.allgather([out], [tensor], AllgatherOptions()))
        self._log("all_gather", nbytes(tensor), "all", time.perf_counter() - t0, tag, device=dev)
        return out

    def all_gather_async(self, tensor: torch.Tensor, *, tag: str = "") -> torch.futures.Future:
        flat = tensor.reshape(-1)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(torch.cat(self.all_gather(flat, tag=tag)))
        return fut

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, tag: str = "") -> torch.Tensor:
        from torch.distributed.distributed_c10d import BroadcastOptions

        dev = self._check("broadcast", tag, [tensor])
        if self.world_size == 1 or self.manager.errored():
            return tensor
        t0 = time.perf_counter()
        opts = BroadcastOptions()
        opts.rootRank = src
        self._wait(self.pg.broadcast([tensor], opts))
        self._log("broadcast", nbytes(tensor), f"src={src}", time.perf_counter() - t0, tag,
                  root=self.rank == src, device=dev)
        return tensor

    def barrier(self, *, tag: str = CONTROL) -> None:
        t = torch.zeros(1, device=self._device_for_new())
        self.all_reduce(t, tag=tag)

    def all_to_all(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], *,
                   tag: str = "") -> None:
        """Personalised exchange over the live quorum (``exchange=scatter``'s two rounds): one
        ``alltoall_base`` of the concatenated messages (gloo's all-to-all-v), exact bytes in
        the ledger; a failure is reported, the receive buffers are left as they were."""
        from torch.distributed.distributed_c10d import AllToAllOptions

        n, me = self.world_size, self.rank
        if len(sends) != n or len(recvs) != n:
            raise ValueError(f"all_to_all: need {n} send and receive tensors")
        dev = self._check("all_to_all", tag, [*sends, *recvs])
        if len({t.dtype for t in [*sends, *recvs]}) != 1:
            self._unsupported("all_to_all of mixed dtypes")
        recvs[me].copy_(sends[me])
        if n == 1 or self.manager.errored():
            return
        t0 = time.perf_counter()
        inp = torch.cat([t.reshape(-1) for t in sends])
        out = torch.empty(sum(t.numel() for t in recvs), dtype=inp.dtype, device=inp.device)
        ok = self._wait(self.pg.alltoall_base(out, inp, [t.numel() for t in recvs],
                                              [t.numel() for t in sends], AllToAllOptions()))
        if ok:
            at = 0
            for t in recvs:
                t.reshape(-1).copy_(out[at:at + t.numel()])
                at += t.numel()
        sent = sum(nbytes(sends[j]) for j in range(n) if j != me)
        recv = sum(nbytes(recvs[j]) for j in range(n) if j != me)
        self._log("all_to_all", sent, "all", time.perf_counter() - t0, tag, exact=(sent, recv),
                  device=dev)

    def _unsupported(self, name: str) -> Any:
        raise FaultToleranceError(
            f"ManagedComm.{name}: not carried over a torchft quorum yet; send tensors of one "
            "dtype")

    def agree(self, ok: bool, *, tag: str = CONTROL) -> bool:
        """True on every live member only if every member passes ``ok`` and none saw an error
        (one all-reduce of a flag, run even when this member already failed, so its peers
        learn it); a failed call is False."""
        flag = torch.tensor([1.0 if ok and self.manager.errored() is None else 0.0],
                            device=self._device_for_new())
        n = self.world_size
        if n == 1:
            return bool(flag.item() == 1.0)
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]
        t0 = time.perf_counter()
        try:
            self.pg.allreduce([flag], opts).wait()
        except Exception as exc:
            self.manager.report_error(exc)
            return False
        self._log("all_reduce", nbytes(flag), "all", time.perf_counter() - t0, tag,
                  device=str(flag.device))
        return bool(flag.item() == float(n)) and self.manager.errored() is None

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]],
                 recvs: Sequence[tuple[int, torch.Tensor]], *, tag: str = "") -> None:
        """Point-to-point messages over the live quorum (ranks are the quorum's): all posted,
        then waited; a failure is reported to the manager (the round's agreement then fails)
        and the remaining messages are not waited for. Bytes exact, one entry a message."""
        dev = self._check("exchange", tag, [t for _, t in [*sends, *recvs]])
        if self.manager.errored():
            return
        t0 = time.perf_counter()
        works = []
        try:
            works += [self.pg.send([t.contiguous()], d, 0) for d, t in sends]
            works += [self.pg.recv([t], s, 0) for s, t in recvs]
        except Exception as exc:
            self.manager.report_error(exc)
            return
        for w in works:
            if not self._wait(w):
                return
        dt = time.perf_counter() - t0
        for d, t in sends:
            self._log("send", nbytes(t), f"dst={d}", dt, tag, exact=(nbytes(t), 0), device=dev)
        for s, t in recvs:
            self._log("recv", nbytes(t), f"src={s}", dt, tag, exact=(0, nbytes(t)), device=dev)

    def send(self, tensor: torch.Tensor, dst: int, *, tag: str = "") -> None:
        self.exchange([(dst, tensor)], [], tag=tag)

    def recv(self, tensor: torch.Tensor, src: int, *, tag: str = "") -> torch.Tensor:
        self.exchange([], [(src, tensor)], tag=tag)
        return tensor

