"""Every codec's exchange (``Compressor.average_async``) on real gloo ranks: the ledger holds
exactly what ``collectives`` predicts, and the result is the *mean* (not a sum, not one rank's),
within a bound justified per codec.

Inputs x_i = c + 0.5 n_i (a common part plus each rank's own noise), so the mean is not small
against the inputs and a wrong scale cannot hide in rounding. Every rank regenerates every other
rank's input from its seed to compute references locally.
"""

import math
from typing import Any

import pytest
import torch
from harness import run_workers

from thinwire.compression import Compressor, RandK, build, slot_codecs
from thinwire.runtime.comm import Comm
from thinwire.runtime.ledger import wire_estimate

SHAPES = [(24, 16), (16,), (12, 24), (12,), (3, 3)]  # a bucket: matrices, vectors, a tiny one
D = sum(math.prod(s) for s in SHAPES)  # 709
SEED = 5
SPECS = {  # every codec, sparse ones at 10 % so the tests see many kept values
    "none": "none", "fp16": "fp16", "bf16": "bf16", "topk": "topk:ratio=0.1",
    "randk": "randk:ratio=0.1", "randk-scaled": "randk:ratio=0.1,ef=false", "qsgd": "qsgd",
    "int8": "int8:chunk=64", "fp8": "fp8:chunk=64", "fp4": "fp4:chunk=64", "sign": "sign",
    "powersgd": "powersgd:rank=2",
    "powersgd-noef": "powersgd:rank=2,ef=false", "int4": "int4:chunk=64",
    "topk2bit": "topk2bit:chunk=64,topk=8", "dcttopk": "dcttopk:chunk=16,topk=4",
}


def _x(rank: int, step: int, d: int = D) -> torch.Tensor:
    common = torch.randn(d, generator=torch.Generator().manual_seed(10_000 + step))
    own = torch.randn(d, generator=torch.Generator().manual_seed(100 * rank + step))
    return common + 0.5 * own


def _codec(spec: str, rank: int) -> Compressor:
    return build(spec, seed=SEED, rank=rank)


def _exchange(comm: Comm, spec: str, steps: int, same: bool = False) -> dict[str, Any]:
    """``steps`` exchanges of this rank's inputs (every rank's the same when ``same``):
    each step's mean, ledger entries, and the bytes average_async reported."""
    comp = _codec(spec, comm.rank)
    means, entries, sent = [], [], []
    for step in range(steps):
        mark = comm.ledger.mark()
        fut, nbytes = comp.average_async(comm, _x(0 if same else comm.rank, step), step,
                                         key=3, tag="grad", shapes=SHAPES)
        means.append(fut.wait().clone())
        entries.append([(e.op, e.tag, e.payload, e.sent, e.recv)
                        for e in comm.ledger.entries[mark:]])
        sent.append(nbytes)
    return {"means": means, "entries": entries, "sent": sent}


def _all(comm: Comm, specs: list[str], steps: int) -> dict[str, Any]:
    return {spec: _exchange(comm, spec, steps) for spec in specs}


def _predicted(spec: str, world: int) -> list[tuple[str, str, int, int, int]]:
    return [(op, "grad", b, *wire_estimate(op, b, world))
            for op, b in _codec(spec, 0).collectives(D, SHAPES)]


@pytest.fixture(scope="module")
def world2() -> list[dict[str, Any]]:
    return run_workers(_all, 2, list(SPECS.values()), 3, timeout=240)


@pytest.fixture(scope="module")
def world4() -> list[dict[str, Any]]:
    specs = [SPECS[n] for n in ("fp16", "topk", "randk", "qsgd", "int8", "sign", "powersgd")]
    return run_workers(_all, 4, specs, 2, timeout=240)


def test_every_codec_is_covered() -> None:
    """Guards the coverage of this file: a codec added to the registry for gradients is
    tested here too (the pipeline-only codecs: tests/strategies/pipeline/test_pipeline_codecs.py)."""
    assert {s.partition(":")[0] for s in SPECS.values()} == set(slot_codecs("grad"))


@pytest.mark.parametrize("world", [2, 4])
def test_ledger_equals_collectives_prediction(world: int, world2: Any, world4: Any) -> None:
    """Guards ``Compressor.collectives``: for every codec the ledger of a real exchange (op,
    payload and the wire estimate of each entry) is what the pure description predicts, so a
    planner computing bytes from it gets the ledger's figures, and ranks agree bit for bit."""
    results = world2 if world == 2 else world4
    for spec in results[0]:
        want = _predicted(spec, world)
        for r, res in enumerate(results):
            for step, got in enumerate(res[spec]["entries"]):
                assert got == want, (spec, r, step)
                assert res[spec]["sent"][step] == sum(e[2] for e in want), spec
                assert torch.equal(res[spec]["means"][step], results[0][spec]["means"][step])


