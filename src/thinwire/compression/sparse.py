"""Sparsifiers: Top-k (largest magnitudes) and Rand-k (random coordinates from shared seeds).

Stich, Cordonnier and Jaggi, "Sparsified SGD with Memory" (NeurIPS 2018): both keep k = ratio x d
coordinates; with error feedback (the memory, :mod:`thinwire.compression.feedback`) the dropped
mass is sent later, and SGD converges at the uncompressed rate.

Top-k, per rank:
  1. select the k largest |x_i|, exactly; at the boundary, among equal magnitudes, the lowest
     indices (so the selection is a function of x alone, the same on every device):
     a. a threshold t from a strided sample of |x|, passed by the sample's expected count
        above the k-th magnitude and three standard deviations more (:data:`SPREAD`);
     b. the candidates |x_i| >= t, in index order (on CPU block by block, each block's |x| in
        cache, the candidates' values taken from it there: x is read from memory once);
     c. if fewer than k passed (an unlucky sample), every index is a candidate;
     d. the k-th largest candidate magnitude v; keep every candidate above v and the first
        (k - #above) equal to v;
  (``approx=True``: an approximate step 1 that skips 1c-1d, step 1' below;)
  2. send their values (input dtype) and indices, ascending. Indices are int32 whenever
     d < 2^31 (any DDP bucket: 2^31 fp32 elements is 8 GiB), halving index bytes against int64;
     int64 beyond that. Payload 8k bytes for fp32 (ratio d / 2k);
  3. decode: zeros with the values scattered at their indices. Not linear (each rank picks
     different indices): all-gather, add each rank's values in place, average.

Approximate Top-k (``approx=True``), step 1' (one pass over x and O(k) work after it, no exact
selection; the threshold from a sample, as in Lin, Han, Mao, Wang and Dally, "Deep Gradient
Compression", ICLR 2018, with the count then fixed to k so the payload keeps its size):
  a. from the strided sample of step 1a, with mu = k x (sample size) / d, two order
     statistics: t_lo, passed by about mu + 2 sqrt(mu) + 1 sampled entries, and t_hi, by about
     mu - 2 sqrt(mu); the candidates are |x_i| >= t_lo (one pass, as step 1b), the strong ones
     among them |x_i| >= t_hi;
  b. the count fixed to k, deterministically: with more than k candidates, drop the excess
     evenly among the weak ones (the j-th weak candidate, from 0, goes when
     floor((j + 1) r / w) > floor(j r / w), r to drop of w weak; if there are more than k strong,
     every weak one and the excess strong ones the same way); with fewer than k (rare: t_lo
     sits about two standard deviations of the estimate beyond k; in none of the 48 draws of
     benchmarks/topk_approx_error.py), add the lowest indices that are not candidates;
  c. what is not sent stays in error feedback's residual, so the approximation delays
     coordinates by a step rather than losing them (tests/test_kernels.py shows it).
  Where the sample does not pay (small d, k > d / 4) it is the exact selection.

Rand-k, all ranks alike:
  1. draw the indices from shared randomness (seed, step, bucket): every rank draws the same
     ones, so indices never go on the wire;
  2. send only the values (ratio d / k);
  3. linear: the values are summed by all-reduce and scattered once.
  Sampling is *stratified*: the d coordinates are cut into k consecutive blocks of length
  b_j = floor((j+1) d / k) - floor(j d / k) and one coordinate is drawn from each, which
  costs O(k) instead of the O(d) of ``randperm`` (2.3 s for d = 64M on 2 cores). Block j's offset
  is floor(h_j b_j / 2^32) with h_j the shared counter-based word of j
  (:func:`~thinwire.compression.quantize.counter_hash`, keys from (seed, step, bucket) and no
  rank): uniform on the block up to 2^-32, and a function of j alone, so the compiled kernels
  compute each index where they gather or scatter its value (no index tensor, no generator:
  ``torch.rand`` of the k offsets cost more than a copy of x) and the torch path computes the
  same indices on any device. Each coordinate is kept with probability 1 / b_j (= k / d when
  k divides d); scaling a kept value by b_j makes the codec unbiased, E[C(x)] = x, with variance
  ||C(x) - x||^2 <= (max b_j - 1) ||x||^2, the same bound as uniform Rand-k. With error
  feedback the unscaled (contractive) form is used, as in Stich et al.: scaled Rand-k expands
  the error by d / k and EF would diverge.

One concept, one file (over 400 lines): the sparsifying codecs (Top-k's exact and approximate
selection, Rand-k), which share their payload and its decode.
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
    NUMPY_DTYPES,
    Compressor,
    Part,
    Payload,
    as_numpy,
    blocks,
    count_k,
    empty,
    is_cpu_float32,
)
from thinwire.compression.quantize import counter_hash, counter_keys
from thinwire.compression.registry import CodecEntry
from thinwire.options import check, opt

SAMPLE = 1 << 16
"""Most elements of Top-k's threshold sample (step 1a; a strided read touches a cache line per
sampled element), and never fewer than :data:`LEAST_SAMPLE`: the exact selection samples
:func:`sample_size` elements, the approximate one 1 in 64."""

LEAST_SAMPLE = 4096
"""Fewest elements of the sample: from d = 16 x 4096 on (below 64 x 4096 sampling 1 in 16 to 1
in 64: a tensor that small lies in the caches); below, every element is a candidate (the
compiled encode took 3x as long so at 64K floats, 5.6x at 200K)."""

SPREAD = 3.0
"""Candidates aimed for (step 1a): the sample's mean count above the true k-th magnitude,
mu = k s / d for a sample of s elements, plus SPREAD of its standard deviations (sqrt(mu)),
plus 8. Falling short of k (the exact but slower step 1c) takes a deviation of over 3
standard deviations (about 1 call in 1,000 at worst); every further candidate costs the
exact selection of step 1d (a margin of 1.5 mu had 20% more candidates at d = 1M, measured:
5% of the compiled encode)."""


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


SAMPLE_COST = 3.0
""":func:`sample_size`'s factor: (SPREAD c / (2 c_s))^(2/3) for a sampled element's cost c_s (a
cache line read) and an extra candidate's c (its extraction and share of the selection), fitted
to the compiled encode on one thread of an AMD Zen 3."""


def sample_size(d: int, k: int) -> int:
    """Elements of the exact selection's sample (step 1a): SAMPLE_COST (k d)^(1/3) within
    [LEAST_SAMPLE, SAMPLE], the size that minimises the sample's cost plus that of the extra
    candidates its margin lets through. A sample of n elements costs c_s n; its margin of SPREAD
    standard deviations lets through about SPREAD sqrt(mu) d / n = SPREAD sqrt(k d / n)
    candidates beyond k (mu = k n / d), c each; the sum is least at
    n = (SPREAD c / (2 c_s))^(2/3) (k d)^(1/3): for k = d / 100 two fifths of the 1 in 64
    elements sampled before at d = 1M, the same 65,536 at 64M (docs/benchmarks/compression.md
    measures both)."""
    return min(SAMPLE, max(LEAST_SAMPLE, round(SAMPLE_COST * (k * d) ** (1 / 3))))


def _stride(d: int, size: int) -> int:
    return (d // size) | 1  # odd: does not follow the rows of a power-of-two-wide matrix


@functools.lru_cache(maxsize=1024)
def _sample_plan(d: int, k: int) -> tuple[int, int] | None:
    """(stride, wanted sample entries) of step 1a, or None where it does not pay (small d,
    or k so large that most entries are candidates anyway)."""
    if d < 16 * LEAST_SAMPLE or 4 * k > d:
        return None
    stride = _stride(d, sample_size(d, k))
    n = len(range(0, d, stride))
    mu = k * n / d
    want = min(n, math.ceil(mu + SPREAD * math.sqrt(mu)) + 8)
    return stride, want


@functools.lru_cache(maxsize=1024)
def _approx_plan(d: int, k: int) -> tuple[int, int, int] | None:
    """(stride, sampled entries at or above t_lo, at or above t_hi) of step 1'a, or None where
    the sample does not pay or is under 1 in 64 elements of LEAST_SAMPLE (then the selection is
    exact). The sample is 1 in 64 elements (at most SAMPLE): its thresholds decide which
    elements are sent."""
    if 4 * k > d or d // 64 < LEAST_SAMPLE:
        return None
    stride = _stride(d, min(SAMPLE, d // 64))
    n = len(range(0, d, stride))
    mu = k * n / d
    want = min(n, math.ceil(mu + 2 * math.sqrt(mu)) + 1)
    return stride, want, max(1, min(want - 1, math.floor(mu - 2 * math.sqrt(mu))))


def _fix_count(x: torch.Tensor, cand: torch.Tensor, values: torch.Tensor, k: int,
               t_hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1'b on any device: the candidates (ascending) and their values, fixed to k."""
    n = cand.numel()
    if n >= k:
        strong = values.abs() >= t_hi
        n_strong = int(strong.sum())
        from_weak = n_strong <= k  # drop weak ones only, else every weak one and some strong
        pool_mask = ~strong if from_weak else strong
        pool = n - n_strong if from_weak else n_strong
        r = n - k if from_weak else n_strong - k
        keep = strong.clone() if from_weak else torch.zeros_like(strong)
        if r == 0:
            keep[pool_mask] = True
        else:
            j = torch.arange(pool, device=cand.device)
            keep[pool_mask] = (j + 1) * r // pool == j * r // pool
        return cand[keep], values[keep]
    free = torch.ones(k, dtype=torch.bool, device=cand.device)  # at least k - n free below k
    free[cand[cand < k]] = False
    extra = free.nonzero().squeeze(1)[:k - n]
    idx, order = torch.sort(torch.cat([cand, extra]))
    return idx, torch.cat([values, x[extra]])[order]


