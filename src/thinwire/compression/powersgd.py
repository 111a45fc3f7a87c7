"""PowerSGD: rank-r approximation by one power iteration a step, warm-started, with error feedback.

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization" (NeurIPS 2019), Algorithm 1. Each gradient tensor of two or more
dimensions is viewed as a matrix M (n x m: first dimension by the rest); per step, per rank:
  0. add the residual: M <- M + e (error feedback);
  1. P = M Q, with Q (m x r) the previous step's Q (warm start) or, at first, a standard normal
     draw from the shared generator, so every rank starts from the same Q;
  2. all-reduce P (summed; one all-reduce per bucket, which also carries the uncompressed
     tensors: 1-D ones, such as biases, and tiny ones where r (n + m) >= n m);
  3. P_hat = orthonormal basis of P (reduced QR);
  4. Q = M^T P_hat;
  5. all-reduce Q and divide by the world size: Q = mean_i M_i^T P_hat;
  6. decompress: P_hat Q^T = P_hat P_hat^T mean_i(M_i), the average's projection on span(P_hat);
  7. keep Q for the next step's warm start (it is the same on every rank);
  8. e <- M - P_hat Q^T (the residual against the *aggregated* approximation, as in the paper).
Warm start turns one power iteration a step into subspace iteration across steps, so the
approximation of a slowly changing gradient approaches its best rank-r one.

This is our own implementation through :class:`~thinwire.runtime.comm.Comm` (torch's
``powerSGD_hook`` calls ``torch.distributed`` directly, past the ledger). Per bucket the wire
carries r (n + m) values per compressed matrix plus the uncompressed tensors, in the input dtype.
Given only a flat tensor (the :class:`Compressor` interface, the planner's ``nominal_ratio``),
it is reshaped to a near-square matrix ceil(sqrt(d)) x ceil(d / ceil(sqrt(d))), zero-padded;
``encode``/``decode`` there are the single-worker algorithm (steps 1, 3, 4, 6, 7).
:meth:`PowerSGD.collectives` lists the two all-reduces with their bytes, without running.

Devices and dtypes: the first Q is drawn on the CPU from the shared generator (every rank,
whatever its device, starts from the same Q) and moved to the input's device and dtype; the
QR factorisation runs in float32 at least (half precision has none) and returns to the input's
dtype. Error feedback is the codec's own (``ef``), never the generic wrapper.

Products: each reads M once, row by row (steps 1 and 4 with Q's columns contiguous and M^T P
as (P^T M)^T: :func:`columns`, :func:`project_back`), and step 6 writes P Q^T once into the
output (:func:`outer`: the compiled kernel on float32 CPU tensors, else ``torch.mm(out=)``);
docs/benchmarks/compression.md times them against the products alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from thinwire import kernels
from thinwire.compression.base import (
    Collective,
    Compressor,
    Part,
    Payload,
    Shapes,
    done,
    write_out,
)
from thinwire.compression.registry import CodecEntry
from thinwire.options import check, opt
from thinwire.runtime.comm import Comm
from thinwire.runtime.ledger import nbytes

# (offset, numel, (n, m) or None for a tensor sent uncompressed)
Segment = tuple[int, int, tuple[int, int] | None]


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the columns of p (reduced QR; deterministic, so ranks agree),
    computed in float32 at least and returned in p's dtype."""
    work = p if p.dtype in (torch.float32, torch.float64) else p.float()
    return torch.linalg.qr(work, mode="reduced").Q.to(p.dtype)


def columns(q: torch.Tensor) -> torch.Tensor:
    """``q`` (m x r) with each of its r columns contiguous (stored as Q^T, r x m): the layout in
    which step 1's ``M @ q`` streams M once (with q row-major, MKL's product with r = 2 columns
    takes a path 2-5x slower on this project's host, docs/benchmarks/compression.md)."""
    return q if q.stride(0) == 1 or q.shape[1] == 1 else q.t().contiguous().t()


