"""Sharding: disjoint, covering, deterministic; skew 1 = home classes only, skew 0 = near iid."""

from __future__ import annotations

import numpy as np
import pytest

from thinwire.data.sharding import all_shards, label_histogram, shard_indices

LABELS = np.repeat(np.arange(10), 200)[np.random.default_rng(0).permutation(2000)]


@pytest.mark.parametrize("world", [1, 3, 4, 7])
def test_iid_disjoint_equal_covering(world: int) -> None:
    shards = [shard_indices(LABELS, r, world, seed=5) for r in range(world)]
    sizes = {len(s) for s in shards}
    assert sizes == {2000 // world}
    union = np.concatenate(shards)
    assert len(np.unique(union)) == len(union)  # disjoint
    assert len(LABELS) - len(union) == 2000 % world < world  # covering up to remainder
    again = shard_indices(LABELS, world - 1, world, seed=5)
    np.testing.assert_array_equal(again, shards[-1])
    if world > 1:
        assert not np.array_equal(shard_indices(LABELS, 0, world, seed=6), shards[0])


@pytest.mark.parametrize("skew", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_skew_disjoint_covering_deterministic(skew: float, world: int) -> None:
    shards = all_shards(LABELS, world, mode="skew", skew=skew, seed=1)
    union = np.concatenate(shards)
    assert len(union) == 2000 and len(np.unique(union)) == 2000
    for r in range(world):
        np.testing.assert_array_equal(
            shard_indices(LABELS, r, world, mode="skew", skew=skew, seed=1), shards[r]
        )


def test_skew_one_gives_only_home_classes() -> None:
    world = 4
    for r in range(world):
        hist = label_histogram(LABELS, shard_indices(LABELS, r, world, mode="skew", skew=1.0), 10)
        home = [c for c in range(10) if c % world == r]
        assert set(np.flatnonzero(hist)) == set(home)
        assert all(hist[c] == 200 for c in home)


def test_skew_zero_near_uniform() -> None:
    for r in range(4):
        hist = label_histogram(LABELS, shard_indices(LABELS, r, 4, mode="skew", skew=0.0), 10)
        assert hist.sum() == 500
        assert hist.min() >= 30 and hist.max() <= 70  # 50 expected; binomial sd ~ 6.7


def test_skew_half_fraction_at_home() -> None:
    hist = label_histogram(LABELS, shard_indices(LABELS, 1, 2, mode="skew", skew=0.5), 10)
    # odd classes: 100 at home + about half of the other 100; even classes: about 50
    assert all(130 <= hist[c] <= 170 for c in range(1, 10, 2))
    assert all(30 <= hist[c] <= 70 for c in range(0, 10, 2))


def test_validation_messages() -> None:
    with pytest.raises(ValueError, match="world must be >= 1"):
        shard_indices(LABELS, 0, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        shard_indices(LABELS, 2, 2)
    with pytest.raises(ValueError, match="skew must be in"):
        shard_indices(LABELS, 0, 2, mode="skew", skew=1.5)
    with pytest.raises(ValueError, match="unknown shard mode"):
        shard_indices(LABELS, 0, 2, mode="dirichlet")
    with pytest.raises(ValueError, match="needs mode='skew'"):
        shard_indices(LABELS, 0, 2, skew=0.5)
    with pytest.raises(ValueError, match="gets no examples"):
        shard_indices(LABELS, 11, 12, mode="skew", skew=1.0)


def test_label_histogram() -> None:
    np.testing.assert_array_equal(
        label_histogram(np.array([0, 2, 2, 1]), np.array([1, 2]), 4), [0, 0, 2, 0]
    )
    with pytest.raises(ValueError):
        label_histogram(np.array([0, 5]), np.array([1]), 3)
