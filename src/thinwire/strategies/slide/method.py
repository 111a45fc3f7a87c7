"""Distributed SLIDE (``slide``): the wide output layer's neurons sharded over the workers, each
shard with its own LSH tables; the layers below it data parallel.

Distributed SLIDE (Yan, Wang, Chen, Shrivastava et al., "Distributed SLIDE: Enabling Training
Large Neural Networks on Low Bandwidth and Simple CPU-Clusters via Model Parallelism and
Sparsity", arXiv 2201.12667) splits SLIDE's wide layer (Chen et al., MLSys 2020;
:class:`~thinwire.strategies.slide.layer.SLIDELayer`) over nodes: node r owns neurons
[r C / n, (r + 1) C / n) and hashes them into its own tables (hash functions drawn from the run's
seed, shared, so a neuron's codes do not depend on where it lives). The model is any module
with ``features(x)`` (the hidden activations) and ``wide`` (an ``nn.Linear``), e.g.
:class:`~thinwire.models.xmlp.XMLP`. One step, every rank on its own batch of b examples
(G = n b in all):

  1. forward of the replicated lower layers: h = features(x) [b, H];
  2. all-gather h and the labels (int32 [b, Y]): every rank holds the step's G rows;
  3. each rank retrieves its shard's active neurons for the G rows (its tables, plus the labels
     that fall in its shard) and computes their logits only;
  4. the softmax is normalised across shards: an all-reduce (max) of the per-row maxima m, then
     one all-reduce (sum) of [sum_j exp(z_j - m), sum of the label logits] per row;
     loss_i = m_i + log S_i - (label logits)_i / |labels_i|, the step's loss their mean;
  5. each shard's logit gradients (softmax - target) / G flow back into its active rows (sparse
     updates) and into the G rows of h; the hidden gradient is summed over shards with a
     reduce-scatter that leaves each rank the sum for its own b rows;
  6. backward of the lower layers; their gradients are summed with one all-reduce (the loss is
     the global mean, so the sum is the gradient of one process on all G rows);
  7. with ``train.clip_norm`` the whole model's norm (the shards' squares summed over the ranks
     in one 4-byte all-reduce, the replicated lower layers' counted once) scales every gradient,
     sparse rows included; both optimizers step (the shard's on sparse gradients: plain SGD or,
     with ``adamw``, :class:`torch.optim.SparseAdam`); each shard counts the update and
     rebuilds its tables from its current weights on SLIDE's schedule.

Steps 1-7 run in the template of :mod:`thinwire.strategies.step` (the pass is
:meth:`SlideStrategy.forward_backward`).

``method.lower=replicate`` trades step 6's all-reduce, whose size grows with the lower layers
(the input matrix of a sparse network: features x hidden), for work: the inputs are all-gathered
in step 2 (4 b 2 P bytes for P non-zeros a row), every rank runs the lower layers on all G rows,
and the hidden gradient is all-reduced (4 G H) instead of reduce-scattered, so every rank
computes the same lower gradients and no parameter crosses the wire: the traffic of a step is of
the order of batch x hidden width, as Distributed SLIDE's.

``method.full=true`` makes every neuron of a shard active (dense logits, dense updates): the
same network trained by dense model parallelism, the Horovod-style baseline of the paper
(shorthand ``dense-mp``); ``dp`` on the same model is the dense data-parallel one.

Parity: n ranks equal one process holding all n shards (:class:`SlideStrategy` with ``shards=n`` on
:meth:`~thinwire.runtime.comm.Comm.local`) on the concatenated batches, up to the order of
floating-point sums. Every message goes through :class:`~thinwire.runtime.comm.Comm`, tagged
``mp`` (steps 2, 4, 5) or ``grad`` (step 6); :func:`traffic_of` gives the ledger exactly.
Checkpoints hold each rank's shard, its tables (sorted ids, offsets, hash functions), its
schedule and both optimizers: a resumed run is the uninterrupted one bit for bit.

One concept, one file (over 400 lines): the slide method (its strategy, checks and traffic
formula), as every method lives in one module.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from thinwire.errors import UsageError
from thinwire.options import check, opt
from thinwire.strategies.base import (
    Batch,
    Context,
    MemoryReport,
    make_optimizer,
)
from thinwire.strategies.entry import (
    HasRunLayout,
    MethodEntry,
    Shares,
    WideShapes,
    WorkerShare,
)
from thinwire.strategies.slide.layer import SLIDELayer
from thinwire.strategies.slide.lsh import FAMILIES, SAMPLINGS
from thinwire.strategies.step import SteppedStrategy, sq_norm, summed
from thinwire.strategies.traffic import Layout, Traffic, wire

LOWER = ("average", "replicate")


@dataclass(frozen=True)
class Options:
    family: str = opt("simhash", "LSH family: simhash (dense inputs) or dwta (sparse inputs)",
                      choices=FAMILIES)
    K: int = opt(8, "hashes per code (SimHash: 2^K buckets a table)")
    L: int = opt(50, "hash tables per shard")
    active: float = opt(0.01, "retrieved neurons per sample, a fraction of the layer (labels "
                        "come on top)")
    bucket: int = opt(32, "neurons read from each hit bucket")
    sampling: str = opt("vanilla", "how the retrieved neurons are chosen: vanilla (tables in a "
                        "random order per sample until the budget is met) or topk (the "
                        "candidates of all L tables ranked by how many tables returned them)",
                        choices=SAMPLINGS)
    rebuild_first: int = opt(50, "updates before the first table rebuild")
    rebuild_growth: float = opt(1.5, "each rebuild interval this times the previous")
    bin_size: int = opt(8, "DWTA: coordinates each hash looks at")
    range_bits: int = opt(12, "DWTA: bits of a table's code")
    full: bool = opt(False, "every neuron active: dense model parallelism (the baseline)")
    lower: str = opt("average", "the layers below the wide one: average (data parallel, their "
                     "gradients all-reduced) or replicate (every rank runs them on all G rows "
                     "from all-gathered inputs; the hidden gradient is all-reduced instead)",
                     choices=LOWER)

    def __post_init__(self) -> None:
        check(1 <= self.K <= 16, "method.K", "must be in [1, 16] (2^K buckets a table)")
        check(1 <= self.L <= 1000, "method.L", "must be in [1, 1000]")
        check(0 < self.active <= 1, "method.active", "must be in (0, 1]")
        check(1 <= self.bucket <= 4096, "method.bucket", "must be in [1, 4096]")
        check(self.rebuild_first >= 1, "method.rebuild_first", "must be >= 1")
        check(1 <= self.rebuild_growth <= 100, "method.rebuild_growth", "must be in [1, 100]")
        check(2 <= self.bin_size <= 1024, "method.bin_size", "must be in [2, 1024]")
        check(1 <= self.range_bits <= 18, "method.range_bits", "must be in [1, 18]")


def shard_range(C: int, n: int, r: int) -> tuple[int, int]:
    """Neurons [lo, hi) of shard r of n (contiguous, sizes differing by at most one)."""
    return r * C // n, (r + 1) * C // n


def budget_of(o: Options, width: int) -> int:
    """Retrieved neurons per sample in a shard of ``width`` neurons."""
    return max(1, min(width, round(o.active * width)))


def check_wide_model(model: nn.Module) -> nn.Linear:
    wide = getattr(model, "wide", None)
    if not isinstance(wide, nn.Linear) or not callable(getattr(model, "features", None)):
        from thinwire.models import MODELS

        fit = [n for n, e in MODELS.entries() if "extreme" in e.data_kinds]
        raise UsageError("method slide needs a model with features(x) and a wide nn.Linear "
                         f"output layer 'wide'; use --model.name {' or '.join(fit)}")
    return wide


class SlideStrategy(SteppedStrategy):
    """Steps 1-7 of the module docstring for this rank's shard (all ``shards`` in one process
    on a local communicator)."""

    name = "slide"

    def __init__(self, ctx: Context, model: nn.Module, *, shards: int | None = None) -> None:
        super().__init__(ctx, model)
        o: Options = ctx.options
        self.o = o
        wide = check_wide_model(model)
        n = self.comm.world_size
        self.shards = shards if shards is not None else n
        if n > 1 and self.shards != n:
            raise ValueError("shards must equal the world size on a process group")
        self.model: Any = model.to(ctx.device)  # its ``features`` and ``wide`` (checked above)
        C, H = wide.out_features, wide.in_features
        self.C, self.H = C, H
        mine = [self.comm.rank] if n > 1 else list(range(self.shards))
        seed = self.cfg.train.seed
        self.parts: list[SLIDELayer] = []
        for r in mine:
            lo, hi = shard_range(C, self.shards, r)
            self.parts.append(SLIDELayer(
                H, hi - lo, family_name=o.family, K=o.K, L=o.L, budget=budget_of(o, hi - lo),
                bucket=o.bucket, bin_size=o.bin_size, range_bits=o.range_bits,
                rebuild_first=o.rebuild_first, rebuild_growth=o.rebuild_growth, offset=lo,
                seed=seed, weight=wide.weight.detach()[lo:hi], bias=wide.bias.detach()[lo:hi],
                sampling=o.sampling, device=ctx.device))
        if self.comm.rank != 0:  # rank 0 keeps room to assemble the layer for evaluation
            wide.weight = nn.Parameter(wide.weight.detach()[:0].clone())
            wide.bias = nn.Parameter(wide.bias.detach()[:0].clone())
        wide_ids = {id(wide.weight), id(wide.bias)}
        self.lower = [p for p in self.model.parameters() if id(p) not in wide_ids]
        self.opt = make_optimizer(self.lower, self.cfg.train)
        wide_params = [p for part in self.parts for p in part.parameters()]
        t = self.cfg.train
        if o.full:
            self.wide_opt: Any = make_optimizer(wide_params, t)
        elif t.optimizer == "adamw":
            self.wide_opt = torch.optim.SparseAdam(wide_params, lr=t.lr)
        else:
            self.wide_opt = torch.optim.SGD(wide_params, lr=t.lr)

    # --- one step -----------------------------------------------------------------------------
    def _gather(self, h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 2."""
        if self.comm.world_size == 1:
            return h.detach(), y
        hs = self.comm.all_gather(h.detach().contiguous(), tag="mp")
        ys = self.comm.all_gather(y.to(torch.int32).contiguous(), tag="mp")
        return torch.cat(hs), torch.cat(ys).long()

    def _logits(self, part: SLIDELayer, h: torch.Tensor, y: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 3: a shard's logits [G, A] and the indicator of its label slots."""
        local = part.local_labels(y)
        assert local is not None  # training batches carry labels
        if self.o.full:
            z = part.dense(h)
            t = torch.zeros(z.shape, dtype=torch.bool, device=z.device)
            rows = torch.arange(z.shape[0], device=z.device).unsqueeze(1).expand_as(local)
            keep = local >= 0
            t[rows[keep], local[keep]] = True
            return z, t
        ids, mask = part.active(h, y)
        z = part(h, ids, mask)
        t = (ids.unsqueeze(-1) == local.unsqueeze(1)).any(-1) & mask
        return z, t

    def sharded_loss(self, h_all: torch.Tensor, y_all: torch.Tensor) -> torch.Tensor:
        """Steps 3-5 on the G rows: backpropagates into the shards and ``h_all`` (a leaf);
        returns the per-row losses [G]."""
        G = h_all.shape[0]
        outs = [self._logits(p, h_all, y_all) for p in self.parts]
        with torch.no_grad():
            m = torch.stack([z.max(1).values for z, _ in outs]).max(0).values
            self.comm.all_reduce(m, op="max", tag="mp")
            stats = torch.zeros(2, G, device=h_all.device)
            for z, t in outs:
                e = torch.exp(z - m.unsqueeze(1))
                stats[0] += e.sum(1)
                stats[1] += torch.where(t, z, torch.zeros_like(z)).sum(1)
            self.comm.all_reduce(stats, op="sum", tag="mp")
            cnt = (y_all >= 0).sum(1).clamp(min=1).float()
            loss = m + torch.log(stats[0]) - stats[1] / cnt
            grads = [((torch.exp(z - m.unsqueeze(1)) / stats[0].unsqueeze(1))
                      - t.float() / cnt.unsqueeze(1)) / G for z, t in outs]
        torch.autograd.backward([z for z, _ in outs], grads)
        return loss

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.opt, self.wide_opt]

    def modules_to_train(self) -> list[nn.Module]:
        return [self.model]

    def forward_backward(self, batch: Batch, step: int) -> torch.Tensor:
        """Steps 1-6; returns the per-row losses of the step's G rows."""
        x, y = batch
        n = self.comm.world_size
        if self.o.lower == "replicate":  # 1-2 on all G rows: inputs gathered, h computed here
            if n > 1:
                x = torch.cat(self.comm.all_gather(x.contiguous(), tag="mp"))
                y = torch.cat(self.comm.all_gather(y.to(torch.int32).contiguous(),
                                                   tag="mp")).long()
            h = self.model.features(x)
            h_all = h.detach()
        else:
            h = self.model.features(x)  # 1
            h_all, y = self._gather(h, y)  # 2
        h_all = h_all.requires_grad_(True)
        loss = self.sharded_loss(h_all, y)  # 3-5
        g = h_all.grad
        assert g is not None
        if n > 1:
            g = (self.comm.all_reduce(g, op="sum", tag="mp") if self.o.lower == "replicate"
                 else self.comm.reduce_scatter(g, tag="mp"))
        h.backward(g)  # 6
        if self.o.lower == "average":
            self._sum_lower()
        return loss

    def grad_norm_sq(self) -> torch.Tensor:
        """The shards' squares (sparse rows) summed over the ranks, the lower layers' once."""
        wide = [q for part in self.parts for q in part.parameters()]
        return summed(sq_norm(wide, self.ctx.device), self.comm) + \
            sq_norm(self.lower, self.ctx.device)

    def after_step(self) -> None:
        """Step 7's end (the optimizers have stepped): each shard counts the update."""
        for part in self.parts:
            part.updated()

    def reduce_loss(self, loss: torch.Tensor | float) -> float:
        return float(loss.mean()) if isinstance(loss, torch.Tensor) else float(loss)

    def _sum_lower(self) -> None:
        if self.comm.world_size == 1:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.lower])
        self.comm.all_reduce(flat, op="sum", tag="grad")
        i = 0
        for p in self.lower:
            p.grad = flat[i:i + p.numel()].view_as(p).clone()
            i += p.numel()

    # --- evaluation, state, memory ------------------------------------------------------------
    def eval_model(self) -> nn.Module | None:
        """Rank 0 assembles the wide layer: its own shard copied, the others broadcast from
        their owners (tagged control)."""
        wide = self.model.wide
        me, n = self.comm.rank, self.comm.world_size
        with torch.no_grad():
            for k, part in enumerate(self.parts):
                if me == 0:
                    r = k if n == 1 else 0
                    lo, hi = shard_range(self.C, self.shards, r)
                    wide.weight[lo:hi] = part.weight
                    wide.bias[lo:hi] = part.bias.squeeze(-1)
            for r in range(1, n):
                lo, hi = shard_range(self.C, n, r)
                if me == r:
                    w, b = self.parts[0].weight.data, self.parts[0].bias.data.squeeze(-1)
                else:
                    w = torch.empty(hi - lo, self.H, device=self.ctx.device)
                    b = torch.empty(hi - lo, device=self.ctx.device)
                self.comm.broadcast(w, src=r, tag="control")
                self.comm.broadcast(b.contiguous(), src=r, tag="control")
                if me == 0:
                    wide.weight[lo:hi] = w
                    wide.bias[lo:hi] = b
        return self.model if me == 0 else None

    def state_dict(self) -> dict[str, Any]:
        lower = {k: v for k, v in self.model.state_dict().items()
                 if not k.startswith("wide.")}
        return {"lower": lower, "opt": self.opt.state_dict(),
                "wide_opt": self.wide_opt.state_dict(),
                "parts": [{"weight": p.weight.detach(), "bias": p.bias.detach(),
                           "slide": p.slide_state()} for p in self.parts]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["lower"], strict=False)
        with torch.no_grad():
            for p, s in zip(self.parts, state["parts"]):
                p.weight.copy_(s["weight"])
                p.bias.copy_(s["bias"])
                p.load_slide_state(s["slide"])
        self.opt.load_state_dict(state["opt"])
        self.wide_opt.load_state_dict(state["wide_opt"])

    def memory(self) -> MemoryReport:
        """Parameters and optimizer state measured from the tensors; gradients: the lower
        layers' dense ones and the shards' sparse ones as held after the last backward."""
        from thinwire.strategies.base import optimizer_bytes

        wide = [q for p in self.parts for q in p.parameters()]
        params = self.lower + wide
        p_bytes = sum(q.numel() * q.element_size() for q in params)
        g_bytes = sum(q.numel() * q.element_size() for q in self.lower)
        for q in wide:
            g = q.grad
            if g is not None:
                g_bytes += (g._values().numel() * g._values().element_size()
                            + g._indices().numel() * 8) if g.is_sparse else \
                    g.numel() * g.element_size()
        return MemoryReport(params=p_bytes, grads=g_bytes,
                            optimizer=optimizer_bytes(self.opt) + optimizer_bytes(self.wide_opt),
                            param_count=sum(q.numel() for q in params),
                            activations=self.meter.peak)


