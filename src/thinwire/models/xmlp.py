"""The extreme-classification network of SLIDE (``xmlp``): sparse input -> hidden -> wide output.

SLIDE's networks (Chen et al., MLSys 2020) for Amazon-670K and Delicious-200K: the sparse
feature vector x (kind ``extreme``: ids and values) times a [features, hidden] matrix (a
weighted bag of embedding rows, plus a bias, then ReLU: 135,909 -> 128 for Amazon-670K), then a
wide output layer [labels, hidden] (670,091 neurons for Amazon-670K). ``forward`` computes
every output (the dense network, for data parallelism and evaluation); the ``slide`` method
trains ``wide`` through LSH-selected active sets and needs only :meth:`XMLP.features` and
``wide`` (any model exposing both trains with it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from thinwire.models.registry import ModelEntry
from thinwire.options import check, opt

if TYPE_CHECKING:
    from thinwire.data.datasets import Dataset


class XMLP(nn.Module):
    """features -> hidden (ReLU) -> labels, on sparse rows x [B, 2, P] (ids, values)."""

    def __init__(self, features: int, hidden: int, labels: int) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(features, hidden, mode="sum")
        bound = 1 / math.sqrt(hidden)
        nn.init.uniform_(self.embed.weight, -bound, bound)
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.wide = nn.Linear(hidden, labels)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden activations [B, hidden] the wide layer reads."""
        ids, vals = x[:, 0].long(), x[:, 1]
        return F.relu(self.embed(ids, per_sample_weights=vals) + self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wide(self.features(x))


@dataclass(frozen=True)
class Options:
    hidden: int = opt(128, "hidden width (SLIDE: 128)")

    def __post_init__(self) -> None:
        check(1 <= self.hidden <= 65536, "model.hidden", "must be in [1, 65536]")


def build(options: Options, dataset: Dataset, seed: int) -> XMLP:
    torch.manual_seed(seed)
    features = int(dataset.extra.get("features", 0)) or int(dataset.x_train[:, 0].max()) + 1
    return XMLP(features, options.hidden, dataset.num_classes)


MODEL = ModelEntry(
    name="xmlp", summary="SLIDE's extreme-classification network: sparse features -> hidden "
    "(ReLU) -> a wide output layer", build=build, data_kinds=("extreme",),
    default_data="xc-synth", options=Options)
