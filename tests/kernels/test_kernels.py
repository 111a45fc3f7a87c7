"""The compiled CPU kernels (thinwire.kernels) against the pure-torch/numpy paths they replace.

Codecs: the same payload bytes and the same decoded values, bit for bit, on 1, 2 and 4 threads
(every codec here is a function of its input, its seeds and the step). SLIDE's fused layer: the
same touched rows, and logits and gradients within the rounding of the float32 sums involved
(the bound is computed from the data, below), and the same bits on any thread count. Every test
runs on both paths where it has a meaning (``path``); the compiled ones are skipped with the
reason where no C++ compiler is found.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from thinwire import kernels
from thinwire.compression import QSGD, Compressor, ErrorFeedback, Int8, RandK, ScaledSign, TopK
from thinwire.compression.fp4 import BOUNDS, FP4
from thinwire.compression.fp8 import FP8
from thinwire.compression.powersgd import outer
from thinwire.compression.quantize import level_dtype
from thinwire.compression.sparse import _approx_plan
from thinwire.strategies.slide.layer import SLIDELayer, active_softmax_loss

HAVE = kernels.available()
needs_kernels = pytest.mark.skipif(not HAVE, reason="no C++ compiler: compiled kernels unbuilt")
PATHS = [pytest.param("0", id="torch"),
         pytest.param("1", id="compiled", marks=needs_kernels)]
SRC = str(Path(__file__).resolve().parents[2] / "src")


def codecs() -> list[Compressor]:
    return [TopK(0.01), TopK(0.3), TopK(0.01, approx=True), TopK(0.002, approx=True),
            RandK(0.01), RandK(0.05, scale=False), Int8(), Int8(100), ScaledSign(), QSGD(16),
            QSGD(127), QSGD(300), QSGD(40_000), FP4(), FP4(7), FP4(100_000), FP8(),
            FP8(100, "e5m2"), FP8(7)]


@contextmanager
def on(path: str, threads: int) -> Iterator[None]:
    """The kernels' path forced and torch's thread count set, both restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with kernels.forced(path):
            yield
    finally:
        torch.set_num_threads(before)


def round_trip(c: Compressor, x: torch.Tensor, path: str, threads: int
               ) -> tuple[list[bytes], torch.Tensor, torch.Tensor]:
    with on(path, threads):
        payload = c.encode(x, 5, key=2)
        y = c.decode(payload, x.numel(), 5, key=2)
        z = torch.randn(x.numel(), generator=torch.Generator().manual_seed(9))
        c.decode_add(payload, z, 5, key=2)
    return [p.contiguous().view(torch.uint8).numpy().tobytes() for p in payload], y, z


@needs_kernels
@pytest.mark.parametrize("d", [1, 7, 4097, 300_001])
def test_compiled_codecs_equal_the_pure_paths_bit_for_bit_on_1_2_4_threads(d: int) -> None:
    # heavy tails and exact ties: top-k's tie rule and int8's half-way roundings are exercised
    g = torch.Generator().manual_seed(d)
    x = torch.randn(d, generator=g) ** 3
    x[:: 7] = 0.5
    x[3:: 11] = -0.0  # fp4's sign of zero
    for c in codecs():
        ref = round_trip(c, x, "0", 1)
        for threads in (1, 2, 4):
            got = round_trip(c, x, "1", threads)
            assert got[0] == ref[0], f"{c} d={d} threads={threads}: payload bytes differ"
            assert torch.equal(got[1], ref[1]), f"{c} d={d} threads={threads}: decode differs"
            assert torch.equal(got[2], ref[2]), f"{c} d={d}: decode_add differs"


@needs_kernels
@pytest.mark.parametrize("d", [70_000, 300_001])
def test_topk_ties_at_the_kth_magnitude_equal_the_pure_path(d: int) -> None:
    """Top-k from a sampled threshold where the k-th magnitude is shared by hundreds to
    thousands of elements (values on a grid of 7 or 101 levels): the compiled selection (the
    k-th found by counting, the kept ones packed eight at a time, ties at the k-th to the
    lowest indices) gives the pure path's indices and values on 1 and 2 threads."""
    for levels in (3, 50):
        x = torch.randint(-levels, levels + 1, (d,),
                          generator=torch.Generator().manual_seed(d + levels)).float() * 0.25
        for ratio in (0.01, 0.2):
            ref = round_trip(TopK(ratio), x, "0", 1)
            for threads in (1, 2):
                got = round_trip(TopK(ratio), x, "1", threads)
                assert got[0] == ref[0], f"levels={levels} ratio={ratio} threads={threads}"


@needs_kernels
def test_streamed_outputs_equal_the_pure_paths() -> None:
    """From 4M floats on (the kernels' STREAM) the decodes write with non-temporal stores (the
    sparse ones zero-fill so, then store their values over the zeros): the same bytes and
    values as the pure paths, with a misaligned output too."""
    d = (1 << 22) + 9
    x = torch.randn(d, generator=torch.Generator().manual_seed(4)) ** 3
    for c in (TopK(0.01), RandK(0.01), Int8(), ScaledSign(), QSGD(16), FP8(), FP8(fmt="e5m2")):
        ref = round_trip(c, x, "0", 1)
        for threads in (1, 2):
            got = round_trip(c, x, "1", threads)
            assert got[0] == ref[0] and torch.equal(got[1], ref[1]), f"{c} threads={threads}"
        payload = c.encode(x, 5, key=2)
        with kernels.forced("1"):
            out = torch.empty(d + 1)[1:]  # 4 bytes past an aligned start
            c.decode(payload, d, 5, key=2, out=out)
        assert torch.equal(out, ref[1]), f"{c}: misaligned output"


