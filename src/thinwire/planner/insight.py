"""When does a communication-efficient method beat plain data parallelism, and where is the
data-parallel scaling knee?

Crossover. On a link of bandwidth W, plain DP takes T_dp(W) per step and a method T_x(W); if
the method needs ``penalty`` times as many steps to reach the same loss, it wins when
penalty * T_x(W) < T_dp(W). Both times fall with W; the method saves bytes, DP saves the
method's overhead (codec time, extra steps), so the method wins below a crossover bandwidth
W*, found by bisection on log W. ``break-even penalty`` T_dp / T_x is the most extra steps a
method can afford on a given link. Compressed DP switches compression on only where it pays,
so its W* is where (1 - 1/ratio) S / (W eff) equals the codec time.

Scaling knee (Keuper & Pfreundt 2016, "Distributed training of deep neural networks:
theoretical and practical limits of parallel scalability"; Fernandez et al. 2024, "Hardware
scaling trends and diminishing returns in large-scale distributed training"): with a fixed
global batch (strong scaling) each worker's compute shrinks as 1/n while the all-reduce stays
~2 S/W, so throughput saturates. The knee is the first worker count whose parallel efficiency
(throughput / (n x single-worker throughput)) falls below 50%.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from thinwire.errors import UsageError
from thinwire.planner.specs import ClusterSpec, CountedSpec, MLPSpec, ModelSpec
from thinwire.planner.step import predict
from thinwire.planner.strategy import StrategySpec

LINKS = (12.5e6, 125e6, 1.25e9, 3.125e9, 12.5e9, 25e9, 50e9)  # 100 Mb/s ... 400 Gb/s


def step_at(model: ModelSpec, cluster: ClusterSpec, s: StrategySpec, bandwidth: float) -> float:
    """Predicted step seconds with the inter-node (or, on one node, intra-node) link at ``bandwidth``."""
    if cluster.nodes == 1:
        cluster = dataclasses.replace(cluster, intra_bandwidth=bandwidth)
    return predict(model, cluster, s, inter_bandwidth=bandwidth).step_time


def crossover_bandwidth(
    model: ModelSpec,
    cluster: ClusterSpec,
    dp: StrategySpec,
    other: StrategySpec,
    penalty: float = 1.0,
    lo: float = 1e5,
    hi: float = 1e12,
) -> float:
    """Largest bandwidth (bytes/s) below which ``other`` beats ``dp``: inf if it wins on every
    link up to ``hi``, 0 if it never wins down to ``lo``."""

    def gain(bw: float) -> float:  # < 0: the method wins
        return penalty * step_at(model, cluster, other, bw) - step_at(model, cluster, dp, bw)

    grid = [lo * (hi / lo) ** (i / 60) for i in range(61)]
    signs = [gain(w) < 0 for w in grid]
    if signs[-1]:
        return math.inf
    if not any(signs):
        return 0.0
    i = max(k for k, won in enumerate(signs) if won)
    a, b = math.log(grid[i]), math.log(grid[i + 1])
    for _ in range(50):
        mid = (a + b) / 2
        a, b = (mid, b) if gain(math.exp(mid)) < 0 else (a, mid)
    return math.exp(a)


BASELINE = "data parallel"
"""The key of the planner's own data parallelism among :func:`method_variants`."""


def method_variants(model: ModelSpec, base: StrategySpec, extra: Sequence[str] = ()
                    ) -> dict[str, StrategySpec]:
    """The planner's own data parallelism (:data:`BASELINE`) and, on the same degrees, every
    registered method at its own defaults (those of ``thinwire train``) and the ``extra`` method
    specs; a method that cuts the model into units only where it can (an MLP, tp = pp = 1)."""
    from thinwire.planner.methods import default_methods, partitioned, resolve
    from thinwire.strategies.entry import Shares

    plain = dataclasses.replace(base, method="", zero=0)
    out = {BASELINE: dataclasses.replace(base, method="")}
    for spec in dict.fromkeys([*default_methods(), *extra]):
        if spec not in extra and not resolve(spec).entry.planned:
            continue
        cuts = partitioned(resolve(spec))
        has_plan = isinstance(model, MLPSpec) or (isinstance(model, CountedSpec)
                                                   and model.ist is not None) \
            or isinstance(resolve(spec).entry, Shares)  # its own cut (it checks the model)
        if cuts and (not has_plan or base.tp > 1 or base.pp > 1):
            continue
        out[spec] = dataclasses.replace(plain, method=spec)
    return out


