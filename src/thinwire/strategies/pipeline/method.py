"""The ``pipeline`` method: pipeline stages x data-parallel replicas, compressed boundaries;
with ``--parallel.tp`` each stage's blocks tensor-parallel (dp x pp x tp).

The run's workers form the mesh dp x pp x tp (``--parallel.pp S``, ``--parallel.tp T``; dp =
workers / (S T)): the model's chain (its registry entry's ``chain``) is cut into S stages, rank
(d, s, t) trains stage s of replica d, with T > 1 its tensor slice t. With T > 1, at the first
batch (after the pipeline has probed its boundary shapes on the whole chain) the regions of the
model's :class:`~thinwire.models.tensor_plan.TPPlan` inside the stage are sharded in place
over the mesh's tensor communicator by :func:`thinwire.strategies.tp.sharding.shard` (Megatron,
Shoeybi et al. 2019: column- and row-parallel layers, the f and g operators, tag ``tp``); the
stage's links are the same modules, so the schedule runs the sharded blocks unchanged, the T
ranks of a stage running the same schedule on the same micro-batches, each exchanging the
(replicated) boundary tensors with the same-t rank of its neighbour stages. Each step, on every
rank:

  1. :meth:`Pipeline.run` (:mod:`.schedule`): the replica's batch in ``micro_batches``
     micro-batches through the GPipe or 1F1B schedule, activations and their gradients crossing
     each boundary through the boundary's codecs (:mod:`.codecs`), the stage's gradients of the
     batch's mean loss accumulated;
  2. the stage's gradients (its local slices with T > 1) averaged over its data group: one
     all-reduce of the flat gradient (tag ``grad``) through the mesh's data communicator;
  3. with ``train.clip_norm``: the squared gradient norm summed over the pipeline group (one
     all-reduce of 4 bytes, tag ``grad``; with T > 1 the stage's slices are first summed over
     the tensor group, another 4 bytes, and its replicated parameters counted once) and every
     stage scales by the same coefficient, so clipping acts on the whole model's norm as in
     single-process training;
  4. the stage's optimizer steps; the last stage's loss is broadcast over the pipeline group
     (tagged control) so every rank reports the batch's loss.

Steps 1-4 are the template of :mod:`thinwire.strategies.step` (the pass is
:meth:`PipelineStrategy.forward_backward`, the norm :meth:`PipelineStrategy.grad_norm_sq`).

Evaluation gathers every stage's parameters of replica 0 on its last stage (tagged control),
which evaluates the whole model (with the boundaries' bottleneck modules, when there are any);
with T > 1 each stage first all-gathers its slices on its tensor rank 0 (control), whose ranks
then carry the exchange.

The method's traffic formula, equal to the ledger, is :mod:`.traffic`; it reads the run's
:class:`~thinwire.strategies.pipeline.plan.PipelinePlan` (boundary shapes, stage sizes, the
stages' tensor-parallel sums), which :func:`~thinwire.strategies.pipeline.plan.pipeline_layout`
probes from the model and one input (:mod:`.plan`, with the model's chain).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from thinwire.compression.registry import check_codec, codec_names
from thinwire.errors import UsageError
from thinwire.options import OptionError, check, opt
from thinwire.runtime.comm import Comm
from thinwire.runtime.ledger import CONTROL
from thinwire.strategies.base import (
    Batch,
    Context,
    MemoryReport,
    make_optimizer,
    memory_of,
)
from thinwire.strategies.entry import HasRunLayout, MethodEntry, Staged
from thinwire.strategies.grads import flatten, grads_of, unflatten_into
from thinwire.strategies.pipeline.codecs import boundary_names, check_spec
from thinwire.strategies.pipeline.plan import TP_USER, PipelinePlan, chain_of, pipeline_layout
from thinwire.strategies.pipeline.schedule import SCHEDULES, Boundaries, Pipeline, cut, order
from thinwire.strategies.pipeline.traffic import message_bytes, traffic
from thinwire.strategies.step import SteppedStrategy, sq_norm, summed
from thinwire.strategies.tp import (
    Exchange,
    Sharded,
    check_split,
    gather_full,
    shard,
    tensor_plan,
    within,
)
from thinwire.strategies.traffic import Layout


@dataclass(frozen=True)
class Options:
    schedule: str = opt("1f1b", "pipeline schedule", choices=SCHEDULES)
    micro_batches: int = opt(4, "micro-batches a step (must divide train.batch_size)")
    codec_fwd: str = opt("none", f"codec of activations: one of {boundary_names(forward=True)} "
                         "with its options, e.g. int8, aqsgd:bits=4, ae:dim=16 (ae, subspace: "
                         "bottlenecks)")
    codec_bwd: str = opt("none", "codec of activation gradients: one of "
                         f"{boundary_names(forward=False)} with its options, e.g. "
                         "lowrank:rank=8 (Optimus-CC)")
    uncompressed_first: int = opt(0, "send the first n boundaries uncompressed")
    epilogue_only: bool = opt(False, "compress gradients only in the 1F1B cool-down (Optimus-CC)")
    overrides: str = opt("", "per-boundary codecs 'b@fwd|bwd;...', e.g. '2@int4|lowrank:rank=4'")
    tp_codec: str = opt("none", "with --parallel.tp > 1: codec on the tensor-parallel sums inside "
                        f"stages: one of {codec_names('tp')} with its options (none: exact)")

    def __post_init__(self) -> None:
        check(self.micro_batches >= 1, "method.micro_batches",
              f"got {self.micro_batches}; use 1 or more")
        check(self.uncompressed_first >= 0, "method.uncompressed_first",
              f"got {self.uncompressed_first}; use 0 or more")
        check_spec(self.codec_fwd, "method.codec_fwd", forward=True)
        check_spec(self.codec_bwd, "method.codec_bwd", forward=False)
        check(not self.epilogue_only or self.schedule == "1f1b", "method.epilogue_only",
              "needs --method.schedule 1f1b (GPipe has no cool-down)")
        parse_overrides(self.overrides)
        if self.tp_codec != "none":
            check_codec(self.tp_codec, "method.tp_codec", slot="tp")

    def boundaries(self) -> Boundaries:
        return Boundaries(self.codec_fwd, self.codec_bwd, self.uncompressed_first,
                          self.epilogue_only, parse_overrides(self.overrides))


def parse_overrides(text: str) -> tuple[tuple[int, str, str], ...]:
    """``"b@fwd|bwd;..."`` -> ((b, fwd, bwd), ...), each spec checked (one-line errors)."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(";"))):
        where, at, specs = item.partition("@")
        fwd, bar, bwd = specs.partition("|")
        if not at or not bar or not where.strip().isdigit():
            raise OptionError(f"method.overrides: {item!r} is not 'boundary@fwd|bwd'; write e.g. "
                              "'2@int4|lowrank:rank=4'")
        check_spec(fwd.strip(), f"method.overrides ({item})", forward=True)
        check_spec(bwd.strip(), f"method.overrides ({item})", forward=False)
        out.append((int(where), fwd.strip(), bwd.strip()))
    return tuple(out)


