"""Hybrid data + model parallelism for recommendation models (``hybrid``), optionally with DCT.

DLRM's hybrid parallelism (Naumov et al., "Deep Learning Recommendation Model for
Personalization and Recommendation Systems", 2019): the embedding tables, which hold almost all
parameters, are split over the workers by table (table t lives on rank t mod n: *model
parallel*); everything else (the MLPs) is replicated (*data parallel*). The tables are the
model's own data, its :class:`~thinwire.models.tensor_plan.EmbeddingPlan` (``ModelEntry
.tables``). One step on rank i's batch of b impressions:

  1. ids: an all-to-all sends each owner the id columns of its tables (int32, b per table);
  2. lookups: each owner looks its tables up for every rank's ids;
  3. forward all-to-all: the vectors [b, tables of owner, dim] go back to the rank whose batch
     they belong to, which assembles [b, T, dim] and runs the model on them;
  4. backward all-to-all: the gradients of those vectors return to the owners (divided by n:
     the global loss is the mean of the ranks' losses), whose tables get them;
  5. the replicated parameters' gradients are averaged with one all-reduce; with
     ``train.clip_norm`` the whole model's norm (the owned tables' squares summed over the
     ranks in one 4-byte all-reduce, the replicated parameters counted once) scales every
     gradient; the optimizer steps (each rank its replica and its own tables).
Steps 1-5 run in the template of :mod:`thinwire.strategies.step` (the pass is
:meth:`HybridStrategy.forward_backward`).
Without DCT the run equals single-process training on the n b impressions of a step, up to
floating-point summation order.

DCT (Gupta et al., "Training Recommender Systems at Scale: Communication-Efficient Model and
Data Parallelism", KDD 2021), ``method.dct=true``: hard thresholds instead of sorting, with the
threshold re-estimated only every ``method.every`` steps.

- DP side (step 5): each rank keeps the entries of its gradient (plus the error-feedback
  residual, our addition after Stich et al. 2018, ``method.ef``) whose magnitude reaches the
  threshold t_g, and sends them as values and int32 indices; t_g is re-estimated as the
  magnitude the top ``dp_keep`` fraction reaches. Counts are all-gathered first (8 bytes), the
  entries sent to every peer; every rank sums the same entries in rank order and divides by n.
- MP side (steps 3-4): the owner sends only the vector entries whose magnitude reaches its
  threshold t_a (values and int32 positions; re-estimated from the top ``mp_keep`` fraction), the
  receiver treats the others as zero, and the backward pass returns gradients only at the kept
  positions (values alone: both sides know them). The entries dropped in the forward pass get no
  gradient, as DCT's "only the most relevant neurons of each sample are updated". The counts of
  the forward message travel first (one int64 per peer).

Bytes: every call goes through :class:`~thinwire.runtime.comm.Comm` (all-to-alls as exact
point-to-point bytes), tagged ``mp`` (ids, vectors, their gradients) or ``grad`` (the DP side);
:func:`traffic_of` gives the uncompressed run's totals exactly (the registry's ``traffic`` over
the run's :class:`HybridLayout`, :func:`hybrid_layout`). DCT's bytes depend on the data and
are what the ledger records; the formula refuses them with one line.

One concept, one file (over 400 lines): the hybrid method (its tables' exchange, DCT, strategy,
checks and traffic formula), as every method lives in one module.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

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
from thinwire.strategies.grads import flatten, grads_of
from thinwire.strategies.step import SteppedStrategy, sq_norm, summed
from thinwire.strategies.traffic import Layout, Traffic, wire

if TYPE_CHECKING:
    from thinwire.models.tensor_plan import EmbeddingPlan


@dataclass(frozen=True)
class Options:
    dct: bool = opt(False, "Dynamic Communication Thresholding (Gupta et al. 2021) on the "
                    "gradients (DP) and on the embedding vectors and their gradients (MP)")
    dp_keep: float = opt(0.01, "DCT: fraction of gradient entries the DP threshold keeps when "
                         "it is re-estimated")
    mp_keep: float = opt(0.05, "DCT: fraction of embedding-vector entries the MP threshold "
                         "keeps when it is re-estimated")
    every: int = opt(50, "DCT: steps between threshold re-estimates")
    ef: bool = opt(True, "DCT: error feedback on the DP side (residuals sent later)")

    def __post_init__(self) -> None:
        check(0 < self.dp_keep <= 1, "method.dp_keep", "must be in (0, 1]")
        check(0 < self.mp_keep <= 1, "method.mp_keep", "must be in (0, 1]")
        check(self.every >= 1, "method.every", "must be >= 1")


def threshold(x: torch.Tensor, keep: float) -> float:
    """The magnitude the top ``keep`` fraction of |x| reaches (at least one entry)."""
    a = x.detach().abs().reshape(-1)
    k = max(1, min(a.numel(), round(keep * a.numel())))
    return float(torch.kthvalue(a, a.numel() - k + 1).values)


def pack(values: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """float32 values and int32 indices as one int32 message [2 k]."""
    return torch.cat([values.float().view(torch.int32), idx.to(torch.int32)])


def unpack(msg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = msg.numel() // 2
    return msg[:k].view(torch.float32), msg[k:].long()


class TableExchange:
    """Steps 1-4 for one rank: which tables it owns, and the all-to-alls (module docstring)."""

    def __init__(self, comm: Comm, plan: EmbeddingPlan, options: Options) -> None:
        self.comm, self.plan, self.o = comm, plan, options
        n = comm.world_size
        self.owned_by = [[t for t in range(len(plan.tables)) if t % n == j] for j in range(n)]
        self.owned = self.owned_by[comm.rank]
        self.t_a = 0.0  # the MP threshold
        self.step = 0

    def fetch_ids(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Step 1: every rank's ids for this rank's tables, [b, owned] per rank."""
        n, b = self.comm.world_size, ids.shape[0]
        sends = [ids[:, self.owned_by[j]].to(torch.int32).contiguous() for j in range(n)]
        recvs = [torch.empty(b, len(self.owned), dtype=torch.int32, device=ids.device)
                 for _ in range(n)]
        self.comm.all_to_all(sends, recvs, tag="mp")
        return recvs

    def forward_vectors(self, local: list[torch.Tensor], b: int) -> tuple[torch.Tensor, Any]:
        """Step 3: send ``local[j]`` [b, owned, dim] to rank j; returns [b, T, dim] and what the
        backward pass needs (the kept positions with DCT)."""
        n, me, dim = self.comm.world_size, self.comm.rank, self.plan.dim
        dev = local[0].device if local else torch.device("cpu")
        shapes = [(b, len(self.owned_by[j]), dim) for j in range(n)]
        recvs: list[torch.Tensor]
        kept_out: list[torch.Tensor | None] = [None] * n
        kept_in: list[torch.Tensor | None] = [None] * n
        if not self.o.dct:
            recvs = [torch.empty(s, device=dev) for s in shapes]
            self.comm.all_to_all([t.detach().contiguous() for t in local], recvs, tag="mp")
        else:
            if self.step % self.o.every == 0:
                others = [local[j] for j in range(n) if j != me]
                if others:
                    self.t_a = threshold(torch.cat([t.reshape(-1) for t in others]),
                                         self.o.mp_keep)
            msgs: list[torch.Tensor] = []
            for j in range(n):
                flat = local[j].detach().reshape(-1)
                if j == me:
                    msgs.append(torch.empty(0, dtype=torch.int32, device=dev))
                    continue
                idx = (flat.abs() >= self.t_a).nonzero().squeeze(1)
                kept_out[j] = idx
                msgs.append(pack(flat[idx], idx))
            counts = [torch.tensor([m.numel()], dtype=torch.int64, device=dev) for m in msgs]
            got = [torch.empty(1, dtype=torch.int64, device=dev) for _ in range(n)]
            self.comm.all_to_all(counts, got, tag="mp")
            bufs = [torch.empty(int(g), dtype=torch.int32, device=dev) for g in got]
            self.comm.all_to_all(msgs, bufs, tag="mp")
            recvs = []
            for j in range(n):
                if j == me:
                    recvs.append(local[j].detach().clone())
                    continue
                values, idx = unpack(bufs[j])
                dense = torch.zeros(shapes[j], device=dev).reshape(-1)
                dense[idx] = values
                kept_in[j] = idx
                recvs.append(dense.view(shapes[j]))
        out = torch.empty(b, len(self.plan.tables), dim, device=dev)
        for j in range(n):
            out[:, self.owned_by[j]] = recvs[j]
        return out, (kept_out, kept_in)

    def backward_vectors(self, grad: torch.Tensor, kept: Any) -> list[torch.Tensor]:
        """Step 4: the gradient of this rank's [b, T, dim] back to the owners; returns the
        gradient of each ``local[j]``, divided by n."""
        n, me = self.comm.world_size, self.comm.rank
        kept_out, kept_in = kept
        b, dim = grad.shape[0], self.plan.dim
        parts = [grad[:, self.owned_by[j]].contiguous() for j in range(n)]
        shape = (b, len(self.owned), dim)
        if not self.o.dct:
            recvs = [torch.empty(shape, device=grad.device) for _ in range(n)]
            self.comm.all_to_all(parts, recvs, tag="mp")
        else:
            sends = [parts[j] if j == me else parts[j].reshape(-1)[kept_in[j]]
                     for j in range(n)]
            bufs = [torch.empty(shape, device=grad.device) if j == me else
                    torch.empty(kept_out[j].numel(), device=grad.device) for j in range(n)]
            self.comm.all_to_all(sends, bufs, tag="mp")
            recvs = []
            for j in range(n):
                if j == me:
                    recvs.append(bufs[j])
                    continue
                dense = torch.zeros(shape, device=grad.device).reshape(-1)
                dense[kept_out[j]] = bufs[j]
                recvs.append(dense.view(shape))
        return [r / n for r in recvs]