@dataclass(frozen=True)
class ScalingPoint:
    """One (method, workers) point of a scaling curve."""

    method: str
    workers: int
    step_time: float
    samples_per_s: float
    comm: float
    compute: float
    efficiency: float = 1.0
    """Throughput / (workers x throughput of the smallest worker count per worker)."""


def _strategy_at(
    base: StrategySpec, cluster: ClusterSpec, d: int, global_batch: int, weak: bool
) -> tuple[StrategySpec, ClusterSpec] | None:
    """The strategy and cluster of ``d`` data-parallel workers (None: the batch does not split)."""
    per_worker = base.micro_batch_size * base.micro_batches if weak else global_batch / d
    if per_worker < base.micro_batch_size or per_worker % base.micro_batch_size:
        return None
    m = int(per_worker) // base.micro_batch_size
    if base.interleave > 1 and m % base.pp:
        return None
    s = dataclasses.replace(base, dp=d, micro_batches=m)
    devices = s.devices
    g = min(cluster.devices_per_node, devices)
    if devices % g:
        return None
    return s, dataclasses.replace(cluster, devices_per_node=g, nodes=devices // g,
                                 device_count=0)


def _curve(model: ModelSpec, key: str, variant: StrategySpec,
           strategies: list[tuple[StrategySpec, ClusterSpec]]) -> list[ScalingPoint]:
    """One method's points over the worker counts that fit, efficiency against the first."""
    curve: list[ScalingPoint] = []
    for s, c in strategies:
        try:
            sized = dataclasses.replace(variant, dp=s.dp, micro_batches=s.micro_batches)
            p = predict(model, c, sized)
        except UsageError:
            continue
        bd = p.breakdown
        curve.append(ScalingPoint(key, s.dp, p.step_time, p.samples_per_s,
                                  bd.dp_comm + bd.codec, bd.compute))
    if not curve:
        return []
    unit = curve[0].samples_per_s / curve[0].workers
    return [dataclasses.replace(q, efficiency=q.samples_per_s / (q.workers * unit))
            for q in curve]


def scaling(
    model: ModelSpec,
    cluster: ClusterSpec,
    base: StrategySpec,
    workers: list[int],
    global_batch: int,
    weak: bool = False,
    extra: Sequence[str] = (),
) -> list[ScalingPoint]:
    """Step time and throughput against data-parallel workers for each method."""
    if not weak and global_batch < 1:
        raise UsageError("--scaling needs --global-batch (strong scaling keeps it fixed) or --weak")
    strategies = [laid for d in workers if (laid := _strategy_at(base, cluster, d, global_batch, weak))]
    points: list[ScalingPoint] = []
    for key, variant in method_variants(model, base, extra).items():
        points += _curve(model, key, variant, strategies)
    return points


def knee(points: list[ScalingPoint], method: str = BASELINE, threshold: float = 0.5
         ) -> int | None:
    """First worker count of ``method`` whose parallel efficiency is below ``threshold``."""
    for q in sorted((q for q in points if q.method == method), key=lambda q: q.workers):
        if q.efficiency < threshold:
            return q.workers
    return None


def plot_scaling(points: list[ScalingPoint], out_dir: Path, title: str) -> Path:
    """Step time and throughput against workers, the DP knee marked; a PNG (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in dict.fromkeys(q.method for q in points):
        qs = sorted((q for q in points if q.method == method), key=lambda q: q.workers)
        xs = [q.workers for q in qs]
        left.plot(xs, [q.step_time for q in qs], marker="o", label=method)
        right.plot(xs, [q.samples_per_s for q in qs], marker="o", label=method)
    bend = knee(points)
    for ax, ylabel in ((left, "step time (s)"), (right, "throughput (samples/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("data-parallel workers")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if bend is not None:
            ax.axvline(bend, color="grey", linestyle="--", label=f"DP knee ({bend} workers)")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path = out_dir / "scaling.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
