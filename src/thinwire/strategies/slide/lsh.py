"""Locality-sensitive hash tables of a layer's neurons, as SLIDE keeps them (vectorised torch).

SLIDE (Chen, Medini, Farwell, Gobriel, Tai, Shrivastava, "SLIDE: In Defense of Smart Algorithms
over Hardware Acceleration for Large-Scale Deep Learning Systems", MLSys 2020) keeps, for each
wide layer, L hash tables; table l files every neuron under a K-part hash code of its weight
vector, and an input retrieves the neurons filed under its own codes: those whose weights are
likely to have a large inner product with it. Two families:

- :class:`SimHash` (signed random projections, Charikar 2002): bit j of a code is
  sign(r_j . v) for a Gaussian direction r_j; two vectors at angle theta agree on a bit with
  probability exactly 1 - theta / pi, on a K-bit code with (1 - theta / pi)^K. SLIDE draws sparse
  +-1 projections for speed; we draw Gaussian ones, for which the probability is exact, at the
  same cost in one dense matrix product. 2^K buckets per table.
- :class:`DWTA` (densified winner-take-all, Chen and Shrivastava, "Densified Winner Take All
  (WTA) Hashing for Sparse Datasets", UAI 2018): each of the K L hash functions looks at
  ``bin_size`` coordinates and returns the position of the largest; a function whose coordinates
  are all zero (an empty bin, frequent for sparse inputs and ReLU activations) borrows the value
  of another function chosen by a fixed random probe sequence (densification). The K values of a
  table are combined into one code modulo 2^``range_bits``.

Steps of :class:`Tables`:
  1. ``build(weight)``: the codes [C, L] of the C neurons; per table the neurons sorted by
     (code, random key) and the offsets of every bucket ([L, buckets + 1]): a bucket is a slice
     of the sorted ids, its order random (the key is drawn from the seed and the rebuild count,
     so rebuilding is deterministic);
  2. ``query(x)``: the codes [B, L] of the inputs; from each hit bucket the first ``bucket``
     neurons (a uniform random subset of a larger bucket, as SLIDE's reservoir-sampled buckets
     of fixed capacity): candidates [B, L, bucket] with a validity mask;
  3. the per-sample active set of a fixed size, forced neurons first (the true labels in
     training), by one of SLIDE's two sampling modes (``SAMPLINGS``):

     - ``topk`` (:func:`select`, SLIDE's frequency ranking): the candidates of all L tables by
       the number of tables that returned them, ties broken at random; one sort of L ``bucket``
       candidates a row;
     - ``vanilla`` (:meth:`Tables.query_vanilla` then :func:`first_distinct`, SLIDE's vanilla
       sampling): per sample the tables in a random order (drawn from the step's generator),
       their buckets taken in that order until the budget is met, duplicates dropped: only the
       first T tables are read, T the fewest whose bucket sizes add up to the budget in every
       row of the batch, plus one for duplicates (about budget / ``bucket`` + 1), and the sort is
       over T ``bucket`` candidates a row;

     in both a shortfall (buckets too small or too alike) is filled by random neurons from the
     step's generator.

Everything is batched tensor work: no per-sample Python loop. Memory: L (C + buckets + 1) int64.

Libraries considered (PyPI): FAISS (``faiss-cpu``) has an ``IndexLSH`` of random-projection
codes, but it answers k-nearest-neighbour queries by Hamming distance over a flat code array
(a scan of every neuron per query) and has no multi-table bucket retrieval, no DWTA and no
device following of torch tensors; FALCONN (multi-table LSH) is unmaintained since 2017 and
builds no wheels for current Pythons; hnswlib, Annoy and NMSLIB are graph or tree indexes whose
rebuild after every weight update costs far more than re-hashing (SLIDE rebuilds often) and
which return neighbours one query at a time. The tables here are a few tensor operations on the
layer's own device, so none of them is used.

On float32 CPU tensors the compiled kernels (:mod:`thinwire.kernels`) hash, build and query in
native arrays (:meth:`Tables.active`), with the same random draws, so with the same results; the
torch code here is their reference.

One concept, one file (over 400 lines): SLIDE's hash tables (the two families, the tables' build
and query, both samplings' active sets and the rebuild schedule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from thinwire import kernels

FAMILIES = ("simhash", "dwta")
SAMPLINGS = ("topk", "vanilla")


def generator(device: torch.device, *seeds: int) -> torch.Generator:
    """A generator on ``device`` seeded from a tuple of integers (stable across runs)."""
    acc = 0x9E3779B97F4A7C15
    for s in seeds:
        acc = (acc * 6364136223846793005 + (int(s) & 0xFFFFFFFFFFFFFFFF) + 1442695040888963407) \
            & 0xFFFFFFFFFFFFFFFF
    g = torch.Generator(device=device)
    g.manual_seed(acc & 0x7FFFFFFFFFFFFFFF)
    return g


class SimHash:
    """K-bit signed random projections, L tables (module docstring)."""

    def __init__(self, dim: int, K: int, L: int, seed: int, device: torch.device) -> None:
        self.K, self.L = K, L
        g = generator(torch.device("cpu"), seed, 0x51)
        self.proj = torch.randn(dim, K * L, generator=g).to(device)
        self.buckets = 1 << K
        self._weights = (1 << torch.arange(K, device=device)).long()

    def codes(self, v: torch.Tensor) -> torch.Tensor:
        """[N, dim] -> int64 codes [N, L] in [0, 2^K): the projections by torch's product on
        both paths (so the signs are the same), the bits packed by the compiled kernels where
        they apply."""
        p = v.float() @ self.proj
        lib = kernels.wants(p)
        if lib is not None:
            out = torch.empty(v.shape[0], self.L, dtype=torch.long, device=p.device)
            lib.lsh_simhash_codes(p.data_ptr(), v.shape[0], self.K, self.L, out.data_ptr(),
                                  kernels.threads())
            return out
        bits = (p > 0).view(v.shape[0], self.L, self.K).long()
        return (bits * self._weights).sum(-1)

    def state(self) -> dict[str, torch.Tensor]:
        return {"proj": self.proj}

    def load(self, s: dict[str, torch.Tensor]) -> None:
        self.proj = s["proj"].to(self.proj.device)


class DWTA:
    """Densified winner-take-all hashes, K per table, L tables (module docstring)."""

    PROBES = 10
    """Densification rounds; a function still empty after them takes the value ``bin_size``."""

    def __init__(self, dim: int, K: int, L: int, seed: int, device: torch.device, *,
                 bin_size: int = 8, range_bits: int = 12) -> None:
        self.K, self.L, self.bin_size, self.range_bits = K, L, bin_size, range_bits
        g = generator(torch.device("cpu"), seed, 0xD7)
        nh = K * L
        need = nh * bin_size  # coordinates dealt from concatenated permutations (SLIDE's bins)
        perms = torch.cat([torch.randperm(dim, generator=g)
                           for _ in range(math.ceil(need / dim))])
        self.coords = perms[:need].view(nh, bin_size).to(device)
        self.probe = torch.stack([torch.randperm(nh, generator=g)
                                  for _ in range(self.PROBES)]).to(device)
        self.buckets = 1 << range_bits
        self._mult = torch.tensor([pow(bin_size + 1, k, 1 << 62) * (2 * k + 1)
                                   for k in range(K)], device=device)

    def codes(self, v: torch.Tensor) -> torch.Tensor:
        """[N, dim] -> int64 codes [N, L] in [0, 2^range_bits)."""
        x = v.float()
        lib = kernels.wants(x)
        if lib is not None and self.coords.device.type == "cpu":
            out = torch.empty(v.shape[0], self.L, dtype=torch.long, device=x.device)
            lib.lsh_dwta_codes(x.data_ptr(), x.shape[0], x.shape[1], self.coords.data_ptr(),
                               self.K, self.L, self.bin_size, self.probe.data_ptr(),
                               self.PROBES, self._mult.data_ptr(), self.buckets, out.data_ptr(),
                               kernels.threads())
            return out
        vals = x[:, self.coords]  # [N, K L, bin]
        h = vals.argmax(-1)
        empty = (vals == 0).all(-1)
        for r in range(self.PROBES):  # densification: borrow from the probed function
            if not bool(empty.any()):
                break
            src = self.probe[r]
            h = torch.where(empty, h[:, src], h)
            empty = empty & empty[:, src]
        h = torch.where(empty, torch.full_like(h, self.bin_size), h)
        h = h.view(v.shape[0], self.L, self.K)
        return (h * self._mult).sum(-1) % self.buckets

    def state(self) -> dict[str, torch.Tensor]:
        return {"coords": self.coords, "probe": self.probe}

    def load(self, s: dict[str, torch.Tensor]) -> None:
        self.coords = s["coords"].to(self.coords.device).contiguous()  # read flat (kernels)
        self.probe = s["probe"].to(self.probe.device).contiguous()


def family(name: str, dim: int, K: int, L: int, seed: int, device: torch.device, *,
           bin_size: int = 8, range_bits: int = 12) -> Any:
    if name == "simhash":
        return SimHash(dim, K, L, seed, device)
    if name == "dwta":
        return DWTA(dim, K, L, seed, device, bin_size=bin_size, range_bits=range_bits)
    raise ValueError(f"unknown hash family {name!r}; use one of {', '.join(FAMILIES)}")


class Tables:
    """L hash tables of ``C`` neurons (steps 1 and 2 of the module docstring)."""

    def __init__(self, hashes: Any, C: int, bucket: int, seed: int,
                 device: torch.device) -> None:
        self.h, self.C, self.bucket, self.seed = hashes, C, bucket, seed
        self.sorted = torch.zeros(hashes.L, C, dtype=torch.long, device=device)
        self.offsets = torch.zeros(hashes.L, hashes.buckets + 1, dtype=torch.long, device=device)
        self.builds = 0

    @torch.no_grad()
    def build(self, weight: torch.Tensor) -> None:
        """Step 1: file every neuron (rows of ``weight`` [C, dim]) in every table."""
        L, nb, C = self.h.L, self.h.buckets, self.C
        codes = self.h.codes(weight)  # [C, L]
        g = generator(weight.device, self.seed, 0x7AB, self.builds)
        key = torch.rand(L, C, generator=g, device=weight.device)
        self.builds += 1
        lib = kernels.wants(key)
        if lib is not None:  # the same order, by a counting sort per table
            self.sorted = torch.empty(L, C, dtype=torch.long, device=key.device)
            self.offsets = torch.empty(L, nb + 1, dtype=torch.long, device=key.device)
            lib.lsh_build(codes.contiguous().data_ptr(), key.data_ptr(), C, L, nb,
                          self.sorted.data_ptr(), self.offsets.data_ptr(), kernels.threads())
            return
        codes = codes.t()  # [L, C]
        # stable: neurons with the same code and key keep their id order (both paths)
        order = torch.argsort(codes.double() + key.double() * 0.5, dim=1, stable=True)
        self.sorted = order.contiguous()  # read flat by every query: no copy there
        counts = torch.zeros(L, nb, dtype=torch.long, device=weight.device)
        counts.scatter_add_(1, codes, torch.ones_like(codes))
        self.offsets = torch.cat([torch.zeros(L, 1, dtype=torch.long, device=weight.device),
                                  counts.cumsum(1)], dim=1)

    @torch.no_grad()
    def query(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 2: candidates [B, L, bucket] (neuron ids) and their validity mask."""
        L, C = self.h.L, self.C
        codes = self.h.codes(x)  # [B, L]
        lrow = torch.arange(L, device=x.device)
        start = self.offsets[lrow, codes]  # [B, L]
        count = self.offsets[lrow, codes + 1] - start
        j = torch.arange(self.bucket, device=x.device)
        valid = j < count.unsqueeze(-1)
        pos = (start.unsqueeze(-1) + j).clamp(max=C - 1)
        flat = self.sorted.reshape(-1)
        ids = flat[(lrow.view(1, L, 1) * C + pos)]
        return ids, valid

    @torch.no_grad()
    def query_vanilla(self, x: torch.Tensor, size: int, g: torch.Generator
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 3, ``vanilla``: candidates [B, T, bucket] and their validity mask, the tables of
        every row in that row's random order (so the columns are in the order taken).

        T is the fewest tables whose buckets (at most ``bucket`` neurons each) hold ``size``
        neurons in every row, plus one (duplicates), at most L: the rest are never read."""
        L, C, dev = self.h.L, self.C, x.device
        codes = self.h.codes(x)  # [B, L]
        B = codes.shape[0]
        lrow = torch.arange(L, device=dev)
        start = self.offsets[lrow, codes]
        count = (self.offsets[lrow, codes + 1] - start).clamp(max=self.bucket)
        # each row's table order (stable: the compiled path's order on equal draws too)
        perm = torch.rand(B, L, generator=g, device=dev).argsort(dim=1, stable=True)
        cum = count.gather(1, perm).cumsum(1)
        need = int((cum < size).sum(1).max()) + 1 if B else 1
        T = min(L, need + 1)
        tab = perm[:, :T]
        st, ct = start.gather(1, tab), count.gather(1, tab)
        j = torch.arange(self.bucket, device=dev)
        valid = j < ct.unsqueeze(-1)
        pos = (st.unsqueeze(-1) + j).clamp(max=C - 1)
        ids = self.sorted.reshape(-1)[tab.unsqueeze(-1) * C + pos]
        return ids, valid

    @torch.no_grad()
    def active(self, x: torch.Tensor, forced: torch.Tensor | None, size: int, sampling: str,
               g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 2-3: the active set [B, min(size, C)] of the inputs ``x`` and its mask, by
        ``sampling`` (``vanilla``: :meth:`query_vanilla` then :func:`first_distinct`;
        ``topk``: :meth:`query` then :func:`select`); ``forced`` [B, F] ids (negative: none).

        On float32 CPU inputs the compiled kernels (:mod:`thinwire.kernels`) do it in native
        arrays, in parallel over samples, with the same random draws from ``g`` in the same
        order, so the two paths give the same active sets."""
        B, C = x.shape[0], self.C
        lib = kernels.wants(x)
        if lib is None or self.sorted.device.type != "cpu":
            if sampling == "vanilla":
                cand, valid = self.query_vanilla(x, min(size, C), g)
                return first_distinct(cand.reshape(B, -1), valid.reshape(B, -1), forced, size,
                                      C, g)
            cand, valid = self.query(x)
            return select(cand.reshape(B, -1), valid.reshape(B, -1), forced, size, C, g)
        L, nb, nt = self.h.L, self.h.buckets, kernels.threads()
        size = min(size, C)
        codes = self.h.codes(x).contiguous()
        fc = forced.to(torch.long).contiguous() if forced is not None and forced.numel() \
            else None
        F = fc.shape[1] if fc is not None else 0
        fp = fc.data_ptr() if fc is not None else None
        dev = x.device
        ids = torch.empty(B, size, dtype=torch.long, device=dev)
        mask = torch.empty(B, size, dtype=torch.bool, device=dev)
        tables = (codes.data_ptr(), self.sorted.data_ptr(), self.offsets.data_ptr(), B, L, C,
                  nb, self.bucket)
        if sampling == "vanilla":
            rnd = torch.rand(B, L, generator=g, device=dev)  # query_vanilla's draw
            if lib.lsh_vanilla(*tables, rnd.data_ptr(), fp, F, size, ids.data_ptr(),
                               mask.data_ptr(), nt):
                start = torch.randint(0, C, (B, 1), generator=g, device=dev)  # the fill's
                lib.lsh_fill(ids.data_ptr(), mask.data_ptr(), B, size, C, start.data_ptr(), nt)
            return ids, mask
        fill = torch.randint(0, C, (B, size), generator=g, device=dev)  # select's, in order
        tie = torch.rand(B, L * self.bucket + F + size, generator=g, device=dev).mul_(0.5)
        lib.lsh_topk(*tables, fp, F, fill.data_ptr(), tie.data_ptr(), size, ids.data_ptr(),
                     mask.data_ptr(), nt)
        return ids, mask

    def state(self) -> dict[str, Any]:
        return {"sorted": self.sorted, "offsets": self.offsets, "builds": self.builds,
                **{f"hash.{k}": v for k, v in self.h.state().items()}}

    def load(self, s: dict[str, Any]) -> None:
        dev = self.sorted.device
        self.sorted = s["sorted"].to(dev).contiguous()
        self.offsets = s["offsets"].to(dev)
        self.builds = int(s["builds"])
        self.h.load({k[5:]: v for k, v in s.items() if k.startswith("hash.")})


@torch.no_grad()
def select(candidates: torch.Tensor, valid: torch.Tensor, forced: torch.Tensor | None,
           size: int, C: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3: the active set [B, size] (ids in [0, C)) and its mask (False: an empty slot).

    ``candidates`` [B, M] with ``valid`` [B, M]; ``forced`` [B, F] ids (negative: none) always
    kept; the rest ranked by how often they occur among the candidates (ties broken at random);
    a shortfall filled by random neurons. ``size`` is capped at C."""
    B, dev = candidates.shape[0], candidates.device
    size = min(size, C)
    sentinel = C
    parts = [torch.where(valid, candidates, torch.full_like(candidates, sentinel))]
    weights = [torch.ones(candidates.shape, device=dev)]
    if forced is not None and forced.numel():
        parts.append(torch.where(forced >= 0, forced, torch.full_like(forced, sentinel)))
        weights.append(torch.full(forced.shape, float(candidates.shape[1] + 1), device=dev))
    fill = torch.randint(0, C, (B, size), generator=g, device=dev)
    parts.append(fill)
    weights.append(torch.zeros(fill.shape, device=dev))
    ids = torch.cat(parts, 1)
    w = torch.cat(weights, 1)
    s_ids, order = torch.sort(ids, dim=1)
    s_w = w.gather(1, order)
    new = torch.ones_like(s_ids, dtype=torch.bool)
    new[:, 1:] = s_ids[:, 1:] != s_ids[:, :-1]
    run = new.long().cumsum(1) - 1  # run index of every sorted entry
    M = ids.shape[1]
    score = torch.zeros(B, M, device=dev).scatter_add_(1, run, s_w)
    run_id = torch.full((B, M), sentinel, dtype=torch.long, device=dev).scatter_(1, run, s_ids)
    n_runs = run[:, -1:] + 1
    live = (torch.arange(M, device=dev) < n_runs) & (run_id < sentinel)
    tie = torch.rand(B, M, generator=g, device=dev) * 0.5
    score = torch.where(live, score + tie, torch.full_like(score, -1.0))
    # the best ``size`` runs, equal scores in run order (stable: topk leaves their order open)
    values, order = torch.sort(score, dim=1, descending=True, stable=True)
    active = run_id.gather(1, order[:, :size])
    mask = values[:, :size] >= 0
    return torch.where(mask, active, torch.zeros_like(active)), mask


@torch.no_grad()
def first_distinct(candidates: torch.Tensor, valid: torch.Tensor, forced: torch.Tensor | None,
                   size: int, C: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3, ``vanilla``: the active set [B, size] and its mask: ``forced`` [B, F] ids
    (negative: none) first, then the distinct valid ``candidates`` [B, M] in their column order
    (the order they were taken), cut at ``size`` (capped at C); a row left short is filled by
    neurons not yet in it from a block of ``size`` consecutive ids at a random start (drawn from
    ``g`` only when some row is short), so every row is full."""
    size = min(size, C)
    sentinel = C
    parts = [torch.where(valid, candidates, torch.full_like(candidates, sentinel))]
    if forced is not None and forced.numel():
        parts.insert(0, torch.where(forced >= 0, forced, torch.full_like(forced, sentinel)))
    ids, mask = _first(torch.cat(parts, 1), size, sentinel)
    if not bool(mask.all()):  # size consecutive ids (mod C) from a random start: distinct
        start = torch.randint(0, C, (ids.shape[0], 1), generator=g, device=ids.device)
        fill = (start + torch.arange(size, device=ids.device)) % C
        kept = torch.where(mask, ids, torch.full_like(ids, sentinel))
        ids, mask = _first(torch.cat([kept, fill], 1), size, sentinel)
    return torch.where(mask, ids, torch.zeros_like(ids)), mask


def _first(ids: torch.Tensor, size: int, sentinel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``size`` distinct ids of every row other than ``sentinel``, in column order,
    and their mask (False: the row had fewer)."""
    B, M = ids.shape
    s_ids, order = torch.sort(ids, dim=1, stable=True)  # equal ids keep their column order
    new = torch.ones_like(s_ids, dtype=torch.bool)
    new[:, 1:] = s_ids[:, 1:] != s_ids[:, :-1]
    new &= s_ids < sentinel
    keep = torch.zeros_like(new).scatter_(1, order, new)  # first occurrences, in column order
    rank = keep.long().cumsum(1) - 1
    slot = torch.where(keep & (rank < size), rank, torch.full_like(rank, size))
    out = torch.zeros(B, size + 1, dtype=ids.dtype, device=ids.device)
    out.scatter_(1, slot, ids)  # column ``size`` collects the rest and is dropped
    n = keep.sum(1, keepdim=True)
    return out[:, :size], torch.arange(size, device=ids.device) < n


@dataclass
class Schedule:
    """SLIDE's rebuild schedule: the first rebuild after ``first`` updates, each interval
    ``growth`` times the previous (exponential spacing), counted in updates of the layer."""

    first: int = 50
    growth: float = 1.5
    updates: int = 0
    next_at: int = 0
    interval: float = 0.0

    def __post_init__(self) -> None:
        if self.next_at == 0:
            self.interval = float(self.first)
            self.next_at = self.first

    def tick(self) -> bool:
        """Count one update; True when the tables are due for a rebuild now."""
        self.updates += 1
        if self.updates < self.next_at:
            return False
        self.interval *= self.growth
        self.next_at = self.updates + max(1, round(self.interval))
        return True

    def state(self) -> dict[str, Any]:
        return {"updates": self.updates, "next_at": self.next_at, "interval": self.interval}

    def load(self, s: dict[str, Any]) -> None:
        self.updates, self.next_at = int(s["updates"]), int(s["next_at"])
        self.interval = float(s["interval"])
