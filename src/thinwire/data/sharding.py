"""Deterministic per-rank sharding of a training set: iid or label-skewed (heterogeneous).

Every rank computes all shards from ``(labels, world, mode, skew, seed)`` with no message and
keeps its own, so the shards are disjoint and together cover the data.

Modes:

- ``"iid"``: a seeded permutation of all N indices cut into ``world`` equal shards of
  ``N // world``; the remainder (< world examples) is dropped so every worker has the same
  number of steps per epoch.
- ``"skew"`` (label skew, the usual heterogeneous-data benchmark of local SGD / federated
  learning): classes are dealt round-robin to workers, class ``c``'s *home* is ``c mod world``.
  For each class, a seeded fraction ``skew`` of its examples (``round(skew * n_c)``) goes to its
  home worker; the rest of all classes is pooled, permuted and spread iid over all workers
  (``np.array_split``: sizes differ by at most one). ``skew = 0`` is iid in distribution (but
  keeps every example), ``skew = 1`` gives each worker only its home classes. Shard sizes differ
  when class sizes differ or ``world`` does not divide the number of classes. No example is
  dropped.

Shards are returned sorted ascending (order within a shard is the
:class:`~thinwire.data.stream.BatchStream`'s job). Randomness: ``Generator(PCG64(SeedSequence(
[seed, tag])))`` with a fixed tag per mode, independent of the stream's ``[seed, rank, epoch]``.
"""

from __future__ import annotations

import numpy as np

SHARD_MODES: tuple[str, ...] = ("iid", "skew")

_IID_TAG = 0x5EED1
_SKEW_TAG = 0x5EED2


def _rng(seed: int, tag: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, tag])))


def _validate(labels: np.ndarray, world: int, mode: str, skew: float, seed: int) -> None:
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if labels.size and (not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0):
        raise ValueError("labels must be non-negative integers (class ids)")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if mode not in SHARD_MODES:
        raise ValueError(f"unknown shard mode {mode!r}; use one of {', '.join(SHARD_MODES)}")
    if not 0.0 <= skew <= 1.0:
        raise ValueError(f"skew must be in [0, 1] (0 = iid, 1 = only home classes), got {skew}")
    if mode == "iid" and skew != 0.0:
        raise ValueError(f"skew={skew} needs mode='skew'; mode='iid' takes skew=0")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")


def all_shards(
    labels: np.ndarray, world: int, *, mode: str = "iid", skew: float = 0.0, seed: int = 0
) -> list[np.ndarray]:
    """The shards of all ``world`` ranks (see the module docstring), each sorted int64 indices."""
    labels = np.asarray(labels)
    _validate(labels, world, mode, skew, seed)
    n = len(labels)
    if mode == "iid":
        per = n // world
        perm = _rng(seed, _IID_TAG).permutation(n)
        return [np.sort(perm[r * per : (r + 1) * per]).astype(np.int64) for r in range(world)]

    rng = _rng(seed, _SKEW_TAG)
    home_parts: list[list[np.ndarray]] = [[] for _ in range(world)]
    pool: list[np.ndarray] = []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(round(skew * len(idx)))
        home_parts[int(c) % world].append(idx[:k])
        pool.append(idx[k:])
    spread = rng.permutation(np.concatenate(pool)) if pool else np.empty(0, dtype=np.int64)
    shards = []
    for r, part in enumerate(np.array_split(spread, world)):
        shards.append(np.sort(np.concatenate([*home_parts[r], part])).astype(np.int64))
    return shards


def shard_indices(
    labels: np.ndarray,
    rank: int,
    world: int,
    *,
    mode: str = "iid",
    skew: float = 0.0,
    seed: int = 0,
) -> np.ndarray:
    """Indices into the training set held by ``rank`` of ``world`` (sorted int64).

    Deterministic in ``(labels, world, mode, skew, seed)``; disjoint across ranks; covering the
    data up to the iid remainder. Raises ValueError for a bad world, rank, mode or skew, and when
    the rank's shard would be empty (e.g. ``skew=1`` with more workers than classes).
    """
    if world >= 1 and not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    shard = all_shards(labels, world, mode=mode, skew=skew, seed=seed)[rank]
    if shard.size == 0:
        raise ValueError(
            f"rank {rank} of {world} gets no examples (N={len(labels)}, mode={mode}, skew={skew}); "
            "use fewer workers, a lower skew, or more data"
        )
    return shard


def label_histogram(labels: np.ndarray, idx: np.ndarray, num_classes: int) -> np.ndarray:
    """Count of each class among ``labels[idx]``: int64 [num_classes], for reports and tests."""
    picked = np.asarray(labels)[np.asarray(idx, dtype=np.int64)]
    if picked.size and (picked.min() < 0 or picked.max() >= num_classes):
        raise ValueError(
            f"labels must lie in [0, {num_classes}), got {picked.min()}..{picked.max()}"
        )
    return np.bincount(picked, minlength=num_classes).astype(np.int64)
