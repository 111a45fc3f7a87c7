"""``thinwire plan --calibrate``: measure this machine, then predict thinwire's own runs.

Calibration runs ``workers`` local processes at once (forked, one gloo group on loopback, torch
threads = max(1, cores // workers), what ``runtime.threads = 0`` gives a run, each process
leading its own session as the launcher's workers do, :func:`run_group`), so every figure
already holds the contention of the run it predicts: 4 workers on 2 cores get about half a
core each while all compute, and gloo's copies compete for the same cores. Measuring one process
and scaling by workers / cores would miss the machine's other tenants; measuring under the
run's own process layout gets both. Per quantity, the mean of repeated timings (runs are
compared by wall_s / steps, a mean):

1. compute: forward + backward + SGD step of the run's MLP and of IST's subnet (hidden widths
   h_i / n) at the run's batch b, on every rank at once; t = t0 + F / R with
   F = 6 b sum_i w_i w_{i+1} through both points: R the compute rate the workers see, t0 the
   fixed per-step cost (Python, autograd, optimizer launches).
   Synchronisation: the same steps with all ranks meeting at a barrier every k steps (k = 1
   for dp, H for local SGD, K for IST); the ratio to free-running steps is what a synchronous
   method pays to meet: the wait for the slowest worker, and the wake-up of processes that
   blocked on a socket while others held the cores (the ``straggler`` factor).
   DDP: the dp step under DDP with thinwire's all-reduce hook against the same step followed by
   one blocking all-reduce per bucket; the difference per bucket is DDP's own cost (reducer
   copies, autograd hooks, the all-reduce on gloo's thread interleaved with the backward pass).
2. links, through thinwire's :class:`~thinwire.runtime.comm.Comm` (the runs' code path):
   all-reduce of S bytes, t = 2(n-1) alpha + 2(n-1)/n S beta; all-gather, t = (n-1) alpha +
   (n-1) S beta; rank 0's point-to-point fan-out and fan-in of S to / from every other rank (IST
   central), t = (n-1) alpha + (n-1) S beta. alpha and beta per op by least squares on relative
   residuals (every size weighs alike), alpha >= 0 (:func:`fit_alpha_beta`).
3. codecs: Top-k with error feedback, encode + (n decodes, sum) per DDP bucket, in bytes of
   gradient per second; IST central, rank 0's bookkeeping in a round besides its exchanges
   (partition, gather and scatter of all n subnets, its subnet module and optimizer), rank 0
   alone while the others wait, as in a run.
Noise: other tenants move these figures by tens of percent from minute to minute, so the
command calibrates before the first run and after every run, and predicts each run from the
two calibrations around it interpolated in time to the middle of its steps (:func:`bracket`).
Reported: each timing's spread (interquartile range / median), the load average, and the change
of the compute rate across each run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any

import numpy as np

from thinwire.config import Config
from thinwire.planner.thinwire_runs import (
    ddp_buckets,
    mlp_params,
    predict_thinwire_run,
    subnet_sizes,
)
from thinwire.runtime import spawn


@dataclass(frozen=True)
class LinkFit:
    """t = hops x alpha + wire bytes / bytes_per_s; ``rms``: relative residual of the fit."""

    alpha_s: float
    bytes_per_s: float
    rms: float = 0.0


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` measured (module docstring); inputs of predict_thinwire_run."""

    workers: int
    threads: int
    compute_flops_per_s: float
    step_overhead_s: float
    links: dict[str, LinkFit]
    codec_bytes_per_s: float = 0.0
    ist_round_s: float = 0.0
    """Central IST: rank 0's bookkeeping per round besides the exchanges (:func:`_ist_round`)."""
    spread: float = 0.0
    """Median over the measurements of (interquartile range / median) of their timings."""
    load_average: float = 0.0
    seconds: float = 0.0
    started_at: float = 0.0
    """Epoch seconds when the measurements began (``time.time()``)."""
    ddp_bucket_s: float = 0.0
    """DDP's cost per bucket and step beyond compute and the all-reduce itself: the reducer's
    copies and autograd hooks, and the hook's all-reduce on gloo's thread interleaved with the
    rest of the backward pass inside the process's share of the CPU."""
    models: list[list[int]] = field(default_factory=list)
    """Widths of the models timed for ``compute`` samples, in order."""
    stragglers: dict[str, float] = field(default_factory=dict)
    """``"<widths>/<k>"`` -> how much longer k steps of that model take on rank 0 when all
    ranks meet at a barrier every k steps, than k free-running steps (>= 1)."""
    samples: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    """(x1, x2, mean seconds) per measurement: (F, 0) compute, (hops, wire bytes) links,
    (bytes, 0) codecs."""

    @property
    def midpoint(self) -> float:
        """Epoch seconds halfway through the measurements."""
        return self.started_at + self.seconds / 2


