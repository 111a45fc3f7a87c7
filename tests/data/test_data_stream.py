"""BatchStream: a pure function of (seed, rank, step); epochs are permutations of the shard."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from thinwire.data.stream import BatchStream

N = 103
X = torch.arange(N, dtype=torch.float32).unsqueeze(1).repeat(1, 3)
Y = torch.arange(N) % 7
SHARD = np.arange(5, 100, 2)  # 48 examples


def make(seed: int = 0, rank: int = 0, batch_size: int = 10) -> BatchStream:
    return BatchStream(X, Y, SHARD, batch_size, seed=seed, rank=rank)


def test_same_seed_rank_step_identical() -> None:
    a, b = make(), make()
    for step in (0, 3, 4, 17):
        xa, ya = a.batch(step)
        xb, yb = b.batch(step)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    x, y = a.batch(0)
    assert x.shape == (10, 3) and y.shape == (10,)
    assert torch.equal(y, Y[x[:, 0].long()])  # rows and labels stay paired


def test_ranks_and_seeds_differ() -> None:
    assert not np.array_equal(make(rank=0).batch_indices(0), make(rank=1).batch_indices(0))
    assert not np.array_equal(make(seed=0).batch_indices(0), make(seed=1).batch_indices(0))


def test_each_epoch_covers_shard_once() -> None:
    s = make()
    assert s.steps_per_epoch == 4  # 48 // 10, the last 8 dropped
    for epoch in range(3):
        steps = range(epoch * 4, (epoch + 1) * 4)
        seen = np.concatenate([s.batch_indices(t) for t in steps])
        assert len(seen) == 40 and len(np.unique(seen)) == 40
        assert set(seen) <= set(SHARD.tolist())
        np.testing.assert_array_equal(np.sort(s.epoch_order(epoch)), SHARD)
    assert not np.array_equal(s.epoch_order(0), s.epoch_order(1))  # reshuffled per epoch


def test_exact_multiple_covers_everything() -> None:
    s = make(batch_size=12)
    seen = np.concatenate([s.batch_indices(t) for t in range(s.steps_per_epoch)])
    np.testing.assert_array_equal(np.sort(seen), SHARD)


def test_restart_equals_continuing() -> None:
    run = make(seed=4, rank=2)
    continuous = [run.batch_indices(t) for t in range(20)]
    resumed = make(seed=4, rank=2)  # a fresh stream as after loading a checkpoint at step 9
    for t in range(9, 20):
        np.testing.assert_array_equal(resumed.batch_indices(t), continuous[t])
    # random access order does not matter either
    for t in (15, 2, 15, 9):
        np.testing.assert_array_equal(run.batch_indices(t), continuous[t])


def test_small_shard_error_names_numbers() -> None:
    with pytest.raises(ValueError, match="shard of 48 examples is smaller than batch_size 64"):
        make(batch_size=64)


def test_validation() -> None:
    with pytest.raises(ValueError, match="step must be >= 0"):
        make().batch(-1)
    with pytest.raises(ValueError, match="indices must lie"):
        BatchStream(X, Y, np.array([0, N]), 1, seed=0, rank=0)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        make(batch_size=0)