@needs_kernels
def test_int8_half_way_values_round_to_even_on_both_paths() -> None:
    """Chunks whose x / scale are exact half-integers (scale 1, so x times 1 / scale is exact):
    both paths round half to even, so a kernel that rounded half away from zero would fail
    here."""
    ties = torch.tensor([127.0] + [k + 0.5 for k in range(-63, 63)] * 4)
    x = ties.repeat(9)
    ref = round_trip(Int8(127), x, "0", 1)
    got = round_trip(Int8(127), x, "1", 2)
    assert got[0] == ref[0] and torch.equal(got[1], ref[1])
    q, _ = Int8(127).encode(x[:127], 0)
    assert q[1:].tolist() == [round(k + 0.5) for k in range(-63, 63)]  # Python: half to even


@needs_kernels
def test_int8_rounds_x_times_the_reciprocal_and_sends_subnormal_scales_as_zeros() -> None:
    """Int8's step 3 on both paths: values within 4 floats of each (n + 1/2) scale (scale =
    3.7 / 127, the chunk's absmax first), where rounding the product x (1 / scale) and the
    quotient x / scale differ for about 1 in 20 of them (checked, so a path that divided would
    fail), give the product's roundings; a chunk whose scale is subnormal (below 2^-126) is
    sent as zeros, and one just above it is rounded as any other."""
    m = np.float32(3.7)
    scale = m / np.float32(127)
    halves = ((np.arange(-126, 126, dtype=np.float32) + np.float32(0.5)) * scale
              ).astype(np.float32)
    near = [halves]
    for direction in (np.inf, -np.inf):
        v = halves
        for _ in range(4):
            v = np.nextafter(v, np.float32(direction))
            near.append(v)
    xs = np.concatenate(near).astype(np.float32)
    product, quotient = np.rint(xs * (np.float32(1) / scale)), np.rint(xs / scale)
    assert (product != quotient).sum() > 50
    chunk = 512
    pieces = [np.concatenate([[m], xs[a:a + chunk - 1]]) for a in range(0, xs.size, chunk - 1)]
    tiny = np.float32(2.0**-126) * np.linspace(-1, 1, chunk, dtype=np.float32)  # scale ~ 1e-40
    least = np.float32(127 * 2.0**-126) * np.linspace(-1, 1, chunk, dtype=np.float32)
    assert np.abs(least).max() / np.float32(127) == np.float32(2.0**-126)  # the least normal
    x = torch.from_numpy(np.concatenate([tiny, least] + pieces).astype(np.float32))
    want = np.concatenate([np.zeros(chunk), np.rint(least * np.float32(2.0**126))] + [
        np.rint(p * (np.float32(1) / (p.max() / np.float32(127)))) for p in pieces])
    for path, threads in (("0", 1), ("1", 1), ("1", 2)):
        got = round_trip(Int8(chunk), x, path, threads)
        assert got[0][0] == want.astype(np.int8).tobytes(), f"path {path}, {threads} threads"


@pytest.mark.parametrize("path", PATHS)
def test_fp4_rounds_to_the_nearest_power_of_two_at_and_beside_each_midpoint(path: str) -> None:
    """fp4's codes at its boundaries (2^-7 and the midpoints 0.75 2^(c - 7)), exactly there and
    one float either side, against the rule counted in Python: how many boundaries |x| / s
    reaches (the kernel counts comparisons, the torch path reads exponent bits)."""
    from thinwire.compression.fp4 import BOUNDS, VALUES
    ms = [0.0, 1.0]
    for b in BOUNDS:
        ms += [b, math.nextafter(b, 0.0), math.nextafter(b, 2.0)]
    ms = [float(torch.tensor(m, dtype=torch.float32)) for m in ms]  # as float32
    x = torch.tensor(ms + [-m for m in ms], dtype=torch.float32)  # chunk of absmax 1
    c = FP4(x.numel())
    with kernels.forced(path):
        packed, scale = c.encode(x, 0)
        y = c.decode((packed, scale), x.numel(), 0)
    nib = torch.stack([packed >> 4, packed & 15], 1).reshape(-1)[:x.numel()].tolist()
    want = [sum(abs(v) >= b for b in BOUNDS) + 8 * (math.copysign(1, v) < 0) for v in x.tolist()]
    assert nib == want
    assert y.tolist() == [VALUES[n] for n in want]


def fp8_grid(fmt: str) -> list[tuple[int, float]]:
    """The finite non-negative codes of a format and their values, from the format's
    definition (not torch's): exponent field E, mantissa field M, bias 7 (e4m3fn) or 15 (e5m2);
    2^(E - bias) (1 + M / 2^m) for E > 0, 2^(1 - bias) M / 2^m for E = 0; e4m3fn's 0x7f and
    e5m2's E = 31 are not finite."""
    m, bias = (3, 7) if fmt == "e4m3" else (2, 15)
    grid = []
    for code in range(128):
        e, f = code >> m, code & ((1 << m) - 1)
        if (fmt == "e4m3" and code == 0x7F) or (fmt == "e5m2" and e == 31):
            continue
        grid.append((code, math.ldexp(1 + f / 2**m, e - bias) if e else
                     math.ldexp(f / 2**m, 1 - bias)))
    return grid


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("path", PATHS)
def test_fp8_rounds_to_the_nearest_code_and_ties_to_even(path: str, fmt: str) -> None:
    """fp8's codes on a chunk of absmax FMAX (scale 1, so x inv = x): every finite value, the
    midpoint of each pair of neighbours (exactly, and one float either side) and values below
    half the least subnormal, both signs, against the nearest value of the format's grid
    written out from its definition, ties to the even code; the decode gives the grid's value.
    A kernel that rounded ties away from zero, or a subnormal or a binade's last value wrongly,
    fails here."""
    grid = fp8_grid(fmt)
    fmax = grid[-1][1]
    xs = [v for _, v in grid] + [2.0**-30, 0.0]
    for (_, lo), (_, hi) in zip(grid, grid[1:]):
        mid = (lo + hi) / 2  # exact in float32: neighbours differ in one bit below theirs
        xs += [mid, math.nextafter(mid, 0.0), math.nextafter(mid, math.inf)]
    xs = [float(torch.tensor(v, dtype=torch.float32)) for v in xs]
    x = torch.tensor([fmax] + xs + [-v for v in xs], dtype=torch.float32)

    def nearest(v: float) -> tuple[int, float]:
        best = min(grid, key=lambda g: (abs(abs(v) - g[1]), g[0] & 1))  # ties: the even code
        return best[0] | (0x80 if math.copysign(1.0, v) < 0 else 0), math.copysign(best[1], v)

    c = FP8(x.numel(), fmt)
    with kernels.forced(path):
        q, scale = c.encode(x, 0)
        y = c.decode((q, scale), x.numel(), 0)
    assert float(scale) == 1.0
    want = [nearest(v) for v in x.tolist()]
    assert q.tolist() == [w[0] for w in want]
    assert y.tolist() == [w[1] for w in want]


