"""Tensor-parallel pieces that several methods use: Megatron's operators
(:mod:`~thinwire.strategies.tp.operators`) and the sharding of a model from its tensor plan
(:mod:`~thinwire.strategies.tp.sharding`). No method lives here."""

from thinwire.strategies.tp.operators import RS_KEYS, Exchange, RowParallel, collectives
from thinwire.strategies.tp.sharding import (
    Sharded,
    check_split,
    gather_full,
    shard,
    split_dims,
    tensor_plan,
    within,
)

__all__ = ["RS_KEYS", "Exchange", "RowParallel", "Sharded", "check_split", "collectives",
           "gather_full", "shard", "split_dims", "tensor_plan", "within"]
