"""The calibration's measurements, run in every process of a forked gloo group at once.

Steps 1-3 of :mod:`thinwire.measure.calibrate` (its docstring has the formulas): each
``_probe_*`` returns (x1, x2, timings) rows per measurement kind; :func:`probe` runs them all in
one process, as rank ``comm.rank`` of the group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from thinwire.runtime import spawn

Rows = dict[str, list[tuple[float, float, list[float]]]]
"""Per measurement kind: (x1, x2, timings) rows, as the probe processes return them."""


@dataclass(frozen=True)
class Probe:
    """What the calibration processes measure (sizes in bytes, models as full widths)."""

    models: tuple[tuple[int, ...], ...]
    batch: int
    norm: str
    threads: int
    all_reduce: tuple[int, ...]
    all_gather: tuple[int, ...] = ()
    p2p: tuple[int, ...] = ()
    codecs: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """(codec spec, element counts) to time."""
    syncs: tuple[tuple[int, int], ...] = ()
    """(index into models, S): the model's steps synchronised every S."""
    ddp: tuple[int, ...] = ()
    """DDP's bucket elements of models[0] (from step 1 on); empty: no DDP probe."""
    runs: tuple[Any, ...] = ()
    """Run configs whose local synchronisation work is timed (periods of more than 2 steps)."""
    reps: int = 5
    data: Any = field(default=None, repr=False, compare=False)
    """The runs' dataset (forked ranks share it); None: random inputs and no local probe."""


def _timed(fn: Callable[..., object], reps: int, *args: Any, warm: int = 1) -> list[float]:
    """Seconds of ``reps`` calls of ``fn(*args)`` after ``warm`` untimed ones."""
    for _ in range(warm):
        fn(*args)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - t0)
    return out


def _weights(widths: Sequence[int]) -> int:
    return sum(a * b for a, b in zip(widths[:-1], widths[1:]))


# --- 1. compute ----------------------------------------------------------------------------------
class _Batches:
    """A few batches of the runs' data (or random ones), handed out in turn."""

    def __init__(self, p: Probe, widths: Sequence[int], count: int = 8) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        if p.data is None:
            self.xs = [torch.randn(p.batch, widths[0], generator=g) for _ in range(count)]
            self.ys = [torch.randint(0, widths[-1], (p.batch,), generator=g) for _ in range(count)]
        else:
            x, y = p.data.x_train, p.data.y_train
            idx = [torch.randint(0, len(y), (p.batch,), generator=g) for _ in range(count)]
            self.xs = [x[i].reshape(p.batch, -1).contiguous() for i in idx]
            self.ys = [y[i] for i in idx]
        self.i = 0

    def next(self) -> tuple[Any, Any]:
        self.i = (self.i + 1) % len(self.xs)
        return self.xs[self.i], self.ys[self.i]


def _train_step(model: Any, opt: Any, loss_fn: Any, batches: _Batches) -> None:
    """One SGD step on the next batch, its loss read back (the step is done)."""
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    float(loss.detach())


def _synced(comm: Any, k: int, *step: Any) -> None:
    for _ in range(k):
        _train_step(*step)
    comm.barrier()


def _mlp(widths: Sequence[int], norm: str) -> Any:
    from thinwire.models import build_mlp

    return build_mlp(widths[0], widths[1:-1], widths[-1], norm=norm)


def _probe_compute(comm: Any, p: Probe, loss_fn: Any) -> Rows:
    """Step 1: each model's free-running steps, and its steps synchronised every S."""
    import torch

    out: Rows = {}
    for index, widths in enumerate(p.models):
        model = _mlp(widths, p.norm)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        batches = _Batches(p, widths)
        comm.barrier()
        ts = _timed(_train_step, 3 * p.reps, model, opt, loss_fn, batches, warm=2)
        out.setdefault("compute", []).append((6.0 * _weights(widths) * p.batch, 0.0, ts))
        for _, k in (sk for sk in p.syncs if sk[0] == index):
            rounds = max(3, 3 * p.reps // k)
            ts = _timed(_synced, rounds, comm, k, model, opt, loss_fn, batches)
            out.setdefault("sync", []).append((index, k, [t / k for t in ts]))
    return out


def _probe_ddp(comm: Any, p: Probe, loss_fn: Any) -> Rows:
    """Step 1, DDP: the full model's step under DDP as ``dp`` builds it, with thinwire's
    all-reduce hook, and the same step followed by one blocking all-reduce per DDP bucket,
    alternately."""
    import torch

    from thinwire.strategies.data_parallel import allreduce_hook, quiet_ddp

    plain = _mlp(p.models[0], p.norm)
    ddp = quiet_ddp(_mlp(p.models[0], p.norm), torch.device("cpu"))
    ddp.register_comm_hook(None, allreduce_hook(comm))
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (plain, ddp)]
    batches = _Batches(p, p.models[0])
    buckets = [torch.zeros(b) for b in p.ddp]

    def reduce_after() -> None:
        _train_step(plain, opts[0], loss_fn, batches)
        for b in buckets:
            comm.all_reduce(b)

    t_ddp: list[float] = []
    t_plain: list[float] = []
    _timed(_train_step, 0, ddp, opts[1], loss_fn, batches, warm=2)  # DDP rebuilds its buckets
    for _ in range(5):  # alternate: the difference of two noisy means
        comm.barrier()
        t_ddp += _timed(_train_step, p.reps, ddp, opts[1], loss_fn, batches)
        comm.barrier()
        t_plain += _timed(reduce_after, p.reps)
    del ddp
    return {"ddp": [(len(buckets), 0.0, t_ddp)], "ddp_plain": [(len(buckets), 0.0, t_plain)]}