@needs_kernels
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_non_finite_chunks_and_every_code_decode_as_torch_does(fmt: str) -> None:
    """The compiled fp8 against torch's conversion where the kernel leaves its finite path:
    chunks holding an infinity or a NaN (torch's codes for them: NaN, and e4m3fn's saturation or
    e5m2's infinity), an all-zero chunk, one of -0.0, one whose scale is subnormal (sent as
    zeros); and the decode of all 256 codes against scales whose products by 2^(127 - bias)
    overflow float32 (1e30), are infinite, NaN, zero or subnormal."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64 * 9, generator=g) * 1e3
    x[5], x[64 + 7], x[128 + 9], x[128 + 10] = math.inf, -math.inf, math.nan, math.inf
    x[192:256] = 0.0
    x[256:320] = -0.0
    x[320:384] = torch.linspace(-1, 1, 64) * 2.0**-130
    x[384:448] = torch.linspace(-1, 1, 64) * 3e38
    c = FP8(64, fmt)
    ref = round_trip(c, x, "0", 1)
    for threads in (1, 2):
        got = round_trip(c, x, "1", threads)
        assert got[0] == ref[0], f"threads={threads}"
        assert torch.equal(got[1].isnan(), ref[1].isnan())
        assert torch.equal(got[1].nan_to_num(), ref[1].nan_to_num())
    codes = torch.arange(256, dtype=torch.uint8).repeat(7)
    scales = torch.tensor([1.0, 1e30, math.inf, math.nan, 0.0, 2.0**-140, -3.5])
    c = FP8(256, fmt)
    with kernels.forced("0"):
        want = c.decode((codes, scales), codes.numel(), 0)
    with kernels.forced("1"):
        got1 = c.decode((codes, scales), codes.numel(), 0)
    assert torch.equal(got1.isnan(), want.isnan())
    assert torch.equal(got1.nan_to_num(), want.nan_to_num())
    table = torch.arange(256, dtype=torch.uint8).view(c.dtype).float()
    assert torch.equal(want.nan_to_num(), (table * scales[:, None]).reshape(-1).nan_to_num())


@pytest.mark.parametrize("path", PATHS)
def test_each_path_keeps_the_codecs_contracts(path: str) -> None:
    """What the codecs promise, checked against the math on each path: top-k keeps the k
    largest magnitudes, int8 is within half a step (and 2^-16 of one), sign decodes to
    +-||x||_1 / d."""
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(1))
    with kernels.forced(path):
        (vals, idx) = TopK(0.01).encode(x, 0)
        k = vals.numel()
        assert set(idx.long().tolist()) == set(x.abs().topk(k).indices.tolist())
        q, scale = Int8().encode(x, 0)
        y = Int8().decode((q, scale), x.numel(), 0)
        step = torch.repeat_interleave(scale, 512)[:x.numel()]
        # x (1 / scale) is within 127 * 2^-23 < 2^-16 of x / scale (int8.py's doc)
        assert torch.all((y - x).abs() <= step * (0.5 + 2**-16) * (1 + 1e-6))
        s = ScaledSign().decode(ScaledSign().encode(x, 0), x.numel(), 0)
        assert torch.allclose(s.abs(), x.abs().mean().expand_as(s), rtol=1e-6)
        assert torch.equal(s > 0, x >= 0)
        for fmt, rel, sub, least in (("e4m3", 2**-4, 2**-10, 2**-6), ("e5m2", 2**-3, 2**-17,
                                                                        2**-14)):
            f = FP8(fmt=fmt)
            q8, scale = f.encode(x, 0)
            y = f.decode((q8, scale), x.numel(), 0)
            step = torch.repeat_interleave(scale, 512)[:x.numel()]
            # fp8.py's doc: 2^-M-1 of |x| in the normal range, half a subnormal step below it
            normal = x.abs() >= least * step
            assert torch.all((y - x).abs()[normal] <= rel * x.abs()[normal] * (1 + 2**-16))
            assert torch.all((y - x).abs()[~normal] <= sub * step[~normal] * (1 + 2**-16))


def skewed(d: int, k: int, sampled: float) -> torch.Tensor:
    """An input whose strided sample misleads approximate top-k's thresholds: every sampled
    entry is ``sampled``, the rest a ramp of distinct magnitudes in (0, 1]."""
    plan = _approx_plan(d, k)
    assert plan is not None
    x = torch.linspace(1e-3, 1.0, d) * torch.where(torch.arange(d) % 3 == 0, -1.0, 1.0)
    x[::plan[0]] = sampled
    return x


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sampled", [2.0, 1e-6, None], ids=["top-up", "strong-excess", "random"])
def test_approximate_topk_sends_exactly_k_and_the_same_bits_on_every_path(
        path: str, sampled: float | None) -> None:
    """Step 1'b's branches, each forced by the input: a sample above everything else (only the
    sampled entries pass, fewer than k: the lowest free indices top up), a sample below everything (every
    entry strong: the excess dropped evenly), and a plain one (weak ones dropped). The count is
    k, the indices ascend and carry their own values, and every path and thread count agrees
    with the torch code that runs on any device."""
    d, ratio = 300_001, 0.05 if sampled == 2.0 else 0.01  # k above the sample's size
    c = TopK(ratio, approx=True)
    k = math.ceil(ratio * d)
    x = (skewed(d, k, sampled) if sampled is not None
         else torch.randn(d, generator=torch.Generator().manual_seed(3)) ** 3)
    reference = c.encode(x.double(), 0)[1].long()  # the any-device torch code
    for threads in (1, 2, 4):
        with on(path, threads):
            values, idx = c.encode(x, 0)
        assert idx.numel() == k and bool(torch.all(idx[1:] > idx[:-1]))
        assert torch.equal(idx.long(), reference)
        assert torch.equal(values, x[idx.long()])
    got = set(reference.tolist())
    kept = len(set(x.abs().topk(k).indices.tolist()) & got) / k
    if sampled == 2.0:  # the lowest free indices topped up what passed
        assert {0, 1, 2} <= got and kept < 1
    elif sampled == 1e-6:  # every entry strong: k of them, spread evenly over x
        gaps = reference[1:] - reference[:-1]
        assert int(gaps.min()) >= d // k - 1 and int(gaps.max()) <= d // k + 1
    else:  # only weak candidates dropped: every strong one (|x| >= t_hi) is sent
        stride, _, want_hi = _approx_plan(d, k) or (1, 0, 0)
        sample = x.abs()[::stride]
        t_hi = torch.kthvalue(sample, sample.numel() - want_hi + 1).values
        strong = set((x.abs() >= t_hi).nonzero().squeeze(1).tolist())
        assert len(strong) < k and strong <= got and kept > 0.5


@pytest.mark.parametrize("path", PATHS)
def test_approximate_topk_with_error_feedback_delays_what_it_does_not_send(path: str) -> None:
    """Error feedback carries what approximate top-k leaves out: after each step the residual
    is exactly the corrected input off the sent coordinates (and zero on them), and over any
    number of steps the decoded updates plus the residual add up to the inputs, exactly
    (inputs on a grid of 2^-10 whose sums float32 holds without rounding)."""
    d, steps = 200_003, 6
    ef = ErrorFeedback(TopK(0.01, approx=True))
    g = torch.Generator().manual_seed(5)
    total_in = torch.zeros(d)
    total_out = torch.zeros(d)
    with kernels.forced(path):
        for step in range(steps):
            x = torch.randint(-4096, 4097, (d,), generator=g).float() / 1024
            before = ef.residuals.get(0, torch.zeros(d)).clone()
            values, idx = ef.encode(x, step)
            corrected = x + before
            decoded = ef.decode((values, idx), d, step)
            sent = torch.zeros(d, dtype=torch.bool)
            sent[idx.long()] = True
            assert torch.equal(decoded[sent], corrected[sent])
            assert torch.equal(ef.residuals[0][sent], torch.zeros(int(sent.sum())))
            assert torch.equal(ef.residuals[0][~sent], corrected[~sent])
            total_in += x
            total_out += decoded
            assert torch.equal(total_out + ef.residuals[0], total_in)


def test_qsgd_counter_stream_is_uniform_and_draws_each_block_alone() -> None:
    """QSGD's CPU draws (CounterUniform): element i is the low (i mod 16 < 8) or high half of
    counter word 8 floor(i / 16) + i mod 8 (counter_hash), a block drawn on its own equals the
    same elements of a longer draw (a partial last group included), and the 16-bit draws are
    uniform (a chi-square test on 256 cells at 2^20 draws, far from its 1e-6 tail) with
    neighbours and the two halves of a word uncorrelated."""
    from thinwire.compression.quantize import CounterUniform, counter_hash, counter_keys
    keys = counter_keys(0, 7, 2, 1)
    n = 1 << 20
    whole = np.empty(n, np.uint16)
    CounterUniform(keys, n).fill(0, whole)
    i = torch.arange(5000)
    h = counter_hash(8 * (i // 16) + i % 8, keys)
    assert np.array_equal(torch.where(i % 16 < 8, h & 0xFFFF, h >> 16).numpy(), whole[:5000])
    part = np.empty((1 << 16) - 5, np.int64)
    CounterUniform(keys, 1 << 16).fill(3 << 16, part)
    assert np.array_equal(part, whole[3 << 16: (4 << 16) - 5])
    counts = np.bincount(whole >> 8, minlength=256)
    chi2 = float(((counts - n / 256) ** 2 / (n / 256)).sum())
    assert chi2 < 400  # 255 degrees of freedom: P(chi2 > 400) < 1e-8
    u = whole.astype(np.float64)
    for lag in (1, 8):  # the next element; the other half of the same word
        assert abs(float(np.corrcoef(u[:-lag], u[lag:])[0, 1])) < 0.01


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("s", [1, 16, 127, 300, 32767, 40_000])
def test_qsgd_levels_are_the_fixed_point_rounding_of_their_draws(path: str, s: int) -> None:
    """QSGD's CPU levels, each written out in Python integers: T = x c16 rounded to float32 then
    to the nearest integer (ties to even), level = floor((T + u) / 2^16) within [-s, s] with u
    the element's 16-bit draw, on 1 and 2 threads. c16 = 2^10 (exact products) so that ties
    (x = (k + 1/2) 2^-10, some where the tie rule decides the level), T = 2^16 s exactly (level
    s whatever the draw) and products past +-2^16 s (clipped) are placed on purpose; the rest
    are normal draws, over a second block and a partial group of sixteen. Non-finite elements
    (then c16 is 0) give -s."""
    from thinwire.compression.quantize import CounterUniform, counter_keys
    d = (1 << 16) + 37
    x = torch.randn(d, generator=torch.Generator().manual_seed(s)) * (64 * s / 3)
    special = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 10.5, 11.5, 0.0, -0.0,
               65536 * s, -65536 * s, 65536 * s + 40000, -65536 * s - 40000]
    x[:len(special)] = torch.tensor(special, dtype=torch.float64) / 1024
    comp = QSGD(s, seed=4, rank=1)
    keys = counter_keys(4, 3, 2, 1)
    u = np.empty(d, np.int64)
    CounterUniform(keys, d).fill(0, u)
    # ties where the rule decides the level: t = N + 1/2 with N even and N + 1 + u = 2^16
    # (level 0 to even, 1 away from zero), and t = -(u + 1/2) for an even u (0 against -1)
    odd = [i for i in range(20, 400) if u[i] % 2][:4]
    even = [i for i in range(20, 400) if u[i] % 2 == 0][:4]
    for i in odd:
        x[i] = (65535 - float(u[i]) + 0.5) / 1024
    for i in even:
        x[i] = -(float(u[i]) + 0.5) / 1024
    t = (x.numpy() * np.float32(1024)).astype(np.float32)
    want = [max(-s, min(s, (round(float(ti)) + int(ui)) >> 16)) for ti, ui in zip(t, u)]

    def levels(x: torch.Tensor, c16: float) -> list[int]:
        if path == "1":
            q = torch.empty(x.numel(), dtype=level_dtype(s))
            kernels.lib().qsgd_encode_counter(x.data_ptr(), x.numel(), c16, *keys, q.data_ptr(),
                                              q.element_size(), s, kernels.threads())
            return q.tolist()
        return comp._levels_cpu(x.numpy(), c16, 3, 2).tolist()

    for threads in (1, 2):
        with on(path, threads):
            assert levels(x, 1024.0) == want
            # a non-finite element makes the norm non-finite and c16 0: its NaN product gives -s
            bad = torch.tensor([1.0, math.nan, -math.inf, math.inf, -2.0] * 7)
            assert levels(bad, 0.0) == [0, -s, -s, -s, 0] * 7
    assert want[8:12] == [0, 0, s, -s] and [want[i] for i in odd + even] == [0] * 8


def _sum_squares_by_definition(x: np.ndarray) -> float:
    """sum_squares's order written out: blocks of 2^16, groups of 64 rows of 32 lanes, each
    lane's float32 squares added one row at a time, its group sums in double, lanes folded by
    halves, blocks in order."""
    total = 0.0
    for a in range(0, x.size, 1 << 16):
        lanes = np.zeros(32, np.float64)
        block = x[a:a + (1 << 16)]
        for g in range(0, block.size, 64 * 32):
            part = np.zeros(32, np.float32)
            for r in range(g, min(block.size, g + 64 * 32), 32):
                row = block[r:r + 32]
                part[:row.size] += row * row
            lanes += part.astype(np.float64)
        h = 16
        while h:
            lanes = lanes[:h] + lanes[h:]
            h //= 2
        total += float(lanes[0])
    return total


@pytest.mark.parametrize("path", PATHS)
def test_qsgd_norm_sums_in_its_documented_order_on_1_2_4_threads(path: str) -> None:
    """QSGD's CPU norm (sum_squares) adds the squares in the order its docstring gives, so the
    compiled kernel (parallel over blocks) and the numpy path (a reduction over rows) agree
    bit for bit on any thread count; and its error is far below float32's unit (torch's own
    float32 norm was off by about 1e-5 relative on such draws)."""
    from thinwire.compression.quantize import round_float32, sum_squares
    for d in (1, 31, 33, 2047, 2049, (1 << 16) + 100, 300_001):
        x = (torch.randn(d, generator=torch.Generator().manual_seed(d)) ** 3).numpy()
        want = _sum_squares_by_definition(x)
        for threads in (1, 2, 4):
            with on(path, threads):
                got = sum_squares(x)
            assert got == want, f"d={d} threads={threads}: {got!r} != {want!r}"
        exact = math.fsum((x.astype(np.float64) ** 2).tolist())
        assert abs(want - exact) <= 1e-6 * exact
        assert abs(round_float32(math.sqrt(want)) - math.sqrt(exact)) <= 2.0**-22 * math.sqrt(exact)


def _sign_scale_by_definition(x: np.ndarray) -> float:
    """ScaledSign's ||x||_1 / d in the order sign.py's docstring gives, written out as loops
    over rows: a block's whole rows of 1024 added one after another in float32, widened, the
    partial row added in float64, blocks in order, then the lanes in order."""
    lanes = np.zeros(1024, np.float64)
    for s in range(0, x.size, 1 << 17):
        block = np.abs(x[s:s + (1 << 17)])
        rows = block.size // 1024
        acc = np.zeros(1024, np.float32)
        for r in range(rows):
            acc = acc + block[r * 1024:(r + 1) * 1024]  # float32 + float32, one row at a time
        part = acc.astype(np.float64)
        tail = block[rows * 1024:]
        part[:tail.size] = part[:tail.size] + tail.astype(np.float64)
        lanes = lanes + part
    total = 0.0
    for v in lanes.tolist():
        total += v
    return float(np.float32(total / max(x.size, 1)))


@pytest.mark.parametrize("path", PATHS)
def test_sign_scale_sums_in_its_documented_order_on_1_2_4_threads(path: str) -> None:
    """ScaledSign's CPU scale adds |x| in the order its docstring gives (float32 rows within a
    block, float64 across blocks), so the compiled encode (parallel over blocks, eight rows in
    registers at a time) and numpy's reduction over rows agree bit for bit on any thread
    count; and the float32 rows keep it within 1e-6 relative of the exact mean."""
    # a lane whose first row is 1e4 and whose next 127 rows add 1e-4 each: lost in float32
    # (below half a unit of 1e4), kept in float64, so the two orders give different scales
    tall = np.full((1 << 17) + 5000, 1e-4, np.float32)
    tall[:1024] = 1e4
    for d in (1, 1023, 1025, 9 * 1024 + 5, (1 << 17) + 3000, 300_001, tall.size):
        x = tall if d == tall.size else (
            torch.randn(d, generator=torch.Generator().manual_seed(d)) ** 3).numpy()
        want = _sign_scale_by_definition(x)
        for threads in (1, 2, 4):
            with on(path, threads):
                got = float(ScaledSign().encode(torch.from_numpy(x), 0)[0])
            assert got == want, f"d={d} threads={threads}: {got!r} != {want!r}"
        exact = math.fsum(np.abs(x.astype(np.float64)).tolist()) / d
        assert abs(want - exact) <= (1e-5 if x is tall else 1e-6) * exact


def slide_step(layer: SLIDELayer, h: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
               labels: torch.Tensor, path: str, threads: int) -> dict[str, torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    h = h.detach().clone().requires_grad_(True)
    with on(path, threads):
        out = layer(h, ids, mask)
        active_softmax_loss(out, ids, mask, labels).backward()
    gw = layer.weight.grad.coalesce()
    gb = layer.bias.grad.coalesce()
    return {"out": out.detach(), "gh": h.grad, "rows": gw.indices()[0], "gw": gw.values(),
            "gb": gb.values()}


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u), u = 2^-24: |fl(sum of n terms) - sum| <= gamma_n
    sum |terms|, for any order of summation. Two orders differ by at most twice that."""
    u = 2.0**-24
    return n * u / (1 - n * u)


