"""Shared steps of the theory-lab experiments (Shulgin & Richtarik, ICML 2024, on quadratics).

For one method on one problem (``simulate``):
  1. compute the moments of its random affine map and Theorem 1's theta (``predictions``);
  2. turn fractions f of the largest step the condition allows into step sizes gamma = f / theta;
  3. run every gamma on the same sketches (IST methods share one set of Partitioner draws) from
     the same x_0, and measure ||x_k - x*||^2_{L_bar};
  4. attach the predictions: limit point, bias floor, stationary error per gamma.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True, eq=False)
class Simulation:
    """Iterates, errors and predictions of one method at several step sizes."""

    method: str
    gammas: tuple[float, ...]
    xs: np.ndarray  # (G, K + 1, d)
    errors: np.ndarray  # (G, K + 1)
    check: ConditionCheck
    moments: Moments
    x_inf: np.ndarray
    floor: float
    stationary: tuple[float, ...]

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
        method=method.name,
        gammas=gammas,
        xs=xs,
        errors=problem.error(xs),
        check=check,
        moments=m,
        x_inf=x_inf,
        floor=bias_floor(problem, x_inf),
        stationary=tuple(stationary_error(problem, m, g) for g in gammas),
    )


def first_below(errors: np.ndarray, level: float) -> int | None:
    """The first iteration whose error is below ``level`` (None if never)."""
    hits = np.flatnonzero(errors < level)
    return int(hits[0]) if hits.size else None
