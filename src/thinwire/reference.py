"""The single-process reference: one worker training on the union of all workers' batches.

At step t it concatenates the batches that workers 0..n-1 would draw at step t and takes one
optimizer step on the full model. For a model without batch-statistics layers this is what data
parallelism computes (the mean gradient over n x b examples), so ``dp`` on n workers must match
it up to floating-point summation order: the parity test's ground truth.
"""

from __future__ import annotations

import torch
from torch import nn

from thinwire.config import Config
from thinwire.models import build_mlp
from thinwire.strategies.base import lr_at, make_optimizer, set_lr
from thinwire.trainer import load_data, make_stream


def reference_run(cfg: Config, steps: int | None = None) -> nn.Module:
    ds = load_data(cfg)
    n = cfg.runtime.workers
    streams = [make_stream(cfg, ds, r, n) for r in range(n)]
    model = build_mlp(ds.input_dim, cfg.model.hidden, ds.num_classes, norm=cfg.model.norm,
                      activation=cfg.model.activation, seed=cfg.train.seed)
    opt = make_optimizer(model.parameters(), cfg.train)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(cfg.train.steps if steps is None else steps):
        xs, ys = zip(*(s.batch(step) for s in streams))
        set_lr(opt, lr_at(cfg.train, step))
        opt.zero_grad(set_to_none=True)
        loss_fn(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return model
