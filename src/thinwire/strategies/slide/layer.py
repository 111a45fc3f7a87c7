"""A SLIDE layer for a user's own model and loop: a wide linear layer computed on an active set.

SLIDE (Chen et al., MLSys 2020) trains a wide layer by computing, for each sample, only the
neurons its locality-sensitive hash codes retrieve (:mod:`thinwire.strategies.slide.lsh`),
plus, in training, the neurons of its true labels. One training step of :class:`SLIDELayer`:

  1. ``active(h, labels)``: per sample a fixed number of neurons, ``budget`` retrieved from the
     L tables plus the sample's labels: ids [B, A], mask [B, A]; ``sampling="vanilla"`` (the
     default) reads the tables in a random order per sample until the budget is met (SLIDE's
     vanilla sampling; about budget / ``bucket`` + 1 tables read), ``sampling="topk"`` ranks
     the candidates of all L tables by how many tables returned them (SLIDE's frequency
     ranking);
  2. ``forward(h, ids, mask)``: the logits of those neurons only, W[ids] . h + b[ids]
     ([B, A], -inf on empty slots), gathered with ``torch.nn.functional.embedding(...,
     sparse=True)``, so the backward pass touches only the active rows: the weight's gradient is
     a sparse tensor of B A rows (train it with :class:`torch.optim.SparseAdam` or plain SGD);
     on float32 CPU tensors the compiled kernels (:mod:`thinwire.kernels`) compute the same
     logits and gradients without the gathered [B, A, H] copy (:class:`_FusedSparseLinear`;
     its weight gradient lists each touched row once);
  3. :func:`active_softmax_loss`: softmax cross-entropy over the active set against the uniform
     distribution over the sample's labels (SLIDE's multi-label loss);
  4. after the optimizer step, ``updated()``: counts the update and rebuilds the tables from the
     current weights when the schedule says so (first after ``rebuild_first`` updates, every
     interval ``rebuild_growth`` times the previous).

``dense(h)`` gives every neuron's logits (evaluation). A layer may hold a slice of a wider layer
(``offset``: the global id of its first neuron; labels are global ids): Distributed SLIDE's
shards (:mod:`thinwire.strategies.slide.method`) are such slices with hash functions drawn from
the same seed, so a neuron files under the same codes whichever shard holds it.

Example::

    layer = thinwire.SLIDELayer(128, 100_000, family="simhash", K=9, L=50, budget=500)
    ids, mask = layer.active(h, labels)
    loss = thinwire.active_softmax_loss(layer(h, ids, mask), ids, mask, labels)
    loss.backward(); sparse_opt.step(); layer.updated()
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from thinwire import kernels
from thinwire.strategies.slide.lsh import (
    FAMILIES,
    SAMPLINGS,
    Schedule,
    Tables,
    family,
    generator,
)


class SLIDELayer(nn.Module):
    """``out_features`` neurons of a wide linear layer with SLIDE's hash tables (module doc).

    - ``family``: ``simhash`` (dense inputs) or ``dwta`` (sparse inputs); ``K`` hashes per code,
      ``L`` tables; ``bin_size`` and ``range_bits``: DWTA's bins and code range;
    - ``budget``: retrieved neurons per sample (labels come on top); ``bucket``: neurons read
      from each hit bucket; ``sampling``: ``topk`` or ``vanilla`` (step 1);
    - ``rebuild_first``, ``rebuild_growth``: the rebuild schedule (updates);
    - ``offset``: global id of the first neuron (a shard of a wider layer); ``seed``: hash
      functions (shared by all shards) and the per-step random draws (per shard).
    """

    def __init__(self, in_features: int, out_features: int, *, family_name: str = "simhash",
                 K: int = 9, L: int = 50, budget: int = 128, bucket: int = 32,
                 bin_size: int = 8, range_bits: int = 12, rebuild_first: int = 50,
                 rebuild_growth: float = 1.5, offset: int = 0, seed: int = 0,
                 sampling: str = "vanilla",
                 weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if family_name not in FAMILIES:
            raise ValueError(f"family {family_name!r}: use one of {', '.join(FAMILIES)}")
        if sampling not in SAMPLINGS:
            raise ValueError(f"sampling {sampling!r}: use one of {', '.join(SAMPLINGS)}")
        self.sampling = sampling
        dev = torch.device(device) if device is not None else (
            weight.device if weight is not None else torch.device("cpu"))
        if weight is None:
            bound = 1 / math.sqrt(in_features)
            g = generator(torch.device("cpu"), seed, 0x11, offset)
            weight = (torch.rand(out_features, in_features, generator=g) * 2 - 1) * bound
            bias = torch.zeros(out_features)
        self.weight = nn.Parameter(_rows_storage(weight.detach(), dev))
        self.bias = nn.Parameter((bias if bias is not None else torch.zeros(out_features))
                                 .detach().clone().to(dev).reshape(out_features, 1))
        self.in_features, self.out_features, self.offset = in_features, out_features, offset
        self.budget, self.seed = budget, seed
        hashes = family(family_name, in_features, K, L, seed, dev, bin_size=bin_size,
                        range_bits=range_bits)
        self.tables = Tables(hashes, out_features, bucket, seed * 1000003 + offset, dev)
        self.schedule = Schedule(rebuild_first, rebuild_growth)
        self.tables.build(self.weight.detach())
        self._kept = _Fused()

    # --- 1. the active set --------------------------------------------------------------------
    def local_labels(self, labels: torch.Tensor | None) -> torch.Tensor | None:
        """Global label ids [B, Y] (negative: padding) -> this layer's ids (negative: not
        here)."""
        if labels is None:
            return None
        loc = labels.long() - self.offset
        inside = (labels >= 0) & (loc >= 0) & (loc < self.out_features)
        return torch.where(inside, loc, torch.full_like(loc, -1))

    @torch.no_grad()
    def active(self, h: torch.Tensor, labels: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 1: ids [B, A] of this layer's active neurons per sample and their mask;
        A = budget + label columns (at most ``out_features``)."""
        forced = self.local_labels(labels)
        size = self.budget + (forced.shape[1] if forced is not None else 0)
        g = generator(h.device, self.seed, 0xAC7, self.offset, self.schedule.updates)
        return self.tables.active(h.detach(), forced, size, self.sampling, g)

    # --- 2. sparse forward --------------------------------------------------------------------
    def forward(self, h: torch.Tensor, ids: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Step 2: logits [B, A] of the active neurons (-inf on empty slots); without ``ids``
        every neuron's logits [B, C] (:meth:`dense`)."""
        if ids is None:
            return self.dense(h)
        if h.dtype == torch.float32 and kernels.wants(self.weight) is not None \
                and kernels.wants(self.bias) is not None and h.device.type == "cpu":
            return _FusedSparseLinear.apply(h, self.weight, self.bias, ids, mask,
                                             self._kept)
        w = F.embedding(ids, self.weight, sparse=True)  # [B, A, in]
        b = F.embedding(ids, self.bias, sparse=True).squeeze(-1)
        out = torch.bmm(w, h.unsqueeze(-1)).squeeze(-1) + b
        if mask is not None:
            out = out.masked_fill(~mask, float("-inf"))
        return out

    def dense(self, h: torch.Tensor) -> torch.Tensor:
        """All ``out_features`` logits [B, C]."""
        return F.linear(h, self.weight, self.bias.squeeze(-1))

    # --- 4. the schedule ----------------------------------------------------------------------
    def updated(self) -> bool:
        """After an optimizer step: count it; rebuild the tables from the current weights when
        due (returns whether it did)."""
        if self.schedule.tick():
            self.rebuild()
            return True
        return False

    @torch.no_grad()
    def rebuild(self) -> None:
        """Re-file every neuron under the codes of its current weights."""
        self.tables.build(self.weight.detach())

    # --- state --------------------------------------------------------------------------------
    def slide_state(self) -> dict[str, Any]:
        """Tables, hash functions and schedule (the weights are in ``state_dict``)."""
        return {"tables": self.tables.state(), "schedule": self.schedule.state()}

    def load_slide_state(self, state: dict[str, Any]) -> None:
        self.tables.load(state["tables"])
        self.schedule.load(state["schedule"])


def _rows_storage(weight: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A copy of ``weight`` on ``dev``; a float32 CPU weight in 2 MiB pages where the compiled
    kernels are built (:func:`thinwire.kernels.empty_huge`): the fused layer reads its active
    rows at random places, and with 4 KiB pages nearly every row of a wide layer misses the
    TLB."""
    if dev.type == "cpu" and weight.dtype == torch.float32 and kernels.lib() is not None:
        out = kernels.empty_huge(*weight.shape)
        return out.copy_(weight)
    return weight.clone().to(dev)


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
"""How many references a storage has (torch's own, not public), or None."""


class _Kept:
    """A buffer kept from step to step for the fused kernels' outputs and scratch (the weight
    gradient's rows, the touched rows and their slots, the logits, the loss's softmax): handed
    out again (a view of its first rows) once nothing but this holder refers to its storage
    (the previous step's gradient dropped by ``zero_grad``, its graph freed by ``backward``),
    else a fresh one, with 1/8 more rows for the next step's. A fresh buffer is faulted in and
    zeroed by the OS on every step: at 1,000,000 outputs and 0.2 % active the weight gradient's
    took as long as writing the gradient itself, and at 1 % the other buffers' 4 KiB faults
    cost about 6 % of the step. Never pickled or copied with its layer."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def take(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A CPU tensor of ``shape`` and ``dtype``, uninitialised (every caller writes it in
        full)."""
        buf = self.buf
        # 2: this holder's reference and the temporary storage object's own (torch's storage
        # use count is not public: where a torch lacks it, every step takes a fresh buffer)
        if buf is None or buf.shape[0] < shape[0] or tuple(buf.shape[1:]) != shape[1:] \
                or buf.dtype != dtype or _USE_COUNT is None \
                or _USE_COUNT(buf.untyped_storage()._cdata) > 2:
            buf = self.buf = kernels.empty_huge(shape[0] + shape[0] // 8, *shape[1:],
                                                dtype=dtype)
        return buf[:shape[0]]

    def __getstate__(self) -> dict[str, Any]:
        return {"buf": None}

    def __deepcopy__(self, memo: dict[int, Any]) -> _Kept:
        return _Kept()


class _Fused:
    """The fused layer's kept buffers (:class:`_Kept`), one per output."""

    def __init__(self) -> None:
        self.grad, self.bias_grad, self.rows, self.start, self.order, self.out = (
            _Kept(), _Kept(), _Kept(), _Kept(), _Kept(), _Kept())


class _LossKept:
    """The fused loss's kept buffers (:class:`_Kept`): the softmax, the targets and the
    logits' gradient."""

    def __init__(self) -> None:
        self.p, self.t, self.grad = _Kept(), _Kept(), _Kept()


_LOSS_KEPT = threading.local()
"""One :class:`_LossKept` per thread (the loss is a function, not a module)."""


def _loss_kept() -> _LossKept:
    held: _LossKept | None = getattr(_LOSS_KEPT, "held", None)
    if held is None:
        held = _LOSS_KEPT.held = _LossKept()
    return held


class _FusedSparseLinear(torch.autograd.Function):
    """Step 2 in the compiled kernels (:mod:`thinwire.kernels`), the same function as the
    gathered path of :meth:`SLIDELayer.forward`, every pass over the touched rows in ascending
    order (each row read once a pass, at nearly sequential addresses where the layer is wide):

      1. forward: the touched rows (every slot's id, as the gathered path's sparse gradient
         lists them) and each row's slots, found by a radix sort; each slot's logit
         W[id] . h + b[id] computed from its row in place (no [B, A, H] copy of the rows),
         rows in parallel blocks;
      2. backward, in one pass over the rows (read in place again): the hidden gradient
         gh[b] = sum_a g[b, a] W[ids[b, a]], summed per chunk of rows and the chunks combined
         in order, and each row's weight gradient sum_{slots of the row} g h[b] written by the
         one thread that owns the row (partitioned by row: no atomics, no locks), into a buffer
         kept from step to step (:class:`_Kept`, as every output and scratch array); returned
         as a coalesced sparse gradient of those rows, the gathered path's gradient coalesced.

    The sums run in another order than torch's batched product, so values agree within the
    rounding of an H-term (forward) or A-term / B-term (backward) float32 sum; on any thread
    count the kernels give the same bits."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                ids: torch.Tensor, mask: torch.Tensor | None, bufs: _Fused
                ) -> torch.Tensor:
        lib = kernels.lib()
        assert lib is not None  # chosen by the caller
        hc = h.detach().contiguous()
        ids64 = ids.detach().to(torch.int64).contiguous()
        m = mask.detach().to(torch.bool).contiguous().view(torch.uint8) if mask is not None \
            else None
        B, A = ids64.shape
        C, H = weight.shape
        n = B * A
        # every buffer a CPU tensor, as the input (a default device may differ)
        rows = bufs.rows.take(min(n, C), dtype=torch.int64)
        start = bufs.start.take(n + 1, dtype=torch.int64)
        order = bufs.order.take(n, dtype=torch.int64)
        U = lib.slide_touched_rows(ids64.data_ptr(), n, C, rows.data_ptr(), start.data_ptr(),
                                   order.data_ptr())
        out = bufs.out.take(B, A)
        lib.slide_forward_rows(weight.data_ptr(), bias.data_ptr(), hc.data_ptr(),
                               rows.data_ptr(), start.data_ptr(), order.data_ptr(),
                               m.data_ptr() if m is not None else None, U, A, H, out.data_ptr(),
                               kernels.threads())
        ctx.save_for_backward(hc, weight, rows, start, order,
                              m if m is not None else hc.new_empty(0))
        ctx.has_mask, ctx.U, ctx.A, ctx.bufs = m is not None, U, A, bufs
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        lib = kernels.lib()
        assert lib is not None
        hc, weight, rows, start, order, m = ctx.saved_tensors
        g = grads[0].detach().to(torch.float32).contiguous()
        U, A = ctx.U, ctx.A
        B = g.shape[0]
        C, H = weight.shape
        gh = torch.empty(B, H, dtype=torch.float32, device=g.device) \
            if ctx.needs_input_grad[0] else None
        gw = gb = wv = bv = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            wv = ctx.bufs.grad.take(U, H)  # every row written in full
            bv = ctx.bufs.bias_grad.take(U, 1)
        lib.slide_backward_rows(g.data_ptr(), weight.data_ptr(), hc.data_ptr(),
                                m.data_ptr() if ctx.has_mask else None, rows.data_ptr(),
                                start.data_ptr(), order.data_ptr(), U, B, A, H,
                                gh.data_ptr() if gh is not None else None,
                                wv.data_ptr() if wv is not None else None,
                                bv.data_ptr() if bv is not None else None, kernels.threads())
        if wv is not None and bv is not None:
            at = rows[:U].unsqueeze(0)
            gw = torch.sparse_coo_tensor(at, wv, (C, H), is_coalesced=True,
                                         check_invariants=False)
            gb = torch.sparse_coo_tensor(at, bv, (C, 1), is_coalesced=True,
                                         check_invariants=False)
        return gh, gw, gb, None, None, None


def label_targets(ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor,
                  offset: int = 0) -> torch.Tensor:
    """[B, A] indicator of the active slots that hold one of the sample's labels (global ids
    [B, Y], negative: padding)."""
    glob = ids + offset
    hit = (glob.unsqueeze(-1) == labels.unsqueeze(1)) & (labels.unsqueeze(1) >= 0)
    return hit.any(-1) & mask


def active_softmax_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                        labels: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Step 3: mean over samples of -sum_{l in labels} log softmax(logits)_l / |labels|, the
    softmax over the active set only (labels are always in it). On float32 CPU logits the
    compiled kernels compute it and its gradient in one pass each (:class:`_FusedActiveLoss`);
    the torch ops below are the reference."""
    if kernels.wants(logits) is not None and labels.dim() == 2:
        out = _FusedActiveLoss.apply(logits, ids, mask, labels, offset)
        assert isinstance(out, torch.Tensor)
        return out
    t = label_targets(ids, mask, labels, offset).float()
    cnt = (labels >= 0).sum(1).clamp(min=1).float()
    logp = torch.log_softmax(logits, dim=1).masked_fill(~mask, 0.0)
    return -((logp * t).sum(1) / cnt).mean()


class _FusedActiveLoss(torch.autograd.Function):
    """:func:`active_softmax_loss` in the compiled kernels, per sample in parallel:

      1. forward: the targets (active slots on whose global id is one of the sample's labels),
         the softmax over the slots that are on (max-shifted, its sum in float64) kept for the
         backward, the sample's -sum_targets log softmax / |labels|, their mean (float64, cast
         to float32 at the end);
      2. backward: d loss / d logit = g (T p - t) / (B |labels|), T the sample's targets, p the
         kept softmax, t the target indicator (0 on the slots that are off).

    Against the torch ops: the same function, rounded once in float64 where torch sums in
    float32, so they agree within the float32 rounding of an A-term softmax (the test bounds it)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                labels: torch.Tensor, offset: int) -> torch.Tensor:
        lib = kernels.lib()
        assert lib is not None  # chosen by the caller
        z = logits.detach().contiguous()
        B, A = z.shape
        ids64 = ids.detach().to(torch.int64).contiguous()
        m = mask.detach().to(torch.bool).contiguous().view(torch.uint8)
        lab = labels.detach().to(torch.int64).contiguous()
        dev = z.device
        kept = _loss_kept()
        p = kept.p.take(B, A)
        t = kept.t.take(B, A, dtype=torch.uint8)
        per = torch.empty(3, B, dtype=torch.float64, device=dev)  # rows, targets, label counts
        loss = torch.empty((), dtype=torch.float64, device=dev)
        lib.slide_softmax_loss(z.data_ptr(), ids64.data_ptr(), m.data_ptr(), lab.data_ptr(), B,
                               A, lab.shape[1], int(offset), p.data_ptr(), t.data_ptr(),
                               per[0].data_ptr(), per[1].data_ptr(), per[2].data_ptr(),
                               loss.data_ptr(), kernels.threads())
        ctx.save_for_backward(p, t, per)
        return loss.to(torch.float32)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        lib = kernels.lib()
        assert lib is not None
        p, t, per = ctx.saved_tensors
        B, A = p.shape
        gz = _loss_kept().grad.take(B, A)
        lib.slide_softmax_loss_backward(p.data_ptr(), t.data_ptr(), per[1].data_ptr(),
                                        per[2].data_ptr(), B, A, float(grads[0]), gz.data_ptr(),
                                        kernels.threads())
        return gz, None, None, None, None


__all__ = ["SLIDELayer", "active_softmax_loss", "label_targets"]
