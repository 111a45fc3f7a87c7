"""predict_thinwire_run against the byte counts of ist.md's digits simulation (n = 4, MLP
64-512-512-10, 2000 steps per worker): DP 9.0e8 floats sent per worker, local SGD (every 10)
9.0e7, IST (10 local steps) 1.0e7."""

from __future__ import annotations

import pytest

from thinwire.errors import UsageError
from thinwire.planner.thinwire_runs import predict_thinwire_run

WIDTHS = (64, 512, 512, 10)
STEPS = 2000


def _floats(method: str, **kw) -> float:
    out = predict_thinwire_run(method, WIDTHS, 32, 4, **kw)
    return float(out["wire_bytes_per_worker_per_step"]) * STEPS / 4


def test_dp_and_localsgd_match_the_ledger():
    assert _floats("dp") == pytest.approx(9.0e8, rel=0.01)
    assert _floats("localsgd", local_steps=10) == pytest.approx(9.0e7, rel=0.01)
    assert _floats("localsgd", period=10) == pytest.approx(9.0e7, rel=0.01)
    out = predict_thinwire_run("dp", WIDTHS, 32, 4)
    assert out["bytes_per_worker_per_step"] == 301_066 * 4  # payload: all fp32 gradients
    assert out["wire_bytes_per_worker_per_step"] == pytest.approx(1.5 * 301_066 * 4)


def test_ist_central_worker_and_root_bytes():
    out = predict_thinwire_run("ist", WIDTHS, 32, 4, local_steps=10, deployment="central")
    sub = 64 * 128 + 128 * 128 + 128 * 10 + (128 + 128 + 10)
    assert out["subnet_params"] == sub
    assert out["bytes_per_worker_per_step"] == pytest.approx(2 * sub * 4 / 10)
    assert float(out["bytes_per_worker_per_step"]) * STEPS / 4 == pytest.approx(1.0e7, rel=0.05)
    assert out["root_bytes_per_step"] == pytest.approx(3 * 2 * sub * 4 / 10)
    sharded = predict_thinwire_run("ist", WIDTHS, 32, 4, local_steps=10, deployment="sharded")
    assert sharded["wire_bytes_per_worker_per_step"] == pytest.approx(2 * sub * 4 / 10 * 3 / 4)
    assert sharded["comm_time_s"] < out["comm_time_s"]  # no hot spot on rank 0


def test_times_follow_the_link_and_the_compute():
    slow = predict_thinwire_run("dp", WIDTHS, 32, 4, link_bytes_per_s=1e6)
    fast = predict_thinwire_run("dp", WIDTHS, 32, 4, link_bytes_per_s=1e9)
    assert slow["comm_time_s"] == pytest.approx(6 * 50e-6 + 1.5 * 301_066 * 4 / 1e6)
    assert slow["step_time_s"] > fast["step_time_s"]
    assert fast["compute_time_s"] == pytest.approx(
        6 * (64 * 512 + 512 * 512 + 512 * 10) * 32 / 1e11
    )
    comp = predict_thinwire_run("compressed", WIDTHS, 32, 4, compression_ratio=50)
    assert comp["bytes_per_worker_per_step"] == pytest.approx(301_066 * 4 / 50)
    one = predict_thinwire_run("dp", WIDTHS, 32, 1)
    assert one["comm_time_s"] == 0 and one["wire_bytes_per_worker_per_step"] == 0


def test_bad_inputs():
    with pytest.raises(UsageError):
        predict_thinwire_run("allgather", WIDTHS, 32, 4)
    with pytest.raises(UsageError):
        predict_thinwire_run("dp", WIDTHS, 32, 0)
    with pytest.raises(UsageError):
        predict_thinwire_run("ist", WIDTHS, 32, 4, deployment="ring")