@needs_kernels
def test_fused_slide_layer_matches_the_gathered_layer_within_float_rounding() -> None:
    torch.manual_seed(0)
    B, H, C = 48, 40, 3000
    layer = SLIDELayer(H, C, K=6, L=12, budget=60)
    h = torch.randn(B, H)
    labels = torch.randint(0, C, (B, 3))
    labels[0, 1:] = -1  # padding
    ids, mask = layer.active(h, labels)
    mask[1, 5:] = False  # empty slots
    ref = slide_step(layer, h, ids, mask, labels, "0", 1)
    got = {t: slide_step(layer, h, ids, mask, labels, "1", t) for t in (1, 2, 4)}
    for t in (2, 4):  # the same bits on any thread count
        for name in ref:
            assert torch.equal(got[t][name], got[1][name]), f"{name} differs on {t} threads"
    fused = got[1]
    assert torch.equal(fused["rows"], ref["rows"])  # the same touched rows
    w, b = layer.weight.detach(), layer.bias.detach().squeeze(1)
    # forward: an H-term dot product plus the bias
    on = mask
    bound_out = 2 * gamma(H + 1) * ((w[ids].abs() @ h.abs().unsqueeze(-1)).squeeze(-1)
                                    + b[ids].abs())
    assert torch.equal(fused["out"][~on], ref["out"][~on])  # -inf on the empty slots
    assert torch.all((fused["out"][on] - ref["out"][on]).abs() <= bound_out[on])
    # the logits' gradient, as both paths see it (the loss is computed by torch on either)
    out = ref["out"].clone().requires_grad_(True)
    active_softmax_loss(out, ids, mask, labels).backward()
    g = out.grad.abs()
    # hidden gradient: an A-term sum per coordinate; the weight rows': at most B A terms a row
    bound_gh = 2 * gamma(ids.shape[1]) * torch.einsum("ba,bah->bh", g, w[ids].abs())
    assert torch.all((fused["gh"] - ref["gh"]).abs() <= bound_gh + 1e-30)
    dense = torch.zeros(C, H).index_add_(0, ids.reshape(-1),
                                         g.reshape(-1, 1) * h.abs().repeat_interleave(
                                             ids.shape[1], 0))
    bound_gw = 2 * gamma(ids.numel()) * dense[ref["rows"]]
    assert torch.all((fused["gw"] - ref["gw"]).abs() <= bound_gw + 1e-30)
    assert torch.allclose(fused["gb"], ref["gb"], rtol=0, atol=2 * gamma(ids.numel()) * float(
        g.sum()))