def check_model(cfg: Any, model: nn.Module) -> None:
    """The chain has at least S links, no parameter is shared between two stages, and with
    tensor parallelism the model's plan splits tp ways."""
    if cfg.parallel.tp > 1:
        check_split(cfg, model, TP_USER)
    links = chain_of(cfg, model)
    S = cfg.parallel.pp
    if len(links) < S:
        raise UsageError(f"parallel.pp: model {cfg.model.name} is a chain of {len(links)} links, "
                         f"fewer than {S} stages; use more layers or fewer stages")
    owner: dict[int, int] = {}
    for s, (a, b) in enumerate(cut(len(links), S)):
        for link in links[a:b]:
            for p in link.parameters():
                if owner.setdefault(id(p), s) != s:
                    raise UsageError(f"model {cfg.model.name}: a parameter is shared by stages "
                                     f"{owner[id(p)]} and {s} (tied embeddings?); untie it "
                                     "(e.g. --model.tie_embeddings false) or use one stage")


def check_config(cfg: Any) -> None:
    o = cfg.method.options
    check(cfg.parallel.tp > 1 or o.tp_codec == "none", "method.tp_codec",
          "compresses the tensor-parallel sums inside stages; use it with --parallel.tp > 1")
    if cfg.train.batch_size % o.micro_batches:
        raise UsageError(f"method.micro_batches: {o.micro_batches} does not divide "
                         f"train.batch_size={cfg.train.batch_size}; use a divisor of it")
    for b, _, _ in o.boundaries().overrides:
        if b >= cfg.parallel.pp - 1:
            raise UsageError(f"method.overrides: boundary {b} does not exist with "
                             f"{cfg.parallel.pp} stages (boundaries 0 .. {cfg.parallel.pp - 2})")


