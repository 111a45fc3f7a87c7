"""int8: one fp32 absmax scale per chunk of elements (blockwise absmax scaling).

  1. cut x into chunks of ``chunk`` elements (512: a 4-byte scale costs 0.8 %);
  2. per chunk, scale = max |x_i| / 127 (sent as fp32);
  3. send round(x_i inv) as int8 (half to even), inv = 1 / scale rounded to float32 once per
     chunk, as PyTorch's own quantize_per_tensor multiplies by its inverse scale; the product
     is within 127 * 2^-23 of x_i / scale, so the error is at most scale (1/2 + 2^-16) per
     element. A chunk whose scale is subnormal (below 2^-126: its absmax under 127 * 2^-126,
     about 1.5e-36; 1 / scale could overflow) takes inv = 0 and is sent as zeros (error
     feedback keeps it);
  4. decode q_i scale.
  Deterministic rounding is biased (slightly); error feedback removes the bias (``ef``, on by
  default). On CPU, steps 2-4 run block by block of whole chunks, in cache.
With the compiled kernels (:mod:`thinwire.kernels`) steps 2-3 are one pass a chunk (the absmax,
then the roundings from cache) and step 4 one pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from thinwire import kernels
from thinwire.compression.base import (
    LARGE_BLOCK,
    Compressor,
    Part,
    Payload,
    blocks,
    chunk_rows,
    empty,
    on_cpu,
    write_out,
)
from thinwire.compression.registry import CodecEntry, check_exchange, exchange_option
from thinwire.options import check, opt

LEAST_SCALE = 2.0**-126
"""float32's least normal number: a chunk with a smaller scale is sent as zeros (step 3)."""


def scaled(chunks: torch.Tensor, safe: torch.Tensor, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Int8's step 3 before the rounding: each row of ``chunks`` times the float32 reciprocal
    of its (positive) ``safe`` scale, or times 0 where that scale is below
    :data:`LEAST_SCALE`."""
    inv = torch.where(safe >= LEAST_SCALE, torch.reciprocal(safe), 0.0)
    return torch.mul(chunks, inv[:, None], out=out)


def absmax_scaled(flat: torch.Tensor, chunk: int, top: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-3 before the rounding on any device, for a code whose largest magnitude is
    ``top`` (127 here, fp8's FMAX): (rows of ``chunk`` elements of x times the float32
    reciprocal of their scale (:func:`scaled`), the fp32 scale per chunk, absmax / top)."""
    chunks = chunk_rows(flat, chunk)
    scale = chunks.abs().amax(dim=1) / top
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scaled(chunks, safe), scale


class Int8(Compressor):
    """Round to int8 against one fp32 absmax scale per chunk of elements (module doc)."""

    name = "int8"

    def __init__(self, chunk: int = 512, *, seed: int = 0, rank: int = 0) -> None:
        super().__init__(seed=seed, rank=rank)
        if chunk < 1:
            raise ValueError(f"int8 chunk must be >= 1, got {chunk}")
        self.chunk = chunk

    def params(self) -> dict[str, Any]:
        return {"chunk": self.chunk}

    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        return (Part(numel, torch.int8), Part(math.ceil(numel / self.chunk), torch.float32))

    def _encode_torch(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # 1. chunks; 2. absmax scale per chunk; 3. round x inv to int8 (|x inv| <= 127 up to a
        # rounding: no clamp needed)
        y, scale = absmax_scaled(flat, self.chunk, 127)
        q = torch.round(y).to(torch.int8)
        return q.reshape(-1)[:flat.numel()], scale

    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        flat = x.reshape(-1).float()
        if not on_cpu(flat):
            return self._encode_torch(flat)
        flat = flat.detach()  # the out= calls below do not take autograd's inputs
        c, d = self.chunk, flat.numel()
        rows = d // c
        q = empty(d, torch.int8)
        scale = empty(math.ceil(d / c), torch.float32)
        lib = kernels.wants(flat)
        if lib is not None:  # steps 2-3 in one pass a chunk
            lib.int8_encode(flat.data_ptr(), d, c, q.data_ptr(), scale.data_ptr(),
                            kernels.threads())
            return (q, scale)
        per = max(1, LARGE_BLOCK // c)  # whole chunks per block
        n = min(per, rows)
        buf, low = torch.empty(n, c, device=flat.device), torch.empty(n, device=flat.device)
        for r0, r1 in blocks(rows, per):
            xb, a, sc, lo = flat[r0 * c:r1 * c].view(-1, c), buf[:r1 - r0], scale[r0:r1], low[:r1 - r0]
            # 2. absmax per chunk as max(max x, -min x) (no |x| pass; abs_ makes -0.0 +0.0)
            torch.amax(xb, dim=1, out=sc)
            torch.amin(xb, dim=1, out=lo)
            torch.maximum(sc, lo.neg_(), out=sc).abs_().div_(127)
            # 3. round x inv to the nearest integer (half to even), stored as int8
            scaled(xb, torch.where(sc > 0, sc, 1.0), out=a)
            q[r0 * c:r1 * c].view(-1, c).copy_(a.round_())
        if rows * c < d:  # the last, partial chunk
            tq, ts = self._encode_torch(flat[rows * c:])
            q[rows * c:] = tq
            scale[rows:] = ts
        return (q, scale)

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        q, scale = payload
        if not on_cpu(q) or (out is not None and (
                out.dtype != torch.float32 or not out.is_contiguous())):
            # 4. q scale per chunk
            values = chunk_rows(q.float(), self.chunk) * scale[:, None]
            return write_out(values.reshape(-1)[:numel], out)
        c, rows = self.chunk, numel // self.chunk
        res = out.view(-1) if out is not None else empty(numel, torch.float32)
        lib = kernels.lib() if q.is_contiguous() and scale.is_contiguous() else None
        if lib is not None:  # 4. in one pass
            lib.int8_decode(q.data_ptr(), scale.data_ptr(), numel, c, res.data_ptr(),
                            kernels.threads())
            return out if out is not None else res
        per = max(1, LARGE_BLOCK // c)
        for r0, r1 in blocks(rows, per):  # 4. block by block: widen, then scale in cache
            ob = res[r0 * c:r1 * c].view(-1, c)
            ob.copy_(q[r0 * c:r1 * c].view(-1, c)).mul_(scale[r0:r1, None])
        if rows * c < numel:
            res[rows * c:] = q[rows * c:].float() * scale[rows]
        return out if out is not None else res


@dataclass(frozen=True)
class Int8Options:
    """Options of ``int8``."""

    chunk: int = opt(512, "elements per fp32 absmax scale")
    ef: bool = opt(True, "error feedback: add back what rounding dropped, next step")
    exchange: str = exchange_option()

    def __post_init__(self) -> None:
        check(self.chunk >= 1, "int8.chunk", f"got {self.chunk}; use 1 or more")
        check_exchange(self, "int8")


INT8 = CodecEntry(
    name="int8", summary="int8 with one fp32 absmax scale per chunk, all-gathered or scattered",
    options=Int8Options, factory=lambda o, seed, rank: Int8(o.chunk, seed=seed, rank=rank))
