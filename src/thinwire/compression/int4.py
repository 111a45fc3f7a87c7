"""``int4``: 4-bit blockwise absmax quantisation, two levels a byte.

The 4-bit format of the compressed-activation literature (Bian et al., "Does compressing
activations help model parallel training?", MLSys 2024, quantise activations and their gradients
to 4 and 8 bits between pipeline stages), here a codec of every slot:
  1. cut the flat x into chunks of ``chunk`` elements; 2. scale = max |x_i| / 7 per chunk;
  3. level = round(x_i / scale) in [-7, 7], stored as level + 8 in a nibble, two a byte
     (high nibble first); 4. decode (level - 8) scale.
|x_i - x_hat_i| <= scale / 2 (round to nearest); payload ceil(d / 2) + 4 ceil(d / chunk) bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from thinwire.compression.base import Compressor, Part, Payload, chunk_rows, write_out
from thinwire.compression.registry import CodecEntry
from thinwire.options import check, opt


def quantize4(flat: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-3: (packed uint8 levels, fp32 scale per chunk)."""
    d = flat.numel()
    rows = chunk_rows(flat, chunk)
    scale = rows.abs().amax(dim=1) / 7
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (torch.round(rows / safe[:, None]).clamp_(-7, 7) + 8).to(torch.uint8).reshape(-1)[:d]
    if d % 2:
        q = torch.cat([q, q.new_full((1,), 8)])
    pairs = q.view(-1, 2)
    return (pairs[:, 0] << 4) | pairs[:, 1], scale


def dequantize4(packed: torch.Tensor, scale: torch.Tensor, numel: int, chunk: int
                ) -> torch.Tensor:
    """Step 4: (level - 8) x scale of its chunk, ``numel`` floats."""
    levels = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:numel]
    return (chunk_rows(levels.float() - 8, chunk) * scale[:, None]).reshape(-1)[:numel]


class Int4(Compressor):
    """4-bit quantisation with an fp32 absmax scale per chunk (module docstring)."""

    name = "int4"

    def __init__(self, chunk: int = 128, *, seed: int = 0, rank: int = 0) -> None:
        super().__init__(seed=seed, rank=rank)
        self.chunk = chunk

    def params(self) -> dict[str, Any]:
        return {"chunk": self.chunk}

    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        return (Part((numel + 1) // 2, torch.uint8), Part(math.ceil(numel / self.chunk),
                                                          torch.float32))

    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        return quantize4(x.detach().reshape(-1).float(), self.chunk)

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        packed, scale = payload
        return write_out(dequantize4(packed, scale, numel, self.chunk), out)


@dataclass(frozen=True)
class Int4Options:
    """Options of ``int4``."""

    chunk: int = opt(128, "elements per fp32 absmax scale")
    ef: bool = opt(True, "error feedback: add back what rounding dropped, next time (off by "
                   "default at a pipeline boundary)")

    def __post_init__(self) -> None:
        check(self.chunk >= 1, "int4.chunk", f"got {self.chunk}; use 1 or more")


INT4 = CodecEntry(
    name="int4", summary="4-bit levels, two a byte, one fp32 absmax scale per chunk, all-gathered",
    options=Int4Options, factory=lambda o, seed, rank: Int4(o.chunk, seed=seed, rank=rank))
