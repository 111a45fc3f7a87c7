"""4-bit floating point (E3M0) with one fp32 absmax scale per chunk: Streaming DiLoCo's outer
gradients on the wire.

Douillard et al., "Streaming DiLoCo with overlapping communication" (arXiv 2501.18512), section
2.3: the outer gradients are sent as 4-bit floats with 1 sign bit, 3 exponent bits and no
mantissa (E3M0), and accumulated in fp32. Here:
  1. cut x into chunks of ``chunk`` elements; per chunk, scale s = max |x_i| (fp32 on the wire);
  2. m_i = |x_i| / s in [0, 1]; the representable magnitudes are 0 and 2^(c - 7) for the
     exponent codes c = 1..7 (1/64 .. 1); m_i goes to the nearest of them: c = 0 below 2^-7,
     else c = 1 + #{c' = 2..7 : m_i >= 0.75 2^(c' - 7)} (0.75 2^j is the midpoint of 2^(j-1)
     and 2^j; ties go up). Comparisons against exact midpoints, not a rounded log2: the same
     codes on every device and in the compiled kernel;
  3. the nibble (sign << 3) | c, two to a byte (the first element in the high nibble):
     ceil(d / 2) bytes;
  4. decode x_hat_i = (-1)^sign s 2^(c - 7) (0 for c = 0).
Not linear (scales differ by rank): the exchange all-gathers each rank's bytes and every rank
decodes and sums them in fp32; with ``exchange=scatter`` it is a quantised reduce-scatter summed
in fp32 and an all-gather of the re-quantised mean (:mod:`thinwire.compression.scatter`).
Deterministic rounding is biased: error feedback is on by default (``ef``). Torch operations on
any device; float32 CPU tensors take the compiled kernel (:mod:`thinwire.kernels`: steps 1-3
in one pass, step 4 in one pass) where it is built, with the same bytes and values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from thinwire import kernels
from thinwire.compression.base import Compressor, Part, Payload, chunk_rows, empty, write_out
from thinwire.compression.registry import CodecEntry, check_exchange, exchange_option
from thinwire.options import check, opt

BOUNDS = (2.0**-7, 0.75 * 2.0**-5, 0.75 * 2.0**-4, 0.75 * 2.0**-3, 0.75 * 2.0**-2, 0.75 * 2.0**-1,
          0.75)
"""Step 2's boundaries: m below the first is code 0, and each one m reaches adds 1 to the code
(0.75 2^(c - 7) between 2^(c - 8) and 2^(c - 7)); all exact in float32. The torch path and the
compiled kernel read the count from m's bits (a NaN's bits give 7 on both)."""

BITS_MIN = 120 << 23
"""The bits of 2^-7 (exponent 120 biased): a non-negative m below it is code 0."""

VALUES = tuple([0.0] + [2.0 ** (c - 7) for c in range(1, 8)] + [-0.0]
               + [-(2.0 ** (c - 7)) for c in range(1, 8)])
"""Step 4's value of each nibble before scaling: (-1)^sign 2^(c - 7), +-0 for c = 0."""


class FP4(Compressor):
    """E3M0 4-bit floats against one fp32 absmax scale per chunk (module docstring)."""

    name = "fp4"

    def __init__(self, chunk: int = 256, *, seed: int = 0, rank: int = 0) -> None:
        super().__init__(seed=seed, rank=rank)
        if chunk < 1:
            raise ValueError(f"fp4 chunk must be >= 1, got {chunk}")
        self.chunk = chunk

    def params(self) -> dict[str, Any]:
        return {"chunk": self.chunk}

    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        return (Part(math.ceil(numel / 2), torch.uint8),
                Part(math.ceil(numel / self.chunk), torch.float32))

    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        flat = x.detach().reshape(-1).float()
        d = flat.numel()
        lib = kernels.wants(flat)
        if lib is not None:  # steps 1-3 in one compiled pass a chunk
            packed, scale = empty((d + 1) // 2, torch.uint8), empty(self.spec(d)[1].numel,
                                                                     torch.float32)
            lib.fp4_encode(flat.data_ptr(), d, self.chunk, packed.data_ptr(), scale.data_ptr(),
                           kernels.threads())
            return (packed, scale)
        # 1. absmax scale per chunk
        chunks = chunk_rows(flat, self.chunk)
        scale = chunks.abs().amax(dim=1)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        # 2. the exponent code of m = |x| / s: how many boundaries m reaches. m = f 2^e with
        #    f in [1, 2) reaches 0.75 2^(e + 1) = 1.5 2^e exactly when f's first fraction bit
        #    is set, so the count is e + 7 + that bit (clamped to 1..7), 0 below 2^-7: from
        #    the bits, ((bits >> 22) + 1) >> 1 = (e + 127) + that bit
        m = (chunks.abs() / safe[:, None]).reshape(-1)[:d]
        bits = m.view(torch.int32)
        code = (((bits >> 22) + 1) >> 1).sub_(120).clamp_(1, 7)
        code = code.masked_fill_(bits < BITS_MIN, 0).to(torch.uint8)
        # 3. sign and code in a nibble, two to a byte
        nib = code | (torch.signbit(flat).to(torch.uint8) << 3)
        if d % 2:
            nib = torch.cat([nib, nib.new_zeros(1)])
        pairs = nib.view(-1, 2)
        return ((pairs[:, 0] << 4) | pairs[:, 1], scale)

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        packed, scale = payload
        lib = kernels.lib() if packed.device.type == "cpu" and packed.is_contiguous() \
            and scale.is_contiguous() and scale.dtype == torch.float32 and (
                out is None or (out.dtype == torch.float32 and out.is_contiguous()
                                and out.device.type == "cpu")) else None
        if lib is not None:  # step 4 in one compiled pass
            res = out.view(-1) if out is not None else empty(numel, torch.float32)
            lib.fp4_decode(packed.data_ptr(), scale.data_ptr(), numel, self.chunk,
                           res.data_ptr(), kernels.threads())
            return out if out is not None else res
        nib = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:numel]
        # 4. (-1)^sign s 2^(c - 7), +-0 for c = 0
        table = torch.tensor(VALUES, dtype=torch.float32, device=packed.device)
        val = (chunk_rows(table[nib.long()], self.chunk) * scale[:, None]).reshape(-1)[:numel]
        return write_out(val, out)


@dataclass(frozen=True)
class FP4Options:
    """Options of ``fp4``."""

    chunk: int = opt(256, "elements per fp32 absmax scale")
    ef: bool = opt(True, "error feedback: add back what rounding dropped, next exchange")
    exchange: str = exchange_option()

    def __post_init__(self) -> None:
        check(self.chunk >= 1, "fp4.chunk", f"got {self.chunk}; use 1 or more")
        check_exchange(self, "fp4")


FP4_ENTRY = CodecEntry(
    name="fp4", summary="4-bit E3M0 floats with one fp32 absmax scale per chunk, all-gathered or scattered",
    options=FP4Options, factory=lambda o, seed, rank: FP4(o.chunk, seed=seed, rank=rank))
