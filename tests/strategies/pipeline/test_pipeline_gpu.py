"""Boundary codecs on CUDA give what they give on the CPU (deterministic codecs: the same
payload bytes and the same decoded tensor up to float rounding), and the payload stays on the
device. Runs only where a CUDA device is visible."""

from __future__ import annotations

import pytest
import torch

from thinwire.compression.base import Site, from_bytes, to_bytes
from thinwire.strategies.pipeline.codecs import build_boundary, sample_ids

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("spec", ["none", "int8", "int4", "topk:ratio=0.1", "randk:ratio=0.1",
                                  "lowrank:rank=4", "aqsgd:bits=4"])
def test_codecs_agree_across_devices(spec: str) -> None:
    x = torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(0))
    ids = sample_ids(torch.arange(24).view(4, 6))
    out = {}
    for device in ("cpu", "cuda"):
        codec = build_boundary(spec, seed=3)
        key = Site(2, 1, ids.to(device))
        payload = codec.encode_tensor(x.to(device), key)
        assert all(t.device.type == device for t in payload)
        buf = to_bytes(payload)
        back = build_boundary(spec, seed=3) if spec.startswith("aqsgd") else codec
        out[device] = (buf.numel(), back.decode_tensor(
            from_bytes(buf, codec.tensor_spec(tuple(x.shape))), tuple(x.shape), key).cpu())
    assert out["cpu"][0] == out["cuda"][0]
    torch.testing.assert_close(out["cuda"][1], out["cpu"][1], rtol=1e-4, atol=1e-5)
