"""The second design's core: lazy communicators, the mesh, batch-norm recalibration, the command
line's help, and every model training with every replicated method and codec."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from harness import rendezvous_dir, run_workers
from method_cases import params as case_params
from torch import nn

from thinwire.builders import build_model, build_strategy, load_data, make_stream
from thinwire.config import load
from thinwire.data.task import task_for
from thinwire.models import build_mlp
from thinwire.models.norms import recalibrate_batchnorm, uses_batch_statistics
from thinwire.runtime.comm import Comm, CommError
from thinwire.runtime.mesh import Mesh
from thinwire.strategies import METHODS
from thinwire.strategies.traffic import Layout


# --- communicators ------------------------------------------------------------------------------
def test_a_comm_used_without_a_process_group_raises() -> None:
    """Guards the silent one-rank fallback: replicas would drift with no error."""
    comm = Comm()
    with pytest.raises(CommError, match="init_process_group"):
        comm.all_reduce(torch.ones(3))
    local = Comm.local()
    assert (local.rank, local.world_size) == (0, 1)
    assert torch.equal(local.all_reduce(torch.ones(3)), torch.ones(3))


def _bind_late(rank: int, store: str, queue: mp.Queue) -> None:
    comm = Comm()  # made before the group exists
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce(t)
    queue.put((rank, comm.world_size, float(t)))
    dist.destroy_process_group()


def test_a_comm_made_before_the_group_binds_on_first_use() -> None:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    store = f"{rendezvous_dir()}/store"
    procs = [ctx.Process(target=_bind_late, args=(r, store, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(queue.get(timeout=60) for _ in range(2))
    for p in procs:
        p.join(timeout=10)
    assert got == [(0, 2, 3.0), (1, 2, 3.0)]


# --- the mesh -----------------------------------------------------------------------------------
def _mesh(comm: Comm) -> dict:
    mesh = Mesh(comm, dp=2, pp=2, tp=2)
    c = mesh.coords
    t = torch.tensor([float(comm.rank)])
    mesh.tp.all_reduce(t, tag="tp")
    d = torch.tensor([float(comm.rank)])
    mesh.dp.all_reduce(d, tag="dp")
    return {"coords": (c.dp, c.pp, c.tp), "tp": float(t), "dp": float(d),
            "sizes": (mesh.dp.world_size, mesh.pp.world_size, mesh.tp.world_size),
            "ops": comm.ledger.by_op(), "rank_of": mesh.rank_of(c.dp, c.pp, c.tp)}


def test_mesh_builds_sub_communicators_on_one_ledger() -> None:
    """2 x 2 x 2 on 8 ranks: rank = (d pp + p) tp + t; a tp all-reduce sums the two tp peers only,
    a dp all-reduce the two replicas; both land in the rank's one ledger."""
    out = run_workers(_mesh, 8, timeout=120)
    for r, o in enumerate(out):
        d, p, t = o["coords"]
        assert r == (d * 2 + p) * 2 + t == o["rank_of"]
        assert o["sizes"] == (2, 2, 2)
        assert o["tp"] == float(r - t + r - t + 1)  # ranks r - t and r - t + 1
        assert o["dp"] == float((p * 2 + t) * 2 + 4)  # ranks p*2+t and 4 + p*2+t
        assert o["ops"]["all_reduce:tp"]["calls"] == 1 and o["ops"]["all_reduce:dp"]["calls"] == 1


# --- batch statistics, recalibrated --------------------------------------------------------------
def test_recalibrated_batchnorm_predicts_single_samples() -> None:
    """IST's original batch-statistics norms cannot predict one sample in eval(); after
    recalibration a sample's logits do not depend on its batch (atol: float32 rounding of the
    normalisation, ~1e-6 of logits of order 1)."""
    torch.manual_seed(0)
    model = build_mlp(12, (32, 32), 4, norm="batch", seed=0)
    x = torch.randn(256, 12)
    assert uses_batch_statistics(model)
    model.eval()
    with pytest.raises(ValueError, match="more than 1 value"):
        model(x[:1])  # one sample has no batch statistics
    assert recalibrate_batchnorm(model, [x[i:i + 64] for i in range(0, 256, 64)]) == 3
    assert not uses_batch_statistics(model)
    batch = model(x[:50])
    for i in (0, 7, 49):
        torch.testing.assert_close(model(x[i:i + 1])[0], batch[i], atol=1e-5, rtol=1e-5)


