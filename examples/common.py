"""Shared by the examples: a process group from torchrun's environment and a regression task.

The task: scikit-learn's bundled diabetes set (442 patients, 10 features, a disease-progression
target), standardised, split 80/20 with a fixed seed; each rank trains on its own disjoint shard
of the training part with the mean squared error. Nothing here is thinwire: it is the user's
side of the examples.
"""

from __future__ import annotations

import argparse
import gc

import numpy as np
import torch
import torch.distributed as dist
from torch import nn


def setup() -> tuple[int, int]:
    """``init_process_group`` from the environment torchrun sets (gloo on CPU)."""
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    return dist.get_rank(), dist.get_world_size()


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.05)
    return p.parse_args()


def diabetes(rank: int, world: int) -> tuple[torch.Tensor, ...]:
    """(x_train shard of this rank, y_train shard, x_test, y_test), standardised."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    cut = int(0.8 * len(y))
    mean, std = x[:cut].mean(0), x[:cut].std(0)
    ymean, ystd = y[:cut].mean(), y[:cut].std()
    x, y = (x - mean) / std, (y - ymean) / ystd
    shard = np.arange(cut)[rank::world]
    as_t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return as_t(x[shard]), as_t(y[shard])[:, None], as_t(x[cut:]), as_t(y[cut:])[:, None]


def net(width: int = 64) -> nn.Module:
    """The user's own model: a plain Sequential (identical on every rank: seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 1))


def batches(x: torch.Tensor, y: torch.Tensor, step: int, size: int = 32
            ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, len(x), (size,), generator=g)
    return x[idx], y[idx]


def report(rank: int, name: str, test_mse: float, sent_bytes: float) -> None:
    """One line per rank 0: the test MSE (1.0 is predicting the mean) and bytes this rank sent."""
    if rank == 0:
        print(f"{name}: final test MSE {test_mse:.4f} (predicting the mean: 1.0), "
              f"sent {sent_bytes:.0f} bytes", flush=True)


def teardown() -> None:
    """Leave the process group cleanly: collect what still holds tensors or hooks, wait for
    every rank, then destroy the group (an exit with gloo's pairs still open can abort)."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()

