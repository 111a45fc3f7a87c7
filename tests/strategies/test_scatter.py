"""The scattered exchange of a low-bit codec (``fp4:exchange=scatter``, ``int8:exchange=scatter``):
against a reference written out by hand (quantise every rank's shards, sum them in fp32, divide,
re-quantise the mean), its bytes against its formula, its error feedback per shard, and the
Streaming DiLoCo outer exchange through it (overlap on) with its traffic formula equal to the
ledger."""

from __future__ import annotations

import math
from typing import Any

import torch
from harness import run_workers
from loco_cases import cfg as _method_cfg
from loco_cases import model as _model
from loco_cases import run as _run

from thinwire.compression import build
from thinwire.compression.fp4 import FP4
from thinwire.compression.fp8 import FP8
from thinwire.compression.int8 import Int8
from thinwire.compression.scatter import ScatteredExchange, shard_numel
from thinwire.runtime.comm import Comm
from thinwire.strategies import METHODS
from thinwire.strategies.traffic import Layout

D = 1001  # not a multiple of the shards: the tail is padded


def _x(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(D, generator=g) * (1 + rank)


def _by_hand(quantiser: Any, n: int, step: int) -> torch.Tensor:
    """Every rank's x cut into n shards of s elements; shard j of the mean is
    Q(sum_r Q(x_r[j]) / n), the sums in fp32 in rank order; Q(v) = decode(encode(v))."""
    s = shard_numel(D, n, quantiser.chunk)
    out = []
    for j in range(n):
        acc = torch.zeros(s)
        for r in range(n):
            v = torch.zeros(n * s)
            v[:D] = _x(r, step)
            piece = v[j * s:(j + 1) * s]
            acc += quantiser.decode(quantiser.encode(piece, step), s, step)
        mean = acc / n
        out.append(quantiser.decode(quantiser.encode(mean, step), s, step))
    return torch.cat(out)[:D]


def _exchange(comm: Comm) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for spec in ("fp4:chunk=64,ef=false,exchange=scatter", "int8:chunk=100,ef=false,exchange=scatter",
                 "fp8:chunk=100,ef=false,exchange=scatter"):
        codec = build(spec, rank=comm.rank)
        mark = comm.ledger.mark()
        fut, handed = codec.average_async(comm, _x(comm.rank, 3), 3, key=1, tag="average")
        mean = fut.wait()
        codec.close()
        entries = comm.ledger.entries[mark:]
        res[spec] = {"mean": mean, "handed": handed,
                     "ledger": [(e.op, e.payload, e.sent, e.recv) for e in entries]}
    # error feedback: a residual per shard, the second exchange sends what the first dropped
    codec = build("fp4:chunk=64,exchange=scatter", rank=comm.rank)
    codec.average_async(comm, _x(comm.rank, 0), 0, key=2)[0].wait()
    res["residuals"] = dict(codec.state_dict())
    codec.close()
    return res


def test_scattered_exchange_against_hand_reference() -> None:
    """Guards the scheme's arithmetic: each rank's result equals the hand reference bit for bit
    (same quantiser, same fp32 order), every rank gets the same mean, it differs from the
    all-gather exchange's mean (one more rounding) and from the exact mean; the ledger holds two
    all_to_all of (n - 1) shard payloads each, equal to the formula."""
    n = 3
    out = run_workers(_exchange, n, timeout=120)
    # relative L2 error bounds of two roundings: E3M0 (a power of two, up to 1/3 off) and int8
    for spec, quantiser, bound in (("fp4:chunk=64,ef=false,exchange=scatter", FP4(64), 0.5),
                                   ("int8:chunk=100,ef=false,exchange=scatter", Int8(100), 0.05),
                                   ("fp8:chunk=100,ef=false,exchange=scatter", FP8(100), 0.1)):
        ref = _by_hand(quantiser, n, 3)
        exact = sum(_x(r, 3) for r in range(n)) / n
        for rank in range(n):
            got = out[rank][spec]
            assert torch.equal(got["mean"], ref), (spec, rank)
            s = shard_numel(D, n, quantiser.chunk)
            shard = quantiser.payload_bytes(s)
            assert got["ledger"] == [("all_to_all", (n - 1) * shard, (n - 1) * shard,
                                      (n - 1) * shard)] * 2, spec
            formula = build(spec).collectives(D, world=n)
            assert [(op, b) for op, b, _, _ in got["ledger"]] == formula
            assert got["handed"] == sum(b for _, b in formula)
        assert not torch.equal(ref, exact)
        assert float((ref - exact).norm() / exact.norm()) < bound, spec
    # each rank keeps one residual per shard it encoded (keys 2 n + j), none for the mean
    for rank in range(n):
        assert sorted(out[rank]["residuals"]) == [f"residual.{2 * n + j}" for j in range(n)]
        assert any(float(v.abs().max()) > 0 for v in out[rank]["residuals"].values())


def test_scatter_option_builds_and_is_refused_in_one_line() -> None:
    """Guards the codec option: ``exchange=scatter`` wraps the codec with its error feedback
    inside, is named in its description, and a bad value is a one-line error naming it."""
    import pytest

    from thinwire.options import OptionError

    codec = build("fp4:exchange=scatter")
    assert isinstance(codec, ScatteredExchange)
    assert codec.describe() == "fp4(chunk=256,ef,exchange=scatter)"
    assert build("fp4").collectives(4096, world=4) == [("all_gather", 2048 + 64)]
    # a ring all-reduce's share: 2 (n - 1) / n payloads against n - 1
    assert codec.exchange_bytes(4096, world=4) == 2 * 3 * (512 + 16)
    with pytest.raises(OptionError, match="fp4.exchange"):
        build("fp4:exchange=ring")


H = 4


def _runs(comm: Comm) -> dict[str, Any]:
    cfg = _method_cfg("diloco", period=H, fragments=2, delay=1,
                      compressor="fp4:chunk=64,exchange=scatter")
    blocking = _method_cfg("diloco", period=H, compressor="int8:exchange=scatter")
    return {"overlap": _run(comm, cfg, 3 * H + 1), "blocking": _run(comm, blocking, 3 * H)}


def test_streaming_diloco_through_the_scattered_exchange() -> None:
    """Guards the outer exchange through the scheme with overlap (delay 1, the exchange on its
    thread while the worker steps) and without: bytes sent and handed to collectives equal the
    traffic formula on every rank, and the ranks hold the same theta_g-derived parameters
    after a blocking round (alpha 0: every fragment replaced by the shared outer result)."""
    world = 4
    out = run_workers(_runs, world, timeout=180)
    layout = Layout.of_model(_model())
    entry = METHODS.get("diloco")
    for name, steps in (("overlap", 3 * H + 1), ("blocking", 3 * H)):
        opts = (_method_cfg("diloco", period=H, fragments=2, delay=1,
                            compressor="fp4:chunk=64,exchange=scatter") if name == "overlap"
                else _method_cfg("diloco", period=H, compressor="int8:exchange=scatter"))
        traffic = entry.traffic(layout, opts.method.options, world, steps, 0, 0)
        for rank in range(world):
            assert out[rank][name]["sent"] == traffic.sent[rank], (name, rank)
            assert out[rank][name]["payload"] == traffic.payload[rank], (name, rank)
            assert {op for op, _, _ in out[rank][name]["ledger"]} == {"all_to_all"}
    for rank in range(1, world):
        assert torch.equal(out[rank]["blocking"]["params"], out[0]["blocking"]["params"])


def test_residuals_follow_their_tensors_into_a_new_bucket() -> None:
    """The shards' residuals, end to end, are the residual of the bucket's elements: split per
    tensor and joined into a bucket of another layout (DDP's rebuild, a checkpoint), each
    element's residual lands at its element. Guards: residuals dropped on a rebuild or resume."""
    from thinwire.compression import build

    world, shapes = 3, [(7, 11), (5,), (300,)]  # 382 elements, shards of 256 (whole chunks)
    d = sum(math.prod(s) for s in shapes)
    src = build("fp4:exchange=scatter,chunk=64")
    src._world = world
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(d, generator=g)
    s = shard_numel(d, world, 64)
    padded = torch.zeros(world * s)
    padded[:d] = truth
    for j in range(world):
        src.inner.residuals[2 * world + j] = padded[j * s:(j + 1) * s].clone()
    pieces = src.split_state(2, shapes)
    assert torch.equal(torch.cat([p["residual"] for p in pieces]), truth)
    # the same tensors in another bucket, in another order, one of them new (no residual)
    dst = build("fp4:exchange=scatter,chunk=64")
    order = [2, 0, 1]
    new_shapes = [shapes[i] for i in order] + [(4,)]
    dst.join_state(5, new_shapes, [pieces[i] for i in order] + [{}])
    dst._world = world  # what its first exchange records
    dst._place(5, d + 4, world)
    want = torch.cat([pieces[i]["residual"] for i in order] + [torch.zeros(4)])
    s2 = shard_numel(d + 4, world, 64)
    got = torch.cat([dst.inner.residuals[5 * world + j] for j in range(world)])
    assert got.shape == (world * s2,) and torch.equal(got[:d + 4], want)
    assert not got[d + 4:].any()
    # and back out per tensor, unchanged
    again = dst.split_state(5, new_shapes)
    assert all(torch.equal(a["residual"], pieces[i]["residual"]) for a, i in zip(again, order))
    dst.reset(5)
    assert not any(k // world == 5 for k in dst.inner.residuals)
