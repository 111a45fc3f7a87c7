"""IST for fully connected networks: the tests of ist.md that catch a wrong implementation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import run_workers

from thinwire.config import load
from thinwire.models import build_mlp
from thinwire.runtime.comm import Comm
from thinwire.strategies import Context, build_strategy
from thinwire.strategies.ist.partition import Partitioner, group_sizes

D, C = 12, 5


def make(comm: Comm, **over: object):
    base = {"method.name": "ist", "model.hidden": "16,12", "model.norm": "none",
            "method.scale": "dropout", "method.local_steps": "3", "train.steps": "6",
            "train.eval_every": "3", "runtime.workers": str(comm.world_size), "train.lr": "0.1"}
    base.update({k: str(v) for k, v in over.items()})
    cfg = load(None, base)
    model = build_mlp(D, cfg.model.hidden, C, norm=cfg.model.norm, seed=0)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    strat = build_strategy(Context(cfg=cfg, comm=comm, device=torch.device("cpu")), model)
    return cfg, strat, init


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, D, generator=g), torch.randint(0, C, (8,), generator=g)


def one_round(comm: Comm, over: dict) -> dict | None:
    cfg, strat, init = make(comm, **over)
    for step in range(cfg.method.local_steps):
        strat.train_step(*batch(comm.rank, step), step)
    full = strat.eval_model()
    out = None
    if full is not None:
        out = {"init": init, "after": {k: v.detach().clone() for k, v in full.state_dict().items()}}
    return {"model": out, "by_op": comm.ledger.by_op(), "mem": strat.memory()}


# --- partitions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("width,n", [(16, 4), (10, 3), (7, 7), (1000, 8)])
def test_partition_disjoint_and_covering(width: int, n: int) -> None:
    p = Partitioner((width, width + 1), n, seed=3)
    for r in range(5):
        for layer, w in zip(p(r).groups, (width, width + 1)):
            allidx = np.concatenate(layer)
            assert sorted(allidx.tolist()) == list(range(w))
            assert max(len(g) for g in layer) - min(len(g) for g in layer) <= 1
    assert not np.array_equal(p(0).groups[0][0], p(1).groups[0][0])


def test_uneven_widths_rotate_the_extra_neuron() -> None:
    assert group_sizes(10, 4, 0) == [3, 3, 2, 2]
    assert group_sizes(10, 4, 1) == [2, 3, 3, 2]
    with pytest.raises(ValueError, match="cannot be cut"):
        group_sizes(3, 4)


def _partition_digest(comm: Comm) -> list[int]:
    p = Partitioner((64, 33), comm.world_size, seed=7)
    return [hash(tuple(np.concatenate([np.concatenate(layer) for layer in p(r).groups]).tolist()))
            for r in range(4)]


def test_partition_identical_on_every_rank() -> None:
    out = run_workers(_partition_digest, 4)
    assert all(o == out[0] for o in out)


# --- bitwise properties ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("deployment", ["central", "sharded"])
@pytest.mark.parametrize("norm", ["none", "batch"])
def test_lr_zero_round_reproduces_the_model_bitwise(n: int, deployment: str, norm: str) -> None:
    over = {"train.lr": 0.0, "method.deployment": deployment, "model.norm": norm,
            "method.scale": "batchnorm" if norm == "batch" else "dropout"}
    res = run_workers(one_round, n, over)[0]["model"]
    for k, v in res["init"].items():
        assert torch.equal(v, res["after"][k]), k


@pytest.mark.parametrize("deployment", ["central", "sharded"])
def test_blocks_not_handed_out_are_unchanged(deployment: str) -> None:
    n = 4
    res = run_workers(one_round, n, {"method.deployment": deployment})[0]["model"]
    g0, g1 = Partitioner((16, 12), n, seed=0)(0).groups
    w_init, w_after = res["init"]["layers.1.weight"], res["after"]["layers.1.weight"]
    changed = ~torch.isclose(w_init, w_after, rtol=0, atol=0)
    for a in range(n):
        for b in range(n):
            block = changed[np.ix_(g1[a], g0[b])]
            if a == b:
                assert block.any(), "a worker's own block must be trained"
            else:
                assert not block.any(), f"cross block ({a},{b}) changed"
    # the shared output bias moved (it is averaged), the first layer's rows all trained
    assert not torch.equal(res["init"]["layers.2.bias"], res["after"]["layers.2.bias"])


def test_central_and_sharded_agree() -> None:
    a = run_workers(one_round, 3, {"method.deployment": "central"})[0]["model"]["after"]
    b = run_workers(one_round, 3, {"method.deployment": "sharded"})[0]["model"]["after"]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_n1_equals_local_sgd_on_the_full_model() -> None:
    comm = Comm.local()  # no process group: world size 1
    cfg_i, ist, _ = make(comm, **{"train.steps": 12, "train.eval_every": 6, "method.local_steps": 6,
                                  "method.scale": "dropout"})
    cfg_l = load(None, {"method.name": "localsgd", "method.period": "6", "model.hidden": "16,12",
                        "model.norm": "none", "train.steps": "12", "train.eval_every": "6",
                        "runtime.workers": "1", "train.lr": "0.1"})
    loc = build_strategy(Context(cfg=cfg_l, comm=comm, device=torch.device("cpu")),
                         build_mlp(D, (16, 12), C, norm="none", seed=0))
    for step in range(12):
        x, y = batch(0, step)
        assert ist.train_step(x, y, step) == loc.train_step(x, y, step)
    full = ist.eval_model()
    for (k, v), (k2, v2) in zip(full.state_dict().items(), loc.model.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k


# --- bytes and memory -----------------------------------------------------------------------------
def subnet_numel(d: int, sizes: list[int], c: int, bias: bool) -> int:
    """ist.md: d h/n + (L-1) h^2/n^2 + h C/n + per-neuron vectors (+ the shared output bias)."""
    n = d * sizes[0] + sum(a * b for a, b in zip(sizes[1:], sizes[:-1])) + c * sizes[-1]
    return n + (sum(sizes) + c if bias else 0)


@pytest.mark.parametrize("n", [2, 4])
def test_central_bytes_per_round_match_the_formula(n: int) -> None:
    out = run_workers(one_round, n, {"method.deployment": "central"})
    part = Partitioner((16, 12), n, seed=0)(0)
    expected = [4 * subnet_numel(D, [len(g) for g in part.of(j)], C, bias=True) for j in range(n)]
    for j in range(1, n):  # a worker: its subnet down and up, once each
        ops = out[j]["by_op"]
        assert ops["recv:subnet"]["recv"] == expected[j]
        assert ops["send:subnet"]["sent"] == expected[j]
    root = out[0]["by_op"]  # the holder: every other subnet out and back
    assert root["send:subnet"]["sent"] == sum(expected[1:])
    assert root["recv:subnet"]["recv"] == sum(expected[1:])


def test_sharded_bytes_spread_evenly() -> None:
    n = 4
    out = run_workers(one_round, n, {"method.deployment": "sharded", "model.hidden": "64,64"})
    sent = [o["by_op"]["send:subnet"]["sent"] for o in out]
    part = Partitioner((64, 64), n, seed=0)(0)
    sub = [4 * subnet_numel(D, [len(g) for g in part.of(j)], C, bias=True) for j in range(n)]
    assert sum(sent) <= 2 * sum(sub)  # nothing travels twice
    assert max(sent) < 2 * sub[0]  # no rank carries the others' subnets
    assert max(sent) / min(sent) < 1.6


def test_memory_report_matches_the_subnet() -> None:
    n = 4
    out = run_workers(one_round, n, {"method.deployment": "central", "model.hidden": "64,64"})
    part = Partitioner((64, 64), n, seed=0)(0)
    full = D * 64 + 64 * 64 + 64 * C + 64 + 64 + C
    for j, o in enumerate(out):
        mem = o["mem"]
        assert mem.param_count == subnet_numel(D, [len(g) for g in part.of(j)], C, bias=True)
        assert mem.grads == 4 * mem.param_count
        assert mem.stored_count == (full if j == 0 else 0)
    assert out[1]["mem"].param_count < full / 3


# --- optimizer state and hybrid -------------------------------------------------------------------
def _reindex(comm: Comm, mode: str) -> dict:
    cfg, strat, _ = make(comm, **{"method.optimizer_state": mode, "train.momentum": 0.9})
    for step in range(6):
        strat.train_step(*batch(comm.rank, step), step)
    stored_state = sum(float(ts[1].abs().sum()) for ts in strat.store if len(ts) > 1)
    return {"by_op": comm.ledger.by_op(), "state": stored_state}


def test_reindexed_momentum_travels_with_the_subnet() -> None:
    reset = run_workers(_reindex, 2, "reset")
    reidx = run_workers(_reindex, 2, "reindex")
    assert reset[1]["by_op"]["send:subnet"]["sent"] * 2 == reidx[1]["by_op"]["send:subnet"]["sent"]
    assert reidx[0]["state"] > 0 and reset[0]["state"] == 0


def _hybrid(comm: Comm) -> dict:
    cfg, strat, _ = make(comm, **{"method.switch_at": 3, "method.period": 3})
    for step in range(6):
        strat.train_step(*batch(comm.rank, step), step)
    m = strat.eval_model()
    return {"by_op": comm.ledger.by_op(), "params": None if m is None else
            torch.cat([p.detach().reshape(-1) for p in m.parameters()])}


def test_hybrid_switches_to_local_sgd() -> None:
    out = run_workers(_hybrid, 2)
    assert "send:switch" in out[0]["by_op"] and "all_reduce:average" in out[0]["by_op"]
    assert out[0]["params"] is not None
