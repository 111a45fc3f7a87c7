"""Tensor parallelism (``tensor``): Megatron-style split layers, data parallelism across groups.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (2019); sequence parallelism after Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (2022). The workers form a dp x tp mesh
(``parallel.tp``; rank = d tp + t, :class:`~thinwire.runtime.mesh.Mesh`); the tp ranks of one
group read the same data shard and hold 1/tp of every split layer, the dp groups are replicas.

Which layers split is the model's own data, its :class:`~thinwire.models.tensor_plan.TensorPlan`
(``ModelEntry.tensor``): per region, column-parallel layers (rows of weight and bias, in units
such as an attention head) and row-parallel ones (columns of the weight; the bias whole).
:func:`shard` rewrites the model in place:

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

One step (:meth:`TensorParallel.train_step`): forward and backward through the sharded model;
the sequence-parallel gradients summed over tp; every local gradient averaged over dp with one
all-reduce; the optimizer steps. Every rank of a tp group then holds the same replicated
parameters and its own slices; the dp replicas are identical.

Why our own operators and not ``torch.distributed.tensor.parallel.parallelize_module``: DTensor
issues its collectives inside its dispatcher, out of reach of :class:`~thinwire.runtime.comm.Comm`
and its ledger, and offers no place to put a codec on an activation. The operators here are the
four autograd functions Megatron itself writes (:class:`_Copy`, :class:`_Reduce`, and their
sequence-parallel forms), each one call of :class:`Exchange`, which goes through ``Comm`` and,
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
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from thinwire.errors import UsageError
from thinwire.options import check, opt
from thinwire.runtime.comm import Comm
from thinwire.strategies.base import (
    Batch,
    Context,
    MemoryReport,
    Strategy,
    lr_at,
    make_optimizer,
    memory_of,
    set_lr,
)
from thinwire.strategies.entry import MethodEntry
from thinwire.strategies.traffic import Layout, Traffic, wire

if TYPE_CHECKING:
    from thinwire.compression.base import Compressor
    from thinwire.models.tensor_plan import TensorPlan


@dataclass(frozen=True)
class Options:
    sequence_parallel: bool = opt(False, "run LayerNorms and residuals on 1/tp of the sequence "
                                  "(all-gather / reduce-scatter instead of all-reduce)")
    codec: str = opt("none", "codec on the tensor-parallel activations and their gradients, "
                     "e.g. int8, fp16, topk:ratio=0.1 (see thinwire.compression; none: exact)")

    def __post_init__(self) -> None:
        if self.codec != "none":
            from thinwire.strategies.data_parallel import check_codec

            check_codec(self.codec, "method.codec")


RS_KEYS = 1 << 20
"""Codec keys of a compressed reduce-scatter's chunks start here (apart from the call sites')."""


# --- the exchange: every tensor-parallel collective, plain or through a codec ---------------------
class Exchange:
    """The tensor-parallel group's collectives (through ``comm``, tagged ``tp``), optionally
    through a codec. ``key`` names the call site (error feedback keeps one residual per key)."""

    def __init__(self, comm: Comm, codec: Compressor | None = None) -> None:
        self.comm = comm
        self.codec = codec
        self.step = 0

    @property
    def size(self) -> int:
        return self.comm.world_size

    def sum(self, x: torch.Tensor, key: int) -> torch.Tensor:
        """The sum of ``x`` over the group (a new tensor)."""
        if self.size == 1:
            return x.clone()
        y = x.detach().contiguous().clone()
        if self.codec is None:
            return self.comm.all_reduce(y, tag="tp")
        fut, _ = self.codec.average_async(self.comm, y, self.step, key=key, tag="tp")
        return fut.wait().mul_(self.size)

    def gather(self, x: torch.Tensor, dim: int, key: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order."""
        if self.size == 1:
            return x.clone()
        flat = x.detach().contiguous()
        if self.codec is None:
            return torch.cat(self.comm.all_gather(flat, tag="tp"), dim)
        from thinwire.compression.base import from_bytes, to_bytes

        spec = self.codec.spec(flat.numel(), flat.dtype)
        wire_bytes = to_bytes(self.codec.encode(flat.reshape(-1).clone(), self.step, key=key))
        rows = self.comm.all_gather(wire_bytes, tag="tp")
        parts = [self.codec.decode(from_bytes(r, spec), flat.numel(), self.step, key=key)
                 .view_as(flat).to(flat.dtype) for r in rows]
        parts[self.comm.rank] = flat  # own slice: never through the codec
        return torch.cat(parts, dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int, key: int) -> torch.Tensor:
        """This rank's slice (along ``dim``) of the sum of ``x`` over the group."""
        n = self.size
        if n == 1:
            return x.clone()
        moved = x.detach().movedim(dim, 0).contiguous()
        if self.codec is None:
            return self.comm.reduce_scatter(moved, tag="tp").movedim(0, dim)
        from thinwire.compression.base import from_bytes, to_bytes

        chunks = list(moved.chunk(n, 0))
        numel = chunks[0].numel()
        spec = self.codec.spec(numel, moved.dtype)
        size = sum(p.nbytes for p in spec)
        me = self.comm.rank
        sends = [to_bytes(self.codec.encode(c.reshape(-1).clone(), self.step, key=RS_KEYS + key * n + j))
                 if j != me else torch.empty(size, dtype=torch.uint8, device=x.device)
                 for j, c in enumerate(chunks)]
        recvs = [torch.empty(size, dtype=torch.uint8, device=x.device) for _ in range(n)]
        self.comm.all_to_all(sends, recvs, tag="tp")
        out = chunks[me].clone()
        for j in range(n):
            if j != me:
                out.add_(self.codec.decode(from_bytes(recvs[j], spec), numel, self.step,
                                           key=RS_KEYS + key * n + me).view_as(out).to(out.dtype))
        return out.movedim(0, dim)

    def collectives(self, op: str, numel: int) -> list[tuple[str, int]]:
        """:func:`collectives` of this group and codec."""
        return collectives(self.codec, op, numel, self.size)


