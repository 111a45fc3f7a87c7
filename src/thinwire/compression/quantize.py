"""QSGD (stochastic quantization, unbiased), and the counter-based draws it shares with
Rand-k (:func:`counter_hash`, :class:`CounterUniform`). int8 with a scale per chunk is
:mod:`thinwire.compression.int8`.

QSGD -- Alistarh, Grubic, Li, Tomioka and Vojnovic, "QSGD: Communication-Efficient SGD via
Gradient Quantization and Encoding" (NeurIPS 2017), with s levels:
  1. send the norm ||x||_2 (one fp32);
  2. r_i = s |x_i| / ||x||_2 in [0, s]; round r_i up with probability r_i - floor(r_i), down
     otherwise: level_i = floor(r_i + u_i) with u_i uniform on [0, 1), each rank drawing its
     own u from its private randomness, so E[level_i] = r_i;
  3. send sign(x_i) x level_i as one signed integer in the smallest dtype that holds [-s, s]
     (int8 for s <= 127: 1 byte an element, less than separate sign bits plus uint8 levels;
     int16 up to 32767; int32 above);
  4. decode x_hat_i = ||x||_2 level_i / s: unbiased, E[x_hat] = x, with
     E||x_hat - x||^2 <= min(d / s^2, sqrt(d) / s) ||x||^2 (their Lemma 3.1).
  Not linear (norms differ by rank): the exchange all-gathers and decodes each rank's payload.
  On CPU the norm's squares are summed in an order fixed by the indices (:func:`sum_squares`,
  the compiled kernel and numpy giving the same bits), and steps 2-3 run block by block in
  cache in fixed point with 16 fraction bits: t_i = x_i c16 in float32 with
  c16 = 2^16 s / ||x||_2 (computed in double, rounded to float32), T_i = rint(t_i) (to
  nearest, ties to even), level_i = floor((T_i + u_i) / 2^16) within [-s, s] for a 16-bit draw
  u_i. That is sign(x_i) level_i in law for r'_i = |T_i| / 2^16, within 2^-17 of the float32
  product |t_i| / 2^16 (itself within 2^-24 relative of r_i): T_i + u_i passes the
  next multiple of 2^16 with probability exactly frac(r'_i), so E[level_i] = r'_i with no grid
  bias, and for x_i < 0 the upper neighbour in magnitude comes with the same probability (no
  sign bits are split off and joined back). u comes from a counter-based stream there
  (:class:`CounterUniform`: element i's draw is half of a hash of i / 2 and the rank's keys,
  so the compiled kernel draws blocks in parallel with the same bits, one hash for two
  elements; ``torch.rand`` on one core costs ~8x a copy of x), from the device's
  ``torch.Generator`` elsewhere (floor(r_i + u_i) with u_i on float32's 2^24-point grid).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from thinwire import kernels
from thinwire.compression.base import (
    BLOCK,
    LARGE_BLOCK,
    NUMPY_DTYPES,
    Compressor,
    Part,
    Payload,
    as_numpy,
    blocks,
    empty,
    mix_seed,
    on_cpu,
    write_out,
)
from thinwire.compression.registry import CodecEntry
from thinwire.options import check, opt

_M32 = 0xFFFFFFFF
LOWBIAS = (np.uint32(0x7FEB352D), np.uint32(0x846CA68B))
"""The multipliers of C. Wellons' ``lowbias32`` integer hash (x ^= x >> 16; x *= m1;
x ^= x >> 15; x *= m2; x ^= x >> 16), a bijection of 32-bit words with low bias."""


@functools.lru_cache(maxsize=1024)
def counter_keys(seed: int, step: int, key: int, rank: int | None) -> tuple[int, int, int]:
    """(k0 odd, k1, k2 odd): the 32-bit keys of this rank's counter stream at (step, key);
    ``rank`` None: the stream every rank shares (Rand-k's offsets). Kept for the last 1,024
    tuples (seven splitmix64 rounds in Python cost more than a kernel call: Rand-k's encode
    and the decodes of its step ask for the same keys)."""
    a = mix_seed(seed, step, key, rank, 0x5EED) if rank is not None else mix_seed(
        seed, step, key, 0x5A4D)
    b = mix_seed(a, 1)
    return (a & _M32) | 1, b & _M32, ((a >> 32) & _M32) | 1


def counter_hash(index: torch.Tensor, keys: tuple[int, int, int]) -> torch.Tensor:
    """h_i = lowbias32(lo32(i) k0 + k1 + hi32(i) k2) (mod 2^32) of int64 indices, as int64
    holding 32-bit words, on the indices' device: :class:`CounterUniform`'s words before the
    shift, computed with torch's int64 ops (every product of two 32-bit words wraps mod 2^64,
    whose low 32 bits are the word's), the bits the compiled kernels compute; the words
    :class:`CounterUniform` cuts QSGD's draws from."""
    k0, k1, k2 = keys
    h = ((index & _M32) * k0 + k1 + (index >> 32) * k2) & _M32
    for shift, mult in ((16, int(LOWBIAS[0])), (15, int(LOWBIAS[1]))):
        h = ((h ^ (h >> shift)) * mult) & _M32
    return h ^ (h >> 16)


class CounterUniform:
    """QSGD's draws on CPU, counter-based, 16 bits an element and one 32-bit word for two:
    element i takes word j = 8 floor(i / 16) + (i mod 8), its low half where i mod 16 < 8 and
    its high half otherwise (eight lanes of words serve sixteen consecutive elements in the
    compiled kernel), and word j is h_j = lowbias32(lo32(j) k0 + k1 + hi32(j) k2) (mod 2^32,
    :func:`counter_hash`): a function of the index and the keys alone, so any block is drawn
    on its own (the compiled kernel draws blocks in parallel, with the same bits). For each j,
    k1 uniform makes lowbias32's input, and so h_j, uniform (a bijection): each element's draw
    is uniform on [0, 2^16), whatever the other elements draw."""

    def __init__(self, keys: tuple[int, int, int], size: int) -> None:
        self.k0, self.k1, self.k2 = keys
        words = -(-size // 16) * 8
        self.base = np.arange(words, dtype=np.uint32) * np.uint32(self.k0)  # j k0 mod 2^32
        self.h = np.empty(words, np.uint32)
        self.t = np.empty(words, np.uint32)

    def fill(self, a: int, out: np.ndarray) -> None:
        """Draws of elements [a, a + out.size) into ``out`` (any integer or float dtype that
        holds 0..65535); ``a`` a multiple of 16 whose block does not cross a multiple of 2^33
        (every block of :data:`BLOCK` from 0)."""
        if a % 16:
            raise ValueError(f"CounterUniform.fill starts at a multiple of 16, got {a}")
        m = out.size
        w = -(-m // 16) * 8
        h, t = self.h[:w], self.t[:w]
        j = a // 2
        offset = ((j & _M32) * self.k0 + self.k1 + (j >> 32) * self.k2) & _M32
        np.add(self.base[:w], np.uint32(offset), out=h)
        for shift, mult in ((16, LOWBIAS[0]), (15, LOWBIAS[1])):
            np.right_shift(h, shift, out=t)
            h ^= t
            h *= mult
        np.right_shift(h, 16, out=t)
        h ^= t
        words = h.reshape(-1, 8)
        g = m // 16
        whole = out[:16 * g].reshape(g, 2, 8)
        np.bitwise_and(words[:g], 0xFFFF, out=whole[:, 0], casting="unsafe")
        np.right_shift(words[:g], 16, out=whole[:, 1], casting="unsafe")
        if m > 16 * g:  # a last, partial group of sixteen
            lane = np.arange(m - 16 * g)
            word = words[g, lane & 7]
            out[16 * g:] = np.where(lane < 8, word & 0xFFFF, word >> 16)


SQ_LANES, SQ_ROWS = 32, 64
""":func:`sum_squares`'s lanes within a block (lane l adds the elements i = l mod 32) and rows
a lane adds in float32 before its double takes the sum."""


def sum_squares(xn: np.ndarray) -> float:
    """The sum of the squares of a contiguous float32 array in an order fixed by the indices
    alone: per block of :data:`BLOCK` elements, 32 lanes (lane l takes i = l mod 32); per group
    of 64 rows of 32, each lane adds its float32 squares in increasing i in float32 (each
    multiply and add rounded on its own), then that sum into the lane's double; the 32 doubles
    folded by halves (lane l += lane l + h for h = 16, 8, 4, 2, 1), the blocks' sums added in
    block order. The compiled kernel (``sum_squares``, parallel over blocks) gets the same bits
    on any thread count. Squares overflow past 1.8e19 as in torch's float32 norm; the error is
    that of 64-term float32 sums (torch's own norm was off by about 1e-5 relative on 2^20
    normal draws, this within a unit in float32's last place)."""
    lib = kernels.lib() if xn.flags.c_contiguous and xn.dtype == np.float32 else None
    if lib is not None:
        return float(lib.sum_squares(xn.ctypes.data, xn.size, kernels.threads()))
    group = SQ_LANES * SQ_ROWS
    total = 0.0
    for a, b in blocks(xn.size, BLOCK):
        sq = xn[a:b] * xn[a:b]
        pad = (-sq.size) % group
        if pad:  # + 0.0 leaves a lane's (non-negative) sums as they are
            sq = np.concatenate([sq, np.zeros(pad, np.float32)])
        # a reduction over an axis that is not the last adds slice after slice, in order, into
        # the result: each lane's squares in increasing i (a test holds this to a loop)
        rows = np.add.reduce(sq.reshape(-1, SQ_ROWS, SQ_LANES), axis=1)
        lanes = np.add.reduce(rows.astype(np.float64), axis=0)
        h = SQ_LANES // 2
        while h:
            lanes = lanes[:h] + lanes[h:]
            h //= 2
        total += float(lanes[0])
    return total


FLOAT32_OVERFLOW = 2.0**128 - 2.0**103
"""The least double that rounds to float32 infinity (float32's largest plus half its last
unit: the tie rounds to even, which is infinity)."""


def round_float32(v: float) -> float:
    """``v`` rounded to float32 (to nearest, ties to even), infinity past float32's range
    without numpy's overflow warning."""
    return math.inf if v >= FLOAT32_OVERFLOW else float(np.float32(v))


def level_dtype(levels: int) -> torch.dtype:
    """The smallest signed integer dtype holding [-levels, levels]."""
    if levels <= 127:
        return torch.int8
    if levels <= 32767:
        return torch.int16
    return torch.int32


class QSGD(Compressor):
    """Stochastic quantization to s levels of |x_i| / ||x||_2, unbiased (Alistarh et al. 2017)."""

    name = "qsgd"
    unbiased = True

    def __init__(self, levels: int, *, seed: int = 0, rank: int = 0) -> None:
        super().__init__(seed=seed, rank=rank)
        if levels < 1:
            raise ValueError(f"qsgd needs at least 1 level, got {levels}")
        self.levels = levels
        self._level_numpy = NUMPY_DTYPES[level_dtype(levels)]

    def params(self) -> dict[str, Any]:
        return {"levels": self.levels}

    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        return (Part(1, torch.float32), Part(numel, level_dtype(self.levels)))

    def variance_bound(self, numel: int) -> float:
        """omega with E||x_hat - x||^2 <= omega ||x||^2 (Alistarh et al., Lemma 3.1)."""
        s = self.levels
        return min(numel / s**2, math.sqrt(numel) / s)

    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        flat = x.reshape(-1).float()
        s = self.levels
        # 1. the norm (on CPU its squares summed in a fixed order: sum_squares)
        lib = kernels.wants(flat)
        if lib is not None:  # steps 1-3 in two compiled passes, nothing else around them
            d, nt = flat.numel(), kernels.threads()
            n = round_float32(math.sqrt(lib.sum_squares(flat.data_ptr(), d, nt)))
            levels = empty(d, level_dtype(s))
            lib.qsgd_encode_counter(flat.data_ptr(), d, self._c16(n),
                                    *counter_keys(self.seed, step, key, self.rank),
                                    levels.data_ptr(), levels.element_size(), s, nt)
            return (torch.full((1,), n, dtype=torch.float32), levels)
        if on_cpu(flat):
            xn = as_numpy(flat)
            n = round_float32(math.sqrt(sum_squares(xn)))
            q = self._levels_cpu(xn, self._c16(n), step, key)
            return (torch.full((1,), n, dtype=torch.float32), torch.from_numpy(q))
        norm = torch.linalg.vector_norm(flat)
        n = float(norm)
        c = s / n if n > 0 else 0.0
        # 2. stochastic rounding: floor(r + u), u ~ U[0, 1), is r's upper neighbour with
        #    probability r - floor(r)
        r = flat.abs().mul_(c)
        g = self.private_generator(step, key, flat.device)
        r.add_(torch.rand(flat.numel(), generator=g, device=flat.device))
        level = r.floor_().clamp_(max=s)
        # 3. sign and level in one signed integer
        return (norm.reshape(1), torch.copysign(level, flat).to(level_dtype(s)))

    def _c16(self, n: float) -> float:
        """c16 = 2^16 s / ||x|| computed in double and rounded to float32 (0 for a zero norm).
        Finite for any positive float32 norm of float32 squares (at least ~3.7e-23)."""
        return float(np.float32(65536.0 * self.levels / n)) if n > 0 else 0.0

    def _levels_cpu(self, xn: np.ndarray, c16: float, step: int, key: int) -> np.ndarray:
        """Steps 2-3 on CPU without the kernels (``encode`` calls them, with the same draws and
        roundings, where they apply), block by block in fixed point (the module's docstring):
        floor((rint(x c16) + u) / 2^16) within [-s, s], u the 16-bit draws of
        :class:`CounterUniform`; a non-finite x_i (then the norm is not finite and c16 is 0)
        gives a NaN product and -s, as in the kernel. In float32 below s = 255
        (|rint(x c16)| + u < 2^24 there, so the sum is exact), in double above."""
        s = self.levels
        q = np.empty(xn.size, dtype=self._level_numpy)
        keys = counter_keys(self.seed, step, key, self.rank)
        size = min(xn.size, BLOCK)
        t, v = np.empty(size, np.float32), np.empty(size, np.float32 if s < 255 else np.float64)
        u = np.empty(size, np.uint16)
        lo, hi = v.dtype.type(-s), v.dtype.type(s)
        draws = CounterUniform(keys, size)
        for a, b in blocks(xn.size, size):
            m = b - a
            tb, vb, ub = t[:m], v[:m], u[:m]
            with np.errstate(invalid="ignore"):  # inf 0 where the norm is not finite
                np.multiply(xn[a:b], np.float32(c16), out=tb)  # 2. x_i c16 in float32
            np.rint(tb, out=tb)  # T_i, ties to even as the CPU's conversion
            draws.fill(a, ub)  # u_i in [0, 2^16)
            np.add(tb, ub, out=vb, dtype=vb.dtype)
            np.multiply(vb, 2.0**-16, out=vb)  # exact: a power of two
            # 3. floor((T_i + u_i) / 2^16): for x_i < 0 the upper neighbour in magnitude with
            #    the same probability as for x_i > 0 (the module's docstring)
            np.floor(vb, out=vb)
            np.clip(vb, lo, hi, out=vb)
            if c16 == 0:  # a zero or non-finite norm: x c16 is NaN where x is not finite
                np.copyto(vb, lo, where=np.isnan(vb))
            q[a:b] = vb
        return q

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        norm, q = payload
        if on_cpu(q) and (out is None or (
                out.dtype == torch.float32 and out.is_contiguous())):
            res = out.view(-1) if out is not None else empty(numel, torch.float32)
            lib = kernels.lib() if q.is_contiguous() and norm.dtype == torch.float32 else None
            if lib is not None:  # 4. widen and scale in one pass; ||x|| / s in double, rounded
                # to float32 by the call: the float32 quotient's bits (a quotient of two floats
                # computed in double and rounded once to float is the correctly rounded one)
                lib.qsgd_decode(q.data_ptr(), q.element_size(), numel,
                                float(norm) / self.levels, res.data_ptr(), kernels.threads())
                return out if out is not None else res
            f = norm.reshape(()) / self.levels  # 4. ||x|| level / s
            for a, b in blocks(numel, LARGE_BLOCK):  # widen, then scale in cache
                res[a:b].copy_(q[a:b]).mul_(f.detach())
            return out if out is not None else res
        f = norm.reshape(()) / self.levels  # 4. ||x|| level / s
        return write_out(q.float() * f, out)


@dataclass(frozen=True)
class QSGDOptions:
    """Options of ``qsgd`` (unbiased: no error feedback)."""

    levels: int = opt(16, "quantization levels s (int8 on the wire up to 127, int16 up to 32767)")

    def __post_init__(self) -> None:
        check(1 <= self.levels < 2**31, "qsgd.levels", f"got {self.levels}; use 1 to 2**31 - 1")


QSGD_ENTRY = CodecEntry(
    name="qsgd", summary="stochastic rounding to s levels of |x| / ||x||, unbiased, all-gathered",
    options=QSGDOptions, factory=lambda o, seed, rank: QSGD(o.levels, seed=seed, rank=rank))
