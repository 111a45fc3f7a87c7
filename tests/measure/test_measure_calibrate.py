"""The calibration: fits against synthetic timings, a run's local work on a silent
communicator, one small calibration of the whole suite end to end, the report, and the
command's input errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from thinwire.cli import main
from thinwire.config import load
from thinwire.data import load_dataset
from thinwire.measure import suite as su
from thinwire.measure.calibrate import (
    Calibration,
    bracket,
    calibrate,
    fit_alpha_beta,
    fit_compute,
    preimport,
)
from thinwire.measure.local import Silent, run_shape, sync_overhead
from thinwire.measure.predict import predict_run, run_traffic, summary_bytes

WIDTHS = (64, 32, 32, 10)


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_alpha_beta_fit_recovers_known_constants(noise: float) -> None:
    rng = torch.Generator().manual_seed(0)
    alpha, rate, n = 80e-6, 2.5e9, 4
    sizes = [2**k for k in range(10, 25, 2)]
    for hops, wire in ((2 * (n - 1), [2 * (n - 1) / n * s for s in sizes]),
                       (n - 1, [(n - 1) * s for s in sizes])):
        t = [hops * alpha + w / rate for w in wire]
        t = [x * (1 + noise * float(torch.randn(1, generator=rng))) for x in t]
        fit = fit_alpha_beta([hops] * len(wire), wire, t)
        tol = 1e-9 if noise == 0 else 0.1
        assert fit.alpha_s == pytest.approx(alpha, rel=tol)
        assert fit.bytes_per_s == pytest.approx(rate, rel=tol)
    flat = fit_alpha_beta([6, 6], [1e3, 1e6], [1.0, 1.0])  # no slope: latency only
    assert flat.alpha_s == pytest.approx(1 / 6, rel=1e-3)
    rate_c, t0 = fit_compute([1e9, 4e9], [0.012, 0.042])
    assert rate_c == pytest.approx(1e11) and t0 == pytest.approx(0.002)
    # a negative slope: through the origin, R = sum F^2 / sum F t
    assert fit_compute([1e9, 4e9], [0.03, 0.02]) == (pytest.approx(17e18 / 0.11e9), 0.0)


def test_sync_overhead_is_a_period_beyond_its_inner_steps() -> None:
    steps = [3.0, 1.0, 1.0, 2.0] * 2  # S = 4: 3 + 1 + 1 + 2 = 7 = 4 x 1 + 3
    assert sync_overhead(steps, 4) == pytest.approx(3.0)
    assert sync_overhead([5.0, 1.0], 2) == 0.0  # no step strictly inside a period


def test_silent_communicator_moves_nothing() -> None:
    comm = Silent(1, 4)
    assert (comm.rank, comm.world_size, comm.distributed) == (1, 4, False)
    x = torch.ones(3)
    assert comm.all_reduce(x) is x and comm.all_gather_async(x).wait().tolist() == [1.0] * 12
    buf = torch.full((2,), float("nan"))
    comm.exchange([(0, x)], [(0, buf)])
    assert buf.tolist() == [0.0, 0.0] and comm.ledger.entries == []


def _cfg(**over: str):
    base = {"data.name": "digits", "model.hidden": "33,30", "train.batch_size": "8",
            "train.steps": "10", "runtime.workers": "2", "run.out": "unused"}
    return load(None, {**base, **over})


def test_run_shape_finds_what_rank_0_trains() -> None:
    ds = load_dataset("digits")
    ist = run_shape(_cfg(**{"method.name": "ist", "method.local_steps": "5"}), ds)
    # rank 0's groups of 33 and 30 neurons over 2 workers: 17 and 15 in round 0, 16 and 15
    # in round 1 (the extra neuron rotates); the mean over the 10 steps of two rounds
    assert ist.trained == (64.0, 16.5, 15.0, 10.0) and ist.key == (64, 16, 15, 10)
    assert (ist.sync_every, ist.codec) == (5, "none")
    topk = run_shape(_cfg(**{"method.compressor": "topk:ratio=0.1"}), ds)
    assert topk.trained == (64.0, 33.0, 30.0, 10.0) and topk.codec == "topk:ratio=0.1"


def test_a_small_calibration_end_to_end(tmp_path: Path) -> None:
    preimport()
    configs = su.suite_configs(WIDTHS, 2, 10, 8, str(tmp_path))
    assert [c.run_name for c in configs] == ["dp", "localsgd", "diloco", "sparseloco", "demo",
                                             "ist", "topk_ratio0.01"]
    probe, layout, shapes = su._prepare(configs, WIDTHS, load_dataset("digits"), reps=2)
    assert probe.models == (WIDTHS, (64, 16, 16, 10))
    assert probe.syncs == ((0, 1), (0, 10), (1, 10)) and probe.ddp == (3520,)
    assert [c.run_name for c in probe.runs] == ["localsgd", "diloco", "sparseloco", "ist"]
    assert probe.codecs == (("topk:ratio=0.01", (3520, 880)),)
    cal = calibrate(probe, 2)
    assert set(cal.links) == {"all_reduce", "all_gather", "p2p"}
    assert set(cal.codecs) == {"topk:ratio=0.01"}
    assert set(cal.sync_overhead_s) == {"localsgd", "diloco", "sparseloco", "ist"}
    assert set(cal.stragglers) == {"64-32-32-10/1", "64-32-32-10/10", "64-16-16-10/10"}
    assert min(cal.stragglers.values()) >= 1.0
    later = dataclasses.replace(cal, started_at=cal.started_at + 100)
    mid = bracket(cal, later, later.midpoint)  # at the second calibration: all its weight
    assert mid.compute_flops_per_s == pytest.approx(later.compute_flops_per_s)
    for cfg, shape in zip(configs, shapes):
        p = predict_run(cfg, layout, mid, shape)
        parts = p["compute_time_s"] + p["comm_time_s"] + p["codec_time_s"] + p["sync_time_s"]
        assert p["step_time_s"] == pytest.approx(parts)
        assert {k: p[k] for k in summary_bytes(run_traffic(cfg, layout))} == summary_bytes(
            run_traffic(cfg, layout))
        w = shape.trained
        flops = 6 * 8 * sum(a * b for a, b in zip(w[:-1], w[1:]))
        want = (mid.step_overhead_s + flops / mid.compute_flops_per_s) * p["straggler"]
        assert p["compute_time_s"] == pytest.approx(want)
        assert p["straggler"] == mid.stragglers[Calibration.key(shape.key, shape.sync_every)]
        codec = 4 * layout.numel / mid.codecs[shape.codec] if shape.codec != "none" else 0.0
        assert p["codec_time_s"] == pytest.approx(codec * p["straggler"])
        fit = {op: mid.links[op] for op in p["rank0_calls"]}
        hops = {"all_reduce": 2, "all_gather": 1, "p2p": 1}  # n = 2
        comm = sum(c * hops[op] * fit[op].alpha_s + b / fit[op].bytes_per_s
                   + (c * mid.call_overhead_s if op != "p2p" else 0.0)
                   for op, (c, b) in p["rank0_calls"].items())
        assert p["comm_time_s"] == pytest.approx(comm / 10)
    json.dumps(dataclasses.asdict(mid))


def test_report_marks_exact_bytes_and_step_errors() -> None:
    bytes_ = {"sent_per_worker_mean": 10.0, "sent_per_worker_max": 12.0,
              "payload_per_worker_mean": 20.0}
    pred = {**bytes_, "step_time_s": 0.011, "compute_time_s": 0.008, "comm_time_s": 0.002,
            "codec_time_s": 0.0, "sync_time_s": 0.001, "straggler": 1.2}
    cal = dataclasses.asdict(Calibration(2, 1, 1e9, 1e-3, {}))
    run = {"run": "x", "predicted": pred, "measured": {**bytes_, "step_time_s": 0.010,
                                                       "spread": 0.3},
           "drift": 0.05, "calibration": cal}
    other = {**run, "run": "y", "measured": {**run["measured"], "sent_per_worker_max": 13.0}}
    data = {"widths": [64, 32, 10], "workers": 2, "cores": 2, "batch_size": 8, "steps": 10,
            "seconds": 3.0, "runs": [run, other]}
    text = su.calibration_report(data)
    assert "| x | 10 | 10 | 12 | 12 | exact | 11.0 | 10.0 | +10.0% |" in text
    assert "| y | 10 | 10 | 12 | 13 | DIFFERENT |" in text
    assert "step-time error: mean 10.0%, max 10.0%" in text


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--model", "mlp-100-32-10"], "Fashion-MNIST"),
        (["--model", "mlp-64-32-10", "--steps", "15"], "multiple of 10"),
        (["--model", "gpt2-small"], "MLP"),
    ],
)
def test_calibrate_bad_input_exits_2(capsys, tmp_path, argv, needle) -> None:
    assert main(["plan", "--calibrate", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1