def _mean(world: int, step: int) -> torch.Tensor:
    return torch.stack([_x(r, step) for r in range(world)]).mean(0)


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_codecs_average_the_decoded_payloads(world: int, world2: Any,
                                                        world4: Any) -> None:
    """Guards the all-gather exchange's scale: the result is (1/n) sum_i decode(C_i(x_i)),
    computed here from fresh codecs of each rank (same seed and rank, so QSGD draws the same
    private rounding). A sum, one rank's payload or a rank-dependent order fails by O(1)."""
    results = world2 if world == 2 else world4
    for spec in ("topk:ratio=0.1", "qsgd", "int8:chunk=64", "sign"):
        if spec not in results[0]:
            continue
        decoded = []
        for r in range(world):
            c = _codec(spec, r)
            decoded.append(c.decode(c.encode(_x(r, 0), 0, key=3), D, 0, key=3))
        want = torch.stack(decoded).sum(0) / world
        got = results[0][spec]["means"][0]
        assert float((got - want).norm() / want.norm()) < 1e-6, spec


def test_linear_codecs_average_within_their_rounding(world2: Any, world4: Any) -> None:
    """Guards the all-reduce exchange's scale against the exact mean m, with bounds from the
    arithmetic: identity, float summation only (1e-6); fp16 / bf16 with unit roundoff u
    (2^-11 / 2^-8): each of x_i / n is rounded once and each of the n - 1 sums once, so
    |err_j| <= n u mean_i |x_ij| elementwise; unscaled Rand-k (with EF) is m on the shared
    indices and 0 elsewhere; scaled Rand-k is b_j m_j there."""
    for world, results in ((2, world2), (4, world4)):
        m = _mean(world, 0)
        mean_abs = torch.stack([_x(r, 0).abs() for r in range(world)]).mean(0)
        for spec, u in (("none", 0.0), ("fp16", 2.0**-11), ("bf16", 2.0**-8)):
            if spec not in results[0]:
                continue
            err = (results[0][spec]["means"][0] - m).abs()
            assert torch.all(err <= world * u * mean_abs + 1e-6 * m.abs().max()), spec
        for spec in ("randk:ratio=0.1", "randk:ratio=0.1,ef=false"):
            if spec not in results[0]:
                continue
            idx, lengths = RandK(0.1, seed=SEED).indices(D, 0, 3)  # what every rank draws
            got = results[0][spec]["means"][0]
            kept = m[idx] * (lengths if "ef=false" in spec else 1)
            assert torch.allclose(got[idx], kept, rtol=1e-6, atol=1e-6), spec
            rest = torch.ones(D, dtype=torch.bool)
            rest[idx] = False
            assert torch.count_nonzero(got[rest]) == 0, spec


def test_biased_codecs_stay_within_their_contraction(world2: Any, world4: Any) -> None:
    """Guards the decoded mean against the exact mean m with each codec's own error: the error
    of the mean is the mean of the errors, so ||avg - m|| <= (1/n) sum_i ||C(x_i) - x_i||, with
    ||C(x) - x||^2 = ||x||^2 - (sum of the k largest x_j^2) for Top-k (Stich et al.),
    (1 - ||x||_1^2 / (d ||x||_2^2)) ||x||^2 for scaled sign (Karimireddy et al.), and, for
    int8, elementwise |err_j| <= mean_i scale_i(j) / 2."""
    for world, results in ((2, world2), (4, world4)):
        m = _mean(world, 0)
        xs = [_x(r, 0) for r in range(world)]
        k = math.ceil(0.1 * D)
        top = sum(math.sqrt(float(x.pow(2).sum() - x.pow(2).topk(k).values.sum())) for x in xs)
        sign = sum(math.sqrt(float(x.pow(2).sum() - x.abs().sum() ** 2 / D)) for x in xs)
        for spec, bound in (("topk:ratio=0.1", top / world), ("sign", sign / world)):
            err = float((results[0][spec]["means"][0] - m).norm())
            assert err <= bound * (1 + 1e-5), spec
            assert err >= 0.2 * bound, spec  # it is lossy: an exact mean would be suspicious
        scales = torch.stack([(torch.nn.functional.pad(x, (0, (-D) % 64)).view(-1, 64)
                               .abs().amax(1) / 127).repeat_interleave(64)[:D] for x in xs])
        err = (results[0]["int8:chunk=64"]["means"][0] - m).abs()
        assert torch.all(err <= scales.mean(0) * (0.5 + 2**-16) + 1e-6)  # int8.py's bound