class _Vectors(torch.autograd.Function):
    """Steps 3 and 4 as one differentiable operation of the owner's lookups."""

    @staticmethod
    def forward(ctx: Any, ex: TableExchange, b: int, *local: torch.Tensor) -> torch.Tensor:
        out, kept = ex.forward_vectors(list(local), b)
        ctx.ex, ctx.kept = ex, kept
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, None, *ctx.ex.backward_vectors(grad.contiguous(), ctx.kept))


def embedding_plan(cfg: Any, model: nn.Module) -> EmbeddingPlan:
    from thinwire.models import MODELS

    entry = MODELS.get(cfg.model.name)
    if entry.tables is None:
        offered = [n for n, e in MODELS.entries() if e.tables is not None]
        raise UsageError(f"method hybrid: model {cfg.model.name} has no embedding tables to "
                         f"split; use a model that has ({', '.join(offered)})")
    return entry.tables(model)


class HybridStrategy(SteppedStrategy):
    name = "hybrid"

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        super().__init__(ctx, model)
        o: Options = ctx.options
        self.o = o
        self.plan = embedding_plan(self.cfg, model)
        self.model = model.to(ctx.device)
        self.ex = TableExchange(self.comm, self.plan, o)
        self.tables: list[nn.Embedding] = []
        for path in self.plan.tables:
            table = model.get_submodule(path)
            assert isinstance(table, nn.Embedding)
            self.tables.append(table)
        me = self.comm.rank
        for t, table in enumerate(self.tables):
            if t not in self.ex.owned and me != 0:  # rank 0 keeps room to assemble for eval
                table.weight = nn.Parameter(table.weight.detach()[:0].clone())
        table_ids = {id(t.weight) for t in self.tables}
        self.dense = [p for p in self.model.parameters() if id(p) not in table_ids]
        trained = self.dense + [p for t in self.ex.owned for p in self.tables[t].parameters()]
        self.opt = make_optimizer(trained, self.cfg.train)
        self._trained = trained
        self.residual: torch.Tensor | None = None
        self.t_g = 0.0

    def _lookup(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Step 2 for every rank's ids: [b, owned, dim] each."""
        return [torch.stack([self.tables[t](r[:, k].long()) for k, t in enumerate(self.ex.owned)],
                            dim=1) if self.ex.owned else
                torch.empty(r.shape[0], 0, self.plan.dim, device=r.device)
                for r in self.ex.fetch_ids(ids)]

    def sync_dense(self, step: int) -> None:
        """Step 5: the replicated gradients averaged over the ranks (DCT: thresholded)."""
        n = self.comm.world_size
        if n == 1:
            return
        flat = flatten(grads_of(self.dense))
        if not self.o.dct:
            self.comm.all_reduce(flat, op="avg", tag="grad")
        else:
            corrected = flat + self.residual if self.residual is not None else flat
            if step % self.o.every == 0:
                self.t_g = threshold(corrected, self.o.dp_keep)
            idx = (corrected.abs() >= self.t_g).nonzero().squeeze(1)
            if self.o.ef:
                self.residual = corrected.clone()
                self.residual[idx] = 0
            msg = pack(corrected[idx], idx)
            counts = self.comm.all_gather(torch.tensor([msg.numel()], device=flat.device),
                                          tag="grad")
            bufs = [torch.empty(int(c), dtype=torch.int32, device=flat.device) for c in counts]
            self.comm.all_to_all([msg] * n, bufs, tag="grad")
            flat = torch.zeros_like(flat)
            for buf in bufs:  # rank order: the same sum everywhere
                values, where = unpack(buf)
                flat.index_add_(0, where, values)
            flat.div_(n)
        i = 0
        for p in self.dense:
            p.grad = flat[i:i + p.numel()].view_as(p).clone()
            i += p.numel()

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.opt]

    def modules_to_train(self) -> list[nn.Module]:
        return [self.model]

    def forward_backward(self, batch: Batch, step: int) -> torch.Tensor:
        """Steps 1-5's exchange: ids, lookups, vectors and their gradients, the dense average."""
        x, y = batch
        self.ex.step = step
        start = self.plan.id_start
        ids = x[:, start:start + len(self.plan.tables)].long()
        vectors = _Vectors.apply(self.ex, x.shape[0], *self._lookup(ids))
        loss = self.loss_fn(self.model(x, **{self.plan.lookup: vectors}), y)
        loss.backward()
        self.sync_dense(step)
        return loss

    def grad_norm_sq(self) -> torch.Tensor:
        """The owned tables' squares summed over the ranks, the replicated MLPs' once."""
        owned = [p for t in self.ex.owned for p in self.tables[t].parameters()]
        return summed(sq_norm(owned, self.ctx.device), self.comm) + \
            sq_norm(self.dense, self.ctx.device)

    def eval_model(self) -> nn.Module | None:
        """Rank 0 receives every table it does not own from its owner (tagged control)."""
        me = self.comm.rank
        for t, table in enumerate(self.tables):
            owner = t % self.comm.world_size
            if owner == 0:
                continue
            buf = (table.weight.data if me in (0, owner) else
                   torch.empty(table.num_embeddings, self.plan.dim, device=table.weight.device))
            self.comm.broadcast(buf, src=owner, tag="control")
        return self.model if me == 0 else None

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                "dct": {"t_a": self.ex.t_a, "t_g": self.t_g,
                        "residual": self.residual if self.residual is not None else
                        torch.zeros(0)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        d = state["dct"]
        self.ex.t_a, self.t_g = float(d["t_a"]), float(d["t_g"])
        self.residual = d["residual"] if d["residual"].numel() else None

    def memory(self) -> MemoryReport:
        return memory_of(self._trained, self.opt)


def traffic_of(batch: int, tables: int, dim: int, dense_params: int, workers: int,
               steps: int, *, clip: bool = False) -> Traffic:
    """Ledger totals per rank of ``steps`` uncompressed hybrid steps (tables dealt t mod n):
    per step the ids (int32) out and back's mirror, the vectors forward, their gradients
    backward (all exact point-to-point bytes), one all-reduce of the replicated gradients and,
    with ``clip`` (``train.clip_norm`` > 0), one of the 4-byte squared norm."""
    n = workers
    if n <= 1:
        return Traffic.none(n)
    owned = [len(range(j, tables, n)) for j in range(n)]
    sent, recv = [], []
    grad = wire("all_reduce", 4 * dense_params, n)
    norm = wire("all_reduce", 4, n) if clip else 0
    ar = grad + norm
    for me in range(n):
        others = sum(owned[j] for j in range(n) if j != me)
        ids_out, ids_in = 4 * batch * others, 4 * batch * owned[me] * (n - 1)
        vec_out, vec_in = 4 * batch * owned[me] * dim * (n - 1), 4 * batch * others * dim
        s = ids_out + vec_out + vec_in + ar  # backward mirrors the forward vectors
        r = ids_in + vec_in + vec_out + ar
        sent.append(s * steps)
        recv.append(r * steps)
    pay = [s - ar * steps + 4 * (dense_params + clip) * steps for s in sent]
    return Traffic(tuple(sent), tuple(recv), tuple(pay),
                   {"all_to_all": (3 * steps, sent[0] - ar * steps),
                    "all_reduce": ((1 + clip) * steps, ar * steps)})


@dataclass(frozen=True)
class HybridLayout:
    """A hybrid run in a :class:`~thinwire.strategies.traffic.Layout` (``Layout.tables``):
    what :func:`traffic_of` reads of the model and the batch."""

    batch: int
    tables: int
    dim: int
    dense_params: int


def hybrid_layout(cfg: Any, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
                  ) -> Layout:
    """The model's layout with the run's :class:`HybridLayout`: its embedding plan's tables
    and width, the parameters outside the tables, ``train.batch_size`` and ``train.clip_norm``
    (``batch``, one step's inputs and targets, is not needed: the ids are fixed columns)."""
    del batch
    plan = embedding_plan(cfg, model)
    table_ids = {id(p) for path in plan.tables for p in model.get_submodule(path).parameters()}
    dense = sum(p.numel() for p in model.parameters() if id(p) not in table_ids)
    run = HybridLayout(cfg.train.batch_size, len(plan.tables), plan.dim, dense)
    return replace(Layout.of_model(model), tables=run, clip=cfg.train.clip_norm > 0)


def traffic(layout: Layout, options: Options, workers: int, steps: int, seed: int,
            optimizer_states: int = 0) -> Traffic:
    """The ledger's totals per rank after ``steps`` steps (:func:`traffic_of` of the run's
    :class:`HybridLayout`); DCT's data-dependent bytes are refused with one line."""
    del seed, optimizer_states
    if options.dct:
        raise UsageError("method hybrid with method.dct: its bytes depend on the data (the "
                         "thresholds keep what the values reach), so no formula predicts "
                         "them; the run's ledger records them")
    run = layout.tables
    if not isinstance(run, HybridLayout):
        raise UsageError("the hybrid method's traffic needs the run's shapes: build the layout "
                         "with thinwire.strategies.hybrid.hybrid_layout")
    return traffic_of(run.batch, run.tables, run.dim, run.dense_params, workers, steps,
                      clip=layout.clip)


def _label(o: Options) -> str:
    return f"hybrid+dct(dp={o.dp_keep:g},mp={o.mp_keep:g},T={o.every})" if o.dct else "hybrid"


def _check_model(cfg: Any, model: nn.Module) -> None:
    embedding_plan(cfg, model)


class HybridEntry(MethodEntry, HasRunLayout):
    """hybrid's registry entry: its traffic reads the run's :class:`HybridLayout`."""

    def run_layout(self, cfg: Any, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
                   ) -> Layout:
        return hybrid_layout(cfg, model, batch)


METHOD = HybridEntry(
    name="hybrid", summary="DLRM hybrid parallelism: embedding tables split by table (all-to-all),"
    " MLPs data parallel; optional DCT thresholding (Gupta et al. 2021)",
    strategy="thinwire.strategies.hybrid:HybridStrategy", options=Options, label=_label,
    check_model=_check_model, traffic=traffic)

__all__ = ["METHOD", "HybridStrategy", "HybridLayout", "Options", "TableExchange", "hybrid_layout",
           "threshold", "traffic", "traffic_of"]
