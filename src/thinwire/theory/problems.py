"""Distributed quadratics: the test bed of Shulgin & Richtarik, ICML 2024 (arXiv 2306.16484).

Worker i of n holds f_i(x) = 1/2 x^T L_i x - b_i^T x on x in R^d; the objective is
f = (1/n) sum_i f_i with Hessian L_bar = (1/n) sum_i L_i, linear term b_bar = (1/n) sum_i b_i
and minimiser x* = L_bar^{-1} b_bar. Errors are measured as ||x - x*||^2_{L_bar}.

Generation (``make_quadratics``), all draws from one seeded ``numpy`` Generator:
  1. draw a shared matrix A_0 and n private matrices E_i (d x d, standard normal);
  2. mix them with the heterogeneity knob h in [0, 1]:
     A_i = sqrt(1 - h) A_0 + sqrt(h) E_i, so h = 0 gives identical workers and h = 1
     independent ones (the paper's heterogeneous case);
  3. L_i = A_i^T A_i / d + ridge * I (symmetric positive definite for ridge > 0);
  4. b_i = sqrt(1 - h_b) b_0 + sqrt(h_b) e_i with its own knob h_b, or b_i = 0 for the
     interpolation regime (every f_i is minimised at x* = 0).

The "standard instance" of the reproduction: n = d = 10, h = h_b = 1, ridge 0.1, seed 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True, eq=False)
class Quadratics:
    """n quadratics f_i(x) = 1/2 x^T L_i x - b_i^T x; ``L`` is (n, d, d), ``b`` is (n, d)."""

    L: np.ndarray
    b: np.ndarray
    name: str = "quadratics"

    def __post_init__(self) -> None:
        L = np.asarray(self.L, dtype=np.float64)
        b = np.asarray(self.b, dtype=np.float64)
        if L.ndim != 3 or L.shape[1] != L.shape[2] or b.shape != L.shape[:2]:
            raise ValueError(
                f"need L of shape (n, d, d) and b of shape (n, d); got {L.shape}, {b.shape}"
            )
        if not np.allclose(L, np.swapaxes(L, 1, 2)):
            raise ValueError("every L_i must be symmetric")
        object.__setattr__(self, "L", L)
        object.__setattr__(self, "b", b)

    @property
    def n(self) -> int:
        return int(self.L.shape[0])

    @property
    def d(self) -> int:
        return int(self.L.shape[1])

    @cached_property
    def L_bar(self) -> np.ndarray:
        return self.L.mean(axis=0)

    @cached_property
    def b_bar(self) -> np.ndarray:
        return self.b.mean(axis=0)

    @cached_property
    def x_star(self) -> np.ndarray:
        """The minimiser L_bar^{-1} b_bar."""
        return np.linalg.solve(self.L_bar, self.b_bar)

    @property
    def interpolation(self) -> bool:
        """True when every f_i is minimised at x* (here: all b_i = L_i x*)."""
        xs = self.x_star
        residual = np.einsum("iab,b->ia", self.L, xs) - self.b
        return bool(np.allclose(residual, 0.0, atol=1e-12 * (1 + np.abs(self.b).max())))

    def grad(self, i: int, x: np.ndarray) -> np.ndarray:
        """grad f_i(x) = L_i x - b_i."""
        return self.L[i] @ x - self.b[i]

    def error(self, x: np.ndarray, ref: np.ndarray | None = None) -> np.ndarray:
        """||x - ref||^2_{L_bar} over the last axis (ref defaults to x*)."""
        diff = np.asarray(x) - (self.x_star if ref is None else ref)
        return np.einsum("...a,ab,...b->...", diff, self.L_bar, diff)

    def heterogeneity(self) -> float:
        """Gradient dissimilarity at the optimum: (1/n) sum_i ||grad f_i(x*)||^2_{L_bar^{-1}}.

        Zero for identical workers and in the interpolation regime; a stand-in for the
        paper's sigma^2 (it vanishes in exactly the same cases).
        """
        g = np.einsum("iab,b->ia", self.L, self.x_star) - self.b
        Linv_g = np.linalg.solve(self.L_bar, g.T).T
        return float(np.mean(np.sum(g * Linv_g, axis=1)))


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {value}")


def make_quadratics(
    d: int,
    n: int,
    *,
    heterogeneity: float = 1.0,
    b_heterogeneity: float | None = None,
    interpolation: bool = False,
    ridge: float = 0.1,
    seed: int = 0,
) -> Quadratics:
    """Seeded random quadratics (steps 1-4 of the module docstring).

    ``heterogeneity`` mixes the L_i (0: identical, 1: independent); ``b_heterogeneity``
    does the same for the b_i and defaults to ``heterogeneity``; ``interpolation`` sets
    every b_i = 0.
    """
    if d < 1 or n < 1:
        raise ValueError(f"need d >= 1 and n >= 1, got d={d}, n={n}")
    if ridge < 0:
        raise ValueError(f"ridge must be >= 0, got {ridge}")
    hb = heterogeneity if b_heterogeneity is None else b_heterogeneity
    _check_unit("heterogeneity", heterogeneity)
    _check_unit("b_heterogeneity", hb)
    rng = np.random.default_rng(seed)
    A0 = rng.standard_normal((d, d))  # step 1
    E = rng.standard_normal((n, d, d))
    b0 = rng.standard_normal(d)
    e = rng.standard_normal((n, d))
    A = np.sqrt(1.0 - heterogeneity) * A0 + np.sqrt(heterogeneity) * E  # step 2
    L = np.einsum("iba,ibc->iac", A, A) / d + ridge * np.eye(d)  # step 3: A_i^T A_i / d
    L = 0.5 * (L + np.swapaxes(L, 1, 2))
    b = np.zeros((n, d)) if interpolation else np.sqrt(1.0 - hb) * b0 + np.sqrt(hb) * e  # step 4
    kind = "interpolation" if interpolation else f"h={heterogeneity:g}, h_b={hb:g}"
    return Quadratics(L=L, b=b, name=f"d={d}, n={n}, {kind}, seed={seed}")


def standard_instance(*, interpolation: bool = False, seed: int = 0) -> Quadratics:
    """n = d = 10, L_i = A_i^T A_i / d + 0.1 I, independent workers, seed 0 by default."""
    return make_quadratics(10, 10, heterogeneity=1.0, interpolation=interpolation, seed=seed)


def homogeneous_instance(*, interpolation: bool = False, seed: int = 0) -> Quadratics:
    """The standard sizes with identical workers: L_i = L and b_i = b for all i."""
    return make_quadratics(10, 10, heterogeneity=0.0, interpolation=interpolation, seed=seed)


def two_by_two(a: float, b: float, c: float, n: int = 2) -> Quadratics:
    """The 2x2 counterexample: n identical workers with L = [[a, c], [c, b]] and b_i = 0."""
    if a <= 0 or b <= 0:
        raise ValueError(f"diagonal entries must be positive, got a={a}, b={b}")
    L = np.array([[a, c], [c, b]], dtype=np.float64)
    return Quadratics(
        L=np.broadcast_to(L, (n, 2, 2)).copy(), b=np.zeros((n, 2)), name=f"2x2 a={a}, b={b}, c={c}"
    )
