"""Tensor parallelism (``tensor``): Megatron-style split layers, data parallelism across groups.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (2019); sequence parallelism after Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (2022). The workers form a dp x tp mesh
(``parallel.tp``; rank = d tp + t, :class:`~thinwire.runtime.mesh.Mesh`); the tp ranks of one
group read the same data shard and hold 1/tp of every split layer, the dp groups are replicas.

Which layers split is the model's own data, its :class:`~thinwire.models.tensor_plan.TPPlan`
(``ModelEntry.tensor``): per region, column-parallel layers (rows of weight and bias, in units
such as an attention head) and row-parallel ones (columns of the weight; the bias whole).
:func:`thinwire.strategies.tp.sharding.shard` rewrites the model in place (the operators are
:mod:`thinwire.strategies.tp.operators`, shared with the pipeline's tensor-parallel stages):

  1. each column layer becomes a smaller ``nn.Linear`` holding rank t's rows (its heads, its
     neurons); each row layer a :class:`RowParallel` holding rank t's columns;
  2. without sequence parallelism, a region's input passes Megatron's *f* (identity forward,
     sum over the group backward) and a row layer's partial product *g* (sum over the group
     forward, identity backward), then the bias is added;
  3. with sequence parallelism the span of the plan (the blocks) runs on 1/tp of the sequence:
     its input is cut (backward: all-gather), its output restored (all-gather; backward: this
     rank's slice); *f* becomes an all-gather over the sequence (backward: reduce-scatter) and
     *g* a reduce-scatter (backward: all-gather). Parameters of the span outside the split
     layers (LayerNorms, row biases) see only their slice: their gradients are summed over the
     group after backward.

One step (the template of :mod:`thinwire.strategies.step`; the pass is
:meth:`TensorParallelStrategy.forward_backward`): forward and backward through the sharded model; the
sequence-parallel gradients summed over tp; every local gradient averaged over dp with one
all-reduce; with ``train.clip_norm`` the whole model's norm (the split slices' squares summed
over tp in one 4-byte all-reduce, the replicated parameters counted once, as Megatron does);
the optimizer steps. Every rank of a tp group then holds the same replicated parameters and its
own slices; the dp replicas are identical.

Why our own operators and not ``torch.distributed.tensor.parallel.parallelize_module``: DTensor
issues its collectives inside its dispatcher, out of reach of :class:`~thinwire.runtime.comm.Comm`
and its ledger, and offers no place to put a codec on an activation. The operators here are the
four autograd functions Megatron itself writes (``_Copy``, ``_Reduce``, and their
sequence-parallel forms), each one call of :class:`~thinwire.strategies.tp.operators.Exchange`,
which goes through ``Comm`` and,
with ``method.codec``, through a codec of :mod:`thinwire.compression` (the same
encode/decode and wire format as compressed data parallelism; error feedback keyed by call
site). The plain path (codec ``none``) uses the backend's collectives directly, so a run equals
single-process training up to floating-point summation order.

Traffic (:func:`traffic`, equal to the ledger): per step and region, two sums of the
[b, L, d] activations over the tp group (forward g, backward f); with sequence parallelism two
all-gathers of [b, L/tp, d] and two reduce-scatters of [b, L, d] per region, one all-gather of
[b, L/tp, d] for the span's entry (backward), one for its exit, and one all-reduce of the span's
replicated parameters; then one all-reduce of all local parameters over dp. Per block that is
8 (tp-1)/tp x b L d x 4 bytes on the wire either way, as the planner counts without sequence
parallelism; Megatron's sequence parallelism keeps only the sequence slice of a region's input
and all-gathers it again in the backward pass (the planner's 10 units), where autograd here
keeps the gathered input (less traffic, more activation memory).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from thinwire.compression.registry import codec_names
from thinwire.errors import UsageError
from thinwire.options import check, opt
from thinwire.runtime.comm import Comm
from thinwire.strategies.base import (
    Batch,
    Context,
    MemoryReport,
    make_optimizer,
    memory_of,
)
from thinwire.strategies.entry import HasRunLayout, MethodEntry
from thinwire.strategies.grads import all_reduce_grads
from thinwire.strategies.step import SteppedStrategy, sq_norm, summed
from thinwire.strategies.tp import (
    Exchange,
    check_split,
    collectives,
    gather_full,
    shard,
    split_dims,
    tensor_plan,
)
from thinwire.strategies.traffic import Layout, Traffic, wire


@dataclass(frozen=True)
class Options:
    sequence_parallel: bool = opt(False, "run LayerNorms and residuals on 1/tp of the sequence "
                                  "(all-gather / reduce-scatter instead of all-reduce)")
    codec: str = opt("none", "codec on the tensor-parallel activations and their gradients: "
                     f"one of {codec_names('tp')} with its options, e.g. topk:ratio=0.1 (none: "
                     "exact)")

    def __post_init__(self) -> None:
        if self.codec != "none":
            from thinwire.compression import check_codec

            check_codec(self.codec, "method.codec", slot="tp")


# --- the strategy -----------------------------------------------------------------------------------
class TensorParallelStrategy(SteppedStrategy):
    name = "tensor"

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        super().__init__(ctx, model)
        o: Options = ctx.options
        mesh = ctx.mesh
        self.tp_comm = mesh.tp if mesh is not None else Comm.local(ctx.comm.ledger)
        self.dp_comm = mesh.dp if mesh is not None else ctx.comm
        codec = None
        if o.codec != "none":
            from thinwire.compression import build

            codec = build(o.codec, seed=self.cfg.train.seed, rank=self.comm.rank, slot="tp")
        self.exchange = Exchange(self.tp_comm, codec)
        self.plan = tensor_plan(self.cfg, model)
        self.full = model if self.comm.rank == 0 else None
        self.model = copy.deepcopy(model) if self.full is not None else model
        self.model.to(ctx.device)
        self.sharded = shard(self.model, self.plan, self.exchange,
                             sequence_parallel=o.sequence_parallel)
        self.opt = make_optimizer(self.model.parameters(), self.cfg.train)
        params = dict(self.model.named_parameters())
        self._span = [params[n] for n in self.sharded.span_replicated]
        self._split = [p for n, p in params.items() if n in self.sharded.split]
        self._whole = [p for n, p in params.items() if n not in self.sharded.split]

    def data_shard(self) -> tuple[int, int]:
        return self.dp_comm.rank, self.dp_comm.world_size

    def sync_grads(self) -> None:
        """After backward: the span's replicated gradients summed over tp (sequence
        parallelism), then every gradient averaged over dp in one all-reduce."""
        if self._span and self.tp_comm.world_size > 1:
            all_reduce_grads(self.tp_comm, self._span, op="sum", tag="tp")
        if self.dp_comm.world_size > 1:
            all_reduce_grads(self.dp_comm, list(self.model.parameters()), op="avg", tag="grad")

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.opt]

    def modules_to_train(self) -> list[nn.Module]:
        return [self.model]

    def forward_backward(self, batch: Batch, step: int) -> torch.Tensor:
        x, y = batch
        self.exchange.step = step
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.sync_grads()
        return loss

    def grad_norm_sq(self) -> torch.Tensor:
        """The slices' squares summed over tp, plus the replicated parameters' (the same on
        every rank of the group)."""
        return summed(sq_norm(self._split, self.ctx.device), self.tp_comm) + \
            sq_norm(self._whole, self.ctx.device)

    def eval_model(self) -> nn.Module | None:
        gather_full(self.model, self.sharded, self.tp_comm, self.full)
        return self.full

    def state_dict(self) -> dict[str, Any]:
        codec = self.exchange.codec
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                "codec": codec.state_dict() if codec is not None else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        if self.exchange.codec is not None:
            self.exchange.codec.load_state_dict(state["codec"])

    def memory(self) -> MemoryReport:
        return memory_of(self.model.parameters(), self.opt)


# --- checks and traffic ------------------------------------------------------------------------------
def _check(cfg: Any) -> None:
    check(cfg.parallel.pp == 1, "parallel.pp",
          "method tensor splits layers only (pp = 1); for pipeline stages of tensor-parallel "
          "blocks use --method pipeline --parallel.pp S --parallel.tp T")


def _check_model(cfg: Any, model: nn.Module) -> None:
    plan = check_split(cfg, model)
    tp = cfg.parallel.tp
    if cfg.method.options.sequence_parallel and plan.seq_len % tp:
        raise UsageError(f"method.sequence_parallel: the sequence length {plan.seq_len} is not "
                         f"divisible by parallel.tp={tp}")


@dataclass(frozen=True)
class TPShape:
    """What the traffic formula knows of one rank's tensor-parallel model and step."""

    regions: int
    """Tensor-parallel regions (2 per transformer block)."""
    tokens: int
    """Positions per step and replica: batch x sequence length."""
    width: int
    """Features at region boundaries (d_model)."""
    local_params: int
    """Parameters one rank holds (its slices and the replicated ones)."""
    span_replicated: int = 0
    """Replicated parameters inside the sequence-parallel span."""

    @staticmethod
    def of(strategy: TensorParallelStrategy, batch: int, seq: int) -> TPShape:
        params = dict(strategy.model.named_parameters())
        return TPShape(len(strategy.plan.regions), batch * seq, strategy.plan.width,
                       sum(p.numel() for p in params.values()),
                       sum(params[n].numel() for n in strategy.sharded.span_replicated))


