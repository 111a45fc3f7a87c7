"""``dcttopk``: DeMo's payload, the top-k coefficients of a blocked DCT.

Peng, Quesnelle and Kingma, "DeMo: Decoupled Momentum Optimization" (arXiv 2411.19870),
Algorithm 1's extraction (the ``demo`` method encodes its momenta with it; here it is a codec of
every slot):
  1. the tensor is viewed as a matrix (rows = its first dimension, a vector as one row) and cut
     into blocks of s_r x s_c, each the largest divisor of its dimension <= ``chunk`` (the
     reference code's rule);
  2. an orthonormal 2-D DCT-II of each block;
  3. the ``topk`` coefficients of largest magnitude of each block are kept and sent as int16
     offsets within the block and fp32 values (``chunk`` <= 181, so offsets fit 16 bits);
  4. decode: the kept coefficients in place (the rest zero), the inverse DCT of each block.
Payload 6 bytes a kept coefficient, blocks x min(topk, s_r s_c) of them. The codec reads the
tensor's shape (the blocks of a matrix differ from those of its flattening), so it is
:class:`~thinwire.compression.base.Shaped`; a flat buffer (a DDP bucket, an outer delta) is one
row. A sum of payloads may be taken in the coefficients and inverted once
(:meth:`DCTTopK.coefficients`, :meth:`DCTTopK.add_coefficients`, :meth:`DCTTopK.inverse`), as
DeMo's mean of the ranks' components is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from thinwire.compression.base import Part, Payload, Shaped, Site
from thinwire.compression.registry import CodecEntry
from thinwire.errors import UsageError
from thinwire.options import check, opt


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is <= ``at_most``."""
    for d in range(min(n, at_most), 0, -1):
        if n % d == 0:
            return d
    return 1


def blocks_of(shape: Sequence[int], chunk: int) -> tuple[int, int, int, int]:
    """Step 1's view of a tensor: (rows, cols, s_r, s_c)."""
    if len(shape) == 0:
        rows, cols = 1, 1
    elif len(shape) == 1:
        rows, cols = 1, shape[0]
    else:
        rows, cols = shape[0], math.prod(shape[1:])
    return rows, cols, largest_divisor(rows, chunk), largest_divisor(cols, chunk)


