"""SparseLoCo: two rounds on two ranks against Algorithm 1 of arXiv 2508.15706 written out by
hand; the traffic formula equals the ledger; checkpoints resume exactly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import run_workers
from loco_cases import LR, batch, cfg, flat, model, resumes_exactly, run

from thinwire.runtime.comm import Comm
from thinwire.strategies import METHODS
from thinwire.strategies.traffic import Layout

H, CHUNK, TOPK, BETA, OUTER = 3, 64, 4, 0.9, 0.8
OPTS = {"period": H, "chunk": CHUNK, "topk": TOPK, "beta": BETA, "outer_lr": OUTER}


def _q2(v: torch.Tensor) -> torch.Tensor:
    """The 2-bit quantiser of the module docstring, on one chunk's kept values."""
    a = v.abs()
    hi = a > a.mean()
    out = torch.empty_like(v)
    for half in (hi, ~hi):
        if half.any():
            out[half] = a[half].mean()
    return torch.where(v < 0, -out, out)


def _by_hand(comm: Comm, rounds: int) -> dict[str, torch.Tensor]:
    m = model()
    inner = torch.optim.SGD(m.parameters(), lr=LR)
    theta = flat(m).clone()
    e = torch.zeros_like(theta)
    step = 0
    for _ in range(rounds):
        for _ in range(H):  # 1. H inner steps
            x, y = batch(comm.rank, step)
            inner.zero_grad()
            F.cross_entropy(m(x), y).backward()
            inner.step()
            step += 1
        with torch.no_grad():
            e = BETA * e + (theta - flat(m))  # 2-3
            sent = torch.zeros_like(e)
            for c in range(0, e.numel(), CHUNK):  # 4. chunked top-k, 2 bits
                chunk = e[c:c + CHUNK]
                top = torch.argsort(chunk.abs(), descending=True)[:TOPK]
                sent[c + top] = _q2(chunk[top])
            e = e - sent  # 5
            mean = sum(comm.all_gather(sent)) / comm.world_size  # 6
            theta = theta - OUTER * mean  # 7
            at = 0
            for p in m.parameters():
                p.copy_(theta[at:at + p.numel()].view_as(p))
                at += p.numel()
    return {"params": flat(m), "error": e}


def _runs(comm: Comm) -> dict[str, Any]:
    return {"strategy": run(comm, cfg("sparseloco", **OPTS), 2 * H),
            "hand": _by_hand(comm, 2)}


@pytest.fixture(scope="module")
def world2() -> list[dict[str, Any]]:
    return run_workers(_runs, 2, timeout=240)


def test_rounds_match_algorithm_1_by_hand(world2: list[dict[str, Any]]) -> None:
    """Guards steps 2-7 (accumulator, chunked top-k, 2-bit values, error feedback, the mean of
    every rank's sparse update, the outer step). Tolerance: the half-means summed in another
    order, one rounding each (|values| < 1: ~1e-7); a wrong chunk, top-k or sign is >= 1e-4."""
    for out in world2:
        assert torch.allclose(out["strategy"]["params"], out["hand"]["params"], rtol=0, atol=1e-6)
    assert torch.equal(world2[0]["strategy"]["params"], world2[1]["strategy"]["params"])


def test_traffic_formula_equals_the_ledger(world2: list[dict[str, Any]]) -> None:
    """Guards the planner's price of SparseLoCo: one all-gather a round of K (2 + 1/4) + 8 C
    bytes on every rank, equal to the formula's bytes, and far below the dense exchange."""
    layout = Layout.of_model(model())
    config = cfg("sparseloco", **OPTS)
    traffic = METHODS.get("sparseloco").traffic(layout, config.method.options, 2, 2 * H + 1, 0, 0)
    d = layout.numel  # 484: 7 chunks of 64 and one of 36
    k, chunks = 8 * TOPK, 8
    payload = 2 * k + -(-k // 4) + 8 * chunks
    for rank, out in enumerate(world2):
        assert out["strategy"]["ledger"] == [("all_gather", "average", payload)] * 2
        assert out["strategy"]["sent"] == traffic.sent[rank]
        assert out["strategy"]["payload"] == traffic.payload[rank] < 4 * d / 5


def test_checkpoint_resumes_exactly() -> None:
    """Guards SparseLoCo's checkpoint state (theta, the accumulator, the step count)."""
    assert resumes_exactly(cfg("sparseloco", **OPTS), 4, 5)