def _pick(cand: torch.Tensor, mags: torch.Tensor, k: int) -> torch.Tensor:
    """Step 1d: of the candidate indices (ascending) with their magnitudes, the k largest
    magnitudes; at the boundary the lowest indices. Any device."""
    if cand.numel() == k:
        return cand
    v = torch.kthvalue(mags, mags.numel() - k + 1).values  # the k-th largest
    above = mags > v
    equal = mags == v
    need = k - int(above.sum())
    keep = above | (equal & (torch.cumsum(equal, 0) <= need))
    return cand[keep]


def _keep_numpy(mags: np.ndarray, k: int) -> np.ndarray | slice:
    """:func:`_pick` in numpy (CPU): which candidates to keep (a mask, or every one)."""
    if mags.size == k:
        return slice(None)
    v = np.partition(mags, mags.size - k)[mags.size - k]
    keep = mags >= v
    if np.count_nonzero(keep) > k:  # ties at v: only the first (k - #above) of them
        above = mags > v
        equal = mags == v
        keep = above | (equal & (np.cumsum(equal) <= k - np.count_nonzero(above)))
    return keep


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (ascending, int64) of the k largest |x_i| of flat ``x``; ties at the boundary go
    to the lowest indices (step 1). Exact on every path and device."""
    d = x.numel()
    plan = _sample_plan(d, k)
    if is_cpu_float32(x):
        return torch.from_numpy(_topk_numpy(as_numpy(x), k, plan)[0])
    a = x.abs()
    if plan is not None:
        stride, want = plan
        sample = a[::stride]
        t = torch.kthvalue(sample, sample.numel() - want + 1).values  # 1a
        cand = (a >= t).nonzero().squeeze(1)  # 1b
        if cand.numel() >= k:
            return _pick(cand, a[cand], k)
    return _pick(torch.arange(d, device=x.device), a, k)  # 1c


def _candidates_numpy(xn: np.ndarray, t: np.floating[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Step 1b on CPU: the indices with |x_i| >= t (ascending) and their values, taken from
    each block while it is in cache, so x is read from memory once (a gather afterwards would
    miss the cache once per kept element)."""
    d = xn.size
    size = min(d, 4 * BLOCK)  # fewer, longer calls: numpy's per-call cost dominates
    a, hit = np.empty(size, xn.dtype), np.empty(size, bool)
    idx: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    for s, e in blocks(d, size):
        xb = xn[s:e]
        found = np.flatnonzero(np.greater_equal(np.abs(xb, out=a[:e - s]), t, out=hit[:e - s]))
        idx.append(found + s)
        vals.append(xb[found])
    return np.concatenate(idx), np.concatenate(vals)


