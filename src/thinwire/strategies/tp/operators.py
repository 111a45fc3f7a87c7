"""Megatron's tensor-parallel operators: every collective of a tensor-parallel group, plain or
through a codec, and the autograd functions and row-parallel layer built on them.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (2019), section 3: a column-parallel layer's input passes *f* (identity forward,
sum over the group backward, :class:`_Copy`), a row-parallel layer's partial product *g* (sum
forward, identity backward, :class:`_Reduce`). With sequence parallelism (Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", 2022) *f* becomes an
all-gather over the sequence (backward: reduce-scatter, :class:`_GatherSeq`) and *g* a
reduce-scatter (backward: all-gather, :class:`_ScatterSeq`); :class:`_Split` / :class:`_Unsplit`
enter and leave the sequence-parallel span.

Each operator is one call of :class:`Exchange`, which goes through
:class:`~thinwire.runtime.comm.Comm` (tag ``tp``) and, with a codec of
:mod:`thinwire.compression`, through its encode/decode (error feedback keyed by call site; a
compressed reduce-scatter is an all-to-all of encoded chunks). Used by the tensor method
(:mod:`thinwire.strategies.tensor`) and by the pipeline's tensor-parallel stages
(:mod:`thinwire.strategies.pipeline.method`) through :mod:`thinwire.strategies.tp.sharding`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from thinwire.runtime.comm import Comm

if TYPE_CHECKING:
    from thinwire.compression.base import Compressor

__all__ = ["RS_KEYS", "Exchange", "RowParallel", "collectives"]


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
