"""Shared steps of the theory-lab experiments (Shulgin & Richtarik, ICML 2024, on quadratics).

For one method on one problem (``simulate``):
  1. compute the moments of its random affine map and Theorem 1's theta (``predictions``);
  2. turn fractions f of the largest step the condition allows into step sizes gamma = f / theta;
  3. run every gamma on the same sketches (IST methods share one set of Partitioner draws) from
     the same x_0, and measure ||x_k - x*||^2_{L_bar};
  4. attach the predictions: limit point and bias floor; the stationary error per gamma is
     computed when first read (a d^2 x d^2 solve per gamma, skipped by experiments that do
     not report it).

Several seeds (``over_seeds``): each seed is its own instance (problem, x_0, sketches) and its
own run; the results are gathered into one, a section per seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from thinwire.theory.methods import IST, Method, Rounds, iterate
from thinwire.theory.predictions import (
    ConditionCheck,
    Moments,
    bias_floor,
    fixed_point,
    sketch_moments,
    stationary_error,
    theorem1,
)
from thinwire.theory.problems import Quadratics
from thinwire.theory.registry import ExperimentResult


@dataclass(frozen=True, eq=False)
class Simulation:
    """Iterates, errors and predictions of one method at several step sizes."""

    problem: Quadratics
    method: str
    gammas: tuple[float, ...]
    xs: np.ndarray  # (G, K + 1, d)
    errors: np.ndarray  # (G, K + 1)
    check: ConditionCheck
    moments: Moments
    x_inf: np.ndarray
    floor: float

    @cached_property
    def stationary(self) -> tuple[float, ...]:
        """Predicted stationary error per step size (step 4, computed on first use)."""
        return tuple(stationary_error(self.problem, self.moments, g) for g in self.gammas)

    def plateau(self, tail: int) -> np.ndarray:
        """Mean error over the last ``tail`` iterations, per step size."""
        return self.errors[:, -tail:].mean(axis=1)


def method_rounds(
    method: Method, problem: Quadratics, K: int, seed: int, owners: np.ndarray | None
) -> Rounds:
    """Rounds of ``method``; IST methods reuse ``owners`` when given (step 3)."""
    if isinstance(method, IST) and owners is not None:
        return method.affine(problem, owners[:K])
    return method.rounds(problem, K, seed)


def simulate(
    problem: Quadratics,
    method: Method,
    fractions: Sequence[float],
    K: int,
    x0: np.ndarray,
    seed: int,
    owners: np.ndarray | None = None,
    mc_owners: np.ndarray | None = None,
) -> Simulation:
    """Steps 1-4 for ``method`` at gamma = f / theta for every f in ``fractions``.

    ``owners`` are the run's IST sketches; ``mc_owners`` the Monte-Carlo draws for the moments
    when they cannot be computed exactly (shared between sketches to save Partitioner calls).
    """
    m = sketch_moments(problem, method, seed=seed + 1, owners=mc_owners)  # step 1
    check = theorem1(problem, m)
    if not check.holds:
        raise ValueError(
            f"Theorem 1's condition fails for {method.name} on {problem.name}: no step size"
        )
    gammas = tuple(float(f) / check.theta for f in fractions)  # step 2
    xs = iterate(method_rounds(method, problem, K, seed, owners), x0, gammas)  # step 3
    x_inf = fixed_point(m)  # step 4
    return Simulation(
        problem=problem,
        method=method.name,
        gammas=gammas,
        xs=xs,
        errors=problem.error(xs),
        check=check,
        moments=m,
        x_inf=x_inf,
        floor=bias_floor(problem, x_inf),
    )


def first_below(errors: np.ndarray, level: float) -> int | None:
    """The first iteration whose error is below ``level`` (None if never)."""
    hits = np.flatnonzero(errors < level)
    return int(hits[0]) if hits.size else None


def over_seeds(
    name: str,
    title: str,
    seeds: Sequence[int],
    run_one: Callable[[int, str], ExperimentResult],
) -> ExperimentResult:
    """Run ``run_one(seed, figure_stem)`` for every seed and gather the results.

    One seed: its result as it is (figure ``<name>.png``). Several: figures ``<name>-seed<s>.png``,
    a section per seed in the table, numbers keyed ``seed=<s>/...``.
    """
    if len(seeds) == 1:
        return run_one(seeds[0], name)
    parts: list[str] = []
    figures: list[Path] = []
    numbers: dict[str, float] = {}
    for seed in seeds:
        result = run_one(seed, f"{name}-seed{seed}")
        parts.append(f"### seed {seed}\n\n{result.summary}\n\n{result.table}")
        figures += result.figures
        numbers.update({f"seed={seed}/{k}": v for k, v in result.numbers.items()})
    return ExperimentResult(
        name,
        f"{title}, seeds {', '.join(str(s) for s in seeds)}",
        "\n\n".join(parts),
        tuple(figures),
        numbers,
        "Each seed draws its own problem, x_0 and sketches; one section per seed.",
    )