def _logits_by_definition(w: np.ndarray, x: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """w_i . x_i + bias_i in float32, added as the fused forward's dot product adds (its
    comment): element j into lane j mod 32, a lane's products in order from 0; then the lanes
    folded by halves (16, 8, 4, 2, 1); then the bias."""
    n, H = w.shape
    prod = w * x
    lanes = np.zeros((n, 32), np.float32)
    for c in range(0, H, 32):
        part = prod[:, c:c + 32]
        lanes[:, :part.shape[1]] = lanes[:, :part.shape[1]] + part
    for width in (16, 8, 4, 2, 1):
        lanes[:, :width] = lanes[:, :width] + lanes[:, width:2 * width]
    return lanes[:, 0] + bias


def _weight_rows_by_definition(g: np.ndarray, h: np.ndarray, on: np.ndarray, ids: np.ndarray,
                               A: int) -> tuple[np.ndarray, ...]:
    """The touched rows ascending, each row's slots ascending, and each row's weight gradient
    and bias gradient summed in that order from 0 in float32: sum over its slots p of
    g[p] h[p // A] and of g[p] (0 g where ``on`` drops the slot), by numpy, the j-th slot of
    every row added in step j."""
    order = np.argsort(ids, kind="stable")
    rows, first, count = np.unique(ids[order], return_index=True, return_counts=True)
    gp = np.where(on, g, np.float32(0)).astype(np.float32)
    gw = np.zeros((rows.size, h.shape[1]), np.float32)
    gb = np.zeros(rows.size, np.float32)
    for j in range(int(count.max())):
        has = count > j
        p = order[first[has] + j]
        gw[has] = gw[has] + gp[p][:, None] * h[p // A]
        gb[has] = gb[has] + gp[p]
    return rows, order, gw, gb


@needs_kernels
def test_fused_slide_rows_equal_their_sums_in_the_kernels_order_streamed_or_not() -> None:
    """The fused layer's kernels against numpy adding in the order their comments give, bit for
    bit: the touched rows and slot order (numpy's stable sort; every row written inside
    min(n, C) places), each slot's logit (the dot product's 32 lanes, -inf where masked), and
    each row's weight gradient, summed in registers and written once -- by streaming stores for
    a gradient of at least 2^23 floats with 32-byte aligned rows, by plain stores otherwise
    (the same gradient one float off alignment) -- and each row's bias gradient. Widths 64
    and 128 (compiled as constants), 72 (eight vectors, then one), 75 (the scalar tail) and
    16; some slots masked, rows repeated within a sample and across samples."""
    lib = kernels.lib()
    assert lib is not None
    rng = np.random.default_rng(5)
    for C, H, B, A in ((200_000, 64, 64, 4000), (3000, 128, 16, 300), (3000, 72, 16, 300),
                       (3000, 75, 16, 300), (100, 16, 8, 200)):
        n = B * A
        ids = rng.integers(0, C, n).astype(np.int64)
        ids[A:2 * A] = ids[:A]  # a second sample on the first one's rows
        on = rng.random(n) > 0.1
        g = rng.standard_normal(n).astype(np.float32)
        h = rng.standard_normal((B, H)).astype(np.float32)
        W = rng.standard_normal((C, H)).astype(np.float32)
        bias = rng.standard_normal(C).astype(np.float32)
        rows_ref, order_ref, gw_ref, gb_ref = _weight_rows_by_definition(g, h, on, ids, A)
        # one guard place past the rows' min(n, C): the last case touches every row
        rows, start, order = (np.full(min(n, C) + 1, -7, np.int64),
                              np.empty(n + 1, np.int64), np.empty(n, np.int64))
        U = lib.slide_touched_rows(ids.ctypes.data, n, C, rows.ctypes.data, start.ctypes.data,
                                   order.ctypes.data)
        assert U == rows_ref.size and np.array_equal(rows[:U], rows_ref) and rows[-1] == -7
        assert np.array_equal(order, order_ref) and start[U] == n
        mask = on.astype(np.uint8)
        out = np.empty(n, np.float32)
        lib.slide_forward_rows(W.ctypes.data, bias.ctypes.data, h.ctypes.data, rows.ctypes.data,
                               start.ctypes.data, order.ctypes.data, mask.ctypes.data, U, A, H,
                               out.ctypes.data, 1)
        want = np.where(on, _logits_by_definition(W[ids], h[np.arange(n) // A], bias[ids]),
                        np.float32(-np.inf))
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32)), f"C={C} H={H}"
        buf = np.empty(U * H + 16, np.float32)
        at = (-buf.ctypes.data // 4) % 8  # 32-byte aligned rows (H % 8 == 0: every row)
        for off, streamed in ((at, H % 8 == 0 and U * H >= 1 << 23), ((at + 1) % 8, False)):
            gw, gb = buf[off:off + U * H], np.empty(U, np.float32)
            lib.slide_backward_rows(g.ctypes.data, W.ctypes.data, h.ctypes.data,
                                    mask.ctypes.data, rows.ctypes.data, start.ctypes.data,
                                    order.ctypes.data, U, B, A, H, None, gw.ctypes.data,
                                    gb.ctypes.data, 1)
            assert np.array_equal(gw.reshape(U, H).view(np.uint32), gw_ref.view(np.uint32)), \
                f"C={C} H={H} streamed={streamed}"
            assert np.array_equal(gb.view(np.uint32), gb_ref.view(np.uint32)), f"C={C} H={H}"
        assert C != 200_000 or U * H >= 1 << 23  # the first case does stream


@needs_kernels
def test_fused_slide_layer_reuses_its_gradient_buffer_only_once_the_gradient_is_dropped(
) -> None:
    torch.manual_seed(1)
    layer = SLIDELayer(32, 2000, K=5, L=8, budget=40)
    h, labels = torch.randn(16, 32), torch.randint(0, 2000, (16, 1))
    ids, mask = layer.active(h, labels)
    first = slide_step(layer, h, ids, mask, labels, "1", 1)
    kept = layer.weight.grad  # held: the next step must write elsewhere
    kept_values = kept.coalesce().values().clone()
    held = {name: first[name].clone() for name in first}  # the logits too: held by the test
    second = slide_step(layer, h * 2, ids, mask, labels, "1", 1)
    assert torch.equal(kept.coalesce().values(), kept_values)
    for name in first:
        assert torch.equal(first[name], held[name]), f"{name} overwritten by the next step"
    assert kept._values().data_ptr() != layer.weight.grad._values().data_ptr()
    del kept
    where = layer.weight.grad._values().data_ptr()
    third = slide_step(layer, h, ids, mask, labels, "1", 1)  # zero_grad dropped the second's
    assert layer.weight.grad._values().data_ptr() == where
    for name in first:
        assert torch.equal(third[name], first[name])
    assert not torch.equal(second["gw"], first["gw"])


def fma_chain(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P Q^T as acc = p_0 q_0, acc = fma(p_k, q_k, acc): each step's exact product and sum in
    float64 (a product of two floats is exact there), rounded once to float32."""
    acc = p[:, :1] * q[:, 0]
    for k in range(1, p.shape[1]):
        acc = (acc.double() + p[:, k:k + 1].double() * q[:, k].double()).float()
    return acc


@needs_kernels
@pytest.mark.parametrize("n, m, r, numel", [(7, 13, 1, 91), (33, 65, 3, 33 * 65 - 7),
                                            (1024, 4100, 2, 1024 * 4100)])
def test_powersgd_decode_kernel_is_the_fused_multiply_add_chain_on_1_2_4_threads(
        n: int, m: int, r: int, numel: int) -> None:
    # the last shape is over kernels' STREAM (non-temporal stores); the second is padded
    g = torch.Generator().manual_seed(n)
    p, q = torch.randn(n, r, generator=g), torch.randn(m, r, generator=g)
    want = fma_chain(p, q).reshape(-1)[:numel]
    for t in (1, 2, 4):
        with on("1", t):
            got = outer(p, q, numel, torch.full((numel,), float("nan")))
        assert torch.equal(got, want), f"{t} threads"
    with kernels.forced("0"):  # torch's product: any order and rounding of the r terms
        ref = outer(p, q, numel, torch.full((numel,), float("nan")))
    bound = 2 * gamma(r) * (p.abs() @ q.abs().T).reshape(-1)[:numel]
    assert torch.all((ref - want).abs() <= bound)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": SRC, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, timeout=120)


def test_without_a_compiler_the_pure_path_runs_and_one_line_says_so(tmp_path: Path) -> None:
    code = ("import torch; from thinwire.compression import Int8; c = Int8(); "
            "x = torch.randn(5000); c.decode(c.encode(x, 0), 5000, 0); "
            "c.decode(c.encode(x, 1), 5000, 1); print('ran')")
    env = {"CXX": str(tmp_path / "no-such-compiler"), "PATH": str(tmp_path),
           "THINWIRE_KERNELS_CACHE": str(tmp_path / "cache"), "THINWIRE_KERNELS": "auto"}
    done = run_python(code, **env)
    assert done.returncode == 0 and done.stdout.strip() == "ran", done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "using the pure-torch path" in lines[0], done.stderr
    forced = run_python(code, **{**env, "THINWIRE_KERNELS": "1"})
    assert forced.returncode != 0
    assert "unset THINWIRE_KERNELS" in forced.stderr.strip().splitlines()[-1]


@needs_kernels
def test_a_fresh_cache_builds_the_library_once(tmp_path: Path) -> None:
    code = "from thinwire import kernels; print(kernels.build())"
    first = run_python(code, THINWIRE_KERNELS_CACHE=str(tmp_path))
    assert first.returncode == 0, first.stderr
    built = Path(first.stdout.strip())
    assert built.parent == tmp_path and built.exists()
    again = run_python(code, THINWIRE_KERNELS_CACHE=str(tmp_path))
    assert Path(again.stdout.strip()) == built
    assert [p.name for p in tmp_path.glob("*.so")] == [built.name]


def test_bad_mode_is_one_line_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THINWIRE_KERNELS", "yes")
    with pytest.raises(ValueError, match="use 0 .* 1 .* or auto"):
        kernels.mode()


def _int8_bytes(x: torch.Tensor, threads: int) -> bytes:
    """Int8's payload of x through the compiled kernels on `threads` threads."""
    with on("1", threads):
        q, scale = Int8().encode(x, 0)
    return q.numpy().tobytes() + scale.numpy().tobytes()


def _encode_in_child(x: torch.Tensor, want: bytes, done: Any) -> None:
    same = _int8_bytes(x, 4) == want
    done.put((same, len(os.listdir("/proc/self/task"))))  # this process's threads


@needs_kernels
def test_kernel_pool_serves_forked_children_and_concurrent_callers() -> None:
    """Guards the kernels' persistent worker pool: children forked while another thread keeps
    the pool's workers busy (a child inherits a pool whose workers do not exist there, often
    held by the parent's job) compute on a fresh pool of their own, with its three workers
    (/proc/self/task), and finish; callers on
    several Python threads at once (ctypes drops the GIL: one holds the pool, the others run
    alone) get the bytes of a 1-thread call."""
    xs = [torch.randn(3 * (1 << 16) + 5, generator=torch.Generator().manual_seed(s))
          for s in range(4)]
    want = [_int8_bytes(x, 1) for x in xs]
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            _int8_bytes(xs[0], 4)

    spinner = threading.Thread(target=busy)
    spinner.start()
    try:
        ctx = mp.get_context("fork")
        for _ in range(4):
            done = ctx.Queue()
            child = ctx.Process(target=_encode_in_child, args=(xs[1], want[1], done))
            child.start()
            child.join(timeout=30)
            alive = child.is_alive()
            if alive:
                child.kill()
            assert not alive and child.exitcode == 0, "a forked child hung or died in a kernel"
            same, threads = done.get(timeout=5)
            assert same, "a forked child computed other bytes"
            assert threads >= 4, f"a forked child ran its kernels alone ({threads} threads)"
    finally:
        stop.set()
        spinner.join()
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda i: [_int8_bytes(xs[i], 2) for _ in range(20)], range(4)))
    for i in range(4):
        assert all(g == want[i] for g in got[i]), f"input {i}: a concurrent call differs"


@needs_kernels
@pytest.mark.parametrize("chunk", [256, 7, 32])
def test_fp4_codes_equal_the_comparisons_at_the_boundaries(chunk: int) -> None:
    """Guards fp4's codes from the quotient's bits (the compiled path) against the seven
    comparisons (the pure path): quotients on the boundaries, one ulp either side, at scales
    from 1e-30 to 1e30, both signs, a NaN and infinities: the same bytes."""
    g = torch.Generator().manual_seed(chunk)
    bounds = torch.tensor(BOUNDS)
    for r in range(20):
        s = torch.rand(1, generator=g).item() * 10.0 ** int(torch.randint(-30, 30, (1,),
                                                                           generator=g))
        x = bounds[torch.randint(0, 7, (4096,), generator=g)] * s
        down, up = torch.zeros_like(x), torch.full_like(x, math.inf)
        x = torch.where(torch.rand(4096, generator=g) < 0.4, torch.nextafter(x, down), x)
        x = torch.where(torch.rand(4096, generator=g) < 0.3, torch.nextafter(x, up), x)
        x[::chunk] = s  # the absmax of every chunk: the scale
        x = x * torch.where(torch.rand(4096, generator=g) < 0.5, -1.0, 1.0)
        if r == 0:
            x[5], x[700], x[1500] = math.nan, math.inf, -math.inf
        with kernels.forced("1"):
            got = FP4(chunk).encode(x, 0)
        with kernels.forced("0"):
            want = FP4(chunk).encode(x, 0)
        assert torch.equal(got[0], want[0]), f"scale {s:g}: codes differ"
        assert r == 0 or torch.equal(got[1], want[1]), f"scale {s:g}: scales differ"
