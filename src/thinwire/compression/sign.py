"""Scaled sign with real bit packing: 1 bit an element on the wire plus one fp32 scale.

Karimireddy, Rebjock, Stich and Jaggi, "Error Feedback Fixes SignSGD and other Gradient
Compression Schemes" (ICML 2019): C(x) = (||x||_1 / d) sign(x). It is contractive,
||C(x) - x||^2 = (1 - ||x||_1^2 / (d ||x||_2^2)) ||x||^2, so with error feedback SGD converges
like SGD, while plain (scaled) signSGD can stall away from the optimum (their counterexamples;
our test shows it on heterogeneous workers).

  1. scale = ||x||_1 / d (one fp32);
  2. bits b_i = [x_i >= 0], packed 8 to a uint8, most significant bit first: exactly
     ceil(d / 8) bytes;
  3. decode x_hat_i = +scale if b_i else -scale.
Not linear (scales differ by rank): the exchange all-gathers ceil(d / 8) + 4 bytes per rank.
Biased: error feedback is on by default (``ef``).

On CPU, steps 1-2 run block by block in cache (x is read from memory once), and step 3 is one
table lookup per packed byte: row b of a (256, 8) table holds the eight decoded values of byte b,
so each output element is written once; with the compiled kernels (:mod:`thinwire.kernels`)
each step is one compiled pass. ||x||_1 on CPU is summed in lanes in an order fixed by the
indices, so that the numpy and the compiled paths give the same bits on any thread count: per
block of 2^17 elements, lane j is the float32 sum of |x| at column j of the block's whole rows
of 1024, in row order, widened to float64 (a partial last row then adds to the first lanes in
float64); the blocks' lanes are added in block order, then the 1024 lanes in order. A lane's
float32 sum of at most 128 rows is within 128 units in the last place of its value (the
compiled encode spent half its operations widening every element to float64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from thinwire import kernels
from thinwire.compression.base import (
    BLOCK,
    Compressor,
    Part,
    Payload,
    as_numpy,
    blocks,
    byte_bits,
    empty,
    is_cpu_float32,
    on_cpu,
    pack_bits,
    unpack_bits,
    write_out,
)
from thinwire.compression.registry import CodecEntry
from thinwire.options import opt

LANES = 1024
"""Lanes of the CPU paths' ||x||_1 (module doc)."""


def _table(scale: float) -> np.ndarray:
    """(256, 8) float32: row b holds +scale where bit j of byte b is set, else -scale."""
    s = np.float32(scale)
    return np.where(byte_bits(), s, -s).astype(np.float32)


class ScaledSign(Compressor):
    """(||x||_1 / d) sign(x), signs packed to bits (Karimireddy et al. 2019)."""

    name = "sign"

    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        return (Part(1, torch.float32), Part(math.ceil(numel / 8), torch.uint8))

    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        flat = x.reshape(-1)
        d = flat.numel()
        if not is_cpu_float32(flat):
            # 1. the scale; 2. the packed sign bits
            scale = torch.linalg.vector_norm(flat.float(), 1) / max(d, 1)
            return (scale.reshape(1), pack_bits(flat >= 0))
        lib = kernels.wants(flat)
        if lib is not None:  # steps 1-2 in one compiled pass, the lanes added there too
            out, bits = torch.empty(1), torch.empty(math.ceil(d / 8), dtype=torch.uint8)
            lib.sign_encode(flat.data_ptr(), d, bits.data_ptr(), out.data_ptr(),
                            kernels.threads())
            return (out, bits)
        xn = as_numpy(flat)
        packed = np.empty(math.ceil(d / 8), np.uint8)
        lanes = np.zeros(LANES, np.float64)
        size = min(d, 2 * BLOCK)  # a multiple of 8 unless it is all of x
        a, ge = np.empty(size, np.float32), np.empty(size, bool)
        for s, e in blocks(d, 2 * BLOCK):
            xb = xn[s:e]
            # 1. ||x||_1, block by block, as lane sums (module doc)
            ab = np.abs(xb, out=a[:e - s])
            full = (e - s) // LANES * LANES
            part = ab[:full].reshape(-1, LANES).sum(axis=0, dtype=np.float32).astype(np.float64)
            part[:e - s - full] += ab[full:]
            lanes += part
            # 2. the bits
            packed[s // 8:(e + 7) // 8] = np.packbits(np.greater_equal(xb, 0, out=ge[:e - s]))
        total = float(np.cumsum(lanes)[-1])  # the lanes added in order
        scale = torch.tensor([total / max(d, 1)], dtype=torch.float32)
        return (scale, torch.from_numpy(packed))

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        scale, packed = payload
        if not on_cpu(packed) or (out is not None and (
                out.dtype != torch.float32 or not out.is_contiguous())):
            # 3. +scale or -scale per bit, as 2 scale b_i - scale (exact)
            s = scale.reshape(())
            bits = unpack_bits(packed, numel).to(s.dtype)
            return write_out(bits.mul_(2 * s).sub_(s), out)
        res = out if out is not None else empty(numel, torch.float32)
        lib = kernels.lib() if packed.is_contiguous() else None
        if lib is not None:  # 3. in one compiled pass
            lib.sign_decode(packed.data_ptr(), numel, float(scale), res.data_ptr(), 0,
                            kernels.threads())
            return res
        self._lookup(float(scale), as_numpy(packed), as_numpy(res).reshape(-1), add=False)
        return res

    def decode_add(self, payload: Payload, out: torch.Tensor, step: int, *, key: int = 0) -> None:
        scale, packed = payload
        if not on_cpu(packed) or out.dtype != torch.float32 or not out.is_contiguous():
            super().decode_add(payload, out, step, key=key)
            return
        lib = kernels.lib() if packed.is_contiguous() else None
        if lib is not None:
            lib.sign_decode(packed.data_ptr(), out.numel(), float(scale), out.data_ptr(), 1,
                            kernels.threads())
            return
        self._lookup(float(scale), as_numpy(packed), as_numpy(out).reshape(-1), add=True)

    @staticmethod
    def _lookup(scale: float, packed: np.ndarray, out: np.ndarray, *, add: bool) -> None:
        """Step 3 on CPU: each packed byte's row of the table, written (or added) into out."""
        table, d = _table(scale), out.size
        full = d // 8
        rows = out[:full * 8].reshape(-1, 8)
        if add:
            buf = np.empty((max(1, min(full, BLOCK // 8)), 8), np.float32)
            for s, e in blocks(full, buf.shape[0]):
                rows[s:e] += np.take(table, packed[s:e], axis=0, out=buf[:e - s], mode="clip")
        else:
            np.take(table, packed[:full], axis=0, out=rows, mode="clip")
        if full * 8 < d:  # the last, partial byte
            tail = table[packed[full]][:d - full * 8]
            if add:
                out[full * 8:] += tail
            else:
                out[full * 8:] = tail


@dataclass(frozen=True)
class SignOptions:
    """Options of ``sign``."""

    ef: bool = opt(True, "error feedback (Karimireddy et al.: without it sign can stall)")


SIGN = CodecEntry(
    name="sign", summary="scaled sign, 1 bit an element plus one fp32 scale, all-gathered",
    options=SignOptions, factory=lambda o, seed, rank: ScaledSign(seed=seed, rank=rank))