def test_running_statistics_are_recomputed_on_request_and_momentum_kept() -> None:
    """``running=True``: a norm that tracks statistics gets the cumulative mean of the batch
    means (the first norm sees the inputs themselves), its momentum back afterwards; without
    it, such a model is left as it is."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 2))
    batches = [torch.randn(16, 3) + 5.0 for _ in range(4)]
    assert recalibrate_batchnorm(model, batches) == 0
    assert torch.equal(model[0].running_mean, torch.zeros(3))
    assert recalibrate_batchnorm(model, batches, running=True) == 1
    torch.testing.assert_close(model[0].running_mean,
                               torch.stack([b.mean(0) for b in batches]).mean(0))
    assert model[0].momentum == 0.1 and not model.training


# --- the command line ---------------------------------------------------------------------------
def test_help_is_grouped_with_one_default_each_and_choices() -> None:
    out = subprocess.run([sys.executable, "-m", "thinwire", "train", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "(default: None)" not in out
    assert "model options of mlp" in out and "method options of ist" in out
    assert "{central,sharded}" in out and "{sgd,adamw}" in out
    for line in out.split("--"):
        assert line.count("(default:") <= 1, line
    v = subprocess.run([sys.executable, "-m", "thinwire", "--version"], capture_output=True,
                       text=True, check=True)
    assert v.stdout.startswith("thinwire ")


# --- every model with every replicated method and codec -----------------------------------------
RUNS = [(m, v, case) for m, v, case in (p.values for p in case_params("models"))]
"""Every method's ``models`` cases of tests/method_cases.py (dp with each codec, localsgd and
diloco with period 2): method options, the model comes from MODEL_CONFIGS."""


def _methods_on(comm: Comm, overrides: dict, runs: list) -> dict:
    """Two steps of each run on one model: replicas agree after each sync, parameters move,
    losses are finite, and the ledger holds exactly the bytes of the method's traffic formula
    (DDP's buckets in the probed gradient-ready order)."""
    out = {}
    for name, variant, extra in runs:
        cfg = load(None, {**overrides, "method.name": name, **extra, "train.steps": 2,
                          "train.eval_every": 2, "runtime.workers": comm.world_size,
                          "train.batch_size": 4, "train.lr": 0.01})
        ds = load_data(cfg)
        model = build_model(cfg, ds)
        start = [p.detach().clone() for p in model.parameters()]
        layout = Layout.of_model(model, ds.x_train[:4])
        strat = build_strategy(cfg, comm, torch.device("cpu"), task_for(ds), model)
        stream = make_stream(cfg, ds, comm.rank, comm.world_size)
        mark = comm.ledger.mark()
        losses = [strat.train_step(stream.batch(s), s) for s in range(2)]
        sent = comm.ledger.totals(since=mark)["sent_bytes"]
        want = METHODS.get(name).traffic(layout, cfg.method.options, comm.world_size, 2, 0, 0)
        assert sent == want.sent[comm.rank], (name, extra, sent, want.sent)
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        moved = any(not torch.equal(a, b) for a, b in zip(start, model.parameters()))
        strat.close()
        out[f"{name}:{variant}"] = (losses, params, moved)
    return out


def _data_dir(sub: str) -> str:
    from harness import DATA

    return str(DATA / sub)


MODEL_CONFIGS = {
    "mlp": lambda: {"model.name": "mlp", "data.name": "digits", "model.hidden": "16,16"},
    "resnet": lambda: {"model.name": "resnet", "data.name": "digits", "model.widths": "4,8",
                       "model.blocks": "1,1"},
    "gpt": lambda: {"model.name": "gpt", "data.name": "tinyshakespeare",
                    "data.dir": _data_dir("tinyshakespeare"), "data.seq_len": 16,
                    "data.limit_train": 256, "data.limit_test": 32, "model.n_layer": 1,
                    "model.d_model": 32, "model.n_head": 2},
    "gcn": lambda: {"model.name": "gcn", "data.name": "cora", "data.dir": _data_dir("cora"),
                    "model.hidden": 16},
}


@pytest.mark.parametrize("model", sorted(MODEL_CONFIGS))
def test_every_model_trains_with_every_replicated_method_and_codec(model: str) -> None:
    over = MODEL_CONFIGS[model]()
    out = run_workers(_methods_on, 2, over, RUNS, timeout=240)
    assert len(out[0]) == len(RUNS)
    for key, (losses, params, moved) in out[0].items():
        assert all(torch.isfinite(torch.tensor(losses))), key
        assert moved, key
        # replicated methods: identical replicas after the (last) synchronisation
        assert torch.equal(params, out[1][key][1]), key
