"""IST for fully connected networks: the tests of ist.md that catch a wrong implementation.

Multi-process tests run the trainer's IST strategy (thinwire.run.build_strategy) on forked gloo
ranks; the user-loop tests drive :class:`thinwire.IST` around plain torch objects.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from harness import run_workers
from torch import nn

from thinwire.builders import build_strategy
from thinwire.config import load
from thinwire.data.task import TASKS
from thinwire.errors import UsageError
from thinwire.models import build_mlp
from thinwire.models.adapter import linear_stack
from thinwire.runtime.comm import Comm
from thinwire.strategies.ist.core import IST
from thinwire.strategies.ist.method import Options, PlateauRule, ist_traffic
from thinwire.strategies.ist.partition import Partitioner, group_sizes

D, C = 12, 5
TASK = TASKS["classification"]


def make(comm: Comm, **over: object):
    base = {"method.name": "ist", "model.hidden": "16,12", "model.norm": "none",
            "method.scale": "dropout", "method.local_steps": "3", "train.steps": "6",
            "train.eval_every": "3", "runtime.workers": str(comm.world_size), "train.lr": "0.1",
            "data.name": "teacher", "method.overlap": "1"}  # disjoint subnets, as published
    base.update({k: str(v) for k, v in over.items()})
    cfg = load(None, base)
    o = cfg.model.options
    model = build_mlp(D, o.hidden, C, norm=o.norm, seed=0)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    strat = build_strategy(cfg, comm, torch.device("cpu"), TASK, model)
    return cfg, strat, init


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, D, generator=g), torch.randint(0, C, (8,), generator=g)


def one_round(comm: Comm, over: dict) -> dict | None:
    cfg, strat, init = make(comm, **over)
    for step in range(cfg.method.options.local_steps):
        strat.train_step(batch(comm.rank, step), step)
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
# through the trainer's strategy; tests/strategies/ist/test_ist_invariants.py covers every adapter at
# n = 2 and 4 in both deployments through the public IST, so three cases suffice here
@pytest.mark.parametrize("n,deployment,norm", [(2, "central", "batch"), (4, "sharded", "batch"),
                                               (4, "central", "none")])
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
    changed = w_init != w_after
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
    """One worker holds every unit: IST is plain local training, bit for bit (the shared output
    bias is copied back, not re-averaged, so no rounding enters)."""
    comm = Comm.local()
    _, ist, _ = make(comm, **{"train.steps": 12, "train.eval_every": 6,
                              "method.local_steps": 6, "method.scale": "dropout"})
    cfg_l = load(None, {"method.name": "localsgd", "method.period": "6", "model.hidden": "16,12",
                        "model.norm": "none", "train.steps": "12", "train.eval_every": "6",
                        "runtime.workers": "1", "train.lr": "0.1", "data.name": "teacher"})
    loc = build_strategy(cfg_l, comm, torch.device("cpu"), TASK,
                         build_mlp(D, (16, 12), C, norm="none", seed=0))
    for step in range(12):
        assert ist.train_step(batch(0, step), step) == loc.train_step(batch(0, step), step)
    full = ist.eval_model()
    for (k, v), (k2, v2) in zip(full.state_dict().items(), loc.model.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k


# --- bytes and memory -----------------------------------------------------------------------------
def subnet_numel(d: int, sizes: list[int], c: int, bias: bool) -> int:
    """ist.md: d h/n + (L-1) h^2/n^2 + h C/n + per-neuron vectors (without the shared bias)."""
    n = d * sizes[0] + sum(a * b for a, b in zip(sizes[1:], sizes[:-1])) + c * sizes[-1]
    return n + (sum(sizes) if bias else 0)


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
    for o in out:  # the shared output bias (C floats): one all-reduce per round
        assert o["by_op"]["all_reduce:shared"]["payload"] == 4 * C


@pytest.mark.parametrize("deployment", ["central", "sharded"])
@pytest.mark.parametrize("n", [2, 4])
def test_ledger_equals_the_traffic_formula(n: int, deployment: str) -> None:
    """The pure traffic function (the planner's) predicts every rank's ledger to the byte, with
    the default overlap (4 workers: every unit on 2 of them)."""
    out = run_workers(one_round, n, {"method.deployment": deployment, "model.hidden": "20,9",
                                     "method.overlap": 0})
    plan = linear_stack(build_mlp(D, (20, 9), C, norm="none", seed=0)).plan
    o = Options(local_steps=3, deployment=deployment, scale="dropout", overlap=0)
    want = ist_traffic(plan, o, n, 3, seed=0)
    for r in range(n):
        ops = out[r]["by_op"]
        sent = sum(v["sent"] for v in ops.values())
        recv = sum(v["recv"] for v in ops.values())
        payload = sum(v["payload"] for v in ops.values())
        assert (sent, recv, payload) == (want.sent[r], want.recv[r], want.payload[r]), r


def _defaults(comm: Comm, published: bool) -> dict:
    """Two rounds of the trainer's ``ist`` with no overlap or optimizer-state option (or the
    published form's), SGD with momentum: one state tensor per parameter."""
    base = {"method.name": "ist", "model.hidden": "16,12", "model.norm": "none",
            "method.local_steps": "3", "train.steps": "6", "train.eval_every": "3",
            "runtime.workers": str(comm.world_size), "train.lr": "0.1", "train.momentum": "0.9",
            "data.name": "teacher"}
    if published:
        base.update({"method.overlap": "1", "method.optimizer_state": "reset"})
    cfg = load(None, base)
    model = build_mlp(D, (16, 12), C, norm="none", seed=0)
    strat = build_strategy(cfg, comm, torch.device("cpu"), TASK, model)
    for step in range(6):
        strat.train_step(batch(comm.rank, step), step)
    ops = comm.ledger.by_op()
    return {"overlap": strat.ist.overlap, "reindex": strat.ist.reindex,
            "bytes": tuple(sum(v[k] for v in ops.values()) for k in ("sent", "recv", "payload"))}


@pytest.mark.parametrize("published", [False, True])
def test_the_trainers_defaults_are_the_recommended_configuration(published: bool) -> None:
    """``thinwire train --method ist`` with no option runs what ``thinwire.IST`` runs by default
    (4 workers: every unit on 2 of them; an MLP's optimizer state dealt with its units), and
    ``ist:overlap=1,optimizer_state=reset`` the published algorithm; each rank's ledger equals
    the traffic formula of the options it ran (the momentum travels only where it is dealt)."""
    n = 4
    out = run_workers(_defaults, n, published)
    assert {(o["overlap"], o["reindex"]) for o in out} == ({(1, False)} if published
                                                            else {(2, True)})
    plan = linear_stack(build_mlp(D, (16, 12), C, norm="none", seed=0)).plan
    o = Options(local_steps=3, **({"overlap": 1, "optimizer_state": "reset"} if published
                                  else {}))
    want = ist_traffic(plan, o, n, 6, seed=0, optimizer_states=1)
    for r in range(n):
        assert out[r]["bytes"] == (want.sent[r], want.recv[r], want.payload[r]), r
    if not published:
        reset = ist_traffic(plan, dataclasses.replace(o, optimizer_state="reset"), n, 6,
                            seed=0, optimizer_states=1)
        assert want.sent[0] > reset.sent[0]  # the momentum rides with the pieces


def test_one_place_holds_the_defaults_of_the_trainer_and_of_thinwire_ist() -> None:
    """strategies/ist/defaults.py: ``Options()`` and ``IST(...)``'s signature read the same
    values; the labels name what departs from the published form."""
    import inspect

    from thinwire.strategies.ist import defaults
    from thinwire.strategies.ist.method import METHOD

    sig = inspect.signature(IST).parameters
    o = Options()
    assert (o.overlap, o.optimizer_state) == (sig["overlap"].default,
                                              sig["optimizer_state"].default)
    assert (o.overlap, o.optimizer_state) == (defaults.OVERLAP, defaults.OPTIMIZER_STATE)
    assert sig["residual"].default == defaults.RESIDUAL == "whole"
    published = Options(**defaults.PUBLISHED)  # type: ignore[arg-type]
    assert (published.overlap, published.optimizer_state) == (1, "reset") != (o.overlap,
                                                                               o.optimizer_state)
    assert METHOD.label(o) == "ist(K=auto,central,auto,overlap=auto)"
    assert METHOD.label(published) == "ist(K=auto,central)"
    assert defaults.PUBLISHED_SPEC == "ist:overlap=1,optimizer_state=reset"


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
        assert mem.param_count == subnet_numel(D, [len(g) for g in part.of(j)], C, bias=True) + C
        assert mem.grads == 4 * mem.param_count
        assert mem.stored_count == (full if j == 0 else C)  # everyone keeps the shared bias
    assert out[1]["mem"].param_count < full / 3


# --- optimizer state and hybrid -------------------------------------------------------------------
def _reindex(comm: Comm, mode: str) -> dict:
    _, strat, _ = make(comm, **{"method.optimizer_state": mode, "train.momentum": 0.9})
    for step in range(6):
        strat.train_step(batch(comm.rank, step), step)
    stored = sum(float(x.abs().sum()) for d in strat.ist.state_store.values() for x in d.values())
    return {"by_op": comm.ledger.by_op(), "state": stored}


def test_reindexed_momentum_travels_with_the_subnet() -> None:
    """Two rounds, worker 1 of the central deployment: it sends its subnet up after each round
    (reindex: with its momentum, twice the bytes) and receives it down at the start of each
    (reindex: without momentum in round 0, when no state exists yet, with it in round 1)."""
    reset = run_workers(_reindex, 2, "reset")
    reidx = run_workers(_reindex, 2, "reindex")
    r_ops, i_ops = reset[1]["by_op"], reidx[1]["by_op"]
    assert i_ops["send:subnet"]["sent"] == 2 * r_ops["send:subnet"]["sent"]
    assert r_ops["recv:subnet"]["recv"] < i_ops["recv:subnet"]["recv"] < 2 * r_ops["recv:subnet"]["recv"]
    assert reidx[0]["state"] > 0 and reset[0]["state"] == 0


def _hybrid(comm: Comm) -> dict:
    _, strat, _ = make(comm, **{"method.switch_at": 3, "method.period": 3})
    for step in range(6):
        strat.train_step(batch(comm.rank, step), step)
    m = strat.eval_model()
    return {"by_op": comm.ledger.by_op(), "params": None if m is None else
            torch.cat([p.detach().reshape(-1) for p in m.parameters()])}


def test_hybrid_switches_to_local_sgd() -> None:
    out = run_workers(_hybrid, 2)
    assert "send:switch" in out[0]["by_op"] and "all_reduce:average" in out[0]["by_op"]
    assert out[0]["by_op"]["all_reduce:average"]["calls"] == 1
    assert out[0]["params"] is not None and out[0]["params"].numel() == D * 16 + 16 * 12 + 12 * C + 16 + 12 + C


def test_plateau_rule() -> None:
    """Flat once the best of the last P values gains <= tol over the best before them, for
    either direction of the metric; never before P + 1 values."""
    rule = PlateauRule(2, 0.01)
    assert [rule.flat(v, True) for v in (0.5, 0.6, 0.605, 0.62, 0.615, 0.625)] == \
        [False, False, False, False, False, True]
    ppl = PlateauRule(1, 0.5)
    assert [ppl.flat(v, False) for v in (9.0, 7.0, 6.6, 6.7)] == [False, False, True, True]


def _auto_hybrid(comm: Comm) -> dict:
    """Rank 0 feeds the metric (the others None, as the trainer does); every rank must switch
    at the same step: the step of the evaluation that found the curve flat."""
    _, strat, _ = make(comm, **{"method.switch_patience": 2, "method.switch_tol": 0.01,
                                "method.period": 3, "train.steps": 15})
    curve = iter((0.5, 0.6, 0.605, 0.606))  # flat at the 4th evaluation (step 12)
    switched = []
    for step in range(15):
        strat.train_step(batch(comm.rank, step), step)
        if (step + 1) % 3 == 0:
            strat.observe(step + 1, next(curve, 0.6) if comm.rank == 0 else None, True)
        switched.append(strat.local is not None)
    return {"switch_step": strat.switch_step, "first": switched.index(True),
            "by_op": comm.ledger.by_op()}


def test_automatic_switch_on_a_flat_curve() -> None:
    out = run_workers(_auto_hybrid, 2)
    for r in out:
        assert r["switch_step"] == 12 and r["first"] == 12
        assert any(k.endswith(":switch") for k in r["by_op"])  # the full model travelled
        assert r["by_op"]["all_reduce:average"]["calls"] == 1  # step 15, H = 3


def test_switch_options_checked() -> None:
    with pytest.raises(UsageError, match="combined with method.switch_at"):
        Options(switch_at=10, switch_patience=2)
    with pytest.raises(UsageError, match="eval_every"):
        load(None, {"method.name": "ist", "method.switch_patience": "2",
                    "train.eval_every": "0", "data.name": "teacher"})


# --- in the user's own loop -----------------------------------------------------------------------
def _user_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 24), nn.LayerNorm(24), nn.ReLU(), nn.Linear(24, 16, bias=False),
                         nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, C))