# --- 2. links ------------------------------------------------------------------------------------
def _fan(comm: Any, out: list[Any], back: list[Any]) -> None:
    """Rank 0 scatters to every other rank, then gathers from them."""
    comm.exchange(out, [])
    comm.exchange([], back)


def _spoke(comm: Any, hub: list[Any]) -> None:
    """The other ranks' side of :func:`_fan`: receive, then send."""
    comm.exchange([], hub)
    comm.exchange(hub, [])


def _probe_p2p(comm: Any, p: Probe) -> Rows:
    """Step 2: rank 0's fan-out and fan-in of each size to / from every other rank."""
    import torch

    n, rank, rows = comm.world_size, comm.rank, []
    for size in p.p2p:
        spokes = [(j, torch.zeros(size // 4)) for j in range(1, n)] if rank == 0 else []
        hub = [] if rank == 0 else [(0, torch.zeros(size // 4))]
        comm.barrier()
        ts = (_timed(_fan, p.reps, comm, spokes, spokes) if rank == 0
              else _timed(_spoke, p.reps, comm, hub))
        rows.append((float(n - 1), float((n - 1) * size), [t / 2 for t in ts]))
    return {"p2p": rows} if rows else {}


def _probe_links(comm: Any, p: Probe) -> Rows:
    """Step 2: all-reduce and all-gather of each size through :class:`Comm`."""
    import torch

    n, out = comm.world_size, _probe_p2p(comm, p)
    for size in p.all_reduce:
        comm.barrier()
        ts = _timed(comm.all_reduce, p.reps, torch.zeros(size // 4))
        out.setdefault("all_reduce", []).append(
            (2.0 * (n - 1), float(round(2 * (n - 1) / n * size)), ts))
    for size in p.all_gather:
        comm.barrier()
        ts = _timed(lambda b: comm.all_gather_async(b).wait(), p.reps, torch.zeros(size // 4))
        out.setdefault("all_gather", []).append((n - 1.0, float((n - 1) * size), ts))
    return out


# --- 3. codecs and local synchronisation work ----------------------------------------------------
def _codec_work(codec: Any, g: Any, n: int) -> None:
    """A codec's local work for one exchange: encode (with feedback), decode n rows, average."""
    from thinwire.compression.base import from_bytes, to_bytes

    wire = to_bytes(codec.encode(g, 0, key=g.numel()))
    spec = codec.spec(g.numel())
    total = codec.decode(from_bytes(wire.clone(), spec), g.numel(), 0)
    for _ in range(n - 1):
        total = total + codec.decode(from_bytes(wire.clone(), spec), g.numel(), 0)
    total.div_(n)


def _probe_codecs(comm: Any, p: Probe) -> Rows:
    """Step 3: each codec's encode + n decodes at each size, in bytes of gradient."""
    import torch

    from thinwire.compression import build

    out: Rows = {}
    for spec, sizes in p.codecs:
        codec = build(spec)
        for numel in sizes:
            comm.barrier()
            ts = _timed(_codec_work, p.reps, codec, torch.randn(numel), comm.world_size)
            out.setdefault(f"codec:{spec}", []).append((4.0 * numel, 0.0, ts))
    return out


def _probe_local(comm: Any, p: Probe) -> Rows:
    """Step 3: each run's Strategy on a silent communicator, every rank as itself."""
    from thinwire.measure.local import step_times, sync_overhead

    out: Rows = {}
    for cfg in p.runs:
        comm.barrier()
        times = step_times(cfg, p.data, comm.rank, periods=3)
        every = cfg.sync_every
        out[f"local:{cfg.run_name}"] = [(float(every), 0.0, [sync_overhead(times, every)])]
    return out


def probe(comm: Any, p: Probe) -> Rows:
    """One calibration process: (x1, x2, timings) per measurement, keyed by kind."""
    import torch

    torch.set_num_threads(p.threads)
    loss_fn = torch.nn.CrossEntropyLoss()
    out = _probe_compute(comm, p, loss_fn)
    comm.barrier()
    if p.ddp:
        out.update(_probe_ddp(comm, p, loss_fn))
    out.update(_probe_links(comm, p))
    out.update(_probe_codecs(comm, p))
    if p.data is not None:
        out.update(_probe_local(comm, p))
    comm.barrier()
    return out


def run_group(fn: Callable[..., Any], workers: int, *args: Any, timeout: float = 300) -> list[Any]:
    """``fn(comm, *args)`` on ``workers`` forked gloo ranks on loopback, each leading its own
    session as the launcher's workers do (see :mod:`thinwire.runtime.spawn`)."""
    return spawn.run_group(fn, workers, *args, timeout=timeout, collective_timeout=120,
                           new_session=True)
