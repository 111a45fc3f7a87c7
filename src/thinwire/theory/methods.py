"""Methods on distributed quadratics: GD, IST with permutation sketches, Rand-k compressed GD.

Shulgin & Richtarik, "Towards a Better Theoretical Understanding of Independent Subnetwork
Training", ICML 2024 (arXiv 2306.16484). One IST step with exact local gradients, iteration k:
  1. draw the Perm-q partition (d = q n): a shared random permutation of the d coordinates cut
     into n blocks S_i of q coordinates, by the recipe of the IST ``Partitioner`` that cuts
     neurons in the torch strategy (``thinwire.strategies.ist.partition``, one layer of width
     d): permutation from ``SeedSequence([seed, k, 0])``, worker i gets entries i q..(i+1) q - 1.
     It is written here in numpy so that the lab needs no torch; a test holds the two equal;
  2. worker i's sketch is C_i = diag(s_i) restricted to S_i, with per-coordinate scales
       plain Perm-q   s_i[j] = n                          (inverted-dropout scaling),
       scaled         s_i[j] = sqrt(n) / sqrt(L_i[j, j])  (the paper's heterogeneous fix),
       precond        s_i[j] = sqrt(n) / sqrt(L_bar[j, j])  (diag(L)^{-1/2}, homogeneous fix);
  3. worker i sketches the model AND its gradient: g_i = C_i (L_i C_i x - b_i);
  4. x <- x - gamma (1/n) sum_i g_i.

Every method here is an affine random map x -> x - gamma (B_k x - c_k); for IST
B_k = (1/n) sum_i C_i L_i C_i and c_k = (1/n) sum_i C_i b_i. Because the blocks are disjoint,
B_k[a, j] = s[a] s[j] L_{w(a)}[a, j] [w(a) = w(j)] / n with w(a) the worker owning coordinate a,
so all K rounds are built at once with numpy and the loop only does d x d products.

Contrast (unbiased): compressed GD with independent Rand-k per worker,
x <- x - gamma (1/n) sum_i (d/k) M_i (L_i x - b_i), M_i a random k-coordinate mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from thinwire.theory.problems import Quadratics

Sketch = Literal["perm", "scaled", "precond"]
SKETCHES: tuple[str, ...] = ("perm", "scaled", "precond")


@dataclass(frozen=True, eq=False)
class Rounds:
    """K rounds of x -> x - gamma (B_k x - c_k): ``B`` is (K, d, d), ``c`` is (K, d)."""

    B: np.ndarray
    c: np.ndarray

    @property
    def K(self) -> int:
        return int(self.B.shape[0])


class Method(Protocol):
    """A method is a name and a generator of its K affine rounds on a problem."""

    @property
    def name(self) -> str: ...

    def rounds(self, problem: Quadratics, K: int, seed: int) -> Rounds: ...


def block_size(d: int, n: int) -> int:
    """q of Perm-q; the sketch needs d = q n."""
    if d % n:
        raise ValueError(f"Perm-q needs d = q n; d={d} is not a multiple of n={n}")
    return d // n


def owners_from_blocks(blocks: Sequence[np.ndarray], d: int) -> np.ndarray:
    """w(a): the worker holding coordinate a (blocks must be disjoint and cover 0..d-1)."""
    owners = np.full(d, -1, dtype=np.int64)
    for i, block in enumerate(blocks):
        owners[np.asarray(block)] = i
    if (owners < 0).any():
        raise ValueError("the blocks do not cover every coordinate")
    return owners


def round_permutation(d: int, seed: int, round_: int) -> np.ndarray:
    """The shared permutation of round ``round_`` (step 1; the Partitioner's, layer 0)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, round_, 0])))
    return rng.permutation(d)


def draw_owners(d: int, n: int, seed: int, K: int, first_round: int = 0) -> np.ndarray:
    """(K, d) owners for rounds first_round..first_round+K-1, the Partitioner's cuts (step 1)."""
    q = block_size(d, n)
    workers = np.repeat(np.arange(n, dtype=np.int64), q)  # position j of the permutation -> j // q
    owners = np.empty((K, d), dtype=np.int64)
    for k in range(K):
        owners[k, round_permutation(d, seed, first_round + k)] = workers
    return owners


def blocks_from_owners(owners: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """The n sorted blocks S_i of one round's owners (the Partitioner's output format)."""
    return tuple(np.flatnonzero(owners == i) for i in range(n))


def sketch_scales(problem: Quadratics, sketch: str) -> np.ndarray:
    """(n, d) table s_i[j] of step 2."""
    n, d = problem.n, problem.d
    if sketch == "perm":
        return np.full((n, d), float(n))
    if sketch == "scaled":
        diag = np.einsum("iaa->ia", problem.L)
        return np.sqrt(n) / np.sqrt(diag)
    if sketch == "precond":
        return np.broadcast_to(np.sqrt(n) / np.sqrt(np.diag(problem.L_bar)), (n, d)).copy()
    raise ValueError(f"unknown sketch {sketch!r}; use one of {', '.join(SKETCHES)}")


def ist_affine(problem: Quadratics, owners: np.ndarray, scales: np.ndarray) -> Rounds:
    """B_k and c_k of steps 2-4 for every row of ``owners`` (K, d), vectorised."""
    n, d = problem.n, problem.d
    ar = np.arange(d)
    L_rows = problem.L[owners[:, :, None], ar[None, :, None], ar[None, None, :]]  # L_{w(a)}[a, j]
    same = owners[:, :, None] == owners[:, None, :]
    s = scales[owners, ar[None, :]]  # s_{w(a)}[a]
    B = L_rows * same * s[:, :, None] * s[:, None, :] / n
    c = s * problem.b[owners, ar[None, :]] / n
    return Rounds(B=B, c=c)


def ist_step_reference(
    problem: Quadratics, x: np.ndarray, blocks: Sequence[np.ndarray], sketch: str, gamma: float
) -> np.ndarray:
    """One IST step written literally, worker by worker (steps 2-4); a check for ``ist_affine``."""
    scales = sketch_scales(problem, sketch)
    total = np.zeros(problem.d)
    for i, block in enumerate(blocks):
        C = np.zeros(problem.d)
        C[block] = scales[i, block]
        total += C * (problem.L[i] @ (C * x) - problem.b[i])
    return x - gamma * total / problem.n


@dataclass(frozen=True)
class GradientDescent:
    """x <- x - gamma (L_bar x - b_bar): the uncompressed reference."""

    name: str = "GD"

    def rounds(self, problem: Quadratics, K: int, seed: int) -> Rounds:
        B = np.broadcast_to(problem.L_bar, (K, problem.d, problem.d))
        return Rounds(B=B, c=np.broadcast_to(problem.b_bar, (K, problem.d)))


@dataclass(frozen=True)
class IST:
    """IST with a Perm-q sketch (q = d / n) and one of the scalings of step 2."""

    sketch: str = "scaled"

    def __post_init__(self) -> None:
        if self.sketch not in SKETCHES:
            raise ValueError(f"unknown sketch {self.sketch!r}; use one of {', '.join(SKETCHES)}")

    @property
    def name(self) -> str:
        return {"perm": "IST plain", "scaled": "IST scaled", "precond": "IST precond"}[self.sketch]

    def affine(self, problem: Quadratics, owners: np.ndarray) -> Rounds:
        return ist_affine(problem, owners, sketch_scales(problem, self.sketch))

    def rounds(self, problem: Quadratics, K: int, seed: int) -> Rounds:
        return self.affine(problem, draw_owners(problem.d, problem.n, seed, K))


def randk_masks(K: int, n: int, d: int, k: int, seed: int) -> np.ndarray:
    """(K, n, d) boolean masks, k coordinates each, independent across workers and rounds."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x52414E44]))
    ranks = rng.random((K, n, d)).argsort(axis=-1).argsort(axis=-1)
    return ranks < k


@dataclass(frozen=True)
class RandKGD:
    """Distributed compressed GD with unbiased Rand-k, k = d / n by default (IST's traffic)."""

    k: int | None = None
    name: str = "Rand-k CGD"

    def rounds(self, problem: Quadratics, K: int, seed: int) -> Rounds:
        n, d = problem.n, problem.d
        k = self.k or max(1, d // n)
        m = randk_masks(K, n, d, k, seed).astype(np.float64) * (d / k)
        B = np.einsum("kia,iaj->kaj", m, problem.L) / n
        c = np.einsum("kia,ia->ka", m, problem.b) / n
        return Rounds(B=B, c=c)


def iterate(rounds: Rounds, x0: np.ndarray, gammas: Sequence[float]) -> np.ndarray:
    """All iterates for every step size at once: (G, K + 1, d)."""
    g = np.asarray(gammas, dtype=np.float64)[:, None]
    xs = np.empty((len(g), rounds.K + 1, x0.shape[-1]))
    x = np.broadcast_to(x0, xs[:, 0].shape).astype(np.float64)
    xs[:, 0] = x
    for k in range(rounds.K):
        x = x - g * (x @ rounds.B[k].T - rounds.c[k])
        xs[:, k + 1] = x
    return xs


def initial_point(d: int, seed: int) -> np.ndarray:
    """x_0 ~ N(0, I), seeded apart from the problem's draws."""
    return np.random.default_rng(np.random.SeedSequence([seed, 0x78302])).standard_normal(d)
