"""Tensor-parallel plans: how a model's layers split across a tensor-parallel group, as data.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (2019): a *region* is a sub-module whose input every rank of the group holds whole;
its first linear layers are split by output features (*column-parallel*: each rank holds a slice
of the weight's rows and of the bias) and its last by input features (*row-parallel*: a slice of
the weight's columns; the bias whole). Between them each rank computes on its own slice (its own
attention heads, its own MLP neurons), and only the region's output needs a sum over the group.
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022),
*sequence parallelism*: the modules between regions (LayerNorms, residual adds, dropout) run on a
slice of the sequence instead of on copies of the whole.

A model offers its plan through its registry entry (``ModelEntry.tensor``); the tensor-parallel
method (:mod:`thinwire.strategies.tensor`) reads nothing else about the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Region:
    """One tensor-parallel region: ``path`` of the sub-module, its column-parallel linear layers
    (relative paths, all fed the region's input) and row-parallel ones (producing its output).
    ``unit``: rows of a column layer that stay together (an attention head's ``head_dim``)."""

    path: str
    column: tuple[str, ...]
    row: tuple[str, ...]
    unit: int = 1


@dataclass(frozen=True)
class TPPlan:
    """Every region of a model and, for sequence parallelism, the span that may run on a slice
    of the sequence.

    ``span``: paths of consecutive top-level modules, in forward order, whose input and output
    are [batch, sequence, features] activations (the transformer blocks); sequence parallelism
    cuts the sequence (dim ``seq_dim``) at the first one's input and restores it after the last.
    Parameters in the span outside the regions' split layers (LayerNorms, row-parallel biases)
    then see only their slice of the sequence: their gradients are summed over the group.
    ``width``: features of the activations at region boundaries (d_model); ``seq_len``: the
    longest sequence (the model's context), for checks and traffic formulas.
    """

    regions: tuple[Region, ...]
    span: tuple[str, ...] = ()
    seq_dim: int = 1
    width: int = 0
    seq_len: int = 0


@dataclass(frozen=True)
class EmbeddingPlan:
    """A model's embedding tables, for model parallelism by table (DLRM's hybrid parallelism,
    Naumov et al. 2019): ``tables`` (paths of ``nn.Embedding`` modules, in feature order) read
    the integer ids in input columns ``id_start ..`` (one column per table, in that order) and
    give vectors of ``dim`` features; the model's forward takes the looked-up vectors
    [batch, tables, dim] as keyword ``lookup`` instead of reading the tables itself, so a
    strategy may fetch them from the tables' owners."""

    tables: tuple[str, ...]
    id_start: int
    dim: int
    lookup: str = "embeddings"