# --- traffic ------------------------------------------------------------------------------------
def traffic_of(batch: int, hidden: int, label_cols: int, lower_params: int, workers: int,
               steps: int, *, lower: str = "average", input_cols: int = 0,
               clip: bool = False) -> Traffic:
    """Ledger totals per rank of ``steps`` steps (module docstring). ``average``: all-gathers
    of h (4 b H) and the labels (4 b Y), all-reduces of the maxima (4 G) and the sums (8 G), a
    reduce-scatter of the hidden gradient (4 G H) and an all-reduce of the lower gradients
    (4 D); G = n b. ``replicate``: all-gathers of the inputs (4 b 2 P, P = ``input_cols``)
    and labels, the same two all-reduces, an all-reduce of the hidden gradient (4 G H). With
    ``clip`` (``train.clip_norm`` > 0) one more all-reduce, of the 4-byte squared norm."""
    n = workers
    if n <= 1:
        return Traffic.none(n)
    G = n * batch
    if lower == "replicate":
        gathers = [4 * batch * 2 * input_cols, 4 * batch * label_cols]
        reduces = [4 * G, 8 * G, 4 * G * hidden]
        scatter = 0
    else:
        gathers = [4 * batch * hidden, 4 * batch * label_cols]
        reduces = [4 * G, 8 * G, 4 * lower_params]
        scatter = 4 * G * hidden
    if clip:
        reduces.append(4)
    g_b = sum(wire("all_gather", p, n) for p in gathers)
    r_b = sum(wire("all_reduce", p, n) for p in reduces)
    s_b = wire("reduce_scatter", scatter, n) if scatter else 0
    per = g_b + r_b + s_b
    pay = sum(gathers) + sum(reduces) + scatter
    calls = {"all_gather": (2 * steps, g_b * steps),
             "all_reduce": (len(reduces) * steps, r_b * steps)}
    if scatter:
        calls["reduce_scatter"] = (steps, s_b * steps)
    return Traffic((per * steps,) * n, (per * steps,) * n, (pay * steps,) * n, calls)