def _label(o: Options) -> str:
    parts = [o.schedule, f"M={o.micro_batches}"]
    if o.codec_fwd != "none":
        parts.append(f"fwd={o.codec_fwd}")
    if o.codec_bwd != "none":
        parts.append(f"bwd={o.codec_bwd}")
    if o.uncompressed_first:
        parts.append(f"plain<{o.uncompressed_first}")
    if o.epilogue_only:
        parts.append("epilogue")
    if o.tp_codec != "none":
        parts.append(f"tp={o.tp_codec}")
    return f"pipeline({','.join(parts)})"


# --- the Strategy --------------------------------------------------------------------------------
class PipelineStrategy(SteppedStrategy):
    """Stage s of replica d of the dp x pp mesh, tensor slice t of it on a dp x pp x tp mesh
    (module docstring, steps 1-4)."""

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        super().__init__(ctx, model)
        self.o: Options = ctx.options
        self.model = model.to(ctx.device)
        self.chain = chain_of(ctx.cfg, self.model)
        mesh = ctx.mesh
        if mesh is None:  # one stage: micro-batched data parallelism
            self.pp_comm, self.dp_comm = Comm.local(self.comm.ledger), self.comm
            self.tp_comm = Comm.local(self.comm.ledger)
            self.d, self.dps = self.comm.rank, self.comm.world_size
            self.loss_rank = 0
        else:
            self.pp_comm, self.dp_comm, self.tp_comm = mesh.pp, mesh.dp, mesh.tp
            self.d, self.dps = mesh.coords.dp, mesh.dp.world_size
            self.loss_rank = mesh.rank_of(0, mesh.pp.world_size - 1, 0)
        self.n_stages, self.stage_rank = self.pp_comm.world_size, self.pp_comm.rank
        # tensor parallelism: the stage's slices (after the first batch); replica 0's first
        # tensor rank of each stage keeps a whole model to gather them into for evaluation
        self.sharded: Sharded | None = None
        self.full: nn.Module | None = None
        if self.tp_comm.world_size > 1 and self.d == 0 and self.tp_comm.rank == 0:
            self.full = copy.deepcopy(self.model)
        codec = None
        if self.o.tp_codec != "none":
            from thinwire.compression import build

            codec = build(self.o.tp_codec, seed=self.cfg.train.seed, rank=self.comm.rank,
                          slot="tp")
        self.exchange = Exchange(self.tp_comm, codec)
        self.pipe: Pipeline | None = None
        self.opt: torch.optim.Optimizer | None = None
        self._pending: dict[str, Any] | None = None

    def data_shard(self) -> tuple[int, int]:
        return self.d, self.dps

    def _setup(self, x: torch.Tensor) -> Pipeline:
        """The stage's pipeline and optimizer, at the first batch (its shape fixes the
        boundaries')."""
        pipe = Pipeline(self.chain, self.pp_comm, micro_batches=self.o.micro_batches,
                        loss=self.loss_fn, example=x.chunk(self.o.micro_batches)[0],
                        schedule=self.o.schedule, boundaries=self.o.boundaries(),
                        seed=self.cfg.train.seed)
        if self.tp_comm.world_size > 1:  # the stage's regions split over the tensor group
            plan = within(tensor_plan(self.cfg, self.model, TP_USER), self.model, pipe.stage)
            self.sharded = shard(self.model, plan, self.exchange)
        self.pipe, self.opt = pipe, make_optimizer(pipe.parameters(), self.cfg.train)
        if self._pending is not None:
            self._apply(self._pending)
            self._pending = None
        return pipe

    def prepare(self, batch: Batch) -> None:
        if self.pipe is None:
            self._setup(batch[0])

    def optimizers(self) -> list[torch.optim.Optimizer]:
        assert self.opt is not None
        return [self.opt]

    def modules_to_train(self) -> list[nn.Module]:
        assert self.pipe is not None
        return list(self.pipe.modules())

    def forward_backward(self, batch: Batch, step: int) -> float:
        """Steps 1 and 2: the schedule, then the stage's gradients averaged over dp."""
        x, y = batch
        assert self.pipe is not None
        self.exchange.step = step
        loss = self.pipe.run(x, y, step)  # 1.
        params = self.pipe.parameters()
        grads = grads_of(params)
        if self.dp_comm.world_size > 1:  # 2.
            flat = flatten(grads)
            self.dp_comm.all_reduce(flat, op="avg", tag="grad")
            unflatten_into(flat, grads)
        for p, g in zip(params, grads):
            p.grad = g
        return loss if loss is not None else 0.0

    def grad_norm_sq(self) -> torch.Tensor:
        """Step 3: the stage's squares (its slices' summed over tp first, its replicated
        parameters once), summed over the stages."""
        assert self.pipe is not None
        dev = self.ctx.device
        params = self.pipe.parameters()
        if self.sharded is None:
            return summed(sq_norm(params, dev), self.pp_comm)
        split = {id(p) for n, p in self.model.named_parameters() if n in self.sharded.split}
        sq = summed(sq_norm([p for p in params if id(p) in split], dev), self.tp_comm)
        return summed(sq + sq_norm([p for p in params if id(p) not in split], dev), self.pp_comm)

    def reduce_loss(self, loss: torch.Tensor | float) -> float:
        """Step 4's end: the last stage's loss, broadcast over the pipeline group (control)."""
        out = torch.tensor([float(loss)], dtype=torch.float64, device=self.ctx.device)
        self.pp_comm.broadcast(out, src=self.n_stages - 1, tag=CONTROL)
        return float(out)

    # --- evaluation ----------------------------------------------------------------------------
    def _stage_modules(self, s: int, chain: Sequence[nn.Module]) -> list[nn.Module]:
        """Stage s's trained modules in :meth:`Pipeline.modules` order (links, decoder, encoder)."""
        a, b = cut(len(chain), self.n_stages)[s]
        out: list[nn.Module] = [nn.Sequential(*chain[a:b])]
        necks = self.pipe.bottlenecks if self.pipe is not None else {}
        if s - 1 in necks:
            out.append(necks[s - 1][1])
        if s in necks:
            out.append(necks[s][0])
        return out

    def eval_model(self) -> nn.Module | None:
        """Stages of replica 0 send their parameters to its last stage, which returns the whole
        model (every rank calls this). With tensor parallelism each stage first gathers its
        slices on its first tensor rank (:func:`~thinwire.strategies.tp.sharding.gather_full`, control),
        and those ranks carry the pipeline's exchange."""
        whole: nn.Module | None = self.model
        if self.sharded is not None:
            if self.d == 0:
                gather_full(self.model, self.sharded, self.tp_comm, self.full)
            whole = self.full
        if whole is None:  # a tensor rank t > 0: its slices are gathered
            return None
        chain = self.chain if whole is self.model else chain_of(self.cfg, whole)
        if self.d == 0 and self.n_stages > 1:
            if self.stage_rank < self.n_stages - 1:
                flat = torch.cat([p.detach().reshape(-1)
                                  for m in self._stage_modules(self.stage_rank, chain)
                                  for p in m.parameters()])
                self.pp_comm.send(flat, self.n_stages - 1, tag=CONTROL)
            else:
                for s in range(self.n_stages - 1):
                    params = [p for m in self._stage_modules(s, chain) for p in m.parameters()]
                    flat = torch.empty(sum(p.numel() for p in params), device=self.ctx.device)
                    self.pp_comm.recv(flat, s, tag=CONTROL)
                    with torch.no_grad():
                        unflatten_into(flat, params)
        if self.comm.rank != self.loss_rank:
            return None
        necks = self.pipe.bottlenecks if self.pipe is not None else {}
        if not necks:
            return whole
        out: list[nn.Module] = []
        for s, (a, b) in enumerate(cut(len(chain), self.n_stages)):
            if s - 1 in necks:
                out.append(necks[s - 1][1])
            out += chain[a:b]
            if s in necks:
                out.append(necks[s][0])
        return nn.Sequential(*out)

    # --- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.pipe is None or self.opt is None:
            return {"model": self.model.state_dict()}
        codec = self.exchange.codec
        return {"params": [p.detach().clone() for p in self.pipe.parameters()],
                "opt": self.opt.state_dict(), "codecs": self.pipe.codec_state(),
                "tp_codec": codec.state_dict() if codec is not None else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "model" in state:
            self.model.load_state_dict(state["model"])
        elif self.pipe is None:
            self._pending = state
        else:
            self._apply(state)

    def _apply(self, state: dict[str, Any]) -> None:
        assert self.pipe is not None and self.opt is not None
        with torch.no_grad():
            for p, v in zip(self.pipe.parameters(), state["params"]):
                p.copy_(v)
        self.opt.load_state_dict(state["opt"])
        self.pipe.load_codec_state(state["codecs"])
        if self.exchange.codec is not None:
            self.exchange.codec.load_state_dict(state["tp_codec"])

    def memory(self) -> MemoryReport:
        if self.pipe is None:
            a, b = cut(len(self.chain), self.n_stages)[self.stage_rank]
            return memory_of([p for link in self.chain[a:b] for p in link.parameters()], None)
        return memory_of(self.pipe.parameters(), self.opt)


class PipelineEntry(MethodEntry, HasRunLayout, Staged):
    """pipeline's registry entry: its traffic reads the run's :class:`PipelinePlan`, and it
    declares the plan, message bytes and pass order the planner's pipeline model reads
    (:mod:`thinwire.planner.pipeline`)."""

    def run_layout(self, cfg: Any, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
                   ) -> Layout:
        return pipeline_layout(cfg, model, batch)

    def plan(self, stages: int, dp: int, batch: int, widths: tuple[tuple[int, ...], ...],
             stage_params: tuple[int, ...], clip: bool = False) -> PipelinePlan:
        return PipelinePlan(stages, dp, batch, widths, stage_params, clip)

    def message_bytes(self, plan: PipelinePlan, options: Options
                      ) -> tuple[list[list[int]], list[list[int]], list[int]]:
        return message_bytes(plan, options)

    def order(self, schedule: str, stage: int, stages: int, micro: int
              ) -> list[tuple[str, int]]:
        return order(schedule, stage, stages, micro)


METHOD = PipelineEntry(
    name="pipeline",
    summary="pipeline stages x data parallelism (GPipe or 1F1B) with compressed boundaries",
    strategy="thinwire.strategies.pipeline.method:PipelineStrategy", options=Options,
    label=_label, check=check_config, check_model=check_model, traffic=traffic,
    parallel=("pp", "tp"))

__all__ = ["METHOD", "Options", "PipelineStrategy", "check_config", "check_model"]