def collectives(codec: Compressor | None, op: str, numel: int, n: int) -> list[tuple[str, int]]:
    """(op, payload bytes) a rank's ledger records for one :class:`Exchange` call of ``op``
    ("sum", "gather", "reduce_scatter") on ``numel`` float32 elements (the call's input) in a
    group of ``n``; for an all-to-all the payload is the bytes sent (exact)."""
    if n == 1:
        return []
    if codec is None:
        name = {"sum": "all_reduce", "gather": "all_gather", "reduce_scatter": "reduce_scatter"}
        return [(name[op], 4 * numel)]
    if op == "sum":
        return codec.collectives(numel)
    if op == "gather":
        return [("all_gather", codec.payload_bytes(numel))]
    return [("all_to_all", (n - 1) * codec.payload_bytes(numel // n))]


class _Copy(torch.autograd.Function):
    """Megatron's f: identity forward, sum over the group backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ex: Exchange, key: int) -> torch.Tensor:
        ctx.ex, ctx.key = ex, key
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.ex.sum(g, ctx.key), None, None


class _Reduce(torch.autograd.Function):
    """Megatron's g: sum over the group forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ex: Exchange, key: int) -> torch.Tensor:
        return ex.sum(x, key)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return g, None, None


class _GatherSeq(torch.autograd.Function):
    """Sequence-parallel f: all-gather forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ex: Exchange, key: int, dim: int) -> torch.Tensor:
        ctx.ex, ctx.key, ctx.dim = ex, key, dim
        return ex.gather(x, dim, key)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.ex.reduce_scatter(g, ctx.dim, ctx.key + 1), None, None, None


class _ScatterSeq(torch.autograd.Function):
    """Sequence-parallel g: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ex: Exchange, key: int, dim: int) -> torch.Tensor:
        ctx.ex, ctx.key, ctx.dim = ex, key, dim
        return ex.reduce_scatter(x, dim, key)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.ex.gather(g, ctx.dim, ctx.key + 1), None, None, None


class _Split(torch.autograd.Function):
    """Entry of the sequence-parallel span: this rank's slice forward, all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ex: Exchange, key: int, dim: int) -> torch.Tensor:
        ctx.ex, ctx.key, ctx.dim = ex, key, dim
        return x.chunk(ex.size, dim)[ex.comm.rank].contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.ex.gather(g, ctx.dim, ctx.key), None, None, None


class _Unsplit(torch.autograd.Function):
    """Exit of the span: all-gather forward; backward this rank's slice (what follows the span
    is computed alike on every rank, so its gradient is too)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ex: Exchange, key: int, dim: int) -> torch.Tensor:
        ctx.ex, ctx.dim = ex, dim
        return ex.gather(x, dim, key)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return g.chunk(ctx.ex.size, ctx.dim)[ctx.ex.comm.rank].contiguous(), None, None, None


