"""Search: enumerate feasible plans and rank them by predicted step time.

The space (Narayanan et al. 2021, Sec. 3 takeaways; Korthikanti et al. 2022):
  t in the divisors of the node size that also divide the heads (TP stays inside a node);
  p in the divisors of N/t that divide the layers; d = N/(t*p), with d dividing the global
  batch B; micro-batch b in {1, 2, 4, 8} dividing B/d, m = B/(d*b);
  v in {1, 2, 3, 4} with (L/p) % v == 0 and m % p == 0 when v > 1;
  recompute none / selective / full; sequence parallel on or off when t > 1;
  ZeRO 0-1 (0-3 without pipelining, as DeepSpeed allows; only 0 when d = 1).
A plan is feasible when ``check_strategy`` accepts it and its memory fits the device. MLPs and
counted models search only the micro-batch size (pure data parallel over all devices).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from thinwire.errors import UsageError
from thinwire.planner.specs import ClusterSpec, ModelSpec, TransformerSpec
from thinwire.planner.step import Prediction, predict
from thinwire.planner.strategy import StrategySpec, check_partition


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    return [k for k in range(1, n + 1) if n % k == 0]


def _dense(n: int, base: StrategySpec, global_batch: int) -> Iterator[StrategySpec]:
    """An MLP or a counted model: pure data parallel over all devices, b in 1..128."""
    for b in (1, 2, 4, 8, 16, 32, 64, 128):
        if global_batch % (b * n) == 0:
            yield dataclasses.replace(base, dp=n, tp=1, pp=1, micro_batch_size=b,
                                      micro_batches=global_batch // (b * n), interleave=1)


def _degrees(model: TransformerSpec, cluster: ClusterSpec, global_batch: int
             ) -> Iterator[tuple[int, int, int]]:
    """(t, p, d): t divides the node and the heads, p the layers, d the batch."""
    n = cluster.devices
    for t in divisors(cluster.devices_per_node):
        for p in divisors(n // t) if not (model.heads % t or n % t) else []:
            d = n // (t * p)
            if model.layers % p == 0 and global_batch % d == 0:
                yield t, p, d


def _savers(t: int, p: int, d: int) -> Iterator[tuple[str, bool, int]]:
    """(recompute, sequence parallel, ZeRO stage): SP only with t > 1; ZeRO 0-3 without a
    pipeline, 0-1 with one, none with a single replica."""
    for rec in ("none", "selective", "full"):
        for sp in (False, True) if t > 1 else (False,):
            for zero in (0,) if d == 1 else (0, 1, 2, 3) if p == 1 else (0, 1):
                yield rec, sp, zero


def _micro(model: TransformerSpec, p: int, d: int, global_batch: int
           ) -> Iterator[tuple[int, int, int]]:
    """(b, m, v): b divides the replica's batch; v divides the stage's layers, m % p == 0."""
    for b in (1, 2, 4, 8):
        if (global_batch // d) % b:
            continue
        m = global_batch // (d * b)
        for v in (1, 2, 3, 4):
            if v == 1 or (p > 1 and (model.layers // p) % v == 0 and m % p == 0):
                yield b, m, v


def candidates(
    model: ModelSpec, cluster: ClusterSpec, base: StrategySpec, global_batch: int
) -> Iterator[StrategySpec]:
    """Every strategy of the search space for ``global_batch`` (memory not yet checked); a
    method cutting the model over the workers keeps t = p = 1."""
    if not isinstance(model, TransformerSpec) or base.partitioned:
        yield from _dense(cluster.devices, base, global_batch)
        return
    for t, p, d in _degrees(model, cluster, global_batch):
        for b, m, v in _micro(model, p, d, global_batch):
            for rec, sp, zero in _savers(t, p, d):
                yield dataclasses.replace(
                    base, dp=d, tp=t, pp=p, micro_batch_size=b, micro_batches=m,
                    interleave=v, recompute=rec, sequence_parallel=sp, zero=zero)


def search(
    model: ModelSpec, cluster: ClusterSpec, base: StrategySpec, global_batch: int
) -> list[Prediction]:
    """Feasible plans sorted by step time (ties: less memory first)."""
    if global_batch < 1:
        raise UsageError(
            "--search needs a global batch: pass --global-batch B (the model preset has none)"
        )
    check_partition(model, base)
    found: list[Prediction] = []
    for s in candidates(model, cluster, base, global_batch):
        try:
            pred = predict(model, cluster, s)
        except UsageError:
            continue
        if pred.memory.fits(cluster):
            found.append(pred)
    found.sort(key=lambda p: (p.step_time, p.memory.total))
    return found


def why(better: Prediction, worse: Prediction) -> str:
    """One line naming the components that make ``better`` faster than ``worse``."""
    a, b = better.breakdown.as_dict(), worse.breakdown.as_dict()
    gaps = sorted(((b[k] - a[k], k) for k in a if k != "total"), reverse=True)
    parts = [f"{k} {-g:+.3g} s" for g, k in gaps if abs(g) > 1e-3 * max(b["total"], 1e-12)][:3]
    lead = 100.0 * (worse.step_time / better.step_time - 1.0)
    return f"{lead:.1f}% faster: " + (", ".join(parts) if parts else "same breakdown")