@dataclass(frozen=True)
class Probe:
    """What the calibration processes measure (sizes in bytes, models as full widths)."""

    models: tuple[tuple[int, ...], ...]
    batch: int
    norm: str
    threads: int
    all_reduce: tuple[int, ...]
    all_gather: tuple[int, ...]
    p2p: tuple[int, ...]
    topk: tuple[tuple[int, ...], float] | None = None  # (bucket elements, kept fraction)
    ist_widths: tuple[int, ...] | None = None
    syncs: tuple[tuple[int, int], ...] = ()  # (index into models, k): synchronised every k steps
    ddp: tuple[int, ...] = ()  # DDP's bucket elements of models[0] (from step 1 on)
    reps: int = 5
    data: tuple[Any, Any] | None = field(default=None, repr=False, compare=False)
    """The run's training inputs and labels (forked ranks share them); None: random data."""


def fit_alpha_beta(
    hops: Sequence[float], wire: Sequence[float], seconds: Sequence[float]
) -> LinkFit:
    """Least squares of t = h alpha + w beta on relative residuals, alpha >= 0, beta > 0."""
    h, w, t = (np.asarray(v, dtype=float) for v in (hops, wire, seconds))
    a = np.stack([h / t, w / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if alpha < 0:
        alpha, beta = 0.0, float(np.sum(w / t) / np.sum((w / t) ** 2))
    beta = max(float(beta), 1e-15)
    rms = float(np.sqrt(np.mean(((h * alpha + w * beta) / t - 1) ** 2)))
    return LinkFit(float(alpha), 1.0 / beta, rms)


def fit_compute(flops: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(rate R, overhead t0) of t = t0 + F / R; t0 >= 0 (through the origin otherwise)."""
    f, t = np.asarray(flops, dtype=float), np.asarray(seconds, dtype=float)
    if len(set(f.tolist())) > 1:
        slope, t0 = np.polyfit(f, t, 1)
        if slope > 0 and t0 >= 0:
            return 1.0 / float(slope), float(t0)
    return float(np.sum(f * f) / np.sum(f * t)), 0.0


def _spread(xs: Sequence[float]) -> float:
    q1, q2, q3 = np.percentile(np.asarray(xs), [25, 50, 75])
    return float((q3 - q1) / q2) if q2 > 0 else 0.0


def _timed(fn: Callable[..., object], reps: int, *args: Any, warm: int = 1) -> list[float]:
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


class _Batches:
    """A few batches of the run's data (or random ones), handed out in turn."""

    def __init__(self, p: Probe, widths: Sequence[int], count: int = 8) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        if p.data is None:
            self.xs = [torch.randn(p.batch, widths[0], generator=g) for _ in range(count)]
            self.ys = [torch.randint(0, widths[-1], (p.batch,), generator=g) for _ in range(count)]
        else:
            x, y = p.data
            idx = [torch.randint(0, len(y), (p.batch,), generator=g) for _ in range(count)]
            self.xs = [x[i].reshape(p.batch, -1).contiguous() for i in idx]
            self.ys = [y[i] for i in idx]
        self.i = 0

    def next(self) -> tuple[Any, Any]:
        self.i = (self.i + 1) % len(self.xs)
        return self.xs[self.i], self.ys[self.i]


def _train_step(model: Any, opt: Any, loss_fn: Any, batches: _Batches) -> None:
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


def _ddp_overhead(comm: Any, p: Probe, loss_fn: Any) -> Rows:
    """The full model's step under DDP with thinwire's all-reduce hook, and the same step
    followed by one blocking all-reduce per DDP bucket, alternately."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from thinwire.models import build_mlp
    from thinwire.strategies.data_parallel import allreduce_hook

    widths = p.models[0]
    plain = build_mlp(widths[0], widths[1:-1], widths[-1], norm=p.norm)
    ddp = DistributedDataParallel(build_mlp(widths[0], widths[1:-1], widths[-1], norm=p.norm))
    ddp.register_comm_hook(None, allreduce_hook(comm))
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (plain, ddp)]
    batches = _Batches(p, widths)
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


def _fan(comm: Any, out: list[Any], back: list[Any]) -> None:
    """Rank 0 scatters to every other rank, then gathers from them (IST central's pattern)."""
    comm.exchange(out, [])
    comm.exchange([], back)


def _topk_codec(comp: Any, g: Any, spec: Any, n: int) -> None:
    """The local work of the Top-k hook for one bucket: encode (EF), decode n rows, average."""
    from thinwire.compression.base import from_bytes, to_bytes

    wire = to_bytes(comp.encode(g, 0, key=g.numel()))
    total = comp.decode(from_bytes(wire.clone(), spec), g.numel(), 0)
    for _ in range(n - 1):
        total = total + comp.decode(from_bytes(wire.clone(), spec), g.numel(), 0)
    total.div_(n)


Rows = dict[str, list[tuple[float, float, list[float]]]]


def _probe(comm: Any, p: Probe) -> Rows:
    """One calibration process: (x1, x2, timings) per measurement, keyed by kind."""
    import torch

    from thinwire.compression import build
    from thinwire.models import build_mlp

    torch.set_num_threads(p.threads)
    n, rank = comm.world_size, comm.rank
    out: Rows = {}
    loss_fn = torch.nn.CrossEntropyLoss()
    for widths in p.models:  # 1. compute, all ranks at once
        model = build_mlp(widths[0], widths[1:-1], widths[-1], norm=p.norm)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        batches = _Batches(p, widths)
        comm.barrier()
        ts = _timed(_train_step, 3 * p.reps, model, opt, loss_fn, batches, warm=2)
        out.setdefault("compute", []).append((6.0 * _weights(widths) * p.batch, 0.0, ts))
        for index, k in p.syncs:  # 1b. the same steps, all ranks waiting for all every k
            if p.models[index] == widths:
                rounds = max(3, 3 * p.reps // k)
                ts = _timed(_synced, rounds, comm, k, model, opt, loss_fn, batches)
                out.setdefault("sync", []).append((index, k, [t / k for t in ts]))
    comm.barrier()
    if p.ddp:  # 1c. DDP's reducer: the DP step against step + blocking all-reduces
        out.update(_ddp_overhead(comm, p, loss_fn))
    for size in p.all_reduce:  # 2. links
        comm.barrier()
        ts = _timed(comm.all_reduce, p.reps, torch.zeros(size // 4))
        out.setdefault("all_reduce", []).append((2 * (n - 1), round(2 * (n - 1) / n * size), ts))
    for size in p.all_gather:
        comm.barrier()
        ts = _timed(lambda b: comm.all_gather_async(b).wait(), p.reps, torch.zeros(size // 4))
        out.setdefault("all_gather", []).append((n - 1, (n - 1) * size, ts))
    for size in p.p2p:
        spokes = [(j, torch.zeros(size // 4)) for j in range(1, n)] if rank == 0 else []
        hub = [] if rank == 0 else [(0, torch.zeros(size // 4))]
        comm.barrier()  # rank 0: scatter then gather; the others: receive then send
        ts = (
            _timed(_fan, p.reps, comm, spokes, spokes)
            if rank == 0
            else _timed(lambda h: (comm.exchange([], h), comm.exchange(h, [])), p.reps, hub)
        )
        out.setdefault("p2p", []).append((n - 1, (n - 1) * size, [t / 2 for t in ts]))
    if p.topk is not None:  # 3. codecs
        buckets, keep = p.topk
        comp = build("topk", ratio=keep)
        for numel in buckets:
            comm.barrier()
            ts = _timed(_topk_codec, p.reps, comp, torch.randn(numel), comp.spec(numel), n)
            out.setdefault("codec", []).append((4.0 * numel, 0.0, ts))
    if p.ist_widths is not None:
        comm.barrier()
        if rank == 0:
            out["ist_round"] = [_ist_round(p.ist_widths, p.norm, n, p.reps)]
        comm.barrier()
    return out


def _ist_round(
    widths: Sequence[int], norm: str, n: int, reps: int
) -> tuple[float, float, list[float]]:
    """Rank 0's bookkeeping in one round of central IST, the strategy's own steps without the
    exchanges: partition, extract all n subnets, build its subnet module and optimizer, load
    its piece, take it back, write all n back."""
    import torch

    from thinwire.models import MLP, build_mlp
    from thinwire.strategies.ist import exchange as ex
    from thinwire.strategies.ist.mlp import mlp_specs
    from thinwire.strategies.ist.partition import Partitioner

    model = build_mlp(widths[0], widths[1:-1], widths[-1], norm=norm)
    specs, own = mlp_specs(model), ex.Ownership.central(model.hidden, n)
    store = [[prm.detach().clone()] for prm in model.parameters()]
    partitioner = Partitioner(model.hidden, n)
    rounds = iter(range(10**9))

    def one_round() -> None:
        groups = [partitioner(next(rounds)).of(j) for j in range(n)]
        pieces = [ex.extract(specs, store, own, 0, g) for g in groups]
        sizes = tuple(len(g) for g in groups[0])
        sub = MLP(model.input_dim, sizes, model.num_classes, norm=norm)
        torch.optim.SGD(sub.parameters(), lr=0.01)
        tensors = [[q.data] for q in sub.parameters()]
        ex.load_piece(specs, tensors, own, 0, groups[0], pieces[0])
        pieces[0] = ex.take_piece(specs, tensors, own, 0, groups[0])
        for g, piece in zip(groups, pieces):
            ex.write_back(specs, store, own, 0, g, piece)

    return 1.0, 0.0, _timed(one_round, reps)


def run_group(fn: Callable[..., Any], workers: int, *args: Any, timeout: float = 300) -> list[Any]:
    """``fn(comm, *args)`` on ``workers`` forked gloo ranks on loopback, each leading its own
    session as the launcher's workers do (see :mod:`thinwire.runtime.spawn`)."""
    return spawn.run_group(fn, workers, *args, timeout=timeout, collective_timeout=120,
                           new_session=True)


def probe_for(configs: Sequence[Config], widths: Sequence[int], reps: int = 5) -> Probe:
    """The measurements the runs of ``configs`` (all of one MLP ``widths``) need."""
    cfg = configs[0]
    n, norm = cfg.runtime.workers, cfg.model.norm
    threads = cfg.runtime.threads or max(1, (os.cpu_count() or 1) // n)
    buckets = tuple(ddp_buckets(widths, norm))
    full = 4 * mlp_params(widths, norm)
    models: list[tuple[int, ...]] = [tuple(widths)]
    ist = [c for c in configs if c.method.name == "ist"]
    if ist:
        sub = tuple(max(1, h // n) for h in widths[1:-1])
        models.append((widths[0], *sub, widths[-1]))
    else:
        models.append((widths[0], *(max(1, h // 2) for h in widths[1:-1]), widths[-1]))
    topk = [c for c in configs if c.method.compressor == "topk"]
    keep = topk[0].method.ratio if topk else 0.0
    gathers = tuple(
        sorted({1 << 12, 1 << 16, 1 << 20, *(8 * max(1, round(keep * b)) for b in buckets)})
    )
    subnet = 4 * max(subnet_sizes(widths, norm, n, 0)) if ist else 1 << 20
    syncs = sorted(
        {
            (1, c.method.local_steps)
            if c.method.name == "ist"
            else (0, c.method.period if c.method.name == "localsgd" else 1)
            for c in configs
        }
    )
    return Probe(
        models=tuple(models),
        batch=cfg.train.batch_size,
        norm=norm,
        threads=threads,
        all_reduce=tuple(sorted({1 << 12, 1 << 16, 1 << 20, *(4 * b for b in buckets), full})),
        all_gather=gathers if topk else (),
        p2p=tuple(sorted({1 << 12, 1 << 16, subnet, 2 * subnet})) if ist else (),
        topk=(buckets, keep) if topk else None,
        ist_widths=tuple(widths) if ist and ist[0].method.deployment == "central" else None,
        syncs=tuple(syncs),
        ddp=buckets if any(c.method.name == "dp" for c in configs) else (),
        reps=reps,
    )


Samples = dict[str, list[tuple[float, float, float]]]


def calibrate(probe: Probe, workers: int) -> Calibration:
    """Measure (module docstring) with ``workers`` processes; fit the constants.

    Each measurement keeps the *mean* of its timings (the runs are compared by wall_s / steps,
    a mean); compute timings are pooled over all ranks."""
    t_start, started_at = time.perf_counter(), time.time()
    load = os.getloadavg()[0]
    ranks = run_group(_probe, workers, probe)
    spreads: list[float] = []
    samples: Samples = {}
    for kind, rows in ranks[0].items():
        for i, (x1, x2, ts) in enumerate(rows):
            pooled = [t for r in ranks for t in r[kind][i][2]] if kind == "compute" else ts
            spreads.append(_spread(pooled))
            samples.setdefault(kind, []).append((x1, x2, float(np.mean(pooled))))
    return fit(
        samples,
        workers,
        probe.threads,
        models=probe.models,
        spread=median(spreads),
        load_average=load,
        seconds=time.perf_counter() - t_start,
        started_at=started_at,
    )


def _key(widths: Sequence[int]) -> str:
    return "-".join(str(w) for w in widths)


def fit(
    samples: Samples,
    workers: int,
    threads: int,
    models: Sequence[Sequence[int]] = (),
    **info: float,
) -> Calibration:
    """The constants of :class:`Calibration` from (x1, x2, seconds) samples per kind;
    ``models``: the widths of the compute samples, in order (for the straggler factors)."""
    flops, secs = zip(*[(x1, t) for x1, _, t in samples["compute"]])
    rate, t0 = fit_compute(flops, secs)
    links = {
        kind: fit_alpha_beta(*zip(*samples[kind]))
        for kind in ("all_reduce", "all_gather", "p2p")
        if samples.get(kind)
    }

    def bytes_rate(kind: str) -> float:
        rows = samples.get(kind, [])
        return sum(r[0] for r in rows) / sum(r[2] for r in rows) if rows else 0.0

    ddp = 0.0
    if samples.get("ddp") and samples.get("ddp_plain"):
        (buckets, _, t_ddp), (_, _, t_plain) = samples["ddp"][0], samples["ddp_plain"][0]
        ddp = max(0.0, t_ddp - t_plain) / buckets
    stragglers = {
        f"{_key(models[int(i)])}/{int(k)}": max(1.0, t / samples["compute"][int(i)][2])
        for i, k, t in samples.get("sync", [])
    }
    return Calibration(
        workers=workers,
        threads=threads,
        compute_flops_per_s=rate,
        step_overhead_s=t0,
        links=links,
        codec_bytes_per_s=bytes_rate("codec"),
        ist_round_s=samples.get("ist_round", [(0.0, 0.0, 0.0)])[0][2],
        ddp_bucket_s=ddp,
        samples=samples,
        stragglers=stragglers,
        models=[list(m) for m in models],
        **info,
    )


def combine(cals: Sequence[Calibration], weights: Sequence[float] | None = None) -> Calibration:
    """One calibration from several of the same probe: every measurement's mean time averaged
    with ``weights`` (default equal), then refit; spreads and loads averaged alike."""
    first = cals[0]
    w = np.asarray(weights if weights is not None else [1.0] * len(cals), dtype=float)
    w = w / w.sum()

    def avg(values: Sequence[float]) -> float:
        return float(np.dot(w, np.asarray(values, dtype=float)))

    samples = {
        kind: [
            (x1, x2, avg([c.samples[kind][i][2] for c in cals]))
            for i, (x1, x2, _) in enumerate(rows)
        ]
        for kind, rows in first.samples.items()
    }
    return fit(
        samples,
        first.workers,
        first.threads,
        spread=avg([c.spread for c in cals]),
        load_average=avg([c.load_average for c in cals]),
        seconds=sum(c.seconds for c in cals),
        started_at=first.started_at,
        models=first.models,
    )


def bracket(before: Calibration, after: Calibration, t_mid: float) -> Calibration:
    """The calibrations before and after a run, interpolated linearly in time to ``t_mid``
    (epoch seconds, the middle of the run's training steps): the machine's other tenants come
    and go, and the run's start-up lies between the first calibration and its first step."""
    a, b = before.midpoint, after.midpoint
    w = min(1.0, max(0.0, (t_mid - a) / (b - a))) if b > a else 0.5
    return combine([before, after], [1.0 - w, w])


def preimport() -> None:
    """Import, once in the calling process, what a process's first ``torch.optim`` optimizer
    imports (torch's compiler stack: seconds on a busy machine): the calibration processes
    forked afterwards inherit it. The runs' workers pay it at set-up, outside their clocks."""
    import torch
    import torch._dynamo  # noqa: F401 - the import is the point

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def method_of(cfg: Config) -> str:
    """predict_thinwire_run's method name for a run config."""
    m = cfg.method
    if m.name == "dp":
        if m.compressor not in ("none", "topk"):
            raise ValueError(f"exact bytes are modelled for topk only, not {m.compressor!r}")
        return "dp" if m.compressor == "none" else "compressed"
    if m.name in ("localsgd", "ist"):
        return m.name
    raise ValueError(f"method {m.name!r} is not modelled (dp, localsgd, ist, dp+topk)")


def predict(
    cfg: Config, widths: Sequence[int], cal: Calibration | None = None
) -> dict[str, float | str]:
    """predict_thinwire_run for a run config (exact bytes; times from ``cal`` when given)."""
    from thinwire.strategies.ist.strategy import state_names

    m, t = cfg.method, cfg.train
    states = state_names(t.optimizer, t.momentum) if m.optimizer_state == "reindex" else ()
    n = cfg.runtime.workers
    sync = m.local_steps if m.name == "ist" else m.period if m.name == "localsgd" else 1
    hidden = [max(1, h // n) for h in widths[1:-1]] if m.name == "ist" else widths[1:-1]
    trained = (widths[0], *hidden, widths[-1])
    kw: dict[str, Any] = {}
    if cal is not None:
        kw = {
            "compute_flops_per_s": cal.compute_flops_per_s,
            "step_overhead_s": cal.step_overhead_s,
            "links": {k: (f.alpha_s, f.bytes_per_s) for k, f in cal.links.items()},
            "codec_bytes_per_s": cal.codec_bytes_per_s,
            "round_overhead_s": cal.ist_round_s,
            "bucket_overhead_s": cal.ddp_bucket_s,
            "straggler": cal.stragglers.get(f"{_key(trained)}/{sync}", 1.0),
        }
    return predict_thinwire_run(
        method_of(cfg),
        widths,
        t.batch_size,
        cfg.runtime.workers,
        local_steps=m.local_steps if m.name == "ist" else 1,
        period=m.period if m.name == "localsgd" else None,
        deployment=m.deployment,
        steps=t.steps,
        norm=cfg.model.norm,
        seed=t.seed,
        topk_keep=m.ratio if m.compressor == "topk" else None,
        state_copies=len(states),
        **kw,
    )


def calibration_json(cal: Calibration) -> dict[str, Any]:
    """The calibration as plain data (for calibration.json)."""
    return asdict(cal)


SUITE: tuple[tuple[str, dict[str, str]], ...] = (
    ("dp", {"method.name": "dp"}),
    ("localsgd", {"method.name": "localsgd", "method.period": "10"}),
    ("ist", {"method.name": "ist", "method.local_steps": "10", "method.deployment": "central"}),
    ("dp-topk", {"method.name": "dp", "method.compressor": "topk", "method.ratio": "0.01"}),
)
"""The runs ``--calibrate`` predicts: DP, local SGD (H = 10), IST (K = 10, central), DP + Top-k
(1%, error feedback)."""
DATA = {784: "fashion-mnist", 64: "digits"}


def suite(
    widths: Sequence[int],
    workers: int,
    steps: int,
    batch: int,
    out: str,
    extra: dict[str, str] | None = None,
) -> list[Config]:
    """The run configs of :data:`SUITE` for one MLP (input 784: Fashion-MNIST, 64: digits)."""
    from thinwire import config as config_mod
    from thinwire.errors import UsageError

    if widths[0] not in DATA or widths[-1] != 10:
        raise UsageError(
            f"--calibrate trains mlp-784-...-10 (Fashion-MNIST) or mlp-64-...-10 "
            f"(digits), not mlp-{'-'.join(map(str, widths))}"
        )
    if steps < 10 or steps % 10:
        raise UsageError(f"--steps {steps}: use a multiple of 10 (local SGD's H and IST's K)")
    base = {
        "data.name": DATA[widths[0]],
        "model.hidden": ",".join(map(str, widths[1:-1])),
        "train.batch_size": str(batch),
        "train.steps": str(steps),
        "train.eval_every": "0",
        "train.log_every": "1",
        "runtime.workers": str(workers),
        "run.out": out,
        "run.progress": "false",
        **(extra or {}),
    }
    return [config_mod.load(None, {**base, **over, "run.name": name}) for name, over in SUITE]


def measured(summary: dict[str, Any], run_dir: str) -> dict[str, float]:
    """What a run measured: step time = wall_s / steps (rank 0, training steps only), the
    summary's bytes, and the spread (IQR / median) of its per-step times in metrics.jsonl."""
    import json
    from pathlib import Path

    steps = [
        rec["step_s"]
        for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        if (rec := json.loads(line)).get("kind") == "train"
    ]
    b = summary["bytes"]
    return {
        "step_time_s": summary["wall_s"] / summary["steps"],
        "sent_per_worker_mean": b["sent_per_worker_mean"],
        "sent_per_worker_max": b["sent_per_worker_max"],
        "payload_per_worker_mean": b["payload_per_worker_mean"],
        "spread": _spread(steps) if steps else 0.0,
    }
