"""What every worker builds from a :class:`~thinwire.config.Config`: the data, the model, its
data shard's batch stream, the method's Strategy and the dp x pp x tp mesh.

Pure functions of the config (and the rank's communicator): every rank builds the same data and
the same model from the run's seed, and the method's registry entry names its Strategy class.
The worker's trainer (:mod:`thinwire.trainer`) and the launcher side's pre-flight
(:func:`thinwire.run.preflight`) both call them; this module imports neither.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from thinwire.config import Config
from thinwire.data import DATASETS, BatchStream, Dataset, DataSource, shard_indices
from thinwire.data.task import Task
from thinwire.errors import UsageError
from thinwire.models import MODELS
from thinwire.runtime.comm import Comm
from thinwire.strategies import METHODS
from thinwire.strategies.base import Context, Strategy

__all__ = ["build_mesh", "build_model", "build_strategy", "load_data", "make_stream",
           "rescalable", "shard_of"]


def load_data(cfg: Config) -> Dataset:
    """The run's dataset (the same on every rank)."""
    d = cfg.data
    source = DataSource(dir=d.dir, download=d.download, limit_train=d.limit_train,
                        limit_test=d.limit_test)
    return DATASETS.get(d.name).load(source, d.options, cfg.train.seed)


def build_model(cfg: Config, dataset: Dataset) -> nn.Module:
    """The full model from the run's seed (identical on every rank)."""
    return MODELS.get(cfg.model.name).build(cfg.model.options, dataset, cfg.train.seed)


def shard_of(cfg: Config, dataset: Dataset, shard: int, shards: int) -> Any:
    labels = dataset.labels
    if labels is None:
        if cfg.data.shard == "skew":
            raise UsageError(f"data.shard: {cfg.data.name} examples have no class to skew by; "
                             "use --data.shard iid")
        labels = torch.zeros(len(dataset.x_train), dtype=torch.int64).numpy()
    return shard_indices(labels, shard, shards, mode=cfg.data.shard, skew=cfg.data.skew,
                         seed=cfg.train.seed)


def make_stream(cfg: Config, dataset: Dataset, shard: int, shards: int) -> BatchStream:
    """The mini-batch stream of data shard ``shard`` of ``shards``."""
    return BatchStream(dataset.x_train, dataset.y_train, shard_of(cfg, dataset, shard, shards),
                       cfg.train.batch_size, seed=cfg.train.seed, rank=shard)


def build_strategy(cfg: Config, comm: Comm, device: torch.device, task: Task,
                   model: nn.Module, mesh: Any = None, replica: Any = None) -> Strategy:
    """The configured method's Strategy around ``model`` (over a torchft quorum with a
    ``replica``, whose communicator ``comm`` is)."""
    strategy_cls: type[Strategy] = METHODS.get(cfg.method.name).strategy_class()
    ctx = Context(cfg=cfg, comm=comm, device=device, loss=task.loss, mesh=mesh,
                  replica=replica)
    return strategy_cls(ctx, model)


def rescalable(cfg: Config) -> bool:
    """Whether the run's method resumes a checkpoint written by another worker count
    (its entry is :class:`~thinwire.strategies.entry.Rescalable` and says so of its options;
    never with ZeRO, whose optimizer state or parameters are sharded per rank)."""
    return cfg.memory.zero == 0 and METHODS.get(cfg.method.name).rescales(cfg.method.options)


def build_mesh(cfg: Config, comm: Comm, device: torch.device) -> Any:
    """The dp x pp x tp mesh of the run (None when every rank is a data-parallel replica)."""
    if cfg.parallel.pp * cfg.parallel.tp == 1:
        return None
    from thinwire.runtime.mesh import Mesh

    return Mesh(comm, dp=cfg.dp_degree, pp=cfg.parallel.pp, tp=cfg.parallel.tp,
                device_type=device.type)