def traffic_of(shape: TPShape, tp: int, dp: int, steps: int, *, sequence_parallel: bool = False,
               codec: str = "none", clip: bool = False) -> Traffic:
    """Ledger totals per rank of ``steps`` steps on a dp x tp mesh (module docstring; ``clip``:
    ``train.clip_norm`` > 0, one 4-byte all-reduce over tp a step)."""
    comp = None
    if codec != "none":
        from thinwire.compression import build

        comp = build(codec, slot="tp")
    act = shape.tokens * shape.width
    per_step: list[tuple[str, int, int]] = []  # (op, payload, group size)
    if tp > 1:
        if sequence_parallel:
            for _ in range(shape.regions):
                for op, numel in (("gather", act // tp), ("reduce_scatter", act),
                                  ("reduce_scatter", act), ("gather", act // tp)):
                    per_step += [(o, b, tp) for o, b in collectives(comp, op, numel, tp)]
            per_step += [(o, b, tp) for o, b in collectives(comp, "gather", act // tp, tp)] * 2
            per_step.append(("all_reduce", 4 * shape.span_replicated, tp))
        else:
            for _ in range(2 * shape.regions):
                per_step += [(o, b, tp) for o, b in collectives(comp, "sum", act, tp)]
    if dp > 1:
        per_step.append(("all_reduce", 4 * shape.local_params, dp))
    if clip and tp > 1:
        per_step.append(("all_reduce", 4, tp))
    calls: dict[str, tuple[int, int]] = {}
    pay = sent = 0
    for op, payload, n in per_step:
        w = payload if op == "all_to_all" else wire(op, payload, n)
        pay, sent = pay + payload * steps, sent + w * steps
        c, b = calls.get(op, (0, 0))
        calls[op] = (c + steps, b + w * steps)
    workers = tp * dp
    return Traffic((sent,) * workers, (sent,) * workers, (pay,) * workers, calls)


@dataclass(frozen=True)
class TensorLayout:
    """A tensor-parallel run in a :class:`~thinwire.strategies.traffic.Layout`: one rank's
    :class:`TPShape` and the degree tp (:func:`tensor_layout`)."""

    shape: TPShape
    tp: int


def tensor_layout(cfg: Any, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
                  ) -> Layout:
    """The model's layout with the run's :class:`TensorLayout` (and ``train.clip_norm``), from
    the model's plan (no sharding): a rank's parameters are its slices of the split ones (:func:`split_dims`) and
    the rest whole; ``batch`` (one step's inputs and targets) gives the sequence length."""
    example = batch[0]
    from thinwire.strategies.traffic import Layout

    plan = tensor_plan(cfg, model)
    tp = cfg.parallel.tp
    split = split_dims(model, plan)
    params = dict(model.named_parameters())
    local = sum(p.numel() // (tp if n in split else 1) for n, p in params.items())
    span = 0
    if cfg.method.options.sequence_parallel:
        prefixes = tuple(q + "." for q in plan.span)
        span = sum(p.numel() for n, p in params.items()
                   if n.startswith(prefixes) and n not in split)
    tokens = cfg.train.batch_size * int(example.shape[plan.seq_dim])
    shape = TPShape(len(plan.regions), tokens, plan.width, local, span)
    return replace(Layout.of_model(model), tensor=TensorLayout(shape, tp),
                   clip=cfg.train.clip_norm > 0)


def traffic(layout: Layout, options: Options, workers: int, steps: int, seed: int,
            optimizer_states: int = 0) -> Traffic:
    """The ledger's totals per rank after ``steps`` steps (:func:`traffic_of` of the run's
    :class:`TensorLayout`)."""
    del seed, optimizer_states
    run = layout.tensor
    if not isinstance(run, TensorLayout):
        raise UsageError("the tensor method's traffic needs the run's shapes: build the layout "
                         "with thinwire.strategies.tensor.tensor_layout")
    if workers % run.tp:
        raise UsageError(f"{workers} workers are not a multiple of parallel.tp={run.tp}")
    return traffic_of(run.shape, run.tp, workers // run.tp, steps,
                      sequence_parallel=options.sequence_parallel, codec=options.codec,
                      clip=layout.clip)


def _label(o: Options) -> str:
    parts = ["sp"] if o.sequence_parallel else []
    if o.codec != "none":
        from thinwire.compression import build

        parts.append(build(o.codec, slot="tp").describe())
    return f"tensor({','.join(parts)})" if parts else "tensor"


class TensorEntry(MethodEntry, HasRunLayout):
    """tensor's registry entry: its traffic reads the run's :class:`TensorLayout`."""

    def run_layout(self, cfg: Any, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
                   ) -> Layout:
        return tensor_layout(cfg, model, batch)


METHOD = TensorEntry(
    name="tensor", summary="Megatron tensor parallelism (parallel.tp) x data parallelism, "
    "optional sequence parallelism and a codec on the activations",
    strategy="thinwire.strategies.tensor:TensorParallelStrategy", options=Options, label=_label,
    check=_check, check_model=_check_model, traffic=traffic, parallel=("tp",))

__all__ = ["METHOD", "Options", "TPShape", "TensorLayout", "TensorParallelStrategy", "tensor_layout",
           "traffic", "traffic_of"]