class RowParallel(nn.Module):
    """A row-parallel linear layer: this rank's columns of the weight, the whole bias; the
    partial products are summed (or reduce-scattered over the sequence) before the bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ex: Exchange, key: int,
                 seq_dim: int | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.ex, self.key, self.seq_dim = ex, key, seq_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.seq_dim is None:
            y = _Reduce.apply(y, self.ex, self.key)
        else:
            y = _ScatterSeq.apply(y, self.ex, self.key, self.seq_dim)
        return y if self.bias is None else y + self.bias


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


@dataclass(frozen=True)
class Sharded:
    """What :func:`shard` did: the split parameters (name -> dim split) and the span's
    replicated parameters (gradients summed over tp with sequence parallelism)."""

    split: dict[str, int]
    span_replicated: tuple[str, ...]


def shard(model: nn.Module, plan: TensorPlan, ex: Exchange, *,
          sequence_parallel: bool = False) -> Sharded:
    """Rewrite ``model`` in place into rank ``ex.comm.rank``'s tensor-parallel shard (steps 1-3
    of the module docstring). Every rank must start from the same model."""
    n, t = ex.size, ex.comm.rank
    seq_dim = plan.seq_dim if sequence_parallel else None
    split: dict[str, int] = {}
    for i, region in enumerate(plan.regions):
        module = model.get_submodule(region.path)
        for name in region.column:
            lin = module.get_submodule(name)
            assert isinstance(lin, nn.Linear)
            rows = lin.out_features
            if rows % (region.unit * n):
                raise UsageError(f"tensor: {region.path}.{name} has {rows // region.unit} units, "
                                 f"not divisible by parallel.tp={n}; choose a tp dividing it")
            lo, hi = t * rows // n, (t + 1) * rows // n
            new = nn.Linear(lin.in_features, hi - lo, bias=lin.bias is not None)
            with torch.no_grad():
                new.weight.copy_(lin.weight[lo:hi])
                if lin.bias is not None:
                    new.bias.copy_(lin.bias[lo:hi])
            _set(module, name, new.to(lin.weight.device))
            split[f"{region.path}.{name}.weight"] = 0
            if lin.bias is not None:
                split[f"{region.path}.{name}.bias"] = 0
        for j, name in enumerate(region.row):
            lin = module.get_submodule(name)
            assert isinstance(lin, nn.Linear)
            cols = lin.in_features
            lo, hi = t * cols // n, (t + 1) * cols // n
            bias = lin.bias.detach().clone() if lin.bias is not None else None
            _set(module, name, RowParallel(lin.weight.detach()[:, lo:hi].clone(), bias, ex,
                                           key=(8 * i + 2 + 2 * j), seq_dim=seq_dim))
            split[f"{region.path}.{name}.weight"] = 1
        if sequence_parallel:
            module.register_forward_pre_hook(
                lambda _m, args, k=8 * i: (_GatherSeq.apply(args[0], ex, k, plan.seq_dim),
                                           *args[1:]))
        else:
            module.register_forward_pre_hook(
                lambda _m, args, k=8 * i: (_Copy.apply(args[0], ex, k), *args[1:]))
    replicated: tuple[str, ...] = ()
    if sequence_parallel and plan.span:
        key = 8 * len(plan.regions)
        first, last = model.get_submodule(plan.span[0]), model.get_submodule(plan.span[-1])

        def enter(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]
            if x.shape[plan.seq_dim] % n:
                raise UsageError(f"tensor: sequence parallelism needs the sequence length "
                                 f"({x.shape[plan.seq_dim]}) divisible by parallel.tp={n}")
            return (_Split.apply(x, ex, key, plan.seq_dim), *args[1:])

        first.register_forward_pre_hook(enter)
        last.register_forward_hook(
            lambda _m, _a, out: _Unsplit.apply(out, ex, key + 1, plan.seq_dim))
        prefixes = tuple(p + "." for p in plan.span)
        replicated = tuple(name for name, _ in model.named_parameters()
                           if name.startswith(prefixes) and name not in split)
    return Sharded(split, replicated)


def gather_full(model: nn.Module, sharded: Sharded, comm: Comm, into: nn.Module | None) -> None:
    """Write the full parameters into ``into`` (when given) from every tp rank's slices
    (all-gathers tagged control: evaluation, not training). Every tp rank calls it."""
    full = dict(into.named_parameters()) if into is not None else {}
    for name, p in model.named_parameters():
        value = p.detach()
        if name in sharded.split:
            value = torch.cat(comm.all_gather(value.contiguous(), tag="control"),
                              sharded.split[name])
        if into is not None:
            with torch.no_grad():
                full[name].copy_(value)


# --- the strategy -----------------------------------------------------------------------------------
def plan_of(cfg: Any, model: nn.Module, who: str = "method tensor") -> TensorPlan:
    """The model's :class:`TensorPlan` from its registry entry, or a one-line error naming
    ``who`` asked and the models that have one."""
    from thinwire.models import MODELS

    entry = MODELS.get(cfg.model.name)
    if entry.tensor is None:
        offered = [n for n, e in MODELS.entries() if e.tensor is not None]
        raise UsageError(f"{who}: model {cfg.model.name} offers no tensor-parallel plan; "
                         f"use a model that does ({', '.join(offered)})")
    return entry.tensor(model)


def within(plan: TensorPlan, model: nn.Module, part: nn.Module) -> TensorPlan:
    """The regions of ``plan`` whose module lies inside ``part`` (e.g. one pipeline stage of
    ``model``), without a sequence-parallel span: a part of the model is sharded alone."""
    from thinwire.models.tensor_plan import TensorPlan

    inside = {id(m) for m in part.modules()}
    regions = tuple(r for r in plan.regions if id(model.get_submodule(r.path)) in inside)
    return TensorPlan(regions, (), plan.seq_dim, plan.width, plan.seq_len)


def split_dims(model: nn.Module, plan: TensorPlan) -> dict[str, int]:
    """The parameters :func:`shard` splits (name -> dim), without sharding: what
    :attr:`Sharded.split` will hold, for traffic formulas and memory counts."""
    out: dict[str, int] = {}
    for region in plan.regions:
        module = model.get_submodule(region.path)
        for name in region.column:
            out[f"{region.path}.{name}.weight"] = 0
            if getattr(module.get_submodule(name), "bias", None) is not None:
                out[f"{region.path}.{name}.bias"] = 0
        for name in region.row:
            out[f"{region.path}.{name}.weight"] = 1
    return out


class TensorParallel(Strategy):
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

            codec = build(o.codec, seed=self.cfg.train.seed, rank=self.comm.rank)
        self.exchange = Exchange(self.tp_comm, codec)
        self.plan = plan_of(self.cfg, model)
        self.full = model if self.comm.rank == 0 else None
        self.model = copy.deepcopy(model) if self.full is not None else model
        self.model.to(ctx.device)
        self.sharded = shard(self.model, self.plan, self.exchange,
                             sequence_parallel=o.sequence_parallel)
        self.opt = make_optimizer(self.model.parameters(), self.cfg.train)
        params = dict(self.model.named_parameters())
        self._span = [params[n] for n in self.sharded.span_replicated]

    def data_shard(self) -> tuple[int, int]:
        return self.dp_comm.rank, self.dp_comm.world_size

    def sync_grads(self) -> None:
        """After backward: the span's replicated gradients summed over tp (sequence
        parallelism), then every gradient averaged over dp in one all-reduce."""
        if self._span and self.tp_comm.world_size > 1:
            flat = torch.cat([_grad(p).reshape(-1) for p in self._span])
            self.tp_comm.all_reduce(flat, tag="tp")
            _unflatten(flat, self._span)
        if self.dp_comm.world_size > 1:
            params = list(self.model.parameters())
            flat = torch.cat([_grad(p).reshape(-1) for p in params])
            self.dp_comm.all_reduce(flat, op="avg", tag="grad")
            _unflatten(flat, params)

    def train_step(self, batch: Batch, step: int) -> float:
        x, y = batch
        self.exchange.step = step
        set_lr(self.opt, lr_at(self.cfg.train, step))
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.sync_grads()
        self.opt.step()
        return float(loss.detach())

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


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _unflatten(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    i = 0
    for p in params:
        n = p.numel()
        p.grad = flat[i:i + n].view_as(p).clone()
        i += n


# --- checks and traffic ------------------------------------------------------------------------------
def _check(cfg: Any) -> None:
    check(cfg.parallel.pp == 1, "parallel.pp",
          "method tensor splits layers only (pp = 1); for pipeline stages of tensor-parallel "
          "blocks use --method pipeline --parallel.pp S --parallel.tp T")
    check(cfg.train.clip_norm == 0, "train.clip_norm",
          "gradient clipping over tensor-parallel slices is not supported; set 0")


def check_split(cfg: Any, model: nn.Module, who: str = "method tensor") -> TensorPlan:
    """The model's plan splits ``parallel.tp`` ways (one-line errors naming ``who``): the model
    has a plan, no dropout, and tp divides every column layer's units."""
    plan = plan_of(cfg, model, who)
    tp = cfg.parallel.tp
    if getattr(cfg.model.options, "dropout", 0.0):
        raise UsageError(f"{who}: model.dropout must be 0 (the ranks of a tensor-parallel group "
                         "would draw different dropout masks for the same activations)")
    for region in plan.regions:
        module = model.get_submodule(region.path)
        for name in region.column:
            lin = module.get_submodule(name)
            assert isinstance(lin, nn.Linear)
            rows = lin.out_features
            if (rows // region.unit) % tp:
                raise UsageError(f"parallel.tp={tp} does not divide the {rows // region.unit} "
                                 f"units of {region.path}.{name}; choose a tp that does")
    return plan


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
    def of(strategy: TensorParallel, batch: int, seq: int) -> TPShape:
        params = dict(strategy.model.named_parameters())
        return TPShape(len(strategy.plan.regions), batch * seq, strategy.plan.width,
                       sum(p.numel() for p in params.values()),
                       sum(params[n].numel() for n in strategy.sharded.span_replicated))


def traffic_of(shape: TPShape, tp: int, dp: int, steps: int, *, sequence_parallel: bool = False,
               codec: str = "none") -> Traffic:
    """Ledger totals per rank of ``steps`` steps on a dp x tp mesh (module docstring)."""
    comp = None
    if codec != "none":
        from thinwire.compression import build

        comp = build(codec)
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


def tensor_layout(cfg: Any, model: nn.Module, example: torch.Tensor) -> Layout:
    """The model's layout with the run's :class:`TensorLayout`, from the model's plan (no
    sharding): a rank's parameters are its slices of the split ones (:func:`split_dims`) and
    the rest whole; ``example`` (an input batch) gives the sequence length."""
    from thinwire.strategies.traffic import Layout

    plan = plan_of(cfg, model)
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
    return replace(Layout.of_model(model), tensor=TensorLayout(shape, tp))


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
                      sequence_parallel=options.sequence_parallel, codec=options.codec)


def _label(o: Options) -> str:
    parts = ["sp"] if o.sequence_parallel else []
    if o.codec != "none":
        from thinwire.compression import build

        parts.append(build(o.codec).describe())
    return f"tensor({','.join(parts)})" if parts else "tensor"


METHOD = MethodEntry(
    name="tensor", summary="Megatron tensor parallelism (parallel.tp) x data parallelism, "
    "optional sequence parallelism and a codec on the activations",
    strategy="thinwire.strategies.tensor:TensorParallel", options=Options, label=_label,
    check=_check, check_model=_check_model, traffic=traffic, run_layout=tensor_layout,
    planned=False, parallel=("tp",))

__all__ = ["METHOD", "Exchange", "Options", "RowParallel", "Sharded", "TPShape",
           "TensorLayout", "TensorParallel", "check_split", "gather_full", "plan_of", "shard",
           "split_dims", "tensor_layout", "traffic", "traffic_of", "within"]
