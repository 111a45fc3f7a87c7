"""``topk2bit``: SparseLoCo's chunked top-k with 2-bit values.

Sarfi, Therien, Lidin and Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo"
(arXiv 2508.15706), Algorithm 1's TopK and quantiser (the ``sparseloco`` method encodes its
accumulator with it; here it is a codec of every slot):
  1. the flat x is cut into chunks of ``chunk`` elements and the ``topk`` entries of largest
     magnitude of each chunk are kept (the paper: 1-3 % density);
  2. per chunk, the kept magnitudes a are split at their mean t (the paper's is a 2-bit
     quantiser of the kept values, its exact form not fixed there); each value is sent as its
     sign and one bit (a > t), packed four values to a byte, and the two half-means as fp32;
  3. decode sign x the mean of its half at its offset; indices go as int16 offsets within their
     chunk (``chunk`` <= 32768).
Payload K (2 + 1/4) + 8 C bytes (K kept values, C chunks): at 64 of 4096, 1/227 of dense fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from thinwire.compression.base import Compressor, Part, Payload, write_out
from thinwire.compression.registry import CodecEntry
from thinwire.errors import UsageError
from thinwire.options import check, opt


class ChunkTopK2Bit(Compressor):
    """The chunked top-k 2-bit codec (module docstring, steps 1-3): per chunk the ``topk``
    largest-magnitude entries, int16 offsets, signs and one magnitude bit packed four values to
    a byte, and the two half-means as fp32."""

    name = "topk2bit"

    def __init__(self, chunk: int, topk: int, *, seed: int = 0, rank: int = 0) -> None:
        super().__init__(seed=seed, rank=rank)
        if not 1 <= topk <= chunk <= 32768:
            raise UsageError(f"topk2bit needs 1 <= topk <= chunk <= 32768, got topk={topk}, "
                             f"chunk={chunk}")
        self.chunk, self.topk = chunk, topk

    def params(self) -> dict[str, Any]:
        return {"chunk": self.chunk, "topk": self.topk}

    def kept(self, numel: int) -> int:
        full, rest = divmod(numel, self.chunk)
        return full * self.topk + min(self.topk, rest)

    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        k = self.kept(numel)
        return (Part(k, torch.int16), Part(math.ceil(k / 4), torch.uint8),
                Part(2 * math.ceil(numel / self.chunk), torch.float32))

    def _valid(self, numel: int, device: torch.device) -> torch.Tensor:
        """(chunks, k) booleans: which selected slots hold a value (the last chunk may be
        shorter than topk)."""
        rows = math.ceil(numel / self.chunk)
        valid = torch.ones(rows, self.topk, dtype=torch.bool, device=device)
        rest = numel - (rows - 1) * self.chunk
        valid[-1, min(self.topk, rest):] = False
        return valid

    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        flat = x.detach().reshape(-1).float()
        d = flat.numel()
        rows = math.ceil(d / self.chunk)
        pad = rows * self.chunk - d
        mag = torch.cat([flat.abs(), flat.new_full((pad,), -1.0)]).view(rows, self.chunk)
        # 1. the top-k magnitudes of each chunk (padding, at -1, is never chosen before a value)
        _, idx = torch.topk(mag, self.topk, dim=1)
        valid = self._valid(d, flat.device)
        vals = torch.cat([flat, flat.new_zeros(pad)]).view(rows, self.chunk).gather(1, idx)
        a = vals.abs()
        # 2. split each chunk's kept magnitudes at their mean; the mean of each half
        n = valid.sum(1).clamp(min=1)
        t = (a * valid).sum(1) / n
        hi = (a > t[:, None]) & valid
        lo = ~hi & valid
        mean_hi = (a * hi).sum(1) / hi.sum(1).clamp(min=1)
        mean_lo = (a * lo).sum(1) / lo.sum(1).clamp(min=1)
        # 2. two bits a value: sign, half; packed four to a byte
        code = (torch.signbit(vals).to(torch.uint8) << 1) | hi.to(torch.uint8)
        code = code[valid]
        if code.numel() % 4:
            code = torch.cat([code, code.new_zeros(4 - code.numel() % 4)])
        q = code.view(-1, 4)
        packed = (q[:, 0] << 6) | (q[:, 1] << 4) | (q[:, 2] << 2) | q[:, 3]
        scales = torch.stack([mean_lo, mean_hi], dim=1).reshape(-1)
        return (idx[valid].to(torch.int16), packed, scales)

    def _sparse(self, payload: Payload, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat positions, decoded values) of a payload."""
        idx, packed, scales = payload
        k = idx.numel()
        codes = torch.stack([packed >> 6, (packed >> 4) & 3, (packed >> 2) & 3, packed & 3],
                            dim=1).reshape(-1)[:k]
        valid = self._valid(numel, idx.device)
        row = torch.arange(valid.shape[0], device=idx.device)[:, None].expand_as(valid)[valid]
        s = scales.view(-1, 2)
        mag = torch.where((codes & 1) > 0, s[row, 1], s[row, 0])
        val = torch.where((codes & 2) > 0, -mag, mag)
        return row * self.chunk + idx.long(), val

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        pos, val = self._sparse(payload, numel)
        dense = torch.zeros(numel, dtype=torch.float32, device=val.device)
        dense[pos] = val
        return write_out(dense, out)

    def decode_add(self, payload: Payload, out: torch.Tensor, step: int, *,
                   key: int = 0) -> None:
        pos, val = self._sparse(payload, out.numel())
        out.view(-1).index_add_(0, pos, val.to(out.dtype))


@dataclass(frozen=True)
class TopK2BitOptions:
    """Options of ``topk2bit``."""

    chunk: int = opt(4096, "elements per top-k chunk (<= 32768)")
    topk: int = opt(64, "entries kept per chunk")
    ef: bool = opt(True, "error feedback: add back what was not sent, next time (off by default "
                   "at a pipeline boundary; sparseloco keeps its own accumulator)")

    def __post_init__(self) -> None:
        check(1 <= self.chunk <= 32768, "topk2bit.chunk", f"got {self.chunk}; use 1 to 32768")
        check(1 <= self.topk <= self.chunk, "topk2bit.topk",
              f"got {self.topk}; use 1 to topk2bit.chunk = {self.chunk}")


TOPK2BIT = CodecEntry(
    name="topk2bit", summary="SparseLoCo: top-k of each chunk, int16 offsets, 2-bit values "
    "(sign, half of the chunk's magnitudes), all-gathered", options=TopK2BitOptions,
    factory=lambda o, seed, rank: ChunkTopK2Bit(o.chunk, o.topk, seed=seed, rank=rank))
