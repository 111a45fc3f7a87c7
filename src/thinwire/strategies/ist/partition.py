"""The IST Partitioner: per round, per hidden layer, disjoint groups of neurons.

Yuan et al., "Distributed Learning of Deep Neural Networks using Independent Subnet Training"
(VLDB 2022), Section 3: each round, every hidden layer's neurons are randomly permuted and cut
into n disjoint groups, one per worker. The same object draws the Perm-q sketches of the theory
lab (Shulgin & Richtarik, ICML 2024), so the torch strategy and the quadratic experiments share
one source of truth.

Steps for round r and layer l of width w:
  1. permutation pi = Generator(SeedSequence([seed, r, l])).permutation(w): every rank computes
     the same pi from (seed, round, layer) with no message;
  2. group sizes: floor(w / n) each, plus one extra neuron for (w mod n) groups; which workers get
     the extra neuron rotates with the round (workers (r + j) mod n, j < w mod n), so no worker
     is always the larger one;
  3. worker i receives the slice of pi that belongs to group i, sorted ascending (sorting keeps
     gathers cache-friendly and makes the partition readable; it does not change the sets).

Partitions are pure data: no torch, no communication. ``width < n`` is an error because some
worker would get an empty subnet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def group_sizes(width: int, n: int, round_: int = 0) -> list[int]:
    """Sizes of the n groups of a layer of ``width`` neurons in round ``round_`` (step 2)."""
    if n < 1:
        raise ValueError(f"number of groups must be >= 1, got {n}")
    if width < n:
        raise ValueError(
            f"a layer of width {width} cannot be cut into {n} non-empty subnets; "
            f"use a width >= {n} or fewer workers"
        )
    base, extra = divmod(width, n)
    sizes = [base] * n
    for j in range(extra):
        sizes[(round_ + j) % n] += 1
    return sizes


def permutation(seed: int, round_: int, layer: int, width: int) -> np.ndarray:
    """The shared permutation of step 1 (int64 array of length ``width``)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, round_, layer])))
    return rng.permutation(width).astype(np.int64)


def split(perm: np.ndarray, n: int, round_: int = 0) -> tuple[np.ndarray, ...]:
    """Cut a permutation into n sorted disjoint groups (steps 2 and 3)."""
    sizes = group_sizes(len(perm), n, round_)
    bounds = np.cumsum([0, *sizes])
    return tuple(np.sort(perm[bounds[i] : bounds[i + 1]]) for i in range(n))


@dataclass(frozen=True)
class RoundPartition:
    """One round's partition: ``groups[layer][worker]`` is a sorted int64 array of neurons."""

    round: int
    widths: tuple[int, ...]
    groups: tuple[tuple[np.ndarray, ...], ...]

    @property
    def n(self) -> int:
        return len(self.groups[0]) if self.groups else 0

    def of(self, worker: int) -> tuple[np.ndarray, ...]:
        """The neuron indices of every hidden layer held by ``worker``."""
        return tuple(layer[worker] for layer in self.groups)

    def __str__(self) -> str:
        lines = [f"round {self.round}: {self.n} subnets"]
        for li, layer in enumerate(self.groups):
            sizes = ", ".join(str(len(g)) for g in layer)
            lines.append(f"  layer {li} (width {self.widths[li]}): sizes [{sizes}]")
        return "\n".join(lines)


@dataclass(frozen=True)
class Partitioner:
    """Draws the IST partition of every hidden layer for any round, identically on all ranks."""

    widths: tuple[int, ...]
    n: int
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        for w in self.widths:
            group_sizes(w, self.n)  # validates width >= n

    def __call__(self, round_: int) -> RoundPartition:
        groups = tuple(
            split(permutation(self.seed, round_, li, w), self.n, round_)
            for li, w in enumerate(self.widths)
        )
        return RoundPartition(round=round_, widths=self.widths, groups=groups)


def perm_sketch_blocks(d: int, n: int, seed: int, round_: int) -> Sequence[np.ndarray]:
    """Coordinate blocks of the Perm-q sketch (d = q n) for one iteration of the theory lab."""
    return Partitioner((d,), n, seed)(round_).groups[0]


def deal(size: int, n: int, seed: int, round_: int, index: int) -> tuple[np.ndarray, ...]:
    """Units of a *dealt* group for round ``round_`` (ResIST, Dun et al. UAI 2022).

    1. permutation pi of the ``size`` units from (seed, round, index), as for neurons;
    2. deal pi round-robin: worker j takes pi[i mod size] for every i = j (mod n), i < max(size, n):
       with size >= n every unit goes to exactly one worker; with size < n every worker still
       gets one unit and some units go to several workers (their copies are averaged);
    3. each worker's units sorted ascending."""
    if n < 1 or size < 1:
        raise ValueError(f"cannot deal {size} units to {n} workers")
    perm = permutation(seed, round_, index, size)
    count = max(size, n)
    return tuple(np.sort(np.unique(perm[np.arange(j, count, n) % size])) for j in range(n))


def resolve_overlap(overlap: int, n: int) -> int:
    """The overlap of a run of ``n`` workers: ``overlap``, or for 0 (auto) max(1, n // 2), so
    every subnet holds about half of every cut group (2 workers: disjoint halves, IST as
    published; 4: each unit on 2 workers). Chosen from docs/benchmarks/ist-quality.md ("IST's
    quality", the ablation): at 4 workers it lifts the residual CNN from 5.0 to 1.9 points under
    plain training and the TransformerEncoder model from 9.1 to 1.5 under, for twice the bytes."""
    if overlap < 0:
        raise ValueError(f"overlap must be >= 0 (0: auto), got {overlap}")
    return overlap if overlap else max(1, n // 2)


def overlapped(parts: Sequence[np.ndarray], overlap: int) -> tuple[np.ndarray, ...]:
    """Overlapping subnets from n disjoint groups: worker i holds groups i, i + 1, ...,
    i + overlap - 1 (mod n), sorted, so every unit is held by exactly ``overlap`` workers (1: the
    groups themselves; n: every worker holds everything, local SGD's subnet)."""
    n = len(parts)
    if not 1 <= overlap <= n:
        raise ValueError(f"overlap must be in [1, {n}], got {overlap}")
    if overlap == 1:
        return tuple(parts)
    return tuple(np.sort(np.concatenate([parts[(i + j) % n] for j in range(overlap)]))
                 for i in range(n))


def partition_groups(groups: Sequence[tuple[str, int, str]], n: int, seed: int,
                     round_: int, overlap: int = 1) -> dict[str, tuple[np.ndarray, ...]]:
    """Round ``round_``'s units of every group: ``{name: (units of worker 0, ..., worker n-1)}``.

    ``groups`` lists (name, size, kind); a group's position in the list seeds its permutation
    (so a fully connected net's hidden layers draw exactly :class:`Partitioner`'s groups).
    ``disjoint`` groups are cut by :func:`split` (and, with ``overlap`` > 1, each worker holds
    ``overlap`` consecutive groups: :func:`overlapped`), ``dealt`` ones by :func:`deal`."""
    out: dict[str, tuple[np.ndarray, ...]] = {}
    for index, (name, size, kind) in enumerate(groups):
        if kind == "dealt":
            out[name] = deal(size, n, seed, round_, index)
        else:
            out[name] = overlapped(split(permutation(seed, round_, index, size), n, round_),
                                   overlap)
    return out
