"""The single-process reference: one worker training on the union of all workers' batches.

At step t it concatenates the batches that workers 0..n-1 draw at step t and takes one optimizer
step on the full model. For a model without batch-statistics layers this is what data
parallelism computes (the mean gradient over n x b examples), so ``dp`` on n workers must match
it up to floating-point summation order: the parity test's ground truth.

The batches are built here from the shard definition (:func:`thinwire.data.all_shards`) and the
stream's documented rule, not through the trainer's :class:`~thinwire.data.BatchStream`, so a
bug in how the trainer picks a rank's shard or batch cannot hide in the reference:
  1. shard_r = all_shards(labels, n, mode, skew, seed)[r];
  2. per epoch e, order_r = Generator(PCG64(SeedSequence([seed, r, e]))).permutation(|shard_r|);
  3. step t of rank r: epoch, position = divmod(t, |shard_r| // b); the batch is
     shard_r[order_r[position b : (position + 1) b]].
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from thinwire.builders import build_model, load_data
from thinwire.config import Config
from thinwire.data import Dataset, all_shards
from thinwire.data.task import task_for
from thinwire.strategies.base import lr_at, make_optimizer, set_lr


def reference_indices(cfg: Config, ds: Dataset, step: int) -> list[np.ndarray]:
    """Dataset indices of every rank's batch at ``step`` (steps 1-3)."""
    n, b, seed = cfg.runtime.workers, cfg.train.batch_size, cfg.train.seed
    labels = ds.labels if ds.labels is not None else np.zeros(len(ds.x_train), dtype=np.int64)
    shards = all_shards(labels, n, mode=cfg.data.shard, skew=cfg.data.skew, seed=seed)
    out = []
    for r, shard in enumerate(shards):
        epoch, pos = divmod(step, len(shard) // b)
        order = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, r, epoch])))
        perm = order.permutation(len(shard))
        out.append(shard[perm[pos * b:(pos + 1) * b]])
    return out


def reference_run(cfg: Config, steps: int | None = None) -> nn.Module:
    ds = load_data(cfg)
    task = task_for(ds)
    model = build_model(cfg, ds)
    opt = make_optimizer(model.parameters(), cfg.train)
    for step in range(cfg.train.steps if steps is None else steps):
        idx = torch.from_numpy(np.concatenate(reference_indices(cfg, ds, step)))
        set_lr(opt, lr_at(cfg.train, step))
        opt.zero_grad(set_to_none=True)
        task.loss(model(ds.x_train[idx]), ds.y_train[idx]).backward()
        opt.step()
    return model
