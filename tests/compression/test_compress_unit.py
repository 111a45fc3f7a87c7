"""Single-process properties of every codec: wire sizes, exactness, error bounds, unbiasedness,
the registry's options and errors, and the CPU fast paths against the device-generic ones."""

import math

import numpy as np
import pytest
import torch

from thinwire import kernels
from thinwire.compression import (
    CODECS,
    FP8,
    QSGD,
    Cast,
    Int8,
    RandK,
    ScaledSign,
    TopK,
    build,
    slot_codecs,
)
from thinwire.compression.base import (
    from_bytes,
    pack_bits,
    pack_bits_torch,
    to_bytes,
    unpack_bits,
    unpack_bits_torch,
)
from thinwire.compression.quantize import CounterUniform, counter_hash, counter_keys
from thinwire.compression.sparse import _sample_plan, topk_indices
from thinwire.options import OptionError

NAMES = list(slot_codecs("grad"))
SPARSE = {"topk", "randk"}


def _build(name: str, **kw: object):
    """The codec with ratio 0.1 where it has a ratio (1 % of a small tensor keeps one value)."""
    return build(name, **({"ratio": 0.1} if name in SPARSE else {}), **kw)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("d", [1, 9, 1000, 4099, 70_001])
def test_payload_bytes_match_spec_and_round_trip_bytes(name: str, d: int) -> None:
    """Guards the wire format: the payload's tensors are exactly the spec's parts (so the
    planner's byte counts are the real ones), and bytes survive the all-gather framing."""
    comp = _build(name, seed=3)
    x = torch.randn(d, generator=torch.Generator().manual_seed(d))
    payload = comp.encode(x, 0)
    wire = to_bytes(payload)
    assert wire.dtype == torch.uint8
    assert wire.numel() == comp.payload_bytes(d) == sum(p.nbytes for p in comp.spec(d))
    assert [(t.numel(), t.dtype) for t in payload] == [(p.numel, p.dtype) for p in comp.spec(d)]
    back = from_bytes(wire, comp.spec(d))
    assert all(torch.equal(a, b) for a, b in zip(payload, back))
    assert torch.equal(comp.decode(back, d, 0), comp.decode(payload, d, 0))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("d", [13, 70_001])
def test_decode_into_out_and_decode_add_match_decode(name: str, d: int) -> None:
    """Guards the exchange's in-place decodes: ``decode(out=)`` writes exactly what ``decode``
    returns, and ``decode_add`` adds exactly that (a stale or partial write shows up here)."""
    comp = _build(name, seed=1, ef=False) if "ef" in _fields(name) else _build(name, seed=1)
    x = torch.randn(d, generator=torch.Generator().manual_seed(7))
    payload = comp.encode(x, 0)
    plain = comp.decode(payload, d, 0)
    out = torch.full((d,), float("nan"))
    assert comp.decode(payload, d, 0, out=out) is out
    assert torch.equal(out, plain)
    base = torch.randn(d, generator=torch.Generator().manual_seed(8))
    acc = base.clone()
    comp.decode_add(payload, acc, 0)
    assert torch.equal(acc, base + plain)


def _fields(name: str) -> set[str]:
    import dataclasses

    return {f.name for f in dataclasses.fields(CODECS.get(name).options)}


def test_nominal_ratios_without_running() -> None:
    """Guards the planner's view of each codec: ratios from the spec alone."""
    d = 1_000_000
    assert TopK(0.01).nominal_ratio(d) == pytest.approx(4 * d / (10_000 * 8))  # fp32 + int32
    assert RandK(0.01).nominal_ratio(d) == pytest.approx(100.0)
    assert Cast(torch.float16).nominal_ratio(d) == 2.0
    assert QSGD(16).nominal_ratio(d) == pytest.approx(4 * d / (d + 4))  # int8 levels, fp32 norm
    assert QSGD(300).spec(d)[1].dtype == torch.int16
    assert Int8(512).payload_bytes(d) == d + 4 * math.ceil(d / 512)
    assert FP8(512).payload_bytes(d) == d + 4 * math.ceil(d / 512)  # a byte an element
    assert ScaledSign().payload_bytes(d) == d // 8 + 4
    assert TopK(0.01).nominal_ratio(d, torch.bfloat16) == pytest.approx(2 * d / (10_000 * 6))


