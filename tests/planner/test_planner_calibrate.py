"""``thinwire plan --calibrate``'s pieces: exact ledger bytes against real runs, the fits
against synthetic timings, one small calibration end to end, and the command's input errors.

The byte tests train tiny MLPs on digits through the trainer on 2 (or 3) forked gloo ranks and
compare every rank's ledger with :func:`ledger_bytes` to the byte, and rank 0's call count per
op with the calls the time model charges: a DP model of 64-512-512-10 (1.2 MB of gradients,
so DDP splits it into a 1 MiB-capped first bucket and a second one from step 1 on), Top-k's
per-bucket k, IST with widths not divisible by n (uneven groups that rotate with the round).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from harness import run_workers

from thinwire.cli import main
from thinwire.config import load
from thinwire.data import load_dataset
from thinwire.planner import calibrate as cb
from thinwire.planner.thinwire_runs import ddp_buckets, ledger_bytes, predict_thinwire_run
from thinwire.runtime.comm import Comm
from thinwire.trainer import Trainer

BASE = {
    "data.name": "digits",
    "train.batch_size": "8",
    "train.steps": "10",
    "train.eval_every": "0",
    "run.progress": "false",
}

RUNS = {
    "dp": (2, {"method.name": "dp", "model.hidden": "512,512"}),
    "dp-topk": (
        2,
        {
            "method.name": "dp",
            "model.hidden": "512,512",
            "model.norm": "layer",
            "method.compressor": "topk",
            "method.ratio": "0.003",
        },
    ),
    "localsgd": (
        3,
        {
            "method.name": "localsgd",
            "method.period": "5",
            "model.norm": "none",
            "model.hidden": "32,32",
        },
    ),
    "ist-central": (2, {"method.name": "ist", "method.local_steps": "5", "model.hidden": "33,30"}),
    "ist-sharded": (
        3,
        {
            "method.name": "ist",
            "method.local_steps": "5",
            "model.hidden": "34,31",
            "method.deployment": "sharded",
            "train.seed": "3",
        },
    ),
}


@pytest.fixture(scope="module", autouse=True)
def _imports_done_once() -> None:
    """Import here, once, what every forked rank would otherwise import on its own (torch's
    compiler stack for the first optimizer; sklearn for digits): seconds per rank and run."""
    cb.preimport()
    load_dataset("digits")


def _train(comm: Comm, cfg, run_dir: str) -> dict:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    summary = Trainer(cfg, comm, torch.device("cpu"), Path(run_dir)).run()
    return {"summary": summary, "totals": comm.ledger.totals(), "by_op": comm.ledger.by_op()}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_ledger_bytes_equal_a_real_run(name: str, tmp_path: Path) -> None:
    n, over = RUNS[name]
    cfg = load(None, {**BASE, **over, "runtime.workers": str(n), "run.out": str(tmp_path)})
    out = run_workers(_train, n, cfg, str(tmp_path / name))
    widths = (64, *cfg.model.hidden, 10)
    pred = cb.predict(cfg, widths)
    m = cfg.method
    lb = ledger_bytes(
        cb.method_of(cfg),
        widths,
        n,
        10,
        norm=cfg.model.norm,
        period=m.period,
        local_steps=m.local_steps,
        deployment=m.deployment,
        seed=cfg.train.seed,
        topk_keep=m.ratio if m.compressor == "topk" else None,
    )
    assert [o["totals"]["sent_bytes"] for o in out] == list(lb.sent)
    assert [o["totals"]["payload_bytes"] for o in out] == list(lb.payload)
    b = out[0]["summary"]["bytes"]
    assert pred["sent_per_worker_mean"] == b["sent_per_worker_mean"]
    assert pred["sent_per_worker_max"] == b["sent_per_worker_max"]
    assert pred["payload_per_worker_mean"] == b["payload_per_worker_mean"]
    calls = sum(v["calls"] for v in out[0]["by_op"].values())
    ((op, (charged, _)),) = lb.rank0_calls.items()
    if op == "p2p":  # the ledger has one entry a message; the model one exchange a direction
        assert name == "ist-sharded" or calls == charged * (n - 1)
    else:
        assert calls == charged
    if name == "dp":
        assert ddp_buckets(widths, "batch") == [5120 + 1024 + 262_144, 1024 + 32_768]


def test_exact_matches_the_analytic_form_where_nothing_rounds() -> None:
    widths = (64, 512, 512, 10)
    exact = predict_thinwire_run("dp", widths, 32, 4, steps=100, norm="none")
    plain = predict_thinwire_run("dp", widths, 32, 4)
    for k in ("bytes_per_worker_per_step", "wire_bytes_per_worker_per_step"):
        assert exact[k] == pytest.approx(plain[k])
    ist = predict_thinwire_run("ist", widths, 32, 4, local_steps=10, steps=100, norm="none")
    sub = 64 * 128 + 128 * 128 + 128 * 10 + 2 * 128 + 10
    assert ist["sent_per_worker_max"] == 10 * 3 * sub * 4  # rank 0 sends 3 subnets a round
    assert ist["sent_per_worker_mean"] == 10 * (3 + 3 * 1) * sub * 4 / 4  # the others 1 each
    with pytest.raises(Exception, match="multiple"):
        predict_thinwire_run("ist", widths, 32, 4, local_steps=10, steps=15)


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_alpha_beta_fit_recovers_known_constants(noise: float) -> None:
    rng = torch.Generator().manual_seed(0)
    alpha, rate, n = 80e-6, 2.5e9, 4
    sizes = [2**k for k in range(10, 25, 2)]
    for hops, wire in (
        (2 * (n - 1), [2 * (n - 1) / n * s for s in sizes]),
        (n - 1, [(n - 1) * s for s in sizes]),
    ):
        t = [hops * alpha + w / rate for w in wire]
        t = [x * (1 + noise * float(torch.randn(1, generator=rng))) for x in t]
        fit = cb.fit_alpha_beta([hops] * len(wire), wire, t)
        tol = 1e-9 if noise == 0 else 0.1
        assert fit.alpha_s == pytest.approx(alpha, rel=tol)
        assert fit.bytes_per_s == pytest.approx(rate, rel=tol)
    flat = cb.fit_alpha_beta([6, 6], [1e3, 1e6], [1.0, 1.0])  # no slope: alpha only
    assert flat.alpha_s > 0
    rate_c, t0 = cb.fit_compute([1e9, 4e9], [0.012, 0.042])
    assert rate_c == pytest.approx(1e11) and t0 == pytest.approx(0.002)


def test_a_small_calibration_end_to_end(tmp_path: Path) -> None:
    widths = (64, 32, 32, 10)
    configs = cb.suite(widths, 2, 10, 8, str(tmp_path))
    probe = dataclasses.replace(cb.probe_for(configs, widths), reps=2)
    assert probe.syncs == ((0, 1), (0, 10), (1, 10)) and probe.ddp == (3520,)
    cal = cb.calibrate(probe, 2)
    assert cal.compute_flops_per_s > 0 and cal.step_overhead_s >= 0
    assert set(cal.links) == {"all_reduce", "all_gather", "p2p"}
    assert all(f.bytes_per_s > 0 and f.alpha_s >= 0 for f in cal.links.values())
    assert cal.codec_bytes_per_s > 0 and cal.ist_round_s > 0 and cal.ddp_bucket_s >= 0
    assert set(cal.stragglers) == {"64-32-32-10/1", "64-32-32-10/10", "64-16-16-10/10"}
    assert min(cal.stragglers.values()) >= 1
    later = dataclasses.replace(cal, started_at=cal.started_at + 100)
    mid = cb.bracket(cal, later, later.midpoint)  # at the second calibration: all its weight
    assert mid.compute_flops_per_s == pytest.approx(later.compute_flops_per_s)
    for cfg in configs:
        assert cb.predict(cfg, widths, mid)["step_time_s"] > 0
    json.dumps(cb.calibration_json(mid))


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--model", "mlp-100-32-10"], "Fashion-MNIST"),
        (["--steps", "15"], "multiple of 10"),
        (["--model", "gpt2-small"], "MLP"),
    ],
)
def test_calibrate_bad_input_exits_2(capsys, tmp_path, argv, needle) -> None:
    assert main(["plan", "--calibrate", "--out", str(tmp_path), *argv]) == 2
    assert needle in capsys.readouterr().err
