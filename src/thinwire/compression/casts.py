"""Identity and precision casts: the linear compressors that are exact or nearly so.

- ``none`` (identity): the payload is the tensor itself. Through the hook it reproduces DDP's
  all-reduce averaging bit for bit (the bucket is divided by n, then summed, as DDP does).
- ``fp16`` / ``bf16``: 1. cast to half precision (2 bytes an element, ratio 2); 2. all-reduce
  the halves (the hook divides by n first, so the sum cannot overflow where the mean does not);
  3. cast the sum back. As torch's ``fp16_compress_hook`` / ``bf16_compress_hook``, but through
  the ledger. Round-to-nearest is biased in the last bit; error feedback removes that bias.
"""

from __future__ import annotations

import torch

from thinwire.compression.base import Compressor, Part, Payload


class Identity(Compressor):
    """No compression: the reference every other compressor is measured against."""

    name = "none"
    linear = True
    unbiased = True

    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        return (Part(numel, dtype),)

    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        return (x.reshape(-1),)

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0) -> torch.Tensor:
        return payload[0].reshape(-1)


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
        return (x.reshape(-1).to(self.wire),)

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0) -> torch.Tensor:
        # 3. back to fp32 (after the all-reduce of step 2)
        return payload[0].reshape(-1).float()
