"""A deep learning recommendation model (DLRM) for click-through prediction.

Naumov et al., "Deep Learning Recommendation Model for Personalization and Recommendation
Systems" (2019). For an impression x = (dense features z, categorical ids v_1 .. v_T):
  1. bottom MLP: h = bottom(z), ``dim`` features (ReLU after every layer);
  2. embeddings: e_t = E_t[v_t], one table of ``dim`` columns per categorical feature;
  3. interaction: the dot products of every pair among (h, e_1, .., e_T) (the strict upper
     triangle of their Gram matrix), concatenated with h;
  4. top MLP: one click logit (ReLU between layers, none at the end).

The tables are what grows with the catalogue and the MLPs are small, so DLRM is trained with
hybrid parallelism: tables split over workers (model parallel), MLPs replicated (data
parallel). The model offers its tables as data (:class:`~thinwire.models.tensor_plan
.EmbeddingPlan`: ``ModelEntry.tables``) and its forward accepts the looked-up vectors
(``embeddings=[B, T, dim]``) so the strategy can fetch them from the tables' owners.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from thinwire.errors import UsageError
from thinwire.models.registry import ModelEntry
from thinwire.models.tensor_plan import EmbeddingPlan
from thinwire.options import check, opt

if TYPE_CHECKING:
    from thinwire.data.datasets import Dataset


def _mlp(widths: tuple[int, ...], *, last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if last_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Dense features and categorical ids [B, dense + T] -> click logits [B]."""

    def __init__(self, dense: int, rows: tuple[int, ...], *, dim: int = 16,
                 bottom: tuple[int, ...] = (64,), top: tuple[int, ...] = (64,)) -> None:
        super().__init__()
        self.dense = dense
        self.dim = dim
        self.bottom = _mlp((dense, *bottom, dim), last_relu=True)
        self.tables = nn.ModuleList(nn.Embedding(r, dim) for r in rows)
        for table in self.tables:
            assert isinstance(table, nn.Embedding)
            nn.init.normal_(table.weight, std=1.0 / math.sqrt(dim))
        f = len(rows) + 1
        self.top = _mlp((dim + f * (f - 1) // 2, *top, 1), last_relu=False)
        iu = torch.triu_indices(f, f, offset=1)
        self.register_buffer("pairs", iu, persistent=False)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Step 2 from the model's own tables: ids [B, T] -> [B, T, dim]."""
        return torch.stack([t(ids[:, i]) for i, t in enumerate(self.tables)], dim=1)

    def forward(self, x: torch.Tensor, embeddings: torch.Tensor | None = None) -> torch.Tensor:
        """Steps 1-4; ``embeddings``: step 2's vectors when fetched elsewhere."""
        if embeddings is None:
            embeddings = self.lookup(x[:, self.dense:].long())
        h = self.bottom(x[:, :self.dense])
        feats = torch.cat([h.unsqueeze(1), embeddings], dim=1)  # [B, T + 1, dim]
        gram = feats @ feats.transpose(1, 2)
        pairs: torch.Tensor = self.pairs  # type: ignore[assignment]
        inter = gram[:, pairs[0], pairs[1]]
        return self.top(torch.cat([h, inter], dim=1)).squeeze(-1)


@dataclass(frozen=True)
class Options:
    dim: int = opt(16, "embedding width (and the bottom MLP's output)")
    bottom: tuple[int, ...] = opt((64,), "hidden widths of the bottom MLP")
    top: tuple[int, ...] = opt((64,), "hidden widths of the top MLP")

    def __post_init__(self) -> None:
        check(self.dim >= 1, "model.dim", "must be >= 1")
        check(all(w >= 1 for w in self.bottom + self.top), "model.bottom",
              "widths must be >= 1")


def build_dlrm(options: Options, dataset: Dataset, seed: int) -> DLRM:
    """The DLRM for a ``click`` dataset (its ``extra`` names the dense features and tables)."""
    if dataset.kind != "click":
        raise UsageError(f"model dlrm needs a click log (a 'click' dataset such as clicks), but "
                         f"{dataset.name} is a '{dataset.kind}' dataset; pick --data.name clicks")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DLRM(int(dataset.extra["dense"]), tuple(dataset.extra["rows"]), dim=options.dim,
                    bottom=options.bottom, top=options.top)


def embedding_plan(model: nn.Module) -> EmbeddingPlan:
    """Every table of the DLRM, in feature order, reading the columns after the dense ones."""
    assert isinstance(model, DLRM)
    return EmbeddingPlan(tuple(f"tables.{i}" for i in range(len(model.tables))),
                         id_start=model.dense, dim=model.dim)


MODEL = ModelEntry(
    name="dlrm", summary="DLRM recommendation model: bottom MLP, embedding tables, dot "
    "interactions, top MLP (click logits)", build=build_dlrm, data_kinds=("click",),
    default_data="clicks", options=Options, tables=embedding_plan)