def _topk_numpy(xn: np.ndarray, k: int, plan: tuple[int, int] | None,
                want_hi: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Step 1 on CPU, with step 2's values: (indices ascending, their values); with
    ``want_hi`` > 0 the approximate step 1' (``plan`` from :func:`_approx_plan`)."""
    d = xn.size
    if plan is not None:
        stride, want = plan
        sample = np.abs(xn[::stride])
        t = np.partition(sample, sample.size - want)[sample.size - want]  # 1a
        cand, values = _candidates_numpy(xn, t)  # 1b
        if want_hi > 0:  # 1'b: the count fixed to k, without a selection
            t_hi = np.partition(sample, sample.size - want_hi)[sample.size - want_hi]
            ti, tv = _fix_count(torch.from_numpy(xn), torch.from_numpy(cand),
                                torch.from_numpy(values), k, torch.tensor(t_hi))
            return ti.numpy(), tv.numpy()
        if cand.size >= k:
            keep = _keep_numpy(np.abs(values), k)
            return cand[keep], values[keep]
    keep = _keep_numpy(np.abs(xn), k)  # 1c
    cand = np.arange(d)[keep]
    return cand, xn[cand]


def _topk_compiled(lib: Any, flat: torch.Tensor, k: int, plan: tuple[int, int] | None,
                   want_hi: int = 0) -> Payload:
    """Steps 1-2 in the compiled kernel (:mod:`thinwire.kernels`): the same selection as
    :func:`_topk_numpy` (a function of x alone), read from memory once."""
    d = flat.numel()
    dt = index_dtype(d)
    values, idx = empty(k, torch.float32), empty(k, dt)
    wide = int(dt == torch.int64)
    stride, want = plan if plan is not None else (0, 0)
    args = (idx.data_ptr(), wide, values.data_ptr(), kernels.threads())
    if lib.topk_encode(flat.data_ptr(), d, k, stride, want, want_hi, *args) != 0:  # 1c
        lib.topk_encode(flat.data_ptr(), d, k, 0, 0, 0, *args)
    return (values, idx)


def _topk_approx_torch(flat: torch.Tensor, k: int, plan: tuple[int, int, int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1' on any device: (indices ascending, their values)."""
    stride, want, want_hi = plan
    a = flat.abs()
    sample = a[::stride]
    t = torch.kthvalue(sample, sample.numel() - want + 1).values  # 1'a
    t_hi = torch.kthvalue(sample, sample.numel() - want_hi + 1).values
    cand = (a >= t).nonzero().squeeze(1)
    return _fix_count(flat, cand, flat[cand], k, t_hi)  # 1'b


class TopK(Compressor):
    """The k largest magnitudes, with their indices (Stich et al. 2018); ``approx``: about the
    k largest, from a sampled threshold (step 1')."""

    name = "topk"

    def __init__(self, ratio: float, *, approx: bool = False, seed: int = 0,
                 rank: int = 0) -> None:
        super().__init__(seed=seed, rank=rank)
        if not 0 < ratio <= 1:
            raise ValueError(f"topk ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio
        self.approx = approx

    def params(self) -> dict[str, Any]:
        return {"ratio": self.ratio, **({"approx": True} if self.approx else {})}

    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        k = count_k(self.ratio, numel)
        return (Part(k, dtype), Part(k, index_dtype(numel)))

    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        flat = x.reshape(-1)
        d = flat.numel()
        k = count_k(self.ratio, d)
        approx = _approx_plan(d, k) if self.approx else None
        if approx is not None:
            return self._encode_approx(flat, k, approx)
        lib = kernels.wants(flat)
        if lib is not None:  # 1-2 in one compiled read of x
            return _topk_compiled(lib, flat, k, _sample_plan(d, k))
        if is_cpu_float32(flat):  # 1-2 in numpy, the values picked up from cache
            idx, values = _topk_numpy(as_numpy(flat), k, _sample_plan(d, k))
            return (torch.from_numpy(values),
                    torch.from_numpy(idx.astype(NUMPY_DTYPES[index_dtype(d)])))
        # 1. the k largest magnitudes
        ti = topk_indices(flat, k)
        # 2. their values and (narrow) indices
        return (flat[ti], ti.to(index_dtype(d)))

    def _encode_approx(self, flat: torch.Tensor, k: int, plan: tuple[int, int, int]
                       ) -> Payload:
        """Steps 1'-2: compiled, numpy or torch, the same indices and values on each."""
        d = flat.numel()
        stride, want, want_hi = plan
        lib = kernels.wants(flat)
        if lib is not None:
            return _topk_compiled(lib, flat, k, (stride, want), want_hi)
        if is_cpu_float32(flat):
            idx, values = _topk_numpy(as_numpy(flat), k, (stride, want), want_hi)
            return (torch.from_numpy(values),
                    torch.from_numpy(idx.astype(NUMPY_DTYPES[index_dtype(d)])))
        ti, tv = _topk_approx_torch(flat, k, plan)
        return (tv, ti.to(index_dtype(d)))

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        values, idx = payload
        # 3. zeros, and the values at their indices
        lib = kernels.wants(values) if out is None or out.is_contiguous() else None
        if lib is not None and (out is None or out.dtype == torch.float32) \
                and idx.is_contiguous():
            res = out if out is not None else empty(numel, torch.float32)
            lib.scatter_decode(values.data_ptr(), idx.data_ptr(), int(idx.dtype == torch.int64),
                               values.numel(), res.data_ptr(), numel, 0, kernels.threads())
            return res
        out = (out if out is not None else empty(numel, values.dtype, values.device)).zero_()
        flat = out.view(-1)
        if is_cpu_float32(flat) and values.dtype == torch.float32:
            as_numpy(flat)[as_numpy(idx)] = as_numpy(values)
        else:
            flat[idx.long()] = values.to(flat.dtype)
        return out

    def decode_add(self, payload: Payload, out: torch.Tensor, step: int, *, key: int = 0) -> None:
        values, idx = payload
        lib = kernels.wants(values)
        if lib is not None and out.dtype == torch.float32 and out.is_contiguous() \
                and idx.is_contiguous():
            lib.scatter_decode(values.data_ptr(), idx.data_ptr(), int(idx.dtype == torch.int64),
                               values.numel(), out.data_ptr(), out.numel(), 1,
                               kernels.threads())
            return
        flat = out.view(-1)
        if is_cpu_float32(flat) and values.dtype == torch.float32:
            target = as_numpy(flat)
            target[as_numpy(idx)] += as_numpy(values)  # distinct indices: exact
            return
        flat.index_add_(0, idx.long(), values.to(flat.dtype))


class RandK(Compressor):
    """k coordinates drawn from shared randomness (stratified); only values are sent."""

    name = "randk"
    linear = True

    def __init__(self, ratio: float, *, scale: bool = True, seed: int = 0, rank: int = 0) -> None:
        super().__init__(seed=seed, rank=rank)
        if not 0 < ratio <= 1:
            raise ValueError(f"randk ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio
        self.scale = scale
        self.unbiased = scale
        # (device, numel, key) -> (step, indices, block lengths): one entry per bucket and device
        self._cache: dict[tuple[torch.device, int, int],
                          tuple[int, torch.Tensor, torch.Tensor]] = {}

    def params(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "unscaled": not self.scale}

    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        return (Part(count_k(self.ratio, numel), dtype),)

    def indices(self, numel: int, step: int, key: int = 0,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, block lengths) shared by all ranks at (step, key), on ``device``."""
        dev = torch.device(device)
        slot = (dev, numel, key)
        hit = self._cache.get(slot)
        if hit is not None and hit[0] == step:
            return hit[1], hit[2]
        k = count_k(self.ratio, numel)
        j = torch.arange(k + 1, dtype=torch.int64, device=dev)
        starts = j * numel // k
        lengths = starts[1:] - starts[:-1]
        h = counter_hash(j[:-1], self.keys(step, key))  # 1. the same words on every device
        idx = starts[:-1] + ((h * lengths) >> 32)
        self._cache[slot] = (step, idx, lengths)
        return idx, lengths

    def keys(self, step: int, key: int = 0) -> tuple[int, int, int]:
        """The shared counter keys of (step, key): the same on every rank."""
        return counter_keys(self.seed, step, key, None)

    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        flat = x.reshape(-1)
        d = flat.numel()
        lib = kernels.wants(flat)
        if lib is not None:  # 1-2 in one compiled pass, each index computed where it is read
            values = empty(count_k(self.ratio, d), torch.float32)
            lib.randk_gather(flat.data_ptr(), d, values.numel(), *self.keys(step, key),
                             values.data_ptr(), kernels.threads())
            return (values,)
        # 1. shared indices; 2. values only
        idx, _ = self.indices(d, step, key, flat.device)
        return (flat[idx],)

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        (values,) = payload
        lib = kernels.wants(values) if out is None or out.is_contiguous() else None
        if lib is not None and (out is None or out.dtype == torch.float32):
            res = out if out is not None else empty(numel, torch.float32)
            lib.randk_scatter(values.data_ptr(), numel, values.numel(), *self.keys(step, key),
                              int(self.scale), res.data_ptr(), 0, kernels.threads())
            return res
        idx, lengths = self.indices(numel, step, key, values.device)
        if out is None:
            out = values.new_zeros(numel)
        else:
            out.zero_()
        # 3. scatter (the all-reduced sum, in the exchange), scaled by b_j when unbiased
        kept = values * lengths.to(values.dtype) if self.scale else values
        out.view(-1)[idx] = kept.to(out.dtype)
        return out

    def decode_add(self, payload: Payload, out: torch.Tensor, step: int, *, key: int = 0) -> None:
        """``out += decode(payload)`` at the k indices alone (they are distinct: exact)."""
        (values,) = payload
        lib = kernels.wants(values)
        if lib is not None and out.is_contiguous() and out.dtype == torch.float32:
            lib.randk_scatter(values.data_ptr(), out.numel(), values.numel(),
                              *self.keys(step, key), int(self.scale), out.data_ptr(), 1,
                              kernels.threads())
            return
        if not out.is_contiguous():
            out.add_(self.decode(payload, out.numel(), step, key=key).view(out.shape))
            return
        idx, lengths = self.indices(out.numel(), step, key, values.device)
        kept = values * lengths.to(values.dtype) if self.scale else values
        out.view(-1).index_add_(0, idx, kept.to(out.dtype))

    def reset(self, key: int | None = None) -> None:
        self._cache.clear()


@dataclass(frozen=True)
class TopKOptions:
    """Options of ``topk``."""

    ratio: float = opt(0.01, "fraction of elements kept: k = ceil(ratio d)")
    ef: bool = opt(True, "error feedback: add back what was not sent, next step")
    approx: bool = opt(False, "about the k largest, from a sampled threshold in one pass "
                       "(no exact selection); error feedback carries the rest")

    def __post_init__(self) -> None:
        check(0 < self.ratio <= 1, "topk.ratio", f"got {self.ratio}; use a value in (0, 1]")


@dataclass(frozen=True)
class RandKOptions:
    """Options of ``randk``."""

    ratio: float = opt(0.01, "fraction of elements kept: k = ceil(ratio d)")
    ef: bool = opt(True, "error feedback, with unscaled (contractive) Rand-k; off: scaled by "
                   "d / k (unbiased) without feedback")

    def __post_init__(self) -> None:
        check(0 < self.ratio <= 1, "randk.ratio", f"got {self.ratio}; use a value in (0, 1]")


TOPK = CodecEntry(
    name="topk", summary="the k largest magnitudes with int32 indices, all-gathered",
    options=TopKOptions,
    factory=lambda o, seed, rank: TopK(o.ratio, approx=o.approx, seed=seed, rank=rank))
RANDK = CodecEntry(
    name="randk", summary="k coordinates from a shared seed, values only, all-reduced",
    options=RandKOptions,
    factory=lambda o, seed, rank: RandK(o.ratio, scale=not o.ef, seed=seed, rank=rank))