def kept(shape: Sequence[int], chunk: int, topk: int) -> int:
    """Coefficients a payload holds for a tensor of ``shape``."""
    rows, cols, sr, sc = blocks_of(shape, chunk)
    return (rows // sr) * (cols // sc) * min(topk, sr * sc)


def dct_matrix(n: int, device: torch.device) -> torch.Tensor:
    """The orthonormal DCT-II matrix D (n x n): coefficients y = D x, inverse x = D^T y."""
    k = torch.arange(n, dtype=torch.float64, device=device)[:, None]
    i = torch.arange(n, dtype=torch.float64, device=device)[None, :]
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(torch.float32)


class DCTTopK(Shaped):
    """Top-k of each block's DCT (module docstring, steps 1-4). :attr:`bases` caches the DCT
    matrices per (size, device): a pure cache, rebuilt when cleared."""

    name = "dcttopk"

    def __init__(self, chunk: int = 64, topk: int = 32, *, seed: int = 0, rank: int = 0) -> None:
        super().__init__(seed=seed, rank=rank)
        if topk < 1 or not 1 <= chunk <= 181:
            raise UsageError(f"dcttopk needs topk >= 1 and chunk in [1, 181] (int16 offsets), "
                             f"got topk={topk}, chunk={chunk}")
        self.chunk, self.topk = chunk, topk
        self.bases: dict[tuple[int, str], torch.Tensor] = {}

    def params(self) -> dict[str, Any]:
        return {"chunk": self.chunk, "topk": self.topk}

    def _d(self, n: int, device: torch.device) -> torch.Tensor:
        key = (n, str(device))
        if key not in self.bases:
            self.bases[key] = dct_matrix(n, device)
        return self.bases[key]

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """x as (blocks, s_r, s_c)."""
        rows, cols, sr, sc = blocks_of(tuple(x.shape), self.chunk)
        b = x.reshape(rows // sr, sr, cols // sc, sc).permute(0, 2, 1, 3)
        return b.reshape(-1, sr, sc)

    def _unblocks(self, b: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        rows, cols, sr, sc = blocks_of(shape, self.chunk)
        x = b.reshape(rows // sr, cols // sc, sr, sc).permute(0, 2, 1, 3)
        return x.reshape(tuple(shape))

    def _dct2(self, x: torch.Tensor) -> torch.Tensor:
        b = self._blocks(x)
        dr, dc = self._d(b.shape[1], x.device), self._d(b.shape[2], x.device)
        return (dr @ b @ dc.T).reshape(b.shape[0], -1)

    def inverse(self, coef: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """Step 4's inverse DCT: the tensor of ``shape`` whose block coefficients are ``coef``
        (blocks, s_r s_c)."""
        _, _, sr, sc = blocks_of(shape, self.chunk)
        dr, dc = self._d(sr, coef.device), self._d(sc, coef.device)
        return self._unblocks(dr.T @ coef.reshape(-1, sr, sc) @ dc, shape)

    def _kept(self, shape: Sequence[int]) -> tuple[int, int]:
        """(blocks, coefficients kept per block) of a tensor of ``shape``."""
        rows, cols, sr, sc = blocks_of(shape, self.chunk)
        return (rows // sr) * (cols // sc), min(self.topk, sr * sc)

    def tensor_spec(self, shape: Sequence[int]) -> tuple[Part, ...]:
        n = kept(shape, self.chunk, self.topk)
        return (Part(n, torch.int16), Part(n, torch.float32))

    def encode_tensor(self, x: torch.Tensor, site: Site) -> Payload:
        # 1-2. the blocks' DCT; 3. the top-k of each
        coef = self._dct2(x.detach().float())
        k = min(self.topk, coef.shape[1])
        _, idx = torch.topk(coef.abs(), k, dim=1)
        val = coef.gather(1, idx)
        return (idx.reshape(-1).to(torch.int16), val.reshape(-1))

    def coefficients(self, shape: Sequence[int], device: torch.device) -> torch.Tensor:
        """Zero coefficients (blocks, s_r s_c) of a tensor of ``shape``, to sum payloads into."""
        _, _, sr, sc = blocks_of(shape, self.chunk)
        return torch.zeros(self._kept(shape)[0], sr * sc, dtype=torch.float32, device=device)

    def add_coefficients(self, payload: Payload, coef: torch.Tensor) -> None:
        """``coef += `` the kept coefficients of ``payload`` in place."""
        idx, val = payload
        blocks = coef.shape[0]
        coef.scatter_add_(1, idx.long().view(blocks, -1), val.view(blocks, -1))

    def decode_tensor(self, payload: Payload, shape: Sequence[int], site: Site) -> torch.Tensor:
        # 4. the kept coefficients in place, the inverse DCT
        idx, val = payload
        coef = self.coefficients(shape, val.device)
        blocks = coef.shape[0]
        coef.scatter_(1, idx.long().view(blocks, -1), val.view(blocks, -1))
        return self.inverse(coef, shape)


@dataclass(frozen=True)
class DCTTopKOptions:
    """Options of ``dcttopk``."""

    chunk: int = opt(64, "largest block side (a divisor of each dimension <= this)")
    topk: int = opt(32, "DCT coefficients kept per block")
    ef: bool = opt(True, "error feedback: add back what was not sent, next time (off by default "
                   "at a pipeline boundary; demo keeps its own in the momentum)")

    def __post_init__(self) -> None:
        check(1 <= self.chunk <= 181, "dcttopk.chunk",
              f"got {self.chunk}; use 1 to 181 (int16 offsets)")
        check(self.topk >= 1, "dcttopk.topk", f"got {self.topk}; use 1 or more")


DCTTOPK = CodecEntry(
    name="dcttopk", summary="DeMo: top-k coefficients of each block's DCT, int16 offsets and "
    "fp32 values, all-gathered", options=DCTTopKOptions,
    factory=lambda o, seed, rank: DCTTopK(o.chunk, o.topk, seed=seed, rank=rank))