def project_back(m_: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Step 4's M^T P, computed as (P^T M)^T: a product that reads M row by row (the transposed
    product ``m_.T @ p`` costs 13-30 copies of M, this one about one; the same bits at the
    measured shapes, the same sums in another order elsewhere). The result is m x r with each
    column contiguous, the layout :func:`columns` asks for."""
    return (p.t() @ m_).t()


def outer(p: torch.Tensor, q: torch.Tensor, numel: int,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """Step 6's P Q^T (n x m, row-major), its first ``numel`` elements, written into ``out``
    (flat, contiguous) when given: by the compiled kernel (one write, streamed when large; the
    chain of fused multiply-adds MKL's product computes, torch.mm's bits at the shapes tested)
    for float32 on the CPU, else by ``torch.mm`` into ``out`` when the matrix
    is unpadded, else through a temporary."""
    n, m, r = p.shape[0], q.shape[0], p.shape[1]
    lib = kernels.wants(out) if out is not None else None
    if lib is not None and out is not None and p.dtype == q.dtype == torch.float32 \
            and p.device.type == q.device.type == "cpu":
        pc, qt = p.contiguous(), q.t().contiguous()
        lib.lowrank_decode(kernels.ptr(pc), kernels.ptr(qt), n, m, r, numel, kernels.ptr(out),
                           kernels.threads())
        return out
    if out is not None and numel == n * m and out.is_contiguous() and out.dtype == p.dtype:
        torch.mm(p, q.t(), out=out.view(n, m))
        return out
    return write_out((p @ q.t()).reshape(-1)[:numel], out)


def square_shape(numel: int) -> tuple[int, int]:
    n = math.ceil(math.sqrt(numel))
    return n, math.ceil(numel / n)


class PowerSGD(Compressor):
    """Rank-``r`` PowerSGD (``rank`` is this worker's rank, as for every codec)."""

    name = "powersgd"

    def __init__(self, r: int, *, error_feedback: bool = True, warm_start: bool = True,
                 seed: int = 0, rank: int = 0) -> None:
        super().__init__(seed=seed, rank=rank)
        if r < 1:
            raise ValueError(f"powersgd rank must be >= 1, got {r}")
        self.r = r
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.residuals: dict[int, torch.Tensor] = {}
        self.qs: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def wants_error_feedback(self) -> bool:
        return False  # its own residual, against the aggregated approximation (step 8)

    def params(self) -> dict[str, Any]:
        return {"rank": self.r, "warm_start": self.warm_start, "ef": self.error_feedback}

    # --- layout --------------------------------------------------------------------------------
    def rank_for(self, n: int, m: int) -> int:
        return min(self.r, n, m)

    def compressible(self, n: int, m: int) -> bool:
        return n > 1 and m > 1 and self.rank_for(n, m) * (n + m) < n * m

    def cannot_compress(self, shapes: Shapes) -> str:
        """'' when rank r compresses at least one matrix of ``shapes`` (r (n + m) < n m), else
        the reason and the largest rank that would."""
        mats = [(s[0], math.prod(s) // s[0]) for s in shapes if len(s) >= 2 and math.prod(s) > 0]
        if any(self.compressible(n, m) for n, m in mats):
            return ""
        best = max(((n * m - 1) // (n + m) for n, m in mats if n > 1 and m > 1), default=0)
        fix = f"use rank <= {best}" if best >= 1 else "use another codec"
        return (f"powersgd:rank={self.r} compresses none of the model's matrices (r (n + m) >= "
                f"n m for each: plain all-reduce bytes under a powersgd label); {fix}")

    def layout(self, numel: int, shapes: Shapes | None = None) -> list[Segment]:
        """Segments of a flat buffer: per tensor of ``shapes``, or one near-square matrix."""
        sizes = [math.prod(s) for s in shapes] if shapes is not None else []
        if shapes is None or sum(sizes) != numel:
            nm = square_shape(numel)
            return [(0, numel, nm if self.compressible(*nm) else None)]
        out: list[Segment] = []
        offset = 0
        for shape, size in zip(shapes, sizes):
            mat = (shape[0], size // shape[0]) if len(shape) >= 2 and size > 0 else None
            out.append((offset, size, mat if mat is not None and self.compressible(*mat) else None))
            offset += size
        return out

    def collectives(self, numel: int, shapes: Shapes | None = None,
                    dtype: torch.dtype = torch.float32, *, world: int = 1) -> list[Collective]:
        """Step 2's all-reduce (the raw tensors and every P), then step 5's (every Q), when
        there is a matrix to compress; bytes in the input dtype."""
        del world
        segs = self.layout(numel, shapes)
        first = sum(s if nm is None else nm[0] * self.rank_for(*nm) for _, s, nm in segs)
        second = sum(nm[1] * self.rank_for(*nm) for _, _, nm in segs if nm is not None)
        out: list[Collective] = [("all_reduce", first * dtype.itemsize)]
        if second:
            out.append(("all_reduce", second * dtype.itemsize))
        return out

    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        ((_, _, nm),) = self.layout(numel)
        if nm is None:
            return (Part(numel, dtype),)
        r = self.rank_for(*nm)
        return (Part(nm[0] * r, dtype), Part(nm[1] * r, dtype))

    def _matrix(self, flat: torch.Tensor, nm: tuple[int, int]) -> torch.Tensor:
        n, m = nm
        pad = n * m - flat.numel()
        return (torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).view(n, m)

    def _q(self, key: int, j: int, like: torch.Tensor, nm: tuple[int, int],
           draw: list[torch.Generator], step: int) -> torch.Tensor:
        """Step 1's Q: the warm one, or a standard normal draw from the shared generator, on
        the CPU (so every rank draws the same), then on ``like``'s device and dtype."""
        shape = (nm[1], self.rank_for(*nm))
        q = self.qs.get((key, j)) if self.warm_start else None
        if q is None or tuple(q.shape) != shape:
            if not draw:
                draw.append(self.shared_generator(step, key))
            q = torch.randn(shape, generator=draw[0])
        return columns(q.to(device=like.device, dtype=like.dtype))

    # --- single worker (the Compressor interface) ----------------------------------------------
    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        flat = x.reshape(-1)
        ((_, _, nm),) = self.layout(flat.numel())
        if nm is None:
            return (flat.clone(),)
        m_ = self._matrix(flat, nm)
        p = orthogonalize(m_ @ self._q(key, 0, m_, nm, [], step))  # 1, 3
        q = project_back(m_, p)  # 4
        if self.warm_start:
            self.qs[(key, 0)] = q  # 7
        return (p.reshape(-1), q.reshape(-1))

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        if len(payload) == 1:
            return write_out(payload[0].reshape(-1), out)
        ((_, _, nm),) = self.layout(numel)
        assert nm is not None
        r = self.rank_for(*nm)
        p, q = payload[0].view(nm[0], r), payload[1].view(nm[1], r)
        return outer(p, q, numel, out)  # 6

    # --- many workers, through the ledger ------------------------------------------------------
    def average_async(self, comm: Comm, x: torch.Tensor, step: int, *, key: int = 0,
                      tag: str = "grad", shapes: Sequence[Sequence[int]] | None = None
                      ) -> tuple[torch.futures.Future, int]:
        """The all-rank average of ``x`` (Future) and the bytes this rank sent (steps 0-8);
        the collectives are :meth:`collectives`'."""
        world = comm.world_size
        flat = x.reshape(-1)
        segs = self.layout(flat.numel(), shapes)
        # 0. error feedback
        e = self.residuals.get(key) if self.error_feedback else None
        usable = e is not None and e.shape == flat.shape and e.device == flat.device
        if usable and e is not None:
            mem = flat + e
        else:  # x receives the average in place: keep M apart when the residual needs it
            mem = flat.clone() if self.error_feedback else flat
        raw = [mem[o:o + s] for o, s, nm in segs if nm is None]
        mats = [(o, s, nm, self._matrix(mem[o:o + s], nm)) for o, s, nm in segs if nm is not None]
        draw: list[torch.Generator] = []
        # 1. P = M Q
        ps = [m_ @ self._q(key, j, m_, nm, draw, step) for j, (_, _, nm, m_) in enumerate(mats)]
        # 2. one all-reduce of the raw tensors and every P
        first = torch.cat([*raw, *(p.reshape(-1) for p in ps)])
        comm.all_reduce(first, tag=tag)
        n_raw = sum(t.numel() for t in raw)
        raw_avg = first[:n_raw] / world
        p_hats, offset = [], n_raw
        for p in ps:
            # 3. orthogonalise
            p_hats.append(orthogonalize(first[offset:offset + p.numel()].view_as(p)))
            offset += p.numel()
        # 4. Q = M^T P_hat
        qs = [project_back(m_, p) for (_, _, _, m_), p in zip(mats, p_hats)]
        second = torch.cat([q.reshape(-1) for q in qs]) if qs else flat.new_zeros(0)
        sent = nbytes(first) + nbytes(second)

        def finish(q_sum: torch.Tensor) -> torch.Tensor:
            q_avg = q_sum / world  # 5. the mean Q
            out = flat  # x is free: the average goes into it
            at = 0
            for o, s, nm in segs:  # the raw averages, back in place
                if nm is None:
                    out[o:o + s] = raw_avg[at:at + s]
                    at += s
            at = 0
            for j, ((o, s, nm, _), p) in enumerate(zip(mats, p_hats)):
                q = q_avg[at:at + nm[1] * p.shape[1]].view(nm[1], p.shape[1])
                at += q.numel()
                outer(p, q, s, out[o:o + s])  # 6. decompress
                if self.warm_start:
                    self.qs[(key, j)] = q  # 7. warm start
            if self.error_feedback:
                self.residuals[key] = mem.sub_(out)  # 8. residual
            return out.view_as(x)

        if not qs:
            return done(finish(second)), sent
        # 5. all-reduce Q
        fut = comm.all_reduce_async(second, tag=tag)
        return fut.then(lambda f: finish(f.value())), sent

    # --- state ---------------------------------------------------------------------------------
    def reset(self, key: int | None = None) -> None:
        if key is None:
            self.residuals.clear()
            self.qs.clear()
            return
        self.residuals.pop(key, None)
        for k in [k for k in self.qs if k[0] == key]:
            del self.qs[k]

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {f"residual.{k}": v for k, v in self.residuals.items()}
        out.update({f"q.{k}.{j}": v for (k, j), v in self.qs.items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals, self.qs = {}, {}
        for name, v in state.items():
            kind, *idx = name.split(".")
            if kind == "residual":
                self.residuals[int(idx[0])] = v.clone()
            elif kind == "q":
                self.qs[(int(idx[0]), int(idx[1]))] = v.clone()

    def split_state(self, key: int, shapes: Shapes) -> list[dict[str, torch.Tensor]]:
        """Per tensor: its slice of the residual and, for a compressed matrix, its warm Q."""
        segs = self.layout(sum(math.prod(s) for s in shapes), shapes)
        e = self.residuals.get(key)
        pieces: list[dict[str, torch.Tensor]] = []
        j = 0
        for o, size, nm in segs:
            piece: dict[str, torch.Tensor] = {}
            if e is not None and e.numel() == sum(s for _, s, _ in segs):
                piece["residual"] = e[o:o + size].clone()
            if nm is not None:
                q = self.qs.get((key, j))
                if q is not None:
                    piece["q"] = q.clone()
                j += 1
            pieces.append(piece)
        return pieces

    def join_state(self, key: int, shapes: Shapes,
                   pieces: Sequence[Mapping[str, torch.Tensor]]) -> None:
        segs = self.layout(sum(math.prod(s) for s in shapes), shapes)
        self.reset(key)
        found = [p.get("residual") for p in pieces]
        like = next((t for t in found if t is not None), None)
        if like is not None:
            self.residuals[key] = torch.cat([
                t.reshape(-1) if t is not None else like.new_zeros(size)
                for t, (_, size, _) in zip(found, segs)])
        j = 0
        for (_, _, nm), piece in zip(segs, pieces):
            if nm is not None:
                if "q" in piece:
                    self.qs[(key, j)] = piece["q"].clone()
                j += 1


@dataclass(frozen=True)
class PowerSGDOptions:
    """Options of ``powersgd``."""

    rank: int = opt(2, "rank r of the approximation P Q^T of each matrix")
    warm_start: bool = opt(True, "start each step's power iteration from the previous Q")
    ef: bool = opt(True, "error feedback against the aggregated approximation (its own)")

    def __post_init__(self) -> None:
        check(self.rank >= 1, "powersgd.rank", f"got {self.rank}; use 1 or more")


POWERSGD = CodecEntry(
    name="powersgd", summary="rank-r P Q^T per matrix, warm-started, two all-reduces",
    options=PowerSGDOptions,
    factory=lambda o, seed, rank: PowerSGD(o.rank, error_feedback=o.ef, warm_start=o.warm_start,
                                           seed=seed, rank=rank))