def test_qsgd_mean_is_unbiased_within_its_variance() -> None:
    """Guards QSGD's exchange against the exact mean: over T steps of fixed inputs, the average
    of the decoded means has E||avg - m||^2 <= omega sum_i ||x_i||^2 / (n^2 T) (Lemma 3.1 of
    Alistarh et al., independent roundings); we allow 3 times that root mean square, less than
    a one-rank result's distance to the mean (a sum's, ||m||, is 3x more)."""
    world, steps = 2, 400
    means = run_workers(_qsgd_steps, world, steps, timeout=120)[0]
    xs = [_x(r, 0) for r in range(world)]
    m = torch.stack(xs).mean(0)
    omega = build("qsgd").variance_bound(D)
    rms = math.sqrt(omega * sum(float(x.pow(2).sum()) for x in xs) / (world**2 * steps))
    assert float((means - m).norm()) <= 3 * rms
    assert 3 * rms < 0.8 * float((xs[0] - m).norm()) < 0.8 * float(m.norm())


def _qsgd_steps(comm: Comm, steps: int) -> torch.Tensor:
    comp = _codec("qsgd", comm.rank)
    total = torch.zeros(D, dtype=torch.float64)
    for step in range(steps):
        fut, _ = comp.average_async(comm, _x(comm.rank, 0), step)
        total += fut.wait().double()
    return (total / steps).float()


def _low_rank(rank: int) -> torch.Tensor:
    """A bucket whose matrices share their column space across ranks (rank 2, as PowerSGD's)."""
    parts = []
    for j, shape in enumerate(SHAPES):
        g = torch.Generator().manual_seed(77 + j)
        if len(shape) == 2 and min(shape) > 2:
            u = torch.randn(shape[0], 2, generator=g)  # common columns
            v = torch.randn(shape[1], 2, generator=torch.Generator().manual_seed(rank * 31 + j))
            parts.append((u @ v.T).reshape(-1))
        else:
            parts.append(torch.randn(math.prod(shape), generator=g) + rank)
    return torch.cat(parts)


def _powersgd_low_rank(comm: Comm) -> torch.Tensor:
    comp = _codec("powersgd:rank=2", comm.rank)
    fut, _ = comp.average_async(comm, _low_rank(comm.rank), 0, shapes=SHAPES)
    return fut.wait()


@pytest.mark.parametrize("world", [2, 4])
def test_powersgd_averages_low_rank_buckets_exactly(world: int) -> None:
    """Guards PowerSGD's scale: when every rank's matrices share a rank-r column space, the
    projection P_hat P_hat^T of step 6 is exact and the result must be the mean itself (raw
    tensors too). Summing Q instead of averaging it (step 5) gives n times the mean."""
    got = run_workers(_powersgd_low_rank, world, timeout=120)
    want = torch.stack([_low_rank(r) for r in range(world)]).mean(0)
    for out in got:
        assert float((out - want).norm() / want.norm()) < 1e-5


def _identical(comm: Comm, specs: list[str]) -> dict[str, Any]:
    return {spec: _exchange(comm, spec, 3, same=True)["means"] for spec in specs}


def test_identical_inputs_average_as_one_rank() -> None:
    """Guards the averaging of every codec, error feedback and PowerSGD's residual included:
    when every rank holds the same inputs, three exchanges at world size 2 give what one rank
    gives alone. QSGD rounds privately, so it runs with s = 2^20 levels, where each rank's
    rounding moves an element by at most ||x|| / s."""
    specs = [*SPECS.values(), "qsgd:levels=1048576"]
    specs.remove("qsgd")
    two = run_workers(_identical, 2, specs, timeout=180)[0]
    one = _identical(Comm.local(), specs)
    for spec in specs:
        for step in range(3):
            x = _x(0, step)
            tol = 2 * float(x.norm()) / 2**20 if spec.startswith("qsgd") else \
                1e-6 * float(x.abs().max())
            err = float((two[spec][step] - one[spec][step]).abs().max())
            assert err <= tol, (spec, step, err)