def _user_loop(comm: Comm, steps: int, k: int) -> dict:
    """A user's loop: their Sequential, AdamW, a scheduler, clipping; IST only wraps it."""
    model = _user_net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    ist = IST(model, opt, comm=comm, local_steps=k, deployment="sharded")
    losses = []
    for step in range(steps):
        x, y = batch(comm.rank, step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    full = ist.full_model()
    out = None if full is None else {k_: v.clone() for k_, v in full.state_dict().items()}
    return {"losses": losses, "full": out, "groups": [g.name for g in ist.plan.groups]}


def test_ist_wraps_a_users_sequential_and_optimizer() -> None:
    out = run_workers(_user_loop, 2, 8, 4)
    assert out[0]["groups"] == ["0", "3"]  # derived at the first forward: named by the layer
    full = out[0]["full"]
    ref = _user_net().state_dict()
    assert set(full) == set(ref)
    for k, v in ref.items():
        assert full[k].shape == v.shape, k
    assert not torch.equal(full["0.weight"], ref["0.weight"])  # it trained
    assert out[1]["full"] is None


def test_ist_one_worker_equals_plain_training_in_the_users_loop() -> None:
    """n = 1: the user's loop with IST is the user's loop without it, bit for bit (AdamW's state
    is reset each round in both: the plain loop recreates its optimizer every K steps)."""
    res = _user_loop(Comm.local(), 8, 4)
    model = _user_net()
    losses = []
    for step in range(8):
        if step % 4 == 0:
            opt = torch.optim.AdamW(model.parameters(), lr=0.01 * 0.5 ** (step // 4))
        x, y = batch(0, step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    assert res["losses"] == losses
    for k, v in model.state_dict().items():
        assert torch.equal(res["full"][k], v), k


def test_evaluating_mid_round_is_one_clear_error() -> None:
    model = _user_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ist = IST(model, opt, comm=Comm.local(), local_steps=3)
    x, y = batch(0, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    with pytest.raises(UsageError, match="mid-round"):
        ist.full_model()
    model.eval()
    with pytest.raises(UsageError, match="evaluated mid-round"):
        model(x)


def test_a_step_without_a_forward_is_one_clear_error() -> None:
    model = _user_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    IST(model, opt, comm=Comm.local(), local_steps=3)
    with pytest.raises(UsageError, match="no forward pass"):
        opt.step()


def test_models_ist_cannot_cut_are_refused_in_one_line() -> None:
    conv = nn.Sequential(nn.Linear(D, 8), nn.Unflatten(1, (1, 8)), nn.Conv1d(1, 1, 3),
                         nn.Flatten(), nn.Linear(6, C))
    x, _ = batch(0, 0)
    with pytest.raises(UsageError, match="no unit to cut"):  # Unflatten is not followed
        IST(conv, torch.optim.SGD(conv.parameters(), lr=0.1), comm=Comm.local(),
            example_input=x)
    ist = IST(conv, torch.optim.SGD(conv.parameters(), lr=0.1), comm=Comm.local())
    with pytest.raises(UsageError, match="no unit to cut"):  # traced at the first forward
        conv(x)
    del ist
    narrow = nn.Sequential(nn.Linear(D, 3), nn.ReLU(), nn.Linear(3, C))
    with pytest.raises(UsageError, match="3 units"):
        IST(narrow, torch.optim.SGD(narrow.parameters(), lr=0.1), comm=_FakeComm(4),
            adapter=linear_stack(narrow))
    with pytest.raises(UsageError, match="no unit to cut"):  # 3 neurons for 4 workers: shared
        IST(narrow, torch.optim.SGD(narrow.parameters(), lr=0.1), comm=_FakeComm(4),
            example_input=x)


class _FakeComm(Comm):
    def __init__(self, n: int) -> None:
        super().__init__()
        self._bound = (0, n)
