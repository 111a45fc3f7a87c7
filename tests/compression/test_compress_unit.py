"""Single-process properties of every compressor: exactness, unbiasedness, wire sizes."""

import math

import pytest
import torch

from thinwire.compression import (
    QSGD,
    REGISTRY,
    Cast,
    Int8,
    RandK,
    ScaledSign,
    TopK,
    build_compressor,
)
from thinwire.compression.base import (
    from_bytes,
    pack_bits,
    pack_bits_torch,
    to_bytes,
    unpack_bits,
    unpack_bits_torch,
)
from thinwire.compression.sparse import topk_indices
from thinwire.config import load

NAMES = sorted(REGISTRY)


def _method(name: str, **kw: object):
    return load(None, {"method.compressor": name, **{f"method.{k}": v for k, v in kw.items()}}).method


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("d", [1, 9, 1000, 4099])
def test_payload_bytes_match_spec_and_round_trip_bytes(name: str, d: int) -> None:
    comp = build_compressor(_method(name, ratio=0.1), seed=3)
    x = torch.randn(d, generator=torch.Generator().manual_seed(d))
    payload = comp.encode(x, 0)
    wire = to_bytes(payload)
    assert wire.dtype == torch.uint8
    assert wire.numel() == comp.payload_bytes(d) == sum(p.nbytes for p in comp.spec(d))
    assert [(t.numel(), t.dtype) for t in payload] == [(p.numel, p.dtype) for p in comp.spec(d)]
    back = from_bytes(wire, comp.spec(d))
    assert all(torch.equal(a, b) for a, b in zip(payload, back))
    assert torch.equal(comp.decode(back, d, 0), comp.decode(payload, d, 0))


def test_nominal_ratios_without_running() -> None:
    d = 1_000_000
    assert TopK(0.01).nominal_ratio(d) == pytest.approx(4 * d / (10_000 * 8))  # fp32 + int32
    assert RandK(0.01).nominal_ratio(d) == pytest.approx(100.0)
    assert Cast(torch.float16).nominal_ratio(d) == 2.0
    assert QSGD(16).nominal_ratio(d) == pytest.approx(4 * d / (d + 4))  # int8 levels, fp32 norm
    assert QSGD(300).spec(d)[1].dtype == torch.int16
    assert Int8(512).payload_bytes(d) == d + 4 * math.ceil(d / 512)
    assert ScaledSign().payload_bytes(d) == d // 8 + 4
    assert TopK(0.01).nominal_ratio(d, torch.bfloat16) == pytest.approx(2 * d / (10_000 * 6))


def test_topk_keeps_k_largest_magnitudes_exactly() -> None:
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


@pytest.mark.parametrize("d, k", [(1 << 19, 5243), (1 << 19, 1), (1 << 19, 100_000)])
def test_topk_sampled_threshold_path_is_exact(d: int, k: int) -> None:
    a = torch.randn(d, generator=torch.Generator().manual_seed(k)).abs()
    got = topk_indices(a, k)
    assert got.numel() == k and torch.unique(got).numel() == k
    assert torch.equal(a[got].sort().values, torch.topk(a, k).values.sort().values)


def test_topk_sampled_threshold_falls_back_on_a_misleading_sample() -> None:
    # the strided sample (every 8th entry) sees only large values, so its threshold passes
    # ~1250 entries < k: the candidates cannot hold the top k and the full topk must run
    a = torch.rand(1 << 19, generator=torch.Generator().manual_seed(0))
    a[::8] += 2
    got = topk_indices(a, 5000)
    assert torch.equal(a[got].sort().values, torch.topk(a, 5000).values.sort().values)


def test_randk_shared_indices_and_unbiased() -> None:
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


def test_qsgd_unbiased_variance_bounded_and_private_rounding() -> None:
    d, s, draws = 100, 4, 4000
    x = torch.randn(d, generator=torch.Generator().manual_seed(2))
    comp = QSGD(s, seed=1, rank=0)
    total = torch.zeros(d, dtype=torch.float64)
    sq_err = 0.0
    for step in range(draws):
        out = comp.decode(comp.encode(x, step), d, step)
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


def test_qsgd_zero_vector() -> None:
    comp = QSGD(16)
    assert torch.count_nonzero(comp.decode(comp.encode(torch.zeros(10), 0), 10, 0)) == 0


@pytest.mark.parametrize("d", [1, 7, 8, 9, 1000, 1001])
def test_bit_packing_round_trip_and_size(d: int) -> None:
    bits = torch.rand(d, generator=torch.Generator().manual_seed(d)) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(d / 8)
    assert torch.equal(unpack_bits(packed, d), bits)
    # the torch path (other devices) has the same layout as numpy's
    assert torch.equal(pack_bits_torch(bits), packed)
    assert torch.equal(unpack_bits_torch(packed, d), bits)


def test_bit_packing_layout_is_msb_first() -> None:
    bits = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.bool)
    assert pack_bits(bits).tolist() == [0b10110000, 0b10000000]


@pytest.mark.parametrize("d", [1, 13, 1000])
def test_sign_bytes_exact_and_decode(d: int) -> None:
    x = torch.randn(d, generator=torch.Generator().manual_seed(4))
    comp = ScaledSign()
    payload = comp.encode(x, 0)
    assert to_bytes(payload).numel() == math.ceil(d / 8) + 4
    out = comp.decode(payload, d, 0)
    scale = float(x.abs().mean())
    assert torch.allclose(out, torch.sign(x) * scale)


def test_int8_error_within_half_a_step_per_chunk() -> None:
    x = torch.randn(2000, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.01, 10, 2000)
    comp = Int8(chunk=256)
    out = comp.decode(comp.encode(x, 0), 2000, 0)
    pad = torch.cat([x, x.new_zeros(48)]).view(-1, 256)
    step = (pad.abs().amax(dim=1) / 127).repeat_interleave(256)[:2000]
    assert torch.all((out - x).abs() <= step / 2 + 1e-6)


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
def test_casts_round_to_wire_dtype(wire: torch.dtype) -> None:
    x = torch.randn(100)
    comp = Cast(wire)
    assert torch.equal(comp.decode(comp.encode(x, 0), 100, 0), x.to(wire).float())


def test_error_feedback_wraps_biased_only() -> None:
    assert type(build_compressor(_method("topk"))).__name__ == "ErrorFeedback"
    assert type(build_compressor(_method("qsgd"))).__name__ == "QSGD"
    assert type(build_compressor(_method("none"))).__name__ == "Identity"
    assert type(build_compressor(_method("sign", error_feedback=False))).__name__ == "ScaledSign"
    assert build_compressor(_method("randk", error_feedback=False)).unbiased


def test_error_feedback_carries_the_residual() -> None:
    comp = build_compressor(_method("topk", ratio=0.1))
    x = torch.randn(100)
    sent = torch.zeros(100)
    for step in range(10):  # the same gradient ten times: 10 x 10 coordinates go out in all
        sent += comp.decode(comp.encode(x, step), 100, step)
    # with memory, what was sent plus what is still owed is exactly what came in
    assert torch.allclose(sent + comp.residuals[0], 10 * x, atol=1e-5)