def test_collectives_describe_each_exchange_without_running() -> None:
    """Guards ``collectives``: the op and payload bytes of one exchange, per codec kind."""
    d = 1_000_000
    assert build("none").collectives(d) == [("all_reduce", 4 * d)]
    assert build("bf16").collectives(d) == [("all_reduce", 2 * d)]
    assert build("randk", ratio=0.01).collectives(d) == [("all_reduce", 40_000)]
    assert build("topk", ratio=0.01).collectives(d) == [("all_gather", 80_000)]
    assert build("sign").collectives(d) == [("all_gather", 4 + d // 8)]
    shapes = [(1000, 990), (10_000,)]
    assert build("powersgd", rank=2).collectives(d, shapes) == [
        ("all_reduce", 4 * (2 * 1000 + 10_000)), ("all_reduce", 4 * 2 * 990)]
    assert build("powersgd").exchange_bytes(d, shapes) == 4 * (2000 + 10_000 + 1980)


def test_registry_builds_from_plain_arguments_and_describes() -> None:
    """Guards the registry: spec strings and keywords give the same codec, EF wraps exactly the
    biased codecs that want it, and labels say what runs."""
    assert build("topk:ratio=0.01").describe() == "topk(ratio=0.01,ef)"
    assert build("topk", ratio=0.01).describe() == "topk(ratio=0.01,ef)"
    assert build("topk:ratio=0.5", ratio=0.01).describe() == "topk(ratio=0.01,ef)"  # keyword wins
    assert build("topk:ef=false").describe() == "topk(ratio=0.01)"
    assert build("powersgd:rank=2,ef=false").describe() == "powersgd(rank=2,warm_start)"
    assert build("qsgd").describe() == "qsgd(levels=16)"
    assert build("none").describe() == "none"
    assert build("int8").describe() == "int8(chunk=512,ef)"
    assert build("fp8").describe() == "fp8(chunk=512,format=e4m3,ef)"
    assert build("fp8:format=e5m2,chunk=64,ef=false").describe() == "fp8(chunk=64,format=e5m2)"
    # EF is the codec's business: a wrapper for the biased ones, never for QSGD, the identity
    # or PowerSGD (its own residual)
    assert type(build("topk")).__name__ == "ErrorFeedback"
    assert type(build("sign:ef=false")).__name__ == "ScaledSign"
    assert type(build("powersgd")).__name__ == "PowerSGD" and build("powersgd").error_feedback
    assert not build("powersgd:ef=false").error_feedback
    assert build("randk:ef=false").unbiased  # scaled without EF
    assert not build("randk").unbiased  # unscaled (contractive) with EF
    assert all(not build(n).wants_error_feedback for n in NAMES)  # built: nothing left to wrap


@pytest.mark.parametrize("spec, message", [
    ("zip", "unknown codec 'zip'; known: none, fp16"),
    ("topk:ratio=2", "topk.ratio: got 2.0; use a value in (0, 1]"),
    ("topk:levels=3", "unknown option topk.levels of codec topk; known: approx, ef, ratio"),
    ("qsgd:ef=true", "unknown option qsgd.ef of codec qsgd; known: levels"),
    ("powersgd:rank=0", "powersgd.rank: got 0; use 1 or more"),
    ("int8:chunk=many", "int8.chunk: expected an integer, got 'many'"),
    ("fp8:format=e3m4", "fp8.format: got 'e3m4'; use e4m3 or e5m2"),
    ("fp8:chunk=0", "fp8.chunk: got 0; use 1 or more"),
    ("sign:ef=maybe", "sign.ef: expected true or false, got 'maybe'"),
])
def test_bad_names_and_options_are_one_line_errors(spec: str, message: str) -> None:
    """Guards the user-facing errors: one line naming the option and what is allowed."""
    with pytest.raises(OptionError) as err:
        build(spec)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_topk_keeps_k_largest_magnitudes_exactly() -> None:
    """Guards Top-k's selection: the k largest magnitudes bit for bit, nothing else."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    comp = TopK(0.05)
    values, idx = comp.encode(x, 0)
    assert idx.dtype == torch.int32 and values.numel() == 50
    out = comp.decode((values, idx), 1000, 0)
    top = torch.argsort(x.abs(), descending=True)[:50]
    mask = torch.zeros(1000, dtype=torch.bool)
    mask[top] = True
    assert torch.equal(out[mask], x[mask])  # the 50 largest, bit for bit
    assert torch.count_nonzero(out[~mask]) == 0  # and nothing else


def test_topk_ties_go_to_the_lowest_indices_on_every_path() -> None:
    """Guards the tie rule that makes Top-k a function of x alone (the same on every device and
    on the numpy and torch paths): equal magnitudes at the boundary go to the lowest indices."""
    x = torch.tensor([1.0, -3.0, 2.0, -2.0, 2.0, 0.5, 2.0])
    for v in (x, x.double()):  # float32: numpy path; float64: the torch path of other devices
        assert topk_indices(v, 3).tolist() == [1, 2, 3]
        assert topk_indices(v, 4).tolist() == [1, 2, 3, 4]
        assert topk_indices(v, 6).tolist() == [0, 1, 2, 3, 4, 6]


@pytest.mark.parametrize("d, k", [(1 << 19, 5243), (1 << 19, 1), (1 << 19, 100_000),
                                  (1 << 20, 10_486), (70_001, 701)])
def test_topk_sampled_threshold_path_is_exact(d: int, k: int) -> None:
    """Guards the sampled threshold: same set as a full sort, on both paths, indices ascending."""
    x = torch.randn(d, generator=torch.Generator().manual_seed(k))
    got = topk_indices(x, k)
    assert got.numel() == k and torch.equal(got, got.sort().values)
    assert torch.equal(x.abs()[got].sort().values, torch.topk(x.abs(), k).values.sort().values)
    assert torch.equal(topk_indices(x.double(), k), got)


def test_topk_sampled_threshold_falls_back_on_a_misleading_sample() -> None:
    """Guards the fallback: a sample that sees only large values finds a threshold that fewer
    than k entries pass; the full selection must run, and stay exact."""
    d, k = 1 << 19, 5000
    plan = _sample_plan(d, k)
    assert plan is not None
    a = torch.rand(d, generator=torch.Generator().manual_seed(0))
    a[::plan[0]] += 2  # exactly the sampled entries are large: only `want` < k pass t
    for v in (a, a.double()):
        got = topk_indices(v, k)
        assert torch.equal(v[got].sort().values, torch.topk(v, k).values.sort().values)


def test_randk_shared_indices_and_unbiased() -> None:
    """Guards Rand-k: ranks draw the same indices, and the scaled form is unbiased."""
    d, draws = 50, 4000
    x = torch.randn(d, generator=torch.Generator().manual_seed(1))
    a, b = RandK(0.1, seed=7, rank=0), RandK(0.1, seed=7, rank=1)
    # shared randomness: two ranks draw the same indices at a step, others at another step
    assert torch.equal(a.indices(d, 5, 2)[0], b.indices(d, 5, 2)[0])
    assert not torch.equal(a.indices(d, 5, 2)[0], a.indices(d, 6, 2)[0])
    total = torch.zeros(d, dtype=torch.float64)
    for step in range(draws):
        out = a.decode(a.encode(x, step), d, step)
        assert torch.count_nonzero(out) == 5
        total += out.double()
    mean = total / draws
    # C(x)_i = b x_i with prob 1/b (b = d/k = 10), else 0: sd_i = |x_i| sqrt(b - 1). With a fixed
    # seed this is deterministic; 5 sd/sqrt(M) would be exceeded by chance with p < 1e-6 per
    # coordinate, while a missing or wrong scale (mean x/10, or 2x) misses by > 20 sd/sqrt(M).
    sd = x.double().abs() * math.sqrt(9)
    assert torch.all((mean - x.double()).abs() <= 5 * sd / math.sqrt(draws))


def test_randk_offsets_are_the_counter_words_and_uniform_in_each_stratum() -> None:
    """Guards Rand-k's index stream: the offset of stratum j is floor(h_j b_j / 2^32), h_j the
    counter word QSGD's 16-bit draws are cut from (two a word: the same hash, so one
    definition), and over many steps each stratum's offsets are uniform (a chi-square over the
    offsets of all strata)."""
    keys = counter_keys(7, 3, 1, None)
    draws = np.empty(8192, np.int64)  # QSGD's: halves of the words, two elements a word
    CounterUniform(keys, 8192).fill(0, draws)
    h = counter_hash(torch.arange(4096), keys).numpy().reshape(-1, 8)
    assert np.array_equal(np.stack([h & 0xFFFF, h >> 16], axis=1).reshape(-1), draws)
    d, b = 1000, 10
    c = RandK(1 / b, seed=3)
    counts = torch.zeros(b)
    for step in range(400):
        idx, lengths = c.indices(d, step)
        assert torch.equal(lengths, torch.full((d // b,), b))
        counts += torch.bincount(idx % b, minlength=b).float()
    expected = counts.sum() / b  # 4,000 a bin
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 30.0  # 9 degrees of freedom: P(chi2 > 30) < 5e-4; a skewed offset gives 1e3+


@pytest.mark.parametrize("path", ["0", pytest.param("1", marks=pytest.mark.skipif(
    not kernels.available(), reason="no C++ compiler: compiled kernels unbuilt"))])
def test_randk_decode_add_adds_the_decoded_tensor_into_any_layout(path: str) -> None:
    """Guards Rand-k's in-place decode_add (kernel or index add) against decode + add, into a
    contiguous and a transposed (non-contiguous) output."""
    c = RandK(0.1, seed=2)
    payload = c.encode(torch.randn(80, generator=torch.Generator().manual_seed(5)), 3)
    with kernels.forced(path):
        for out in (torch.arange(80.0).view(10, 8), torch.arange(80.0).view(8, 10).t()):
            want = out + c.decode(payload, 80, 3).view(out.shape)
            c.decode_add(payload, out, 3)
            assert torch.equal(out, want)


@pytest.mark.parametrize("d", [100, 70_001])
def test_qsgd_unbiased_variance_bounded_and_private_rounding(d: int) -> None:
    """Guards QSGD (CPU block path for the larger d): unbiased, within Lemma 3.1's variance,
    levels within [-s, s], private rounding per rank and reproducible per (seed, step, rank)."""
    s = 4
    draws = 4000 if d == 100 else 200
    x = torch.randn(d, generator=torch.Generator().manual_seed(2))
    comp = QSGD(s, seed=1, rank=0)
    total = torch.zeros(d, dtype=torch.float64)
    sq_err = 0.0
    for step in range(draws):
        payload = comp.encode(x, step)
        assert int(payload[1].abs().max()) <= s
        out = comp.decode(payload, d, step)
        total += out.double()
        sq_err += float((out - x).pow(2).sum())
    mean = total / draws
    # each x_hat_i takes one of two neighbouring levels ||x|| / s apart: sd_i <= ||x|| / (2 s);
    # deterministic rounding (a biased QSGD) would be off by ~||x|| / (2 s) on average.
    sd = float(x.norm()) / (2 * s)
    assert torch.all((mean - x.double()).abs() <= 5 * sd / math.sqrt(draws))
    # Lemma 3.1: E||x_hat - x||^2 <= min(d/s^2, sqrt(d)/s) ||x||^2
    assert sq_err / draws <= comp.variance_bound(d) * float(x.pow(2).sum())
    other = QSGD(s, seed=1, rank=1)  # another rank rounds independently
    assert not torch.equal(comp.encode(x, 0)[1], other.encode(x, 0)[1])
    assert torch.equal(comp.encode(x, 0)[1], QSGD(s, seed=1, rank=0).encode(x, 0)[1])


def test_qsgd_levels_are_the_sign_times_floor_or_ceil_of_r() -> None:
    """Guards QSGD's block path bit by bit: each level is sign(x_i) floor(r_i) or that plus one
    (never further), and exact levels (r_i an integer) never move."""
    s, d = 16, 70_001
    x = torch.randn(d, generator=torch.Generator().manual_seed(3))
    x[:4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
    norm, q = QSGD(s, seed=2).encode(x, 0)
    r = x.double().abs() * s / float(norm)
    lv = q.double().abs()
    assert torch.all((lv == r.floor()) | (lv == r.floor() + 1))
    assert torch.all(q.double() * x.double() >= 0)  # the sign of x (0 for zeros)
    assert torch.all(q[:4] == 0)
    one = torch.zeros(d)
    one[10] = -3.0  # r = s exactly: level s, whatever the draw
    for step in range(5):
        _, q1 = QSGD(s, seed=2).encode(one, step)
        assert q1[10] == -s and torch.count_nonzero(q1) == 1


def test_qsgd_zero_vector() -> None:
    """Guards the division by a zero norm: zeros decode to zeros."""
    comp = QSGD(16)
    assert torch.count_nonzero(comp.decode(comp.encode(torch.zeros(10), 0), 10, 0)) == 0


@pytest.mark.parametrize("d", [1, 7, 8, 9, 1000, 1001])
def test_bit_packing_round_trip_and_size(d: int) -> None:
    """Guards the bit layout on both paths (numpy on CPU, torch elsewhere)."""
    bits = torch.rand(d, generator=torch.Generator().manual_seed(d)) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(d / 8)
    assert torch.equal(unpack_bits(packed, d), bits)
    # the torch path (other devices) has the same layout as numpy's
    assert torch.equal(pack_bits_torch(bits), packed)
    assert torch.equal(unpack_bits_torch(packed, d), bits)


def test_bit_packing_layout_is_msb_first() -> None:
    """Guards the wire layout of packed bits: most significant bit first, zero padding."""
    bits = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.bool)
    assert pack_bits(bits).tolist() == [0b10110000, 0b10000000]


@pytest.mark.parametrize("d", [1, 13, 1000, 70_003])
def test_sign_bytes_exact_and_decode(d: int) -> None:
    """Guards scaled sign: ceil(d/8) + 4 bytes, bits equal to the torch path's, decode is
    +-||x||_1 / d exactly (zeros count as positive)."""
    x = torch.randn(d, generator=torch.Generator().manual_seed(4))
    x[0] = 0.0
    comp = ScaledSign()
    payload = comp.encode(x, 0)
    assert to_bytes(payload).numel() == math.ceil(d / 8) + 4
    assert torch.equal(payload[1], pack_bits_torch(x >= 0))
    out = comp.decode(payload, d, 0)
    scale = float(x.double().abs().mean())
    assert float(payload[0]) == pytest.approx(scale, rel=1e-6)
    assert torch.equal(out, torch.where(x >= 0, payload[0], -payload[0]))


@pytest.mark.parametrize("d, chunk", [(2000, 256), (70_001, 512), (5, 512), (1 << 16, 1 << 17)])
def test_int8_error_within_half_a_step_per_chunk(d: int, chunk: int) -> None:
    """Guards int8's bound (|error| <= scale (1/2 + 2^-16) per element) and its bytes against
    the torch path of other devices."""
    x = torch.randn(d, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.01, 10, d)
    comp = Int8(chunk=chunk)
    payload = comp.encode(x, 0)
    out = comp.decode(payload, d, 0)
    pad = torch.cat([x, x.new_zeros((-d) % chunk)]).view(-1, chunk)
    step = (pad.abs().amax(dim=1) / 127).repeat_interleave(chunk)[:d]
    assert torch.all((out - x).abs() <= step * (0.5 + 2**-16) + 1e-6)  # int8.py's doc
    q, scale = comp._encode_torch(x)
    assert torch.equal(payload[0], q) and torch.equal(payload[1], scale)


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
def test_casts_round_to_wire_dtype(wire: torch.dtype) -> None:
    """Guards fp16 / bf16: exactly one rounding to the wire dtype and back."""
    x = torch.randn(100)
    comp = Cast(wire)
    assert torch.equal(comp.decode(comp.encode(x, 0), 100, 0), x.to(wire).float())


def test_error_feedback_carries_the_residual() -> None:
    """Guards EF's bookkeeping: what was sent plus what is still owed is what came in."""
    comp = build("topk", ratio=0.1)
    x = torch.randn(100)
    sent = torch.zeros(100)
    for step in range(10):  # the same gradient ten times: 10 x 10 coordinates go out in all
        sent += comp.decode(comp.encode(x, step), 100, step)
    assert torch.allclose(sent + comp.residuals[0], 10 * x, atol=1e-5)