@dataclass(frozen=True)
class SlidePlan:
    """What one rank of a slide run holds and moves (:func:`plan`)."""

    params: int
    """Bytes of parameters: the lower layers and the rank's shard of the wide layer."""
    optimizer: int
    """Bytes of Adam's two moments of both (SparseAdam keeps them dense for the shard)."""
    tables: int
    """Bytes of the shard's hash tables (sorted ids and bucket offsets, int64)."""
    bytes_per_step: int
    """Wire bytes a rank sends a step (:func:`traffic_of`)."""
    flops_per_step: float
    """Multiply-adds x 2 of a step on one rank: lower layers, hashing, active logits."""
    updated: int = 0
    """Parameters its optimizers update a step, at most: the lower layers (dense) and the
    shard's rows active for some sample (sparse; every row for dense-mp)."""

    def step_seconds(self, flops_per_s: float, link_bytes_per_s: float) -> float:
        """Compute and communication added (no overlap: the step's messages are sequential)."""
        return self.flops_per_step / flops_per_s + self.bytes_per_step / link_bytes_per_s


def plan(*, features: int, hidden: int, labels: int, batch: int, workers: int, nnz: int,
         label_cols: int, active: float, K: int = 8, L: int = 50, full: bool = False,
         lower: str = "average") -> SlidePlan:
    """A slide run's memory, bytes and step work per rank from its shapes, the active fraction
    an input (``full``: every neuron, dense-mp). ``features`` x ``hidden`` is the lower layers'
    input matrix, ``labels`` the wide layer's width, ``nnz`` the non-zeros of an input row."""
    n, b, H = workers, batch, hidden
    G = n * b
    width = labels // n + (1 if labels % n else 0)
    lower_params = features * H + H
    shard = width * (H + 1)
    A = width if full else budget_of(Options(active=active, K=K, L=L), width) + label_cols
    rows = G if lower == "replicate" else b
    flops = 2.0 * 3 * rows * nnz * H  # the input matrix, forward and backward
    flops += 0 if full else 2.0 * G * H * K * L  # SimHash codes of the G rows
    flops += 2.0 * 3 * G * A * H  # active logits, their weight and hidden gradients
    t = traffic_of(b, H, label_cols, lower_params, n, 1, lower=lower, input_cols=nnz)
    return SlidePlan(params=4 * (lower_params + shard), optimizer=8 * (lower_params + shard),
                     tables=0 if full else 8 * L * (width + (1 << K) + 1),
                     bytes_per_step=t.sent[0], flops_per_step=flops,
                     updated=lower_params + min(width, G * A) * (H + 1))


