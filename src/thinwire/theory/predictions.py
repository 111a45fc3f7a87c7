"""Predictions for IST on quadratics, computed from the problem (Shulgin & Richtarik, ICML 2024).

Every method of ``methods`` is the random affine map x_{k+1} = x_k - gamma (B_k x_k - c_k) with
(B_k, c_k) drawn independently each round. Everything predicted follows from the moments of
(B, c), obtained in one of three ways for IST (``sketch_moments``; GD is deterministic and
Rand-k CGD has closed-form moments, ``randk_moments``):
  1. exactly for Perm-1 (d = n): B is diagonal and every coordinate's owner w(a) is uniform,
     every pair (w(a), w(j)), a != j, uniform over distinct workers, so first and second
     moments are closed-form sums over workers;
  2. exactly by enumerating all d! permutations when d! <= ``exact_limit``;
  3. otherwise by Monte-Carlo over ``samples`` rounds drawn by the IST Partitioner.
From the moments:
  a. limit point: E[x_{k+1}] = E[x_k] - gamma (E[B] E[x_k] - E[c]), so x_inf = E[B]^{-1} E[c]
     for every gamma; the bias floor is ||x_inf - x*||^2_{L_bar} (Theorem 2);
  b. Theorem 1's condition E[B^T L_bar B] <= theta W, W = 1/2 E[L_bar B + B^T L_bar]:
     theta = largest generalised eigenvalue; infinite when W is not positive definite;
  c. the stationary error at step gamma: with A = I - gamma B and m = x_inf, S = E[x x^T]
     solves S = E[A S A^T] + gamma (E[A m c^T] + E[c m^T A^T]) + gamma^2 E[c c^T] (x_k is
     independent of round k's draw); the plateau is
     E||x - x*||^2_{L_bar} = tr(L_bar S) - 2 x*^T L_bar m + ||x*||^2_{L_bar}.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from thinwire.theory.methods import (
    IST,
    GradientDescent,
    Method,
    RandKGD,
    Rounds,
    block_size,
    sketch_scales,
)
from thinwire.theory.problems import Quadratics, two_by_two


@dataclass(frozen=True, eq=False)
class Moments:
    """E[B], E[c], E[B_ab B_cd] (d,d,d,d), E[B_ab c_j] (d,d,d), E[c c^T]; ``how`` says how."""

    EB: np.ndarray
    Ec: np.ndarray
    EBB: np.ndarray
    EBc: np.ndarray
    Ecc: np.ndarray
    how: str


def moments_from_rounds(rounds: Rounds, how: str) -> Moments:
    """Sample averages over equally weighted rounds (exact when the rounds are all outcomes)."""
    K, d = rounds.B.shape[0], rounds.B.shape[1]
    Bf = np.ascontiguousarray(rounds.B).reshape(K, d * d)
    c = np.ascontiguousarray(rounds.c)
    return Moments(
        EB=Bf.mean(axis=0).reshape(d, d),
        Ec=c.mean(axis=0),
        EBB=(Bf.T @ Bf / K).reshape(d, d, d, d),
        EBc=(Bf.T @ c / K).reshape(d, d, d),
        Ecc=c.T @ c / K,
        how=how,
    )


def pairwise(U: np.ndarray, V: np.ndarray) -> np.ndarray:
    """E[U_{w(a)}[a] V_{w(j)}[j]] for a uniform bijection w (step 1); U, V are (n, d), d = n."""
    n = U.shape[0]
    out = np.outer(U.sum(axis=0), V.sum(axis=0)) - U.T @ V
    out = out / (n * (n - 1)) if n > 1 else out
    np.fill_diagonal(out, (U * V).mean(axis=0))
    return out


def perm1_moments(problem: Quadratics, sketch: str) -> Moments:
    """Exact moments of IST with a Perm-1 sketch (step 1): B = diag(beta_{w(a)}[a])."""
    n, d = problem.n, problem.d
    s = sketch_scales(problem, sketch)
    beta = s**2 * np.einsum("iaa->ia", problem.L) / n
    gam = s * problem.b / n
    EBB = np.zeros((d, d, d, d))
    idx = np.arange(d)
    EBB[idx[:, None], idx[:, None], idx[None, :], idx[None, :]] = pairwise(beta, beta)
    EBc = np.zeros((d, d, d))
    EBc[idx, idx, :] = pairwise(beta, gam)
    return Moments(
        EB=np.diag(beta.mean(axis=0)),
        Ec=gam.mean(axis=0),
        EBB=EBB,
        EBc=EBc,
        Ecc=pairwise(gam, gam),
        how="exact (Perm-1 closed form)",
    )


def randk_moments(problem: Quadratics, k: int) -> Moments:
    """Exact moments of Rand-k CGD: B = a sum_i M_i L_i, c = a sum_i M_i b_i, a = d / (k n).

    Masks of different workers are independent (E[m_i[a] m_i'[c]] = (k/d)^2); within a worker
    E[m[a] m[c]] = k/d on the diagonal and k(k-1)/(d(d-1)) off it.
    """
    n, d = problem.n, problem.d
    alpha = d / (k * n)
    P = np.full((d, d), k * (k - 1) / (d * (d - 1)) if d > 1 else 0.0)
    np.fill_diagonal(P, k / d)
    Q = (k / d) ** 2
    L, b = problem.L, problem.b
    S, s = L.sum(axis=0), b.sum(axis=0)
    G = np.einsum("iab,ice->abce", L, L)
    H = np.einsum("iab,ij->abj", L, b)
    F = b.T @ b
    return Moments(
        EB=problem.L_bar.copy(),
        Ec=problem.b_bar.copy(),
        EBB=alpha**2 * (Q * (np.einsum("ab,ce->abce", S, S) - G) + P[:, None, :, None] * G),
        EBc=alpha**2 * (Q * (np.einsum("ab,j->abj", S, s) - H) + P[:, None, :] * H),
        Ecc=alpha**2 * (Q * (np.outer(s, s) - F) + P * F),
        how="exact (independent masks)",
    )


def all_owners(d: int, n: int) -> np.ndarray:
    """Owners for every one of the d! permutations, cut into n blocks of q (step 2)."""
    q = block_size(d, n)
    perms = np.array(list(itertools.permutations(range(d))), dtype=np.int64)
    owners = np.empty_like(perms)
    owners[np.arange(len(perms))[:, None], perms] = np.repeat(np.arange(n), q)[None, :]
    return owners


def sketch_moments(
    problem: Quadratics,
    method: Method,
    *,
    exact_limit: int = 40320,
    samples: int = 20000,
    seed: int = 1,
    owners: np.ndarray | None = None,
) -> Moments:
    """Moments of (B, c) for ``method`` on ``problem`` (steps 1-3 of the module docstring).

    ``owners`` (K, d), when given, are the Monte-Carlo rounds of an IST method (so several
    sketches can share one set of Partitioner draws); otherwise ``samples`` rounds are drawn.
    """
    if isinstance(method, GradientDescent):
        return moments_from_rounds(method.rounds(problem, 1, seed), "exact (deterministic)")
    if isinstance(method, RandKGD):
        return randk_moments(problem, method.k or max(1, problem.d // problem.n))
    if isinstance(method, IST):
        if problem.d == problem.n:
            return perm1_moments(problem, method.sketch)
        if math.factorial(problem.d) <= exact_limit:
            every = all_owners(problem.d, problem.n)
            return moments_from_rounds(
                method.affine(problem, every), f"exact ({len(every)} permutations)"
            )
        if owners is not None:
            return moments_from_rounds(
                method.affine(problem, owners), f"Monte-Carlo ({len(owners)} rounds)"
            )
    return moments_from_rounds(
        method.rounds(problem, samples, seed), f"Monte-Carlo ({samples} rounds)"
    )


def fixed_point(m: Moments) -> np.ndarray:
    """x_inf = E[B]^{-1} E[c], the limit of E[x_k] for any stable gamma (step a)."""
    return np.linalg.solve(m.EB, m.Ec)


def paper_x_inf_scaled_perm1(problem: Quadratics) -> np.ndarray:
    """The paper's closed form for the scaled Perm-1 sketch: n^{-3/2} sum_i diag(L_i)^{-1/2} b_i."""
    diag = np.einsum("iaa->ia", problem.L)
    return problem.n**-1.5 * np.sum(problem.b / np.sqrt(diag), axis=0)


def bias_floor(problem: Quadratics, x_inf: np.ndarray) -> float:
    """||x_inf - x*||^2_{L_bar}: the error IST keeps however small gamma is."""
    return float(problem.error(x_inf))


@dataclass(frozen=True)
class ConditionCheck:
    """Theorem 1's E[B^T L_bar B] <= theta W: the smallest theta, inf when none exists."""

    theta: float
    lambda_min_W: float
    how: str

    @property
    def holds(self) -> bool:
        return math.isfinite(self.theta)


def theorem1(problem: Quadratics, m: Moments, rtol: float = 1e-12) -> ConditionCheck:
    """Smallest theta with E[B^T L_bar B] <= theta W (step b)."""
    L = problem.L_bar
    BLB = np.einsum("badc,bd->ac", m.EBB, L)
    BLB = 0.5 * (BLB + BLB.T)
    W = 0.5 * (L @ m.EB + m.EB.T @ L)
    evals, evecs = np.linalg.eigh(W)
    lam_min = float(evals[0])
    if lam_min <= rtol * max(abs(float(evals[-1])), 1e-300):
        return ConditionCheck(theta=math.inf, lambda_min_W=lam_min, how=m.how)
    W_isqrt = evecs @ np.diag(evals**-0.5) @ evecs.T
    theta = float(np.linalg.eigvalsh(W_isqrt @ BLB @ W_isqrt)[-1])
    return ConditionCheck(theta=theta, lambda_min_W=lam_min, how=m.how)


def stationary_error(problem: Quadratics, m: Moments, gamma: float) -> float:
    """E||x - x*||^2_{L_bar} once the iteration at step gamma is stationary (step c); inf if unstable.

    Stability is rho(T) < 1 for T(S) = E[A S A^T]. T maps positive semidefinite matrices to
    positive semidefinite ones, so rho(T) < 1 exactly when X = T(X) + I has a positive definite
    solution (then X = sum_k T^k(I)); one LU solve answers both that and the plateau, with no
    eigenvalues of the d^2 x d^2 operator.
    """
    d = problem.d
    eye = np.eye(d)
    # E[A_ab A_ce] for A = I - gamma B, then the operator S -> E[A S A^T] on row-major vec(S)
    EAA = (
        np.einsum("ab,ce->abce", eye, eye)
        - gamma * (np.einsum("ab,ce->abce", eye, m.EB) + np.einsum("ab,ce->abce", m.EB, eye))
        + gamma**2 * m.EBB
    )
    T = EAA.transpose(0, 2, 1, 3).reshape(d * d, d * d)
    mean = fixed_point(m)
    EAmc = np.outer(mean, m.Ec) - gamma * np.einsum("abj,b->aj", m.EBc, mean)  # E[A m c^T]
    R = gamma * (EAmc + EAmc.T) + gamma**2 * m.Ecc
    try:
        sol = np.linalg.solve(np.eye(d * d) - T, np.stack([eye.reshape(-1), R.reshape(-1)], 1))
    except np.linalg.LinAlgError:
        return math.inf
    X = sol[:, 0].reshape(d, d)
    if not np.all(np.isfinite(X)) or np.linalg.eigvalsh(0.5 * (X + X.T))[0] <= 0:
        return math.inf  # no positive definite X = T(X) + I: rho(T) >= 1
    S = sol[:, 1].reshape(d, d)
    xs, L = problem.x_star, problem.L_bar
    second, cross, last = float(np.trace(L @ S)), float(2 * xs @ L @ mean), float(xs @ L @ xs)
    value = second - cross + last
    # a second moment of a non-negative quantity: what is left of the cancellation below the
    # rounding of its terms is zero (e.g. an unbiased method on identical workers)
    return 0.0 if value <= 1e-12 * (abs(second) + abs(cross) + abs(last)) else value


def two_by_two_threshold(a: float, b: float) -> float:
    """The off-diagonal c above which the plain sketch breaks Theorem 1's condition: 2ab/(a+b)."""
    return 2 * a * b / (a + b)


def two_by_two_check(a: float, b: float, c: float) -> ConditionCheck:
    """Theorem 1's condition for plain Perm-1 IST on L = [[a, c], [c, b]], two workers."""
    problem = two_by_two(a, b, c)
    return theorem1(problem, sketch_moments(problem, IST("perm")))


def descent_rate(problem: Quadratics, m: Moments, gamma: float) -> float:
    """Per-step factor rho of E||x_k - x*||^2_{L_bar} <= rho^k ||x_0 - x*||^2_{L_bar} (interpolation).

    From Theorem 1's argument: E||x_{k+1}||^2_L = ||x||^2_L - 2 gamma x^T W x + gamma^2 x^T
    E[B^T L B] x <= ||x||^2_L - gamma (2 - gamma theta) x^T W x, and x^T W x >= lambda ||x||^2_L
    with lambda the smallest eigenvalue of W relative to L_bar. Exact for scaled Perm-1 (B = I).
    """
    check = theorem1(problem, m)
    if not check.holds or gamma * check.theta >= 2:
        return math.inf
    L = problem.L_bar
    W = 0.5 * (L @ m.EB + m.EB.T @ L)
    Lc = np.linalg.cholesky(L)
    Li = np.linalg.inv(Lc)
    lam = float(np.linalg.eigvalsh(Li @ W @ Li.T)[0])
    return 1.0 - gamma * (2.0 - gamma * check.theta) * lam
