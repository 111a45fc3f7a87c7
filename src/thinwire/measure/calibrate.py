"""Calibration: measure this machine under a run's own process layout, fit the time model.

Calibration runs ``workers`` local processes at once (forked, one gloo group on loopback, torch
threads = max(1, cores // workers), what ``runtime.threads = 0`` gives a run, each process
leading its own session as the launcher's workers do: :mod:`thinwire.measure.probes`), so every
figure already holds the contention of the runs it predicts: 4 workers on 2 cores get about half a
core each while all compute, and gloo's copies compete for the same cores. Per quantity, the
mean of repeated timings (runs are compared by wall_s / steps, a mean):

1. compute: forward + backward + SGD step of each MLP the runs train (the full model, a
   subnet: :class:`~thinwire.measure.local.RunShape`) at the runs' batch b, on every rank at
   once; t = t0 + F / R with F = 6 b sum_i w_i w_{i+1} by least squares (:func:`fit_compute`):
   R the compute rate the workers see, t0 the fixed per-step cost (Python, autograd, optimizer
   launches). Synchronisation: the same steps with all ranks meeting at a barrier every S steps
   (each run's period); the ratio to free-running steps is what a synchronous method pays to
   meet: the wait for the slowest worker, and the wake-up of processes that blocked on a
   socket while others held the cores (the ``straggler`` factor).
   DDP: the full model's step under DDP with thinwire's all-reduce hook against the same step
   followed by one blocking all-reduce per DDP bucket; the difference per bucket is DDP's own
   cost (reducer copies, autograd hooks, the all-reduce on gloo's thread interleaved with the
   backward pass), charged per collective call (``call_overhead_s``).
2. links, through thinwire's :class:`~thinwire.runtime.comm.Comm` (the runs' code path), at the
   runs' own message sizes: all-reduce of S bytes, t = 2(n-1) alpha + 2(n-1)/n S beta;
   all-gather, t = (n-1) alpha + (n-1) S beta; rank 0's fan-out and fan-in of S to / from every
   other rank, t = (n-1) alpha + (n-1) S beta. alpha and beta per op by least squares on
   relative residuals (every size weighs alike), alpha >= 0 (:func:`fit_alpha_beta`).
3. codecs: each run's codec, encode (with its error feedback) + n decodes, in bytes of gradient
   per second; local synchronisation work: each run's Strategy on a communicator that moves
   nothing (:mod:`thinwire.measure.local`), every rank at once, rank 0's seconds per period
   beyond its steps.
Noise: other tenants move these figures by tens of percent from minute to minute, so the suite
calibrates before the first run and after every run, and predicts each run from the two
calibrations around it interpolated in time to the middle of its steps (:func:`bracket`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import median

import numpy as np

from thinwire.measure.probes import Probe, Rows, run_group
from thinwire.measure.probes import probe as probe_rows

Samples = dict[str, list[tuple[float, float, float]]]
"""Per measurement kind: (x1, x2, mean seconds) rows."""


@dataclass(frozen=True)
class LinkFit:
    """t = hops x alpha + wire bytes / bytes_per_s; ``rms``: relative residual of the fit."""

    alpha_s: float
    bytes_per_s: float
    rms: float = 0.0


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` measured (module docstring); inputs of the run predictor."""

    workers: int
    threads: int
    compute_flops_per_s: float
    step_overhead_s: float
    links: dict[str, LinkFit]
    call_overhead_s: float = 0.0
    """DDP's cost per bucket (collective call) and step beyond the collective itself."""
    codecs: dict[str, float] = field(default_factory=dict)
    """Codec spec -> bytes of gradient per second (encode + n decodes)."""
    sync_overhead_s: dict[str, float] = field(default_factory=dict)
    """Run name -> rank 0's local work per synchronisation period beyond its steps."""
    stragglers: dict[str, float] = field(default_factory=dict)
    """:meth:`key` -> how much longer S steps of that model take on rank 0 when all ranks meet
    at a barrier every S steps, than S free-running steps (>= 1)."""
    spread: float = 0.0
    """Median over the measurements of (interquartile range / median) of their timings."""
    load_average: float = 0.0
    seconds: float = 0.0
    started_at: float = 0.0
    """Epoch seconds when the measurements began (``time.time()``)."""
    models: list[list[int]] = field(default_factory=list)
    """Widths of the models timed for ``compute`` samples, in order."""
    samples: Samples = field(default_factory=dict)
    """(x1, x2, mean seconds) per measurement: (F, 0) compute, (hops, wire bytes) links,
    (bytes, 0) codecs, (S, 0) local synchronisation work."""

    @property
    def midpoint(self) -> float:
        """Epoch seconds halfway through the measurements."""
        return self.started_at + self.seconds / 2

    @staticmethod
    def key(widths: Sequence[int], every: int) -> str:
        """``"<widths>/<S>"``: the straggler factor of a model synchronised every S steps."""
        return "-".join(str(w) for w in widths) + f"/{every}"


