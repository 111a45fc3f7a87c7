"""A stateless per-rank mini-batch stream: the batch of a step is a pure function of the step.

``batch(step)`` depends only on ``(seed, rank, step)`` and the shard, never on what was read
before, so a run resumed from a checkpoint at step t sees exactly the batches it would have seen
had it never stopped, and no data-loader state needs saving.

Steps for global step t with a shard of S examples and batch size B:
  1. steps_per_epoch = S // B (the last incomplete batch of every epoch is dropped);
  2. epoch, position = divmod(t, steps_per_epoch);
  3. order = Generator(PCG64(SeedSequence([seed, rank, epoch]))).permutation(S);
  4. the batch is shard[order[position * B : (position + 1) * B]].

Each rank draws its own order (the rank is in the seed): unlike the original IST code, where
every rank shuffled identically, workers do not walk their shards in lock-step.
"""

from __future__ import annotations

import numpy as np
import torch


class BatchStream:
    """Mini-batches of ``(x[indices], y[indices])`` for any global step, reshuffled every epoch."""

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        indices: np.ndarray,
        batch_size: int,
        *,
        seed: int,
        rank: int,
    ) -> None:
        indices = np.asarray(indices, dtype=np.int64)
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"x has {x.shape[0]} rows but y has {y.shape[0]}")
        if indices.ndim != 1:
            raise ValueError(f"indices must be 1-D, got shape {indices.shape}")
        if indices.size and (indices.min() < 0 or indices.max() >= x.shape[0]):
            raise ValueError(f"indices must lie in [0, {x.shape[0]})")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(indices) < batch_size:
            raise ValueError(
                f"shard of {len(indices)} examples is smaller than batch_size {batch_size}; "
                f"use batch_size <= {len(indices)}, fewer workers, or more data"
            )
        if seed < 0 or rank < 0:
            raise ValueError(f"seed and rank must be >= 0, got seed={seed}, rank={rank}")
        self._x = x
        self._y = y
        self._indices = indices
        self._batch_size = batch_size
        self._seed = seed
        self._rank = rank
        # a cache only (the order of the last epoch used), not state: results never depend on it
        self._cached_epoch = -1
        self._cached_order = np.empty(0, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        """Full batches per pass over the shard (step 1)."""
        return len(self._indices) // self._batch_size

    @property
    def batch_size(self) -> int:
        """Examples per batch."""
        return self._batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The shard's indices in the order of ``epoch`` (step 3), as dataset indices."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self._cached_epoch:
            seq = np.random.SeedSequence([self._seed, self._rank, epoch])
            perm = np.random.Generator(np.random.PCG64(seq)).permutation(len(self._indices))
            self._cached_order = self._indices[perm]
            self._cached_epoch = epoch
        return self._cached_order

    def batch_indices(self, step: int) -> np.ndarray:
        """Dataset indices of the batch for global step ``step`` (steps 2 and 4)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, pos = divmod(step, self.steps_per_epoch)
        b = self._batch_size
        return self.epoch_order(epoch)[pos * b : (pos + 1) * b].copy()

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The mini-batch ``(x, y)`` for global step ``step``."""
        sel = torch.from_numpy(self.batch_indices(step))
        return self._x[sel], self._y[sel]
