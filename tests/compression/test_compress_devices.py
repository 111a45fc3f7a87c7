"""The device-generic torch paths (what CUDA runs) against the CPU's numpy fast paths, on CPU:
every codec with its fast paths switched off must give what it gives with them on, and every
tensor it makes must follow the input's device and dtype."""

import math

import pytest
import torch

from thinwire.compression import base, build, fp8, quantize, sign, slot_codecs, sparse

SPECS = ["none", "fp16", "bf16", "topk:ratio=0.01", "topk:ratio=0.3", "randk:ratio=0.1",
         "randk:ratio=0.1,ef=false", "qsgd", "qsgd:levels=127", "int8", "int8:chunk=100",
         "fp4", "fp4:chunk=100", "fp8", "fp8:chunk=100,format=e5m2", "sign", "powersgd:rank=2",
         "int4", "topk2bit:chunk=64,topk=8", "dcttopk"]
BITWISE = {"none", "fp16", "bf16", "topk", "randk", "int8", "fp4", "fp8", "powersgd", "int4",
           "topk2bit", "dcttopk"}


def _off_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every codec module sees its input as off the CPU: the paths other devices take."""
    for module in (base, sparse, sign, quantize, fp8):
        for name in ("on_cpu", "is_cpu_float32"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lambda *_a: False)


@pytest.fixture()
def torch_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    _off_cpu(monkeypatch)


def _run(spec: str, d: int) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]]:
    comp = build(spec, seed=9)
    out = []
    for step in range(3):  # error feedback and warm starts carry state across steps
        x = torch.randn(d, generator=torch.Generator().manual_seed(step)) * 3
        x[:3] = torch.tensor([0.0, -0.0, 2.5])
        payload = comp.encode(x, step, key=2)
        buf = torch.full((d,), float("nan"))
        comp.decode(payload, d, step, key=2, out=buf)
        out.append((payload, buf, x))
    return out


def test_every_codec_is_covered() -> None:
    """Guards the coverage of this file: a codec added to the registry for gradients is
    tested here too (the pipeline-only codecs: tests/strategies/pipeline/test_pipeline_codecs.py)."""
    assert {s.partition(":")[0] for s in SPECS} == set(slot_codecs("grad"))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("d", [9, 70_001, 300_007])
def test_torch_paths_match_numpy_paths(spec: str, d: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards the code CUDA runs, on CPU: the torch path's payload bytes are the numpy path's
    (sign: the same bits, the scale to summation order; QSGD draws its rounding from the
    device's own generator, so there each level is checked to be floor(r) or floor(r) + 1)."""
    fast = _run(spec, d)
    _off_cpu(monkeypatch)
    slow = _run(spec, d)
    name = spec.partition(":")[0]
    for (pf, of, x), (ps, os_, _) in zip(fast, slow):
        assert [(t.dtype, t.numel()) for t in pf] == [(t.dtype, t.numel()) for t in ps]
        assert bool(torch.isfinite(os_).all())
        if name in BITWISE:
            assert all(torch.equal(a, b) for a, b in zip(pf, ps)), spec
            assert torch.equal(of, os_), spec
        elif name == "sign":
            assert torch.equal(pf[1], ps[1])
            assert float(ps[0]) == pytest.approx(float(pf[0]), rel=1e-5)
        else:
            norm, q = ps
            levels = int(spec.partition("=")[2] or 16)
            r = x.double().abs() * levels / float(norm)
            lv = q.double().abs()
            assert torch.all((lv == r.floor()) | (lv == r.floor() + 1) | (lv == levels))
            assert int(lv.max()) <= levels


@pytest.mark.parametrize("spec", SPECS)
def test_tensors_follow_the_input_dtype(spec: str, torch_paths: None) -> None:
    """Guards dtype-following on the torch paths: a bfloat16 input (half precision has no numpy
    dtype and no QR) round-trips, and the decode into a bfloat16 buffer is within the codec's
    reach of the input: below ||x|| for the contractive codecs, below 1.5 sqrt(omega) ||x|| for
    QSGD (Lemma 3.1), below 1.2 sqrt(d / k - 1) ||x|| for scaled Rand-k."""
    d = 4096
    x = torch.randn(d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    comp = build(spec, seed=1)
    payload = comp.encode(x, 0)
    out = torch.empty(d, dtype=torch.bfloat16)
    comp.decode(payload, d, 0, out=out)
    assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out.float()).all())
    rel = float((out.float() - x.float()).norm() / x.float().norm())
    bound = {"qsgd": 1.5 * math.sqrt(min(d / 16**2, math.sqrt(d) / 16)),
             "qsgd:levels=127": 1.5 * math.sqrt(math.sqrt(d) / 127),
             "randk:ratio=0.1,ef=false": 1.2 * math.sqrt(10 - 1)}.get(spec, 1.0)
    assert rel < bound, (spec, rel)