# --- fits ----------------------------------------------------------------------------------------
def fit_alpha_beta(hops: Sequence[float], wire: Sequence[float], seconds: Sequence[float]
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


def spread_of(xs: Sequence[float]) -> float:
    """Interquartile range / median."""
    q1, q2, q3 = np.percentile(np.asarray(xs), [25, 50, 75])
    return float((q3 - q1) / q2) if q2 > 0 else 0.0


# --- the fit -------------------------------------------------------------------------------------
def _pooled(ranks: list[Rows]) -> tuple[Samples, list[float]]:
    """Mean seconds per measurement (compute timings pooled over all ranks, the rest rank 0's)
    and each measurement's spread."""
    spreads: list[float] = []
    samples: Samples = {}
    for kind, rows in ranks[0].items():
        for i, (x1, x2, ts) in enumerate(rows):
            pooled = [t for r in ranks for t in r[kind][i][2]] if kind == "compute" else ts
            spreads.append(spread_of(pooled))
            samples.setdefault(kind, []).append((x1, x2, float(np.mean(pooled))))
    return samples, spreads


def calibrate(probe: Probe, workers: int) -> Calibration:
    """Measure (module docstring) with ``workers`` processes; fit the constants."""
    t_start, started_at = time.perf_counter(), time.time()
    load = os.getloadavg()[0]
    samples, spreads = _pooled(run_group(probe_rows, workers, probe))
    return fit(samples, workers, probe.threads, models=probe.models, spread=median(spreads),
               load_average=load, seconds=time.perf_counter() - t_start, started_at=started_at)


def _prefixed(samples: Samples, prefix: str) -> dict[str, float]:
    """``{name: mean seconds}`` of single-row kinds ``prefix + name``."""
    return {k[len(prefix):]: rows[0][2] for k, rows in samples.items() if k.startswith(prefix)}


def _codec_rates(samples: Samples) -> dict[str, float]:
    out = {}
    for kind, rows in samples.items():
        if kind.startswith("codec:"):
            out[kind[len("codec:"):]] = sum(r[0] for r in rows) / sum(r[2] for r in rows)
    return out


def _call_overhead(samples: Samples) -> float:
    if not (samples.get("ddp") and samples.get("ddp_plain")):
        return 0.0
    (buckets, _, t_ddp), (_, _, t_plain) = samples["ddp"][0], samples["ddp_plain"][0]
    return max(0.0, t_ddp - t_plain) / buckets


def fit(samples: Samples, workers: int, threads: int, models: Sequence[Sequence[int]] = (),
        **info: float) -> Calibration:
    """The constants of :class:`Calibration` from (x1, x2, seconds) samples per kind;
    ``models``: the widths of the compute samples, in order (for the straggler factors)."""
    flops, secs = zip(*[(x1, t) for x1, _, t in samples["compute"]])
    rate, t0 = fit_compute(flops, secs)
    links = {kind: fit_alpha_beta(*zip(*samples[kind]))
             for kind in ("all_reduce", "all_gather", "p2p") if samples.get(kind)}
    stragglers = {
        Calibration.key(models[int(i)], int(k)): max(1.0, t / samples["compute"][int(i)][2])
        for i, k, t in samples.get("sync", [])
    }
    return Calibration(
        workers=workers, threads=threads, compute_flops_per_s=rate, step_overhead_s=t0,
        links=links, call_overhead_s=_call_overhead(samples), codecs=_codec_rates(samples),
        sync_overhead_s=_prefixed(samples, "local:"), stragglers=stragglers,
        models=[list(m) for m in models], samples=samples, **info)


def combine(cals: Sequence[Calibration], weights: Sequence[float] | None = None) -> Calibration:
    """One calibration from several of the same probe: every measurement's mean time averaged
    with ``weights`` (default equal), then refit; spreads and loads averaged alike."""
    first = cals[0]
    w = np.asarray(weights if weights is not None else [1.0] * len(cals), dtype=float)
    w = w / w.sum()

    def avg(values: Sequence[float]) -> float:
        return float(np.dot(w, np.asarray(values, dtype=float)))

    samples = {kind: [(x1, x2, avg([c.samples[kind][i][2] for c in cals]))
                      for i, (x1, x2, _) in enumerate(rows)]
               for kind, rows in first.samples.items()}
    return fit(samples, first.workers, first.threads, models=first.models,
               spread=avg([c.spread for c in cals]),
               load_average=avg([c.load_average for c in cals]),
               seconds=sum(c.seconds for c in cals), started_at=first.started_at)


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
