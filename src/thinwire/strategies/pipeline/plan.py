"""What a pipeline run looks like before it runs: the model's chain, the stages it is cut into,
the boundary shapes and the stages' tensor-parallel sums (:class:`PipelinePlan`), probed from the
model on the meta device (:func:`pipeline_layout`). The pipeline method's traffic formula
(:mod:`thinwire.strategies.pipeline.traffic`) and the planner read it; nothing here runs a
collective.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from thinwire.errors import UsageError
from thinwire.strategies.pipeline.schedule import cut
from thinwire.strategies.tp import split_dims, tensor_plan
from thinwire.strategies.traffic import Layout

__all__ = ["TP_USER", "PipelinePlan", "chain_of", "pipeline_layout"]


def chain_of(cfg: Any, model: nn.Module) -> list[nn.Module]:
    """The model's chain from its registry entry, or a one-line error."""
    from thinwire.models import MODELS

    entry = MODELS.get(cfg.model.name)
    if entry.chain is None:
        cut_able = [n for n, e in MODELS.entries() if e.chain is not None]
        raise UsageError(f"model {cfg.model.name} is not a chain of stages; the pipeline cuts "
                         f"{', '.join(cut_able)}")
    return entry.chain(model)


TP_USER = "parallel.tp > 1 in the pipeline"
"""Who asks for a tensor-parallel plan (named in its one-line errors)."""


@dataclass(frozen=True)
class PipelinePlan:
    """What the traffic formula knows of a pipeline run: stages S, replicas dp, the per-replica
    batch, the per-sample shape leaving each stage but the last, each stage's parameter count
    on one rank (without bottlenecks; its tensor slices with tp > 1) and whether gradients are
    clipped; with tensor parallelism the degree ``tp`` and, per stage, the per-sample elements
    of each of its group sums (a region's input in backward, each row layer's output in
    forward)."""

    stages: int
    dp: int
    batch: int
    widths: tuple[tuple[int, ...], ...]
    stage_params: tuple[int, ...]
    clip: bool = False
    tp: int = 1
    tp_sums: tuple[tuple[int, ...], ...] = ()


def pipeline_layout(cfg: Any, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
                    ) -> Layout:
    """The model's :class:`Layout` with the run's :class:`PipelinePlan` (``batch``: one step's
    inputs and targets of the dataset; shapes found on a copy of the model on the meta
    device)."""
    example = batch[0]
    S, tp = cfg.parallel.pp, cfg.parallel.tp
    links = chain_of(cfg, model)
    cuts = cut(len(links), S)
    split: dict[str, int] = {}
    meta = copy.deepcopy(model).to("meta")
    sums: list[list[int]] = [[] for _ in range(S)]
    at = [0]  # the stage being probed
    if tp > 1:
        plan = tensor_plan(cfg, model, TP_USER)
        split = split_dims(model, plan)
        for region in plan.regions:
            module = meta.get_submodule(region.path)
            module.register_forward_pre_hook(
                lambda _m, args: sums[at[0]].append(args[0][0].numel()))
            for name in region.row:
                module.get_submodule(name).register_forward_hook(
                    lambda _m, _a, out: sums[at[0]].append(out[0].numel()))
    probe = chain_of(cfg, meta)
    h = example[:1].to("meta")
    widths: list[tuple[int, ...]] = []
    with torch.no_grad():
        for s, (a, b) in enumerate(cuts):
            at[0] = s
            for link in probe[a:b]:
                h = link(h)
            if s < S - 1:
                widths.append(tuple(h.shape[1:]))
    name_of = {id(p): n for n, p in model.named_parameters()}
    sizes = tuple(sum(p.numel() // (tp if name_of.get(id(p)) in split else 1)
                      for p in nn.Sequential(*links[a:b]).parameters()) for a, b in cuts)
    pp_plan = PipelinePlan(S, cfg.dp_degree, cfg.train.batch_size, tuple(widths), sizes,
                           cfg.train.clip_norm > 0, tp,
                           tuple(tuple(x) for x in sums) if tp > 1 else ())
    return replace(Layout.of_model(model), pipeline=pp_plan)
