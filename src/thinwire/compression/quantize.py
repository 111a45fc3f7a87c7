"""Quantizers: QSGD (stochastic, unbiased) and int8 with a scale per chunk.

QSGD -- Alistarh, Grubic, Li, Tomioka and Vojnovic, "QSGD: Communication-Efficient SGD via
Gradient Quantization and Encoding" (NeurIPS 2017), with s levels:
  1. send the norm ||x||_2 (one fp32);
  2. r_i = s |x_i| / ||x||_2 in [0, s]; round r_i up with probability r_i - floor(r_i), down
     otherwise (each rank draws its own rounding, from its private generator), so
     E[level_i] = r_i;
  3. send sign(x_i) x level_i as one signed integer in the smallest dtype that holds [-s, s]
     (int8 for s <= 127: 1 byte an element, less than separate sign bits plus uint8 levels;
     int16 up to 32767; int32 above);
  4. decode x_hat_i = ||x||_2 level_i / s: unbiased, E[x_hat] = x, with
     E||x_hat - x||^2 <= min(d / s^2, sqrt(d) / s) ||x||^2 (their Lemma 3.1).
  Not linear (norms differ by rank): the hook all-gathers and decodes each rank's payload.

int8 (blockwise absmax, as in hivemind's and bitsandbytes' blockwise codecs):
  1. cut x into chunks of ``chunk`` elements (512: a 4-byte scale costs 0.8 %);
  2. per chunk, scale = max |x_i| / 127 (sent as fp32);
  3. send round(x_i / scale) as int8; the error is at most scale / 2 per element.
  Deterministic rounding is biased (slightly); error feedback removes the bias.
"""

from __future__ import annotations

import math

import torch

from thinwire.compression.base import Compressor, Part, Payload


def level_dtype(levels: int) -> torch.dtype:
    """The smallest signed integer dtype holding [-levels, levels]."""
    if levels <= 127:
        return torch.int8
    if levels <= 32767:
        return torch.int16
    return torch.int32


class QSGD(Compressor):
    """Stochastic quantization to s levels of |x_i| / ||x||_2, unbiased."""

    name = "qsgd"
    unbiased = True

    def __init__(self, levels: int, *, seed: int = 0, rank: int = 0) -> None:
        super().__init__(seed=seed, rank=rank)
        if levels < 1:
            raise ValueError(f"qsgd needs at least 1 level, got {levels}")
        self.levels = levels

    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        return (Part(1, torch.float32), Part(numel, level_dtype(self.levels)))

    def variance_bound(self, numel: int) -> float:
        """omega with E||x_hat - x||^2 <= omega ||x||^2 (Alistarh et al., Lemma 3.1)."""
        s = self.levels
        return min(numel / s**2, math.sqrt(numel) / s)

    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        flat = x.reshape(-1).float()
        s = self.levels
        # 1. the norm
        norm = flat.norm()
        n = float(norm)
        # 2. stochastic rounding: floor(r + u), u ~ U[0, 1), is r's upper neighbour with
        #    probability r - floor(r)
        r = flat.abs().mul_(s / n if n > 0 else 0.0)
        r.add_(torch.rand(flat.numel(), generator=self.private_generator(step, key)))
        level = r.floor_().clamp_(max=s)
        # 3. sign and level in one signed integer
        q = torch.copysign(level, flat).to(level_dtype(s))
        return (norm.reshape(1), q)

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0) -> torch.Tensor:
        norm, q = payload
        # 4. ||x|| level / s
        return q.float() * (norm / self.levels)


class Int8(Compressor):
    """Round to int8 against one fp32 absmax scale per chunk of elements."""

    name = "int8"

    def __init__(self, chunk: int = 512, *, seed: int = 0, rank: int = 0) -> None:
        super().__init__(seed=seed, rank=rank)
        if chunk < 1:
            raise ValueError(f"int8 chunk must be >= 1, got {chunk}")
        self.chunk = chunk

    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        return (Part(numel, torch.int8), Part(math.ceil(numel / self.chunk), torch.float32))

    def _chunks(self, flat: torch.Tensor) -> torch.Tensor:
        pad = (-flat.numel()) % self.chunk
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(-1, self.chunk)

    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        flat = x.reshape(-1).float()
        # 1. chunks; 2. absmax scale per chunk
        chunks = self._chunks(flat)
        scale = chunks.abs().amax(dim=1) / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        # 3. round to int8
        q = torch.round(chunks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        return (q.reshape(-1)[:flat.numel()], scale)

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0) -> torch.Tensor:
        q, scale = payload
        chunks = self._chunks(q.float())
        return (chunks * scale[:, None]).reshape(-1)[:numel]