def run_layout(cfg: Any, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Layout:
    """``thinwire plan --config`` of a slide run: the model's parameters and the run's shapes
    (:class:`~thinwire.strategies.entry.WideShapes`) from its wide layer, its lower parameters
    (XMLP's input matrix plus its bias: features = (lower - hidden) / hidden) and one step's
    batch (inputs [b, 2, P]: the batch and P; labels [b, Y]: the label slots); whether the run
    clips (``train.clip_norm``)."""
    example, labels = batch
    wide = check_wide_model(model)
    H = wide.in_features
    wide_ids = {id(wide.weight), id(wide.bias)}
    lower = sum(p.numel() for p in model.parameters() if id(p) not in wide_ids)
    if lower < H or (lower - H) % H:
        raise UsageError(f"method slide prices the lower layers as an input matrix of features x "
                         f"{H} plus a bias; this model's {lower} lower parameters are not; "
                         "price it with thinwire plan --model FILE.toml (kind = \"extreme\")")
    shapes = WideShapes(features=(lower - H) // H, hidden=H, labels=wide.out_features,
                       nnz=int(example.shape[2]), label_cols=int(labels.shape[1]),
                       batch=int(example.shape[0]))
    return dataclasses.replace(Layout.of_model(model), wide=shapes,
                               clip=cfg.train.clip_norm > 0)


def _shapes(layout: Layout) -> Any:
    """The extreme-classification shapes the planner's layout carries (one-line error if
    none)."""
    wide = layout.wide
    if wide is None:
        raise UsageError("method slide shards a wide output layer: price it on an extreme-"
                         "classification model (--model xmlp-amazon-670k or a kind = \"extreme\" "
                         "file)")
    return wide


def traffic(layout: Layout, options: Options, workers: int, steps: int, seed: int,
            optimizer_states: int = 0) -> Traffic:
    """The ledger's totals per rank after ``steps`` steps (:func:`traffic_of` of the layout's
    extreme-classification shapes, ``layout.wide``)."""
    del seed, optimizer_states
    w = _shapes(layout)
    return traffic_of(w.batch, w.hidden, w.label_cols, w.features * w.hidden + w.hidden,
                      workers, steps, lower=options.lower, input_cols=w.nnz,
                      clip=layout.clip)


def share(layout: Layout, options: Options, workers: int) -> WorkerShare:
    """One rank's part for the planner (:func:`plan` of the layout's shapes at the options'
    active fraction, K and L): the lower layers and its shard, the step's work per sample of
    its batch, its hash tables."""
    w = _shapes(layout)
    if w.labels < workers:
        raise UsageError(f"method slide: the wide layer's {w.labels} neurons cannot be split "
                         f"over {workers} workers; use fewer workers or a wider layer")
    p = plan(features=w.features, hidden=w.hidden, labels=w.labels, batch=w.batch,
             workers=workers, nnz=w.nnz, label_cols=w.label_cols, active=options.active,
             K=options.K, L=options.L, full=options.full, lower=options.lower)
    return WorkerShare(params=p.params / 4, flops_per_sample=p.flops_per_step / w.batch,
                       other_bytes=float(p.tables), updated=p.updated)


def _label(o: Options) -> str:
    topk = ",topk" if o.sampling == "topk" else ""
    name = "dense-mp" if o.full else \
        f"slide({o.family},K={o.K},L={o.L},active={o.active:g}{topk})"
    return name + ("[replicate]" if o.lower == "replicate" else "")


def _check(cfg: Any) -> None:
    t, o = cfg.train, cfg.method.options
    if not o.full:
        check(t.weight_decay == 0, "train.weight_decay",
              "the sparse updates of method slide take no weight decay; use 0")
        check(t.optimizer == "adamw" or t.momentum == 0, "train.momentum",
              "sparse SGD of method slide takes no momentum; use 0 or --train.optimizer adamw")


def _check_model(cfg: Any, model: nn.Module) -> None:
    wide = check_wide_model(model)
    n = cfg.runtime.workers
    if wide.out_features < n:
        raise UsageError(f"method slide: the wide layer's {wide.out_features} neurons cannot be "
                         f"split over {n} workers; use fewer workers or a wider layer")


def _alias(name: str, values: Any) -> dict[str, str] | None:
    """``dense-mp``: the same sharded layer with every neuron active."""
    if name != "dense-mp":
        return None
    return {"name": "slide", "full": "true", **dict(values)}


class SlideEntry(MethodEntry, HasRunLayout, Shares):
    """slide's registry entry: its traffic reads the run's wide-layer shapes, and a worker
    holds its shard of the wide layer (:func:`share`)."""

    def run_layout(self, cfg: Any, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
                   ) -> Layout:
        return run_layout(cfg, model, batch)

    def share(self, layout: Layout, options: Options, workers: int) -> WorkerShare:
        return share(layout, options, workers)


METHOD = SlideEntry(
    name="slide", summary="Distributed SLIDE: the wide layer sharded over workers with LSH-"
    "selected active neurons (sparse), lower layers data parallel (Yan et al. 2022)",
    strategy="thinwire.strategies.slide.method:SlideStrategy", options=Options, label=_label,
    check=_check, check_model=_check_model, alias=_alias, traffic=traffic,
    defaults={"train.optimizer": "adamw", "train.lr": "0.001"}, model_kinds=("extreme",))

__all__ = ["METHOD", "Options", "SlideStrategy", "SlidePlan", "plan", "run_layout",
           "shard_range", "share", "traffic", "traffic_of"]
