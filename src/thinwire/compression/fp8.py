"""fp8: one fp32 absmax scale per chunk of elements, each element an 8-bit float (OCP FP8: e4m3fn,
or e5m2) of x over its chunk's scale (blockwise absmax scaling, as torchft's and DeepSpeed's
fp8 collectives quantise row- or blockwise).

  1. cut x into chunks of ``chunk`` elements (512: a 4-byte scale costs 0.8 %);
  2. per chunk, scale = max |x_i| / FMAX (sent as fp32), FMAX the format's largest finite
     value (448 for e4m3fn, 57344 for e5m2), so the chunk's largest magnitude lands on it;
  3. send fp8(x_i inv), inv = 1 / scale rounded to float32 once per chunk as int8's step 3
     (:func:`thinwire.compression.int8.absmax_scaled`; a chunk whose scale is below 2^-126
     takes inv = 0 and is sent as zeros), fp8() torch's own conversion (to nearest, ties to even;
     |x_i inv| <= FMAX (1 + 2^-22), so no finite x reaches the overflow cases: a chunk holding
     an infinity or a NaN sends what torch's conversion makes of it). e4m3fn keeps 3 mantissa
     bits (error at most 2^-4 of |x_i| in its normal range; below it, |x_i| under 2^-6 scale,
     at most 2^-10 scale), e5m2 2 bits and a wider range (2^-3 of |x_i|; 2^-17 scale under
     2^-14 scale), each up to float32's roundings of x_i inv and of the decode's product;
  4. decode fp8 value times scale.
  Deterministic rounding is biased (slightly); error feedback removes the bias (``ef``, on by
  default).
With the compiled kernels (:mod:`thinwire.kernels`) steps 2-3 are one pass a chunk (the absmax,
then torch's codes computed from the bits, eight lanes at once, from cache) and step 4 one pass;
a CPU tensor otherwise, and every other device, runs the torch path: torch's float8 dtypes, their
cast, and a lookup in the 256 codes' values for the decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from thinwire import kernels
from thinwire.compression.base import (
    Compressor,
    Part,
    Payload,
    chunk_rows,
    empty,
    on_cpu,
    write_out,
)
from thinwire.compression.int8 import absmax_scaled
from thinwire.compression.registry import CodecEntry, check_exchange, exchange_option
from thinwire.options import check, opt

FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
"""The formats by name: torch's dtype of each."""


def largest(fmt: str) -> float:
    """FMAX of a format: its largest finite value (448 for e4m3, 57344 for e5m2)."""
    return float(torch.finfo(FORMATS[fmt]).max)


class FP8(Compressor):
    """Round to an 8-bit float against one fp32 absmax scale per chunk of elements (module
    doc)."""

    name = "fp8"

    def __init__(self, chunk: int = 512, fmt: str = "e4m3", *, seed: int = 0,
                 rank: int = 0) -> None:
        super().__init__(seed=seed, rank=rank)
        if chunk < 1:
            raise ValueError(f"fp8 chunk must be >= 1, got {chunk}")
        if fmt not in FORMATS:
            raise ValueError(f"fp8 format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        self.chunk = chunk
        self.format = fmt
        self.dtype = FORMATS[fmt]
        self.fmax = largest(fmt)
        self._e5m2 = int(fmt == "e5m2")  # the kernels' format argument
        self._tables: dict[torch.device, torch.Tensor] = {}

    def params(self) -> dict[str, Any]:
        return {"chunk": self.chunk, "format": self.format}

    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        return (Part(numel, torch.uint8), Part(math.ceil(numel / self.chunk), torch.float32))

    def _table(self, device: torch.device) -> torch.Tensor:
        """The 256 codes' values by torch's own conversion, kept per device (a lookup is
        several times faster than torch's float8 -> float32 cast on CPU)."""
        table = self._tables.get(device)
        if table is None:
            codes = torch.arange(256, dtype=torch.uint8, device=device)
            table = self._tables[device] = codes.view(self.dtype).float()
        return table

    def _encode_torch(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # 1. chunks; 2. absmax scale per chunk; 3. x inv converted by torch (to nearest, ties
        # to even), sent as its bits
        y, scale = absmax_scaled(flat, self.chunk, self.fmax)
        q = y.to(self.dtype).view(torch.uint8)
        return q.reshape(-1)[:flat.numel()], scale

    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        flat = x.reshape(-1).float()
        lib = kernels.wants(flat) if on_cpu(flat) else None
        if lib is None:
            return self._encode_torch(flat.detach())
        c, d = self.chunk, flat.numel()
        q = empty(d, torch.uint8)
        scale = empty(math.ceil(d / c), torch.float32)
        # steps 2-3 in one pass a chunk
        lib.fp8_encode(flat.data_ptr(), d, c, self._e5m2, q.data_ptr(),
                       scale.data_ptr(), kernels.threads())
        return (q, scale)

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        q, scale = payload
        lib = kernels.lib() if (
            on_cpu(q) and q.is_contiguous() and scale.is_contiguous()
            and (out is None or (out.dtype == torch.float32 and out.is_contiguous()))) else None
        if lib is None:  # 4. fp8 value times scale, per chunk
            values = chunk_rows(self._table(q.device).index_select(0, q.reshape(-1).int()),
                                self.chunk)
            return write_out((values * scale[:, None]).reshape(-1)[:numel], out)
        res = out.view(-1) if out is not None else empty(numel, torch.float32)
        # 4. in one pass
        lib.fp8_decode(q.data_ptr(), scale.data_ptr(), numel, self.chunk,
                       self._e5m2, res.data_ptr(), kernels.threads())
        return out if out is not None else res


@dataclass(frozen=True)
class FP8Options:
    """Options of ``fp8``."""

    chunk: int = opt(512, "elements per fp32 absmax scale")
    format: str = opt("e4m3", "e4m3 (e4m3fn: 3 mantissa bits, up to 448) or e5m2 (2 mantissa "
                      "bits, up to 57344)")
    ef: bool = opt(True, "error feedback: add back what rounding dropped, next step")
    exchange: str = exchange_option()

    def __post_init__(self) -> None:
        check(self.chunk >= 1, "fp8.chunk", f"got {self.chunk}; use 1 or more")
        check(self.format in FORMATS, "fp8.format",
              f"got {self.format!r}; use {' or '.join(FORMATS)}")
        check_exchange(self, "fp8")


FP8_ENTRY = CodecEntry(
    name="fp8", summary="8-bit floats (e4m3fn or e5m2) with one fp32 absmax scale per chunk, "
    "all-gathered or scattered", options=FP8Options,
    factory=lambda o, seed, rank: FP8(o.chunk, o.format, seed=seed, rank=rank))
