"""Data parallelism and local SGD through the trainer: parity, ledger exactness, resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import assert_same_state, flat_state, run_workers
from method_cases import params, resolve

from thinwire.config import load
from thinwire.reference import reference_run
from thinwire.runtime.comm import Comm
from thinwire.trainer import Trainer

BASE = {"data.name": "digits", "model.hidden": "32,32", "model.norm": "none",
        "train.batch_size": "16", "train.lr": "0.05", "train.steps": "20",
        "train.eval_every": "10", "run.progress": "false"}


def cfg_for(n: int, tmp: Path, **over: object):
    return load(None, {**BASE, "runtime.workers": str(n), "run.out": str(tmp),
                       **{k: str(v) for k, v in over.items()}})


def _train(comm: Comm, cfg, run_dir: str) -> dict:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    tr = Trainer(cfg, comm, torch.device("cpu"), Path(run_dir))
    summary = tr.run()
    model = getattr(tr.strategy, "model", None)
    params = None if model is None else [p.detach().clone() for p in model.parameters()]
    return {"summary": summary, "params": params, "totals": comm.ledger.totals()}


@pytest.mark.parametrize("n", [2, 4])
def test_dp_matches_single_process_reference(n: int, tmp_path: Path) -> None:
    """n workers x batch b == 1 worker x batch n b. Tolerance: the two differ only in float32
    summation order of the gradient mean (relative error ~1e-7 per step), which 20 SGD steps at
    lr 0.05 amplify at most modestly; 1e-5 relative / 1e-6 absolute is two orders above that and
    far below a wrong average (a missing 1/n changes parameters by ~1e-2)."""
    cfg = cfg_for(n, tmp_path)
    out = run_workers(_train, n, cfg, str(tmp_path / "dp"))
    ref = list(reference_run(cfg).parameters())
    for r in range(n):
        for p, q in zip(out[r]["params"], ref):
            torch.testing.assert_close(p, q.detach(), rtol=1e-5, atol=1e-6)


def test_dp_ledger_counts_exact_gradient_bytes(tmp_path: Path) -> None:
    n = 2
    cfg = cfg_for(n, tmp_path)
    out = run_workers(_train, n, cfg, str(tmp_path / "dp"))
    n_params = 64 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10
    for o in out:
        assert o["totals"]["payload_bytes"] == 20 * 4 * n_params
        assert o["totals"]["sent_bytes"] == 20 * round(2 * (n - 1) / n * 4 * n_params)
    assert out[0]["summary"]["memory"]["params_held_max"] == n_params


def _count_ddp_broadcasts(comm: Comm, cfg, run_dir: str) -> int:
    """Training steps of dp counting DDP's own broadcasts (the model at construction, the
    buffers at each forward), which would bypass ``comm``'s ledger."""
    import torch.distributed as dist

    calls = [0]
    inner = dist._broadcast_coalesced

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return inner(*args, **kwargs)

    dist._broadcast_coalesced = counted
    try:
        _train(comm, cfg, run_dir)
    finally:
        dist._broadcast_coalesced = inner
    return calls[0]


def test_dp_moves_nothing_outside_the_ledger(tmp_path: Path) -> None:
    """DDP neither broadcasts the model when it is built nor a batch-norm model's buffers at
    every forward (both through the process group, not the ledger); rank 0's running statistics
    are its own either way, so its trained model equals the single-process reference."""
    n = 2
    cfg = cfg_for(n, tmp_path, **{"model.norm": "batch"})
    assert run_workers(_count_ddp_broadcasts, n, cfg, str(tmp_path / "dp")) == [0, 0]


def test_localsgd_averages_every_period(tmp_path: Path) -> None:
    n = 2
    cfg = cfg_for(n, tmp_path, **{"method.name": "localsgd", "method.period": 5})
    out = run_workers(_train, n, cfg, str(tmp_path / "ls"))
    n_params = 64 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10
    for o in out:
        assert o["totals"]["payload_bytes"] == (20 // 5) * 4 * n_params
    for p, q in zip(out[0]["params"], out[1]["params"]):
        assert torch.equal(p, q)  # identical right after averaging


def _train_state(comm: Comm, cfg, run_dir: str) -> dict:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    tr = Trainer(cfg, comm, torch.device("cpu"), Path(run_dir))
    summary = tr.run()
    return {"summary": summary, "state": flat_state(tr.strategy.state_dict())}


@pytest.mark.parametrize("method,variant,case", params("resume"))
def test_resume_equals_uninterrupted(method: str, variant: str, case: dict,
                                     tmp_path: Path) -> None:
    """A run cut at step 10 and resumed ends in exactly the state of the uninterrupted run:
    parameters and every optimizer / method state tensor (momentum, Adam's moments, DiLoCo's
    outer momentum and global copy, a codec's error-feedback residuals and
    PowerSGD's factors, IST's stored slices and re-indexed state, the state after
    the hybrid switch), compared bit for bit. Guards: a checkpoint missing any state. The cases:
    every method's ``resume`` entry in tests/method_cases.py."""
    n = 2
    over = {**resolve(case), "method.name": method, "run.checkpoint_every": 10}
    full = run_workers(_train_state, n, cfg_for(n, tmp_path, **over), str(tmp_path / "full"))
    cut = cfg_for(n, tmp_path, **{**over, "train.steps": 10, "train.eval_every": 10})
    run_workers(_train_state, n, cut, str(tmp_path / "cut"))
    resumed = cfg_for(n, tmp_path, **{**over, "run.resume": "true"})
    res = run_workers(_train_state, n, resumed, str(tmp_path / "cut"))
    for r in range(n):
        a, b = full[r]["state"], res[r]["state"]
        tensors, _ = assert_same_state(a, b, r)
        assert tensors > 0
    a, b = full[0]["summary"], res[0]["summary"]
    assert a["final"] == b["final"]
    assert a["bytes"]["sent_per_worker_mean"] == b["bytes"]["sent_per_worker_mean"]
    lines = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len((tmp_path / "full" / "metrics.jsonl").read_text().splitlines())
