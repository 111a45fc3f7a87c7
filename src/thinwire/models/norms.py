"""Batch-statistics normalisation, recalibrated for export.

IST's original networks (Yuan et al., VLDB 2022) normalise every layer with BatchNorm using the
statistics of the current batch, in training and in evaluation (``track_running_stats=False``):
a subnet holding 1/n of a layer is re-normalised to the full net's scale. Such a model cannot
predict a single sample in ``eval()`` (one sample has no variance). :func:`recalibrate_batchnorm`
fixes the exported model:
  1. every BatchNorm without running statistics gets them (``track_running_stats=True``,
     ``momentum=None``: a cumulative average, zeroed);
  2. the model runs forward in training mode, without gradients, over the given batches, so
     each norm accumulates the mean of the batch means and of the unbiased batch variances;
  3. back in ``eval()`` the norms use those statistics: predictions no longer depend on the
     other samples of a batch.
With ``running=True`` the norms that do keep running statistics are recomputed the same way
(zeroed, a cumulative average over the batches; their ``momentum`` is restored afterwards): the
statistics of a model assembled from parts trained apart, as IST's full model, are not the
full model's (docs/benchmarks/ist-quality.md, "BatchNorm statistics at evaluation": 2.4-2.9
points on a residual CNN).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def uses_batch_statistics(model: nn.Module) -> bool:
    """Whether some BatchNorm of ``model`` normalises with batch statistics in eval mode."""
    return any(isinstance(m, _BN) and not m.track_running_stats for m in model.modules())


@torch.no_grad()
def recalibrate_batchnorm(model: nn.Module, batches: Iterable[torch.Tensor], *,
                          running: bool = False) -> int:
    """Steps 1-3 on ``model`` in place; returns the number of norms recalibrated (0: nothing
    to do, the model is unchanged). ``batches``: inputs (x only), e.g. 20 training batches;
    ``running``: the norms that keep running statistics are recomputed too (module
    docstring)."""
    norms = [m for m in model.modules() if isinstance(m, _BN)
             and (running or not m.track_running_stats)]
    if not norms:
        return 0
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    kept = {m: m.momentum for m in norms if m.track_running_stats}
    for m in norms:  # 1.
        if not m.track_running_stats:
            m.track_running_stats = True
            m.register_buffer("running_mean", torch.zeros(m.num_features, device=device))
            m.register_buffer("running_var", torch.ones(m.num_features, device=device))
            m.register_buffer("num_batches_tracked", torch.tensor(0, device=device))
        m.momentum = None
        m.reset_running_stats()
    was = model.training
    model.train()
    for x in batches:  # 2.
        model(x.to(device))
    model.train(was)
    for m, momentum in kept.items():
        m.momentum = momentum
    model.eval()  # 3.
    return len(norms)
