"""The model registry's vocabulary: one :class:`ModelEntry` per model, in the model's own module.

``build(options, dataset, seed)`` returns the full model with weights drawn from ``seed``
(identical on every rank); ``options`` is an instance of the entry's options dataclass (the
``[model]`` keys beyond ``name``). ``data_kinds`` lists the dataset kinds the model accepts
(a mismatch is a one-line error before any worker starts); ``default_data`` is the dataset used
when the config names none. ``ist`` builds the model's IST adapter
(:mod:`thinwire.models.adapter`), None when the model has no IST units. ``blocks`` are regular
expressions matching the full names of the model's repeated blocks (what ``--memory.recompute
block`` checkpoints and ``--memory.zero 2|3`` shards as one FSDP2 group each); ``selective`` those
of the parts recomputed under ``--memory.recompute selective`` (empty: the model has none).
``activations(options, dataset, batch, recompute)`` gives the bytes the model's forward pass and
loss keep for backward, from its shapes (the planner's prediction of the measured figure). ``chain`` gives the
model as a chain of modules whose composition, in order, is the model's forward pass (sharing its
parameters): where pipeline stages may be cut; None when the model is not a chain. ``tensor`` gives its
tensor-parallel plan and ``tables`` its embedding tables for model parallelism by table
(:mod:`thinwire.models.tensor_plan`), None when it has none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from thinwire.options import NoOptions

if TYPE_CHECKING:
    from torch import nn

    from thinwire.data.datasets import Dataset
    from thinwire.models.adapter import ISTAdapter
    from thinwire.models.tensor_plan import EmbeddingPlan, TPPlan


@dataclass(frozen=True)
class ModelEntry:
    name: str
    summary: str
    build: Callable[[Any, Dataset, int], nn.Module]
    data_kinds: tuple[str, ...]
    default_data: str
    options: type = NoOptions
    ist: Callable[[nn.Module], ISTAdapter] | None = None
    blocks: tuple[str, ...] = ()
    selective: tuple[str, ...] = ()
    activations: Callable[[Any, Dataset, int, str], int] | None = None
    chain: Callable[[nn.Module], list[nn.Module]] | None = None
    tensor: Callable[[nn.Module], TPPlan] | None = None
    tables: Callable[[nn.Module], EmbeddingPlan] | None = None
