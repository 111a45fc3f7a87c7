"""Crossover by target: which method reaches a loss or accuracy first, per link speed.

On a link of bandwidth W a method's time to a target is its planner step time T_x(W) times the
steps its runs needed to reach that target (:mod:`thinwire.planner.convergence`):

1. the methods compared are those the convergence table has: the baseline (plain data
   parallelism) as the planner's own data parallelism, every other spec as
   ``StrategySpec.method``, priced from its registry entry's traffic formula like any method
   (:mod:`thinwire.planner.methods`; no method is named here);
2. ``time(x, W) = step_at(x, W) * steps(x, target)``; a method without steps for the target
   (none of its runs reached it) *does not reach* and is never the winner; one the planner
   cannot price on this model is left out with its reason;
3. the winner at W is the method of least time (:func:`winner`);
4. the links where the winner changes are found on a log grid of 61 points from 800 kb/s to
   8 Tb/s and refined by bisection on log W (:func:`winner_ranges`): the prose names the winner
   of each range.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from thinwire.errors import UsageError
from thinwire.planner.convergence import Convergence
from thinwire.planner.insight import BASELINE, step_at
from thinwire.planner.specs import ClusterSpec, ModelSpec
from thinwire.planner.strategy import StrategySpec

LO, HI = 1e5, 1e12


@dataclass(frozen=True)
class Priced:
    """The methods of a convergence table as the planner prices them."""

    variants: dict[str, StrategySpec]  # table spec -> strategy (the baseline: BASELINE's strategy)
    labels: dict[str, str]
    unpriced: dict[str, str]  # table spec -> why the planner cannot price it here


def priced(model: ModelSpec, cluster: ClusterSpec, base: StrategySpec, conv: Convergence
           ) -> Priced:
    """Step 1."""
    from thinwire.planner.methods import resolve

    plain = dataclasses.replace(base, method="", zero=0)
    variants: dict[str, StrategySpec] = {}
    labels: dict[str, str] = {}
    unpriced: dict[str, str] = {}
    for m in conv.methods:
        if m.spec == conv.baseline:
            variants[m.spec], labels[m.spec] = dataclasses.replace(base, method=""), BASELINE
            continue
        s = dataclasses.replace(plain, method=m.spec)
        try:
            step_at(model, cluster, s, cluster.inter_bandwidth)
        except UsageError as exc:
            unpriced[m.spec] = str(exc)
            continue
        variants[m.spec], labels[m.spec] = s, resolve(m.spec).label
    return Priced(variants, labels, unpriced)


def times_at(model: ModelSpec, cluster: ClusterSpec, p: Priced, conv: Convergence,
             target: float, bandwidth: float) -> dict[str, float | None]:
    """Step 2: seconds to ``target`` per method at ``bandwidth`` (None: does not reach)."""
    out: dict[str, float | None] = {}
    for spec, s in p.variants.items():
        steps = conv.steps(spec, target)
        out[spec] = None if steps is None else steps * step_at(model, cluster, s, bandwidth)
    return out


def winner(times: dict[str, float | None]) -> str | None:
    """Step 3: the method of least time among those that reach; None if none does."""
    reached = {k: t for k, t in times.items() if t is not None}
    return min(reached, key=lambda k: reached[k]) if reached else None


def winner_ranges(model: ModelSpec, cluster: ClusterSpec, p: Priced, conv: Convergence,
                  target: float, lo: float = LO, hi: float = HI
                  ) -> list[tuple[float, float, str | None]]:
    """Step 4: [(from W, to W, winner)] covering [lo, hi], boundaries refined by bisection."""

    def win(w: float) -> str | None:
        return winner(times_at(model, cluster, p, conv, target, w))

    grid = [lo * (hi / lo) ** (i / 60) for i in range(61)]
    wins = [win(w) for w in grid]
    out: list[tuple[float, float, str | None]] = []
    start = lo
    for i in range(60):
        if wins[i] == wins[i + 1]:
            continue
        a, b = math.log(grid[i]), math.log(grid[i + 1])
        for _ in range(40):
            mid = (a + b) / 2
            a, b = (mid, b) if win(math.exp(mid)) == wins[i] else (a, mid)
        edge = math.exp((a + b) / 2)
        out.append((start, edge, wins[i]))
        start = edge
    out.append((start, hi, wins[-1]))
    return out


def describe_ranges(ranges: Sequence[tuple[float, float, str | None]], labels: dict[str, str],
                    what: str, lo: float = LO, hi: float = HI) -> str:
    """One line: the winner of each link range to the target named by ``what``."""
    from thinwire.planner.render import rate

    parts = []
    for a, b, k in ranges:
        who = labels[k] if k is not None else "no method (none reaches it)"
        if a <= lo and b >= hi:
            where = f"on all links modelled ({rate(lo)} to {rate(hi)})"
        elif a <= lo:
            where = f"below {rate(b)}"
        elif b >= hi:
            where = f"above {rate(a)} (to {rate(hi)})"
        else:
            where = f"from {rate(a)} to {rate(b)}"
        parts.append(f"{who} {where}")
    return f"fastest to {what}: " + "; ".join(parts)
