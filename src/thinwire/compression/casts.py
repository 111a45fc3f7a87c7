"""Identity and precision casts: the linear codecs that are exact or nearly so.

- ``none`` (identity): the payload is the tensor itself. Through the hook it reproduces DDP's
  all-reduce averaging bit for bit (the bucket is divided by n, then summed, as DDP does).
- ``fp16`` / ``bf16``: 1. cast to half precision (2 bytes an element, ratio 2); 2. all-reduce
  the halves (the exchange divides by n first, so the sum cannot overflow where the mean does
  not); 3. cast the sum back. As torch's ``fp16_compress_hook`` / ``bf16_compress_hook``, but
  through the ledger. Round-to-nearest is biased in the last bit; error feedback (Stich et al.
  2018, :mod:`.feedback`) removes that bias, and is on by default (``ef``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thinwire.compression.base import Compressor, Part, Payload, empty, write_out
from thinwire.compression.registry import CodecEntry
from thinwire.options import opt


class Identity(Compressor):
    """No compression: the reference every other codec is measured against."""

    name = "none"
    linear = True
    unbiased = True

    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        return (Part(numel, dtype),)

    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        return (x.reshape(-1),)

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return write_out(payload[0].reshape(-1), out)


class Cast(Compressor):
    """Send every element in a narrower float dtype (``fp16`` or ``bf16``)."""

    linear = True

    def __init__(self, wire: torch.dtype, *, seed: int = 0, rank: int = 0) -> None:
        super().__init__(seed=seed, rank=rank)
        if wire not in (torch.float16, torch.bfloat16):
            raise ValueError(f"cast to {wire} is not supported; use float16 or bfloat16")
        self.wire = wire
        self.name = "fp16" if wire == torch.float16 else "bf16"

    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        return (Part(numel, self.wire),)

    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        # 1. round each element to the wire dtype
        flat = x.reshape(-1)
        return (empty(flat.numel(), self.wire, flat.device).copy_(flat),)

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        # 3. back to fp32 (after the all-reduce of step 2), or into out's dtype
        wire = payload[0].reshape(-1)
        return write_out(wire, out if out is not None else empty(numel, torch.float32,
                                                                  wire.device))


@dataclass(frozen=True)
class CastOptions:
    """Options of ``fp16`` and ``bf16``."""

    ef: bool = opt(True, "error feedback: add back what rounding dropped, next step")


NONE = CodecEntry(name="none", summary="no compression: the plain all-reduce average",
                  factory=lambda o, seed, rank: Identity(seed=seed, rank=rank))
FP16 = CodecEntry(name="fp16", summary="cast to float16 and all-reduce (2x)",
                  options=CastOptions,
                  factory=lambda o, seed, rank: Cast(torch.float16, seed=seed, rank=rank))
BF16 = CodecEntry(name="bf16", summary="cast to bfloat16 and all-reduce (2x)",
                  options=CastOptions,
                  factory=lambda o, seed, rank: Cast(torch.bfloat16, seed=seed, rank=rank))
